// decoder_layer_: one pre-norm decoder layer of a Llama / Qwen3 target, in place, composed of the
// other ops: the fused residual add and RMSNorm, the QKV projection, qk_norm_rope_ (writing the
// layer's K/V cache), cached_attention, the output projection, the second fused add and norm, the
// gated MLP (silu_and_mul). One call per layer instead of a dozen from Python: at 30 layers the
// Python between the ops cost about 2 ms of a 13 ms decode step (benchmarks/HISTORY.md).
// Built into the CPU library and (QSPEC_CUDA_LIBRARY) the CUDA one, each registering its device and
// calling that device's op entry points directly: through the dispatcher each of a layer's dozen
// calls would cost a boxed round trip (about a microsecond). A projection runs packed_linear when
// its weight is packed (4-D, CPU), else aten::linear.
#include <cmath>
#include <optional>
#include <string_view>
#include <utility>


#include "activation_entry.h"
#include "attention_entry.h"
#include "checks.h"
#include "norm_rope_entry.h"
#include "ops.h"

namespace qspec_ext {
namespace {

constexpr std::string_view kOp = "decoder_layer_";

#ifdef QSPEC_CUDA_LIBRARY
constexpr DeviceType kDevice = DeviceType::CUDA;
constexpr auto fused_add_rms_norm_ = fused_add_rms_norm_entry<kDevice, fused_add_rms_norm_cuda>;
constexpr auto qk_norm_rope_ = qk_norm_rope_entry<kDevice, qk_norm_rope_cuda>;
constexpr auto cached_attention = cached_attention_entry<kDevice, cached_attention_cuda>;
constexpr auto silu_and_mul = silu_and_mul_entry<kDevice, silu_and_mul_cuda>;
#else
constexpr DeviceType kDevice = DeviceType::CPU;
constexpr auto fused_add_rms_norm_ = fused_add_rms_norm_entry<kDevice, fused_add_rms_norm_cpu>;
constexpr auto qk_norm_rope_ = qk_norm_rope_entry<kDevice, qk_norm_rope_cpu>;
constexpr auto cached_attention = cached_attention_entry<kDevice, cached_attention_cpu>;
constexpr auto silu_and_mul = silu_and_mul_entry<kDevice, silu_and_mul_cpu>;
#endif

// self.index_copy_(0, index, source), returning self.
Tensor index_copy_(const Tensor& self, const Tensor& index, const Tensor& source) {
  return call_aten("aten::index_copy_", "", self, int64_t{0}, index, source);
}

// x [M, K] @ weight^T: weight [N, K] as stored, or packed (qspec_ext.models.linear.pack_weight).
Tensor project(std::string_view name, const Tensor& x, const Tensor& weight, int64_t out_features) {
  if (weight.dim() == 4) {
#ifdef QSPEC_CUDA_LIBRARY
    QSPEC_CHECK(false, kOp, name, "is packed (4-D), which only the CPU kernels take, got it on ", weight.device());
#else
    return packed_linear_cpu(x, weight, out_features);
#endif
  }
  QSPEC_CHECK(weight.dim() == 2 && weight.size(0) == out_features && weight.size(1) == x.size(1), kOp, name,
              "must be [", out_features, ", ", x.size(1), "] (or packed, 4-D), got ", weight.sizes());
  // Checked here, not left to aten::linear: before torch 2.13 a stable-ABI caller gets no message from it.
  QSPEC_CHECK(dtype_of(weight) == dtype_of(x) && weight.device() == x.device(), kOp, name,
              "must have hidden's dtype ", dtype_of(x), " and device ", x.device(), ", got ", dtype_of(weight),
              " on ", weight.device());
  return call_aten("aten::linear", "", x, weight, std::optional<Tensor>());
}

void decoder_layer(Tensor& hidden, Tensor& residual, const Tensor& input_norm,
                   const Tensor& post_norm, const Tensor& qkv_weight, const Tensor& o_weight,
                   const Tensor& gate_up_weight, const Tensor& down_weight,
                   const std::optional<Tensor>& q_norm, const std::optional<Tensor>& k_norm,
                   Tensor& k_cache, Tensor& v_cache, const Tensor& cos_sin_cache,
                   const Tensor& positions, const Tensor& rope_positions, const Tensor& slots,
                   const std::optional<Tensor>& tree_start, const std::optional<Tensor>& tree_seen,
                   int64_t num_heads_q, int64_t num_heads_kv, int64_t head_dim, int64_t intermediate_size,
                   double eps, const std::optional<Tensor>& token_rows,
                   const std::optional<Tensor>& output_rows, const std::optional<Tensor>& output_positions) {
  QSPEC_CHECK(hidden.dim() == 2, kOp, "hidden", "must be 2-D [tokens, hidden_size], got ", hidden.sizes());
  QSPEC_CHECK(residual.sizes() == hidden.sizes() && dtype_of(residual) == dtype_of(hidden), kOp, "residual",
              "must match hidden ", hidden.sizes(), " ", dtype_of(hidden), ", got ", residual.sizes(), " ",
              dtype_of(residual));
  QSPEC_CHECK(positions.dim() == 2, kOp, "positions", "must be 2-D [batch, tokens], got ", positions.sizes());
  const int64_t grid = positions.size(0) * positions.size(1);
  if (token_rows) {
    QSPEC_CHECK(token_rows->dim() == 1 && token_rows->size(0) == hidden.size(0) &&
                    dtype_of(*token_rows) == kLong && token_rows->device() == hidden.device(),
                kOp, "token_rows", "must be int64 [", hidden.size(0), "] (hidden's rows) on ", hidden.device(),
                ", got ", dtype_of(*token_rows), " ", token_rows->sizes(), " on ", token_rows->device());
    if (token_rows->is_cpu()) {  // (on CUDA the index ops below check the bounds)
      const Tensor rows = as_contiguous(*token_rows);
      const int64_t* row = const_data<int64_t>(rows);
      for (int64_t i = 0; i < rows.numel(); ++i)
        QSPEC_CHECK(row[i] >= (i ? row[i - 1] + 1 : 0) && row[i] < grid, kOp, "token_rows",
                    "must be increasing rows of the [batch * tokens] = ", grid, " grid of positions, got ", row[i],
                    " at index ", i);
    }
  } else {
    QSPEC_CHECK(grid == hidden.size(0), kOp, "positions",
                "must be [batch, tokens] with batch * tokens = hidden's ", hidden.size(0), " rows, got ",
                positions.sizes());
  }
  QSPEC_CHECK(output_rows.has_value() == output_positions.has_value(), kOp,
              output_rows ? "output_positions" : "output_rows", "must be given with ",
              output_rows ? "output_rows" : "output_positions", ", got None");
  if (output_rows) {
    QSPEC_CHECK(!tree_start, kOp, "output_rows", "is for chains, not draft trees (tree_start given)");
    QSPEC_CHECK(output_rows->dim() == 1 && dtype_of(*output_rows) == kLong &&
                    output_rows->device() == hidden.device(),
                kOp, "output_rows", "must be int64 [rows] on ", hidden.device(), ", got ", dtype_of(*output_rows),
                " ", output_rows->sizes(), " on ", output_rows->device());
    QSPEC_CHECK(output_positions->dim() == 2 && output_positions->size(0) == positions.size(0) &&
                    output_positions->numel() == output_rows->numel() &&
                    dtype_of(*output_positions) == dtype_of(positions),
                kOp, "output_positions", "must be ", dtype_of(positions), " [", positions.size(0), ", ",
                positions.size(0) ? output_rows->numel() / positions.size(0) : 0, "] (output_rows' ",
                output_rows->numel(), " tokens in ", positions.size(0), " requests), got ",
                dtype_of(*output_positions), " ", output_positions->sizes());
    if (output_rows->is_cpu()) {
      const Tensor rows = as_contiguous(*output_rows);
      const int64_t* row = const_data<int64_t>(rows);
      for (int64_t i = 0; i < rows.numel(); ++i)
        QSPEC_CHECK(row[i] >= 0 && row[i] < hidden.size(0), kOp, "output_rows", "must be rows of hidden, in [0, ",
                    hidden.size(0), "), got ", row[i], " at index ", i);
    }
  }
  for (const auto& [name, size] : {std::pair<std::string_view, int64_t>{"num_heads_q", num_heads_q},
                                    {"num_heads_kv", num_heads_kv}, {"head_dim", head_dim},
                                    {"intermediate_size", intermediate_size}})
    QSPEC_CHECK(size > 0, kOp, name, "must be positive, got ", size);
  const int64_t width = hidden.size(1), q_width = num_heads_q * head_dim;

  fused_add_rms_norm_(hidden, residual, input_norm, eps);  // residual += hidden; hidden = its norm
  Tensor qkv = project("qkv_weight", hidden, qkv_weight, q_width + 2 * num_heads_kv * head_dim);
  qk_norm_rope_(qkv, q_norm, k_norm, cos_sin_cache, rope_positions, num_heads_q, num_heads_kv, head_dim, eps, true,
                k_cache, v_cache, slots);
  // output_rows: only these tokens attend (at output_positions) and run the MLP. Else packed
  // tokens (token_rows): their queries go to their rows of the [B, T] grid (padding rows zero,
  // position -1: attention leaves them), and their contexts come back.
  Tensor query = as_strided(qkv, {qkv.size(0), q_width}, {qkv.stride(0), 1});
  const Tensor& query_positions = output_rows ? *output_positions : positions;
  if (output_rows)
    query = torch::stable::index_select(query, 0, *output_rows);
  else if (token_rows)
    query = index_copy_(zeros({grid, q_width}, query), *token_rows, query);
  // query: [rows, q_width] with unit column stride, viewed as [B, T, Hq, D]; context comes contiguous.
  const int64_t batch = query_positions.size(0), tokens = query_positions.size(1), row_stride = query.stride(0);
  STD_TORCH_CHECK(query.size(0) == batch * tokens);  // the argument checks above make it so
  const Tensor context = cached_attention(
      as_strided(query, {batch, tokens, num_heads_q, head_dim}, {tokens * row_stride, row_stride, head_dim, 1}),
      k_cache, v_cache, query_positions, std::pow(double(head_dim), -0.5), 0, tree_start, tree_seen);
  Tensor context_rows = as_strided(context, {batch * tokens, q_width}, {q_width, 1});
  if (token_rows && !output_rows) context_rows = torch::stable::index_select(context_rows, 0, *token_rows);
  Tensor attended = project("o_weight", context_rows, o_weight, width);
  Tensor stream = output_rows ? torch::stable::index_select(residual, 0, *output_rows) : residual;
  fused_add_rms_norm_(attended, stream, post_norm, eps);
  const Tensor gate_up = project("gate_up_weight", attended, gate_up_weight, 2 * intermediate_size);
  const Tensor out = project("down_weight", silu_and_mul(gate_up), down_weight, width);
  if (!output_rows) return void(torch::stable::copy_(hidden, out));
  index_copy_(residual, *output_rows, stream);
  index_copy_(hidden, *output_rows, out);
}

}  // namespace

#ifdef QSPEC_CUDA_LIBRARY
STABLE_TORCH_LIBRARY_IMPL(qspec_ext, CUDA, m) { m.impl("decoder_layer_", TORCH_BOX(&decoder_layer)); }
#else
STABLE_TORCH_LIBRARY_IMPL(qspec_ext, CPU, m) { m.impl("decoder_layer_", TORCH_BOX(&decoder_layer)); }
#endif

}  // namespace qspec_ext
