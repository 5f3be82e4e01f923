// The only place operator schemas are written. Kernels register in cpu/*.cpp and cuda/*.cu.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(qspec_ext, m) {
  // out = RMSNorm(input) * weight over the last dim, computed in fp32.
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  // residual += input; input = RMSNorm(residual) * weight, normalizing the fp32 sum.
  m.def("fused_add_rms_norm_(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  // EAGLE-3 layer-0 input: (cat(RMSNorm(embeds), RMSNorm(hidden)), residual) in one pass.
  m.def(
      "eagle3_input_norm(Tensor embeds, Tensor hidden, Tensor embed_weight, Tensor hidden_weight, float eps, "
      "bool norm_before_residual) -> (Tensor, Tensor)");
  // In place on packed QKV: per-head RMSNorm of q and k, RoPE, optional KV-cache write.
  m.def(
      "qk_norm_rope_(Tensor(a!) qkv, Tensor? q_weight, Tensor? k_weight, Tensor cos_sin_cache, Tensor positions, "
      "int num_heads_q, int num_heads_kv, int head_dim, float eps, bool is_neox, Tensor(b!)? k_cache=None, "
      "Tensor(c!)? v_cache=None, Tensor? slot_mapping=None) -> ()");

  // Drafter fc input: row j = concat_i(aux[i][indices[j]] (+ residual[i][...])), normalized per norm_mode.
  m.def(
      "gather_aux_hidden(Tensor[] aux, Tensor indices, Tensor[]? residual, str norm_mode, Tensor? norm_weight, "
      "float eps) -> Tensor");
  // gather_aux_hidden into a preallocated [N, n*H] buffer.
  m.def(
      "gather_aux_hidden_out(Tensor[] aux, Tensor indices, Tensor[]? residual, str norm_mode, Tensor? norm_weight, "
      "float eps, Tensor(a!) out) -> ()");

  // Greedy verification: keep drafts while they equal the target argmax, then emit one target token.
  m.def("verify_greedy(Tensor draft_ids, Tensor target_logits, Tensor? num_draft=None) -> (Tensor, Tensor)");
  // verify_greedy into preallocated out_ids [B, K+1] and num_accepted [B].
  m.def(
      "verify_greedy_out(Tensor draft_ids, Tensor target_logits, Tensor? num_draft, Tensor(a!) out_ids, "
      "Tensor(b!) num_accepted) -> ()");
  // Lossless rejection sampling from target logits (temperature 0 rows verified greedily).
  m.def(
      "verify_sampling(Tensor draft_ids, Tensor? draft_probs, Tensor target_logits, Tensor temperature, Tensor seed, "
      "Tensor offset, Tensor? d2t=None, Tensor? num_draft=None) -> (Tensor, Tensor)");
  // verify_sampling into preallocated out_ids [B, K+1] and num_accepted [B].
  m.def(
      "verify_sampling_out(Tensor draft_ids, Tensor? draft_probs, Tensor target_logits, Tensor temperature, "
      "Tensor seed, Tensor offset, Tensor? d2t, Tensor? num_draft, Tensor(a!) out_ids, Tensor(b!) num_accepted) -> ()");

  // Tree verification (EAGLE-2/3 draft trees): parents [B, N] (parent of node i+1 in [0, i], -1 unused),
  // target_logits [B, N+1, V]; walks from the root following the target's token at each node.
  m.def("verify_tree_greedy(Tensor draft_ids, Tensor parents, Tensor target_logits) -> (Tensor, Tensor, Tensor)");
  m.def(
      "verify_tree_greedy_out(Tensor draft_ids, Tensor parents, Tensor target_logits, Tensor(a!) out_ids, "
      "Tensor(b!) num_accepted, Tensor(c!) path) -> ()");
  // The same walk with the target's token drawn from softmax(row / temperature), keyed by (seed, offset + depth).
  m.def(
      "verify_tree_sampling(Tensor draft_ids, Tensor parents, Tensor target_logits, Tensor temperature, "
      "Tensor seed, Tensor offset) -> (Tensor, Tensor, Tensor)");
  m.def(
      "verify_tree_sampling_out(Tensor draft_ids, Tensor parents, Tensor target_logits, Tensor temperature, "
      "Tensor seed, Tensor offset, Tensor(a!) out_ids, Tensor(b!) num_accepted, Tensor(c!) path) -> ()");

  // Decode attention of query [B, T, Hq, D] over the static cache [B * L, Hkv, D] (GQA): query (b, t) at
  // position p sees the keys at slots <= p (within the window when window > 0), or with a tree the context
  // before tree_start[b] plus the scratch slots tree_start[b] + s its tree_seen[b, t, s] marks; reads only
  // those slots. Padding queries (position -1) give zeros.
  m.def(
      "cached_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor positions, float scale, int window=0, "
      "Tensor? tree_start=None, Tensor? tree_seen=None) -> Tensor");

  // The gated MLP's activation: input [..., 2I] = (gate, up) -> silu(gate) * up [..., I], in fp32.
  m.def("silu_and_mul(Tensor input) -> Tensor");

  // input [M, K] @ W^T for W [N, K] packed in panels of 16 output columns with 4-byte lanes of G = 4 /
  // element size inputs, [ceil(N / 16), ceil(K / G), 16, G], zero past N and K (CPU: the projections'
  // inference path). Returns [M, out_features = N].
  m.def("packed_linear(Tensor input, Tensor packed_weight, int out_features) -> Tensor");

  // One pre-norm decoder layer (Llama / Qwen3) in place, composed of the ops above: residual += hidden,
  // attention of its norm (QKV, qk_norm_rope_ into the caches at slots, cached_attention, o), residual +=
  // that, hidden = the gated MLP of its norm. Projection weights [N, K], or packed (CPU). hidden holds
  // the rows of the [B, T] grid of positions, or with token_rows only those rows (packed tokens).
  // output_rows (with output_positions [B, F], their positions): only these rows of hidden attend and
  // run the MLP (a prefill's last tokens); every row's K/V is written, the other rows of hidden and
  // residual are left as the input norm and the stream entering the attention.
  m.def(
      "decoder_layer_(Tensor(a!) hidden, Tensor(b!) residual, Tensor input_norm, Tensor post_norm, "
      "Tensor qkv_weight, Tensor o_weight, Tensor gate_up_weight, Tensor down_weight, Tensor? q_norm, "
      "Tensor? k_norm, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor cos_sin_cache, Tensor positions, "
      "Tensor rope_positions, Tensor slots, Tensor? tree_start, Tensor? tree_seen, int num_heads_q, "
      "int num_heads_kv, int head_dim, int intermediate_size, float eps, Tensor? token_rows=None, Tensor? output_rows=None, "
      "Tensor? output_positions=None) -> ()");
}
