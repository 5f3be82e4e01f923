// The gather ops' entry points, written once: argument checks and output allocation
// around a device half (gather_aux_hidden_cpu / _cuda) that fills the output.
#pragma once

#include <optional>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/string_view.h>

#include "checks.h"

namespace qspec_ext {

using GatherImpl = void (*)(std::string_view op, at::TensorList aux, const at::Tensor& indices,
                            const std::optional<at::TensorList>& residual,
                            const std::optional<at::Tensor>& norm_weight, double eps, const AuxGatherShape& s,
                            at::Tensor& out);

template <GatherImpl impl>
at::Tensor gather_aux_hidden_entry(at::TensorList aux, const at::Tensor& indices, std::optional<at::TensorList> residual,
                                   c10::string_view norm_mode, const std::optional<at::Tensor>& norm_weight,
                                   double eps) {
  constexpr std::string_view op = "gather_aux_hidden";
  const AuxGatherShape s = check_gather_aux_hidden(op, aux, indices, residual, norm_mode, norm_weight);
  at::Tensor out = at::empty({s.num_rows, s.num_aux * s.hidden}, aux[0].options());
  impl(op, aux, indices, residual, norm_weight, eps, s, out);
  return out;
}

template <GatherImpl impl>
void gather_aux_hidden_out_entry(at::TensorList aux, const at::Tensor& indices, std::optional<at::TensorList> residual,
                                 c10::string_view norm_mode, const std::optional<at::Tensor>& norm_weight, double eps,
                                 at::Tensor& out) {
  constexpr std::string_view op = "gather_aux_hidden_out";
  const AuxGatherShape s = check_gather_aux_hidden(op, aux, indices, residual, norm_mode, norm_weight);
  check_gather_out(out, s, aux[0]);
  impl(op, aux, indices, residual, norm_weight, eps, s, out);
}

}  // namespace qspec_ext
