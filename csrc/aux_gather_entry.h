// The gather ops' entry points, written once: argument checks and output allocation
// around a device half (gather_aux_hidden_cpu / _cuda) that fills the output.
#pragma once

#include <optional>
#include <string_view>


#include "checks.h"
#include "qspec_ext/aux_gather.h"

namespace qspec_ext {

using GatherImpl = void (*)(std::string_view op, const TensorList& aux, const Tensor& indices,
                            const std::optional<TensorList>& residual,
                            const std::optional<Tensor>& norm_weight, double eps, const AuxGatherShape& s,
                            Tensor& out);

template <GatherImpl impl>
Tensor gather_aux_hidden_entry(const TensorList& aux, const Tensor& indices, std::optional<TensorList> residual,
                                   std::string_view norm_mode, const std::optional<Tensor>& norm_weight,
                                   double eps) {
  constexpr std::string_view op = "gather_aux_hidden";
  const AuxGatherShape s = check_gather_aux_hidden(op, aux, indices, residual, norm_mode, norm_weight);
  Tensor out = empty({s.num_rows, s.num_aux * s.hidden}, aux[0]);
  impl(op, aux, indices, residual, norm_weight, eps, s, out);
  return out;
}

template <GatherImpl impl>
void gather_aux_hidden_out_entry(const TensorList& aux, const Tensor& indices, std::optional<TensorList> residual,
                                 std::string_view norm_mode, const std::optional<Tensor>& norm_weight, double eps,
                                 Tensor& out) {
  constexpr std::string_view op = "gather_aux_hidden_out";
  const AuxGatherShape s = check_gather_aux_hidden(op, aux, indices, residual, norm_mode, norm_weight);
  check_gather_out(out, s, aux[0]);
  impl(op, aux, indices, residual, norm_weight, eps, s, out);
}

// Raw pointers for the kernels. weight: the norm weight as the kernel will read it.
template <typename T>
AuxGatherParams<T> aux_gather_params(const TensorList& aux, const Tensor& indices,
                                     const std::optional<TensorList>& residual,
                                     const std::optional<Tensor>& weight, double eps, const AuxGatherShape& s,
                                     Tensor& out) {
  AuxGatherParams<T> p{};
  for (int i = 0; i < s.num_aux; ++i) {
    p.aux[i] = const_data<T>(aux[i]);
    p.aux_stride[i] = aux[i].stride(0);
    if (s.has_residual) {
      p.residual[i] = const_data<T>((*residual)[i]);
      p.residual_stride[i] = (*residual)[i].stride(0);
    }
  }
  p.indices = indices.const_data_ptr();
  p.indices_i64 = dtype_of(indices) == kLong;
  p.weight = weight.has_value() ? weight->const_data_ptr() : nullptr;
  p.weight_f32 = weight.has_value() && dtype_of(*weight) == kFloat;
  p.out = mutable_data<T>(out);
  p.out_stride = out.stride(0);
  p.num_rows = s.num_rows;
  p.num_source = s.num_source;
  p.num_aux = s.num_aux;
  p.hidden = static_cast<int>(s.hidden);
  p.eps = static_cast<float>(eps);
  p.mode = s.mode;
  return p;
}

}  // namespace qspec_ext
