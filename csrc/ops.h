// Every C++ entry point of qspec_ext, one list. Schemas live in torch_bindings.cpp.
#pragma once

#include <optional>
#include <tuple>


#include "checks.h"

namespace qspec_ext {

// ---- norm_rope: the drafter / target attention prologue ----
// The device halves; the op entry points around them are templates in norm_rope_entry.h.
void rms_norm_cpu(const Tensor& rows, const Tensor& weight, double eps, Tensor& out);
void fused_add_rms_norm_cpu(Tensor& in_rows, Tensor& res_rows, const Tensor& weight, double eps);
void eagle3_input_norm_cpu(const Tensor& embeds, const Tensor& hidden, const Tensor& embed_weight,
                           const Tensor& hidden_weight, double eps, bool norm_before_residual, Tensor& x,
                           Tensor& residual);
void qk_norm_rope_cpu(Tensor& qkv, const std::optional<Tensor>& q_weight,
                      const std::optional<Tensor>& k_weight, const Tensor& cos_sin_cache,
                      const Tensor& positions, double eps, bool is_neox, const std::optional<Tensor>& k_cache,
                      const std::optional<Tensor>& v_cache, const std::optional<Tensor>& slot_mapping,
                      const QKNormRopeShape& s);

void rms_norm_cuda(const Tensor& rows, const Tensor& weight, double eps, Tensor& out);
void fused_add_rms_norm_cuda(Tensor& in_rows, Tensor& res_rows, const Tensor& weight, double eps);
void eagle3_input_norm_cuda(const Tensor& embeds, const Tensor& hidden, const Tensor& embed_weight,
                            const Tensor& hidden_weight, double eps, bool norm_before_residual, Tensor& x,
                            Tensor& residual);
void qk_norm_rope_cuda(Tensor& qkv, const std::optional<Tensor>& q_weight,
                       const std::optional<Tensor>& k_weight, const Tensor& cos_sin_cache,
                       const Tensor& positions, double eps, bool is_neox, const std::optional<Tensor>& k_cache,
                       const std::optional<Tensor>& v_cache, const std::optional<Tensor>& slot_mapping,
                       const QKNormRopeShape& s);

// ---- aux_gather: target features into the drafter's fc input ----
// The device halves; the op entry points around them are templates in aux_gather_entry.h.
void gather_aux_hidden_cpu(std::string_view op, const TensorList& aux, const Tensor& indices,
                           const std::optional<TensorList>& residual, const std::optional<Tensor>& norm_weight,
                           double eps, const AuxGatherShape& s, Tensor& out);
void gather_aux_hidden_cuda(std::string_view op, const TensorList& aux, const Tensor& indices,
                            const std::optional<TensorList>& residual, const std::optional<Tensor>& norm_weight,
                            double eps, const AuxGatherShape& s, Tensor& out);

// ---- verify: batched draft verification ----
// The device halves; the op entry points around them are templates in verify_entry.h.
void verify_cpu(std::string_view op, const Tensor& draft_ids, const std::optional<Tensor>& draft_probs,
                const Tensor& target_logits, const std::optional<Tensor>& temperature,
                const std::optional<Tensor>& seed, const std::optional<Tensor>& offset,
                const std::optional<Tensor>& d2t, const std::optional<Tensor>& num_draft,
                const VerifyShape& s, Tensor& out_ids, Tensor& num_accepted);
void verify_cuda(std::string_view op, const Tensor& draft_ids, const std::optional<Tensor>& draft_probs,
                 const Tensor& target_logits, const std::optional<Tensor>& temperature,
                 const std::optional<Tensor>& seed, const std::optional<Tensor>& offset,
                 const std::optional<Tensor>& d2t, const std::optional<Tensor>& num_draft,
                 const VerifyShape& s, Tensor& out_ids, Tensor& num_accepted);

void verify_tree_cpu(std::string_view op, const Tensor& draft_ids, const Tensor& parents,
                     const Tensor& target_logits, const std::optional<Tensor>& temperature,
                     const std::optional<Tensor>& seed, const std::optional<Tensor>& offset,
                     const TreeVerifyShape& s, Tensor& out_ids, Tensor& num_accepted, Tensor& path);
void verify_tree_cuda(std::string_view op, const Tensor& draft_ids, const Tensor& parents,
                      const Tensor& target_logits, const std::optional<Tensor>& temperature,
                      const std::optional<Tensor>& seed, const std::optional<Tensor>& offset,
                      const TreeVerifyShape& s, Tensor& out_ids, Tensor& num_accepted, Tensor& path);

// ---- attention: decode attention over the used part of a static KV cache ----
// The device halves; the op entry point around them is a template in attention_entry.h.
void cached_attention_cpu(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                          const Tensor& positions, double scale, int64_t window,
                          const std::optional<Tensor>& tree_start, const std::optional<Tensor>& tree_seen,
                          const AttentionShape& s, Tensor& out);
void cached_attention_cuda(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                           const Tensor& positions, double scale, int64_t window,
                           const std::optional<Tensor>& tree_start, const std::optional<Tensor>& tree_seen,
                           const AttentionShape& s, Tensor& out);

// ---- activation: the gated MLP's silu(gate) * up ----
// The device halves; the op entry point around them is a template in activation_entry.h.
void silu_and_mul_cpu(const Tensor& rows, Tensor& out);
void silu_and_mul_cuda(const Tensor& rows, Tensor& out);

// ---- packed_linear: the projections' CPU inference path ----
Tensor packed_linear_cpu(const Tensor& input, const Tensor& packed_weight, int64_t out_features);

// ---- the CPU's vector extensions ----
// Whether this CPU has AVX512-BF16 (with AVX512-BW / VL) and QSPEC_CPU_BF16_DOT is not 0 (0 runs and
// tests the other kernels on it): packed_linear's and cached_attention's bf16 kernels ask it.
bool cpu_bf16_dot();  // csrc/cpu/packed_linear.cpp
// Whether this CPU has AVX-512 (F, BW, VL) and QSPEC_CPU_AVX512 is not 0: cached_attention's fp32
// query-lane kernel asks it.
bool cpu_avx512();  // csrc/cpu/packed_linear.cpp
// Whether bf16 packed_linear runs AMX tiles on this CPU: AMX-BF16 and AVX512-BF16, the kernel's leave
// to use AMX, neither QSPEC_CPU_AMX nor QSPEC_CPU_BF16_DOT at 0.
bool cpu_amx();  // csrc/cpu/packed_linear.cpp

}  // namespace qspec_ext
