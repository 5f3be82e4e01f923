// The norm / RoPE ops' entry points, written once: the device check, argument checks and
// output allocation around a device half (*_cpu / *_cuda in ops.h) that fills the outputs.
#pragma once

#include <optional>
#include <string_view>
#include <tuple>


#include "checks.h"

namespace qspec_ext {

// rows: the input as validated [R, W] rows (strided rows allowed); out: [R, W], contiguous.
using RmsNormImpl = void (*)(const Tensor& rows, const Tensor& weight, double eps, Tensor& out);
// in_rows, res_rows: non-overlapping [R, W] views of input and residual, updated in place.
using FusedAddRmsNormImpl = void (*)(Tensor& in_rows, Tensor& res_rows, const Tensor& weight, double eps);
// x [R, 2W] and residual [R, W]: contiguous outputs.
using Eagle3InputNormImpl = void (*)(const Tensor& embeds, const Tensor& hidden, const Tensor& embed_weight,
                                     const Tensor& hidden_weight, double eps, bool norm_before_residual,
                                     Tensor& x, Tensor& residual);
using QKNormRopeImpl = void (*)(Tensor& qkv, const std::optional<Tensor>& q_weight,
                                const std::optional<Tensor>& k_weight, const Tensor& cos_sin_cache,
                                const Tensor& positions, double eps, bool is_neox,
                                const std::optional<Tensor>& k_cache, const std::optional<Tensor>& v_cache,
                                const std::optional<Tensor>& slot_mapping, const QKNormRopeShape& s);

template <DeviceType device>
void check_kernel_device(std::string_view op, std::string_view name, const Tensor& t) {
  constexpr std::string_view kind = device == DeviceType::CPU ? "CPU" : "CUDA";
  QSPEC_CHECK(t.device().type() == device, op, name, "must be a ", kind, " tensor for the ", kind, " kernel, got ",
              t.device());
}

template <DeviceType device, RmsNormImpl impl>
Tensor rms_norm_entry(const Tensor& input, const Tensor& weight, double eps) {
  check_kernel_device<device>("rms_norm", "input", input);
  const Tensor rows = check_rms_norm(input, weight);
  Tensor out = empty(input.sizes().vec(), input);
  if (input.numel() > 0) impl(rows, weight, eps, out);
  return out;
}

template <DeviceType device, FusedAddRmsNormImpl impl>
void fused_add_rms_norm_entry(Tensor& input, Tensor& residual, const Tensor& weight, double eps) {
  check_kernel_device<device>("fused_add_rms_norm_", "input", input);
  auto [in_rows, res_rows] = check_fused_add_rms_norm(input, residual, weight);
  if (input.numel() > 0) impl(in_rows, res_rows, weight, eps);
}

template <DeviceType device, Eagle3InputNormImpl impl>
std::tuple<Tensor, Tensor> eagle3_input_norm_entry(const Tensor& embeds, const Tensor& hidden,
                                                           const Tensor& embed_weight,
                                                           const Tensor& hidden_weight, double eps,
                                                           bool norm_before_residual) {
  check_kernel_device<device>("eagle3_input_norm", "embeds", embeds);
  check_eagle3_input_norm(embeds, hidden, embed_weight, hidden_weight);
  const int64_t rows = embeds.size(0), width = embeds.size(1);
  Tensor x = empty({rows, 2 * width}, embeds);
  Tensor residual = empty({rows, width}, embeds);
  if (rows > 0 && width > 0) impl(embeds, hidden, embed_weight, hidden_weight, eps, norm_before_residual, x, residual);
  return {x, residual};
}

template <DeviceType device, QKNormRopeImpl impl>
void qk_norm_rope_entry(Tensor& qkv, const std::optional<Tensor>& q_weight,
                        const std::optional<Tensor>& k_weight, const Tensor& cos_sin_cache,
                        const Tensor& positions, int64_t num_heads_q, int64_t num_heads_kv, int64_t head_dim,
                        double eps, bool is_neox, const std::optional<Tensor>& k_cache,
                        const std::optional<Tensor>& v_cache, const std::optional<Tensor>& slot_mapping) {
  check_kernel_device<device>("qk_norm_rope_", "qkv", qkv);
  const QKNormRopeShape s = check_qk_norm_rope(qkv, q_weight, k_weight, cos_sin_cache, positions, num_heads_q,
                                               num_heads_kv, head_dim, k_cache, v_cache, slot_mapping);
  impl(qkv, q_weight, k_weight, cos_sin_cache, positions, eps, is_neox, k_cache, v_cache, slot_mapping, s);
}

}  // namespace qspec_ext
