// Argument validation shared by the CPU and CUDA entry points. Every failure raises a
// RuntimeError naming the op, the argument, what was expected and what was given.
#pragma once

#include <optional>
#include <string_view>
#include <utility>

#include "torch_stable.h"

#include "qspec_ext/aux_gather.h"

namespace qspec_ext {

// fp32, fp16 or bf16.
void check_activation(std::string_view op, std::string_view name, const Tensor& t);
void check_same_device(std::string_view op, std::string_view name, const Tensor& t, const Tensor& ref);
// 1-D [width] norm weight in fp32 or the activation dtype, on the activation's device.
void check_norm_weight(std::string_view op, std::string_view name, const Tensor& weight, int64_t width,
                       const Tensor& activation);
// Index tensor: int32 or int64, 1-D [length], contiguous, on ref's device.
void check_index(std::string_view op, std::string_view name, const Tensor& t, int64_t length,
                 const Tensor& ref);
// The most blocks a kernel launch puts in its (1-D) grid: CUDA's gridDim.x limit. Every op
// checks its launch size against it on every device, so the limit shows on CPU too.
constexpr int64_t kMaxLaunchBlocks = (int64_t{1} << 31) - 1;
void check_launch_size(std::string_view op, std::string_view name, int64_t count, std::string_view what);
// The widest row a kernel takes: its 32-bit element loops keep headroom below 2^31.
constexpr int64_t kMaxWidth = int64_t{1} << 30;
void check_width(std::string_view op, std::string_view name, int64_t width);
// A tensor written in place, viewed as [rows, width]: rows must not overlap (row stride >= width).
void check_written_rows(std::string_view op, std::string_view name, const Tensor& rows);
void check_no_overlap(std::string_view op, std::string_view name, const Tensor& a, std::string_view other,
                      const Tensor& b);

// A [rows, width] view of t (any rank >= 1) whose rows may be strided; never copies. Rows
// and width are within kMaxLaunchBlocks.
Tensor as_rows(std::string_view op, std::string_view name, const Tensor& t);

// rms_norm: input as [rows, H] (strided rows allowed), weight [H].
Tensor check_rms_norm(const Tensor& input, const Tensor& weight);
// fused_add_rms_norm_: input and residual as non-overlapping [rows, H] views.
std::pair<Tensor, Tensor> check_fused_add_rms_norm(const Tensor& input, const Tensor& residual,
                                                           const Tensor& weight);

// Shapes of one qk_norm_rope_ call, validated.
struct QKNormRopeShape {
  int64_t num_tokens;
  int64_t num_heads_q;
  int64_t num_heads_kv;
  int64_t head_dim;
  int64_t rot_dim;
  int64_t max_position;
  int64_t num_slots;  // 0 without caches
  bool has_norm;
  bool has_cache;
};

QKNormRopeShape check_qk_norm_rope(const Tensor& qkv, const std::optional<Tensor>& q_weight,
                                   const std::optional<Tensor>& k_weight, const Tensor& cos_sin_cache,
                                   const Tensor& positions, int64_t num_heads_q, int64_t num_heads_kv,
                                   int64_t head_dim, const std::optional<Tensor>& k_cache,
                                   const std::optional<Tensor>& v_cache,
                                   const std::optional<Tensor>& slot_mapping);

// Shapes of one gather_aux_hidden call, validated.
struct AuxGatherShape {
  int64_t num_rows;    // N
  int64_t num_source;  // T
  int64_t hidden;      // H
  int num_aux;         // n
  AuxNormMode mode;
  bool has_residual;
};

AuxGatherShape check_gather_aux_hidden(std::string_view op, const TensorList& aux, const Tensor& indices,
                                       const std::optional<TensorList>& residual, std::string_view norm_mode,
                                       const std::optional<Tensor>& norm_weight);
// The out= buffer of gather_aux_hidden_out: [N, n*H], the dtype of aux, last dim contiguous.
void check_gather_out(const Tensor& out, const AuxGatherShape& shape, const Tensor& aux0);

// Shapes of one verify_greedy / verify_sampling call, validated.
struct VerifyShape {
  int64_t batch;        // B
  int num_draft_max;    // K
  int64_t vocab;        // V
  int64_t draft_vocab;  // Vq (= V without d2t)
  bool has_probs;
  bool has_d2t;
  bool has_num_draft;
};

// Sampling arguments (temperature, seed, offset, draft_probs, d2t) are checked when given.
VerifyShape check_verify(std::string_view op, const Tensor& draft_ids, const Tensor& target_logits,
                         const std::optional<Tensor>& num_draft, const std::optional<Tensor>& draft_probs,
                         const std::optional<Tensor>& temperature, const std::optional<Tensor>& seed,
                         const std::optional<Tensor>& offset, const std::optional<Tensor>& d2t);
// out_ids [B, K+1] int64 and num_accepted [B] int64, contiguous, on the logits' device.
void check_verify_out(std::string_view op, const Tensor& out_ids, const Tensor& num_accepted,
                      const VerifyShape& shape, const Tensor& target_logits);

// Shapes of one verify_tree_greedy / verify_tree_sampling call, validated.
struct TreeVerifyShape {
  int64_t batch;  // B
  int num_nodes;  // N
  int64_t vocab;  // V
};

// draft_ids [B, N] int64, parents [B, N] int32/int64 contiguous, target_logits [B, N+1, V];
// the sampling vectors when given. Values (parents topological, ids in range) are checked by
// the device halves.
TreeVerifyShape check_verify_tree(std::string_view op, const Tensor& draft_ids, const Tensor& parents,
                                  const Tensor& target_logits, const std::optional<Tensor>& temperature,
                                  const std::optional<Tensor>& seed, const std::optional<Tensor>& offset);
// out_ids [B, N+1], num_accepted [B], path [B, N+1]: int64, contiguous, on the logits' device.
void check_verify_tree_out(std::string_view op, const Tensor& out_ids, const Tensor& num_accepted,
                           const Tensor& path, const TreeVerifyShape& shape, const Tensor& target_logits);

// Shapes of one cached_attention call, validated.
struct AttentionShape {
  int64_t batch, tokens, heads_q, heads_kv, head_dim, max_length;
  int64_t scratch;  // S of tree_seen [B, T, S]; 0 without a tree
  bool has_tree;
};

// query [B, T, Hq, D] (last dim contiguous), caches [B * L, Hkv, D] contiguous in the query's
// dtype, positions [B, T] int32/int64 (any strides), window >= 0, and the tree pair when given
// (tree_start [B] int64, tree_seen [B, T, S] bool, S <= L). Position values are checked by the
// CPU half (the CUDA kernel clamps every key range to the cache instead of reading positions).
AttentionShape check_cached_attention(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                                      const Tensor& positions, int64_t window,
                                      const std::optional<Tensor>& tree_start,
                                      const std::optional<Tensor>& tree_seen);

// silu_and_mul: input as [rows, 2I] (strided rows allowed), an even last dim (gate, then up).
Tensor check_silu_and_mul(const Tensor& input);

void check_eagle3_input_norm(const Tensor& embeds, const Tensor& hidden, const Tensor& embed_weight,
                             const Tensor& hidden_weight);

}  // namespace qspec_ext
