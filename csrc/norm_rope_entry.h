// The norm / RoPE ops' entry points, written once: the device check, argument checks and
// output allocation around a device half (*_cpu / *_cuda in ops.h) that fills the outputs.
#pragma once

#include <optional>
#include <string_view>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "checks.h"

namespace qspec_ext {

// rows: the input as validated [R, W] rows (strided rows allowed); out: [R, W], contiguous.
using RmsNormImpl = void (*)(const at::Tensor& rows, const at::Tensor& weight, double eps, at::Tensor& out);
// in_rows, res_rows: non-overlapping [R, W] views of input and residual, updated in place.
using FusedAddRmsNormImpl = void (*)(at::Tensor& in_rows, at::Tensor& res_rows, const at::Tensor& weight, double eps);
// x [R, 2W] and residual [R, W]: contiguous outputs.
using Eagle3InputNormImpl = void (*)(const at::Tensor& embeds, const at::Tensor& hidden, const at::Tensor& embed_weight,
                                     const at::Tensor& hidden_weight, double eps, bool norm_before_residual,
                                     at::Tensor& x, at::Tensor& residual);
using QKNormRopeImpl = void (*)(at::Tensor& qkv, const std::optional<at::Tensor>& q_weight,
                                const std::optional<at::Tensor>& k_weight, const at::Tensor& cos_sin_cache,
                                const at::Tensor& positions, double eps, bool is_neox,
                                const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
                                const std::optional<at::Tensor>& slot_mapping, const QKNormRopeShape& s);

template <c10::DeviceType device>
void check_kernel_device(std::string_view op, std::string_view name, const at::Tensor& t) {
  constexpr std::string_view kind = device == c10::DeviceType::CPU ? "CPU" : "CUDA";
  QSPEC_CHECK(t.device().type() == device, op, name, "must be a ", kind, " tensor for the ", kind, " kernel, got ",
              t.device());
}

template <c10::DeviceType device, RmsNormImpl impl>
at::Tensor rms_norm_entry(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_kernel_device<device>("rms_norm", "input", input);
  const at::Tensor rows = check_rms_norm(input, weight);
  at::Tensor out = at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::Contiguous));
  if (input.numel() > 0) impl(rows, weight, eps, out);
  return out;
}

template <c10::DeviceType device, FusedAddRmsNormImpl impl>
void fused_add_rms_norm_entry(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_kernel_device<device>("fused_add_rms_norm_", "input", input);
  auto [in_rows, res_rows] = check_fused_add_rms_norm(input, residual, weight);
  if (input.numel() > 0) impl(in_rows, res_rows, weight, eps);
}

template <c10::DeviceType device, Eagle3InputNormImpl impl>
std::tuple<at::Tensor, at::Tensor> eagle3_input_norm_entry(const at::Tensor& embeds, const at::Tensor& hidden,
                                                           const at::Tensor& embed_weight,
                                                           const at::Tensor& hidden_weight, double eps,
                                                           bool norm_before_residual) {
  check_kernel_device<device>("eagle3_input_norm", "embeds", embeds);
  check_eagle3_input_norm(embeds, hidden, embed_weight, hidden_weight);
  const int64_t rows = embeds.size(0), width = embeds.size(1);
  at::Tensor x = at::empty({rows, 2 * width}, embeds.options());
  at::Tensor residual = at::empty({rows, width}, embeds.options());
  if (rows > 0 && width > 0) impl(embeds, hidden, embed_weight, hidden_weight, eps, norm_before_residual, x, residual);
  return {x, residual};
}

template <c10::DeviceType device, QKNormRopeImpl impl>
void qk_norm_rope_entry(at::Tensor& qkv, const std::optional<at::Tensor>& q_weight,
                        const std::optional<at::Tensor>& k_weight, const at::Tensor& cos_sin_cache,
                        const at::Tensor& positions, int64_t num_heads_q, int64_t num_heads_kv, int64_t head_dim,
                        double eps, bool is_neox, const std::optional<at::Tensor>& k_cache,
                        const std::optional<at::Tensor>& v_cache, const std::optional<at::Tensor>& slot_mapping) {
  check_kernel_device<device>("qk_norm_rope_", "qkv", qkv);
  const QKNormRopeShape s = check_qk_norm_rope(qkv, q_weight, k_weight, cos_sin_cache, positions, num_heads_q,
                                               num_heads_kv, head_dim, k_cache, v_cache, slot_mapping);
  impl(qkv, q_weight, k_weight, cos_sin_cache, positions, eps, is_neox, k_cache, v_cache, slot_mapping, s);
}

}  // namespace qspec_ext
