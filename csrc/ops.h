// Every C++ entry point of qspec_ext, one list. Schemas live in torch_bindings.cpp.
#pragma once

#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

namespace qspec_ext {

// ---- norm_rope: the drafter / target attention prologue ----
at::Tensor rms_norm_cpu(const at::Tensor& input, const at::Tensor& weight, double eps);
void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> eagle3_input_norm_cpu(const at::Tensor& embeds, const at::Tensor& hidden,
                                                         const at::Tensor& embed_weight,
                                                         const at::Tensor& hidden_weight, double eps,
                                                         bool norm_before_residual);
void qk_norm_rope_cpu(at::Tensor& qkv, const std::optional<at::Tensor>& q_weight,
                      const std::optional<at::Tensor>& k_weight, const at::Tensor& cos_sin_cache,
                      const at::Tensor& positions, int64_t num_heads_q, int64_t num_heads_kv, int64_t head_dim,
                      double eps, bool is_neox, const std::optional<at::Tensor>& k_cache,
                      const std::optional<at::Tensor>& v_cache, const std::optional<at::Tensor>& slot_mapping);

at::Tensor rms_norm_cuda(const at::Tensor& input, const at::Tensor& weight, double eps);
void fused_add_rms_norm_cuda(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> eagle3_input_norm_cuda(const at::Tensor& embeds, const at::Tensor& hidden,
                                                          const at::Tensor& embed_weight,
                                                          const at::Tensor& hidden_weight, double eps,
                                                          bool norm_before_residual);
void qk_norm_rope_cuda(at::Tensor& qkv, const std::optional<at::Tensor>& q_weight,
                       const std::optional<at::Tensor>& k_weight, const at::Tensor& cos_sin_cache,
                       const at::Tensor& positions, int64_t num_heads_q, int64_t num_heads_kv, int64_t head_dim,
                       double eps, bool is_neox, const std::optional<at::Tensor>& k_cache,
                       const std::optional<at::Tensor>& v_cache, const std::optional<at::Tensor>& slot_mapping);

// ---- aux_gather: target features into the drafter's fc input ----
at::Tensor gather_aux_hidden_cpu(at::TensorList aux, const at::Tensor& indices,
                                 std::optional<at::TensorList> residual, c10::string_view norm_mode,
                                 const std::optional<at::Tensor>& norm_weight, double eps);
void gather_aux_hidden_out_cpu(at::TensorList aux, const at::Tensor& indices, std::optional<at::TensorList> residual,
                               c10::string_view norm_mode, const std::optional<at::Tensor>& norm_weight, double eps,
                               at::Tensor& out);
at::Tensor gather_aux_hidden_cuda(at::TensorList aux, const at::Tensor& indices,
                                  std::optional<at::TensorList> residual, c10::string_view norm_mode,
                                  const std::optional<at::Tensor>& norm_weight, double eps);
void gather_aux_hidden_out_cuda(at::TensorList aux, const at::Tensor& indices,
                                std::optional<at::TensorList> residual, c10::string_view norm_mode,
                                const std::optional<at::Tensor>& norm_weight, double eps, at::Tensor& out);

// ---- verify: batched draft verification ----
std::tuple<at::Tensor, at::Tensor> verify_greedy_cpu(const at::Tensor& draft_ids, const at::Tensor& target_logits,
                                                     const std::optional<at::Tensor>& num_draft);
void verify_greedy_out_cpu(const at::Tensor& draft_ids, const at::Tensor& target_logits,
                           const std::optional<at::Tensor>& num_draft, at::Tensor& out_ids, at::Tensor& num_accepted);
std::tuple<at::Tensor, at::Tensor> verify_sampling_cpu(const at::Tensor& draft_ids,
                                                       const std::optional<at::Tensor>& draft_probs,
                                                       const at::Tensor& target_logits, const at::Tensor& temperature,
                                                       const at::Tensor& seed, const at::Tensor& offset,
                                                       const std::optional<at::Tensor>& d2t,
                                                       const std::optional<at::Tensor>& num_draft);
void verify_sampling_out_cpu(const at::Tensor& draft_ids, const std::optional<at::Tensor>& draft_probs,
                             const at::Tensor& target_logits, const at::Tensor& temperature, const at::Tensor& seed,
                             const at::Tensor& offset, const std::optional<at::Tensor>& d2t,
                             const std::optional<at::Tensor>& num_draft, at::Tensor& out_ids,
                             at::Tensor& num_accepted);

std::tuple<at::Tensor, at::Tensor> verify_greedy_cuda(const at::Tensor& draft_ids, const at::Tensor& target_logits,
                                                     const std::optional<at::Tensor>& num_draft);
void verify_greedy_out_cuda(const at::Tensor& draft_ids, const at::Tensor& target_logits,
                           const std::optional<at::Tensor>& num_draft, at::Tensor& out_ids, at::Tensor& num_accepted);
std::tuple<at::Tensor, at::Tensor> verify_sampling_cuda(const at::Tensor& draft_ids,
                                                       const std::optional<at::Tensor>& draft_probs,
                                                       const at::Tensor& target_logits, const at::Tensor& temperature,
                                                       const at::Tensor& seed, const at::Tensor& offset,
                                                       const std::optional<at::Tensor>& d2t,
                                                       const std::optional<at::Tensor>& num_draft);
void verify_sampling_out_cuda(const at::Tensor& draft_ids, const std::optional<at::Tensor>& draft_probs,
                             const at::Tensor& target_logits, const at::Tensor& temperature, const at::Tensor& seed,
                             const at::Tensor& offset, const std::optional<at::Tensor>& d2t,
                             const std::optional<at::Tensor>& num_draft, at::Tensor& out_ids,
                             at::Tensor& num_accepted);

}  // namespace qspec_ext
