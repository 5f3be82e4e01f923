"""Typed wrappers over ``torch.ops.qspec_ext`` and their fake (meta) kernels.

Activations are fp32, fp16 or bf16; norm weights fp32 or the activation dtype; index
tensors int32 or int64. Rows of 2-D inputs may be strided (last dim contiguous).
Every op runs on CPU and, when built with CUDA, on CUDA (on the current stream), except
``packed_linear``: its packed weights are the CPU's inference path.
"""

from collections.abc import Sequence

import torch

_ops = torch.ops.qspec_ext


def rms_norm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dim, in fp32; returns ``input``'s shape and dtype.

    input: ``[..., H]``; weight: ``[H]``.
    """
    return _ops.rms_norm(input, weight, eps)


def fused_add_rms_norm_(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> None:
    """In place: ``residual += input``; ``input = RMSNorm(residual) * weight``.

    The norm is taken of the fp32 sum, before it is rounded into ``residual``.
    input, residual: ``[..., H]``, same dtype; weight: ``[H]``.
    """
    _ops.fused_add_rms_norm_(input, residual, weight, eps)


def eagle3_input_norm(
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    embed_weight: torch.Tensor,
    hidden_weight: torch.Tensor,
    eps: float = 1e-6,
    norm_before_residual: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The EAGLE-3 layer-0 input in one pass.

    embeds, hidden: ``[T, H]``; weights ``[H]``. Returns ``x [T, 2H] = cat(RMSNorm(embeds), RMSNorm(hidden))``
    and ``residual [T, H]``: the normalized hidden if ``norm_before_residual``, else a copy of ``hidden``.
    """
    return _ops.eagle3_input_norm(embeds, hidden, embed_weight, hidden_weight, eps, norm_before_residual)


def qk_norm_rope_(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    eps: float = 1e-6,
    is_neox: bool = True,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> None:
    """In place on the packed QKV projection ``[T, (Hq + 2 Hkv) * D]``.

    Per q and k head: RMSNorm over ``head_dim`` with ``q_weight``/``k_weight`` ``[D]`` (skipped
    when both are None), kept in fp32, then RoPE on the first ``rot`` dims from
    ``cos_sin_cache [max_position, rot]`` (cos first half, sin second) at ``positions [T]``;
    ``is_neox`` pairs i with i + rot/2, else 2i with 2i+1. V is untouched.
    With ``k_cache``/``v_cache`` ``[num_slots, Hkv, D]`` and ``slot_mapping [T]``, the final K and V of
    token t are also written at slot ``slot_mapping[t]`` (-1 skips the token).
    """
    _ops.qk_norm_rope_(
        qkv, q_weight, k_weight, cos_sin_cache, positions, num_heads_q, num_heads_kv, head_dim, eps, is_neox,
        k_cache, v_cache, slot_mapping,
    )


def gather_aux_hidden(
    aux: Sequence[torch.Tensor],
    indices: torch.Tensor,
    residual: Sequence[torch.Tensor] | None = None,
    norm_mode: str = "none",
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The drafter's fc input from the target's aux-layer features, in one pass.

    aux: n (1..8) tensors ``[T, H]`` (rows may be strided); indices: ``[N]`` int32/int64 rows to
    take, -1 = padding (a row of zeros); residual: n tensors like aux, added to them (for models
    that keep the residual stream separate). Row j of the ``[N, n*H]`` result is
    ``concat_i(aux[i][indices[j]] (+ residual[i][indices[j]]))``, then, in fp32:

    - ``norm_mode="none"``: as is;
    - ``"fc_norm"`` (EAGLE 3.1): each H-wide chunk i RMS-normalized with ``norm_weight[i]`` (``[n, H]``);
    - ``"norm_before_fc"``: one RMSNorm over the whole row with ``norm_weight`` (``[n*H]``).
    """
    return _ops.gather_aux_hidden(list(aux), indices, None if residual is None else list(residual), norm_mode,
                                  norm_weight, eps)


def gather_aux_hidden_out(
    aux: Sequence[torch.Tensor],
    indices: torch.Tensor,
    out: torch.Tensor,
    residual: Sequence[torch.Tensor] | None = None,
    norm_mode: str = "none",
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    """:func:`gather_aux_hidden` into a preallocated ``out [N, n*H]`` (static shapes for decode loops)."""
    _ops.gather_aux_hidden_out(list(aux), indices, None if residual is None else list(residual), norm_mode,
                               norm_weight, eps, out)


def verify_greedy(
    draft_ids: torch.Tensor, target_logits: torch.Tensor, num_draft: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of K drafts per request.

    draft_ids: ``[B, K]`` int64 target-vocab ids (1 <= K <= 32); target_logits: ``[B, K+1, V]``
    (row i scores the token after draft i-1); num_draft: ``[B]`` int32/int64 drafts per request
    (ragged batches; default K). Drafts are kept while they equal ``torch.argmax`` of their row
    (ties: lowest id); then the argmax of the first mismatching row, or of row n (the bonus),
    is emitted. Returns ``out_ids [B, K+1]`` int64 (accepted drafts, the emitted token, then -1)
    and ``num_accepted [B]`` int64. No host synchronization.
    """
    return _ops.verify_greedy(draft_ids, target_logits, num_draft)


def verify_greedy_out(
    draft_ids: torch.Tensor,
    target_logits: torch.Tensor,
    out_ids: torch.Tensor,
    num_accepted: torch.Tensor,
    num_draft: torch.Tensor | None = None,
) -> None:
    """:func:`verify_greedy` into preallocated ``out_ids [B, K+1]`` and ``num_accepted [B]`` (int64)."""
    _ops.verify_greedy_out(draft_ids, target_logits, num_draft, out_ids, num_accepted)


def verify_sampling(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    d2t: torch.Tensor | None = None,
    num_draft: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling: the emitted tokens follow softmax(target_logits / temperature).

    draft_ids ``[B, K]`` int64 target-vocab ids; draft_probs ``[B, K, Vd]`` (fp32 or the logits
    dtype) the drafter's probabilities, over the draft vocabulary mapped by ``d2t`` ``[Vd]``
    (target id = d + d2t[d]) or over the target vocabulary without d2t; None means argmax drafts
    (q one-hot). temperature ``[B]`` fp32 (0 = greedy for that request); seed, offset ``[B]``
    int64: random numbers are keyed only by (seed, offset + row), so pass the absolute
    position of the first verified token as offset and a replay reproduces.

    Draft x is accepted with probability min(1, p(x)/q(x)), never when p(x) or q(x) is 0; at the
    first rejection a token is drawn from normalize(max(0, p - q)), after n accepted drafts the
    bonus from p. A row with NaN logits or no finite logit has no distribution: its draft is
    rejected and torch.argmax of the row is emitted. Returns ``(out_ids [B, K+1], num_accepted [B])``.
    """
    return _ops.verify_sampling(draft_ids, draft_probs, target_logits, temperature, seed, offset, d2t, num_draft)


def verify_sampling_out(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    out_ids: torch.Tensor,
    num_accepted: torch.Tensor,
    d2t: torch.Tensor | None = None,
    num_draft: torch.Tensor | None = None,
) -> None:
    """:func:`verify_sampling` into preallocated ``out_ids [B, K+1]`` and ``num_accepted [B]`` (int64)."""
    _ops.verify_sampling_out(draft_ids, draft_probs, target_logits, temperature, seed, offset, d2t, num_draft,
                             out_ids, num_accepted)


def verify_tree_greedy(
    draft_ids: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification of a draft tree per request.

    Node 0 is the root (the last verified token); draft nodes 1..N in topological order.
    draft_ids ``[B, N]`` int64: the target-vocab token of node i+1; parents ``[B, N]`` int32/int64
    (contiguous): the parent of node i+1, in [0, i], or -1 for an unused node (ragged trees; an
    unused node has no used children); target_logits ``[B, N+1, V]``: row j scores the token after
    the path to node j (one target forward over [root, nodes] with tree attention).

    From the root: x = torch.argmax of the current node's row; if a child of the node holds x
    (the lowest-index one if siblings repeat a token) x is accepted and the walk moves there,
    else x is emitted and the walk stops. Returns ``out_ids [B, N+1]`` (the accepted drafts, then
    the target's own token, then -1), ``num_accepted [B]`` and ``path [B, N+1]`` (the rows that
    produced out_ids; ``path[b, 0] = 0``, -1 after), all int64. No host synchronization.
    """
    return _ops.verify_tree_greedy(draft_ids, parents, target_logits)


def verify_tree_greedy_out(draft_ids: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor,
                           out_ids: torch.Tensor, num_accepted: torch.Tensor, path: torch.Tensor) -> None:
    """:func:`verify_tree_greedy` into preallocated ``out_ids [B, N+1]``, ``num_accepted [B]``, ``path [B, N+1]``."""
    _ops.verify_tree_greedy_out(draft_ids, parents, target_logits, out_ids, num_accepted, path)


def verify_tree_sampling(
    draft_ids: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor, temperature: torch.Tensor,
    seed: torch.Tensor, offset: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless tree verification at temperature: the walk of :func:`verify_tree_greedy` with x
    drawn from softmax(row / temperature) (fused, the probabilities never materialized) by the
    Philox stream of :func:`verify_sampling`, keyed by (seed, offset + depth of the emitted token).
    The emitted tokens follow the target's distribution exactly for any tree of deterministic
    (e.g. top-k) drafts. temperature ``[B]`` fp32 (0 = greedy), seed, offset ``[B]`` int64; a row
    with NaN logits or no finite logit emits its torch.argmax. CPU and CUDA decide the same.
    """
    return _ops.verify_tree_sampling(draft_ids, parents, target_logits, temperature, seed, offset)


def verify_tree_sampling_out(draft_ids: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor,
                             temperature: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
                             out_ids: torch.Tensor, num_accepted: torch.Tensor, path: torch.Tensor) -> None:
    """:func:`verify_tree_sampling` into preallocated ``out_ids``, ``num_accepted``, ``path``."""
    _ops.verify_tree_sampling_out(draft_ids, parents, target_logits, temperature, seed, offset, out_ids,
                                  num_accepted, path)


def cached_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int = 0,
    tree_start: torch.Tensor | None = None,
    tree_seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of ``query [B, T, Hq, D]`` (last dim contiguous) over a static KV cache
    ``k_cache``/``v_cache [B * L, Hkv, D]`` (request b's slot j at row ``b * L + j``; ``Hq`` a
    multiple of ``Hkv``), softmax in fp32 with scores scaled by ``scale``. Returns ``[B, T, Hq, D]``.

    Query (b, t) at ``positions[b, t]`` = p sees the slots ``j <= p``; with a draft tree, the
    context slots ``j < tree_start[b]`` and the scratch slots ``tree_start[b] + s`` that
    ``tree_seen [B, T, S]`` marks (``tree_start[b] = -1``: the request is inactive). With
    ``window > 0`` only slots ``j > p - window``. Padding queries (p = -1) and queries that see
    no slot give zeros. Only the slots a query can see are read: the cost follows the context
    used, not the cache allocated.
    """
    return _ops.cached_attention(query, k_cache, v_cache, positions, scale, window, tree_start, tree_seen)


def silu_and_mul(input: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation: ``silu(gate) * up`` ``[..., I]`` for ``input [..., 2I]`` = (gate, up)
    (one gate_up projection's output), in fp32, rounded once into ``input``'s dtype."""
    return _ops.silu_and_mul(input)


def packed_linear(input: torch.Tensor, packed_weight: torch.Tensor, out_features: int) -> torch.Tensor:
    """``input @ W^T`` ``[M, out_features]`` for ``input [M, K]`` (fp32 or bf16) and ``packed_weight``
    = ``models.linear.pack_weight(W [out_features, K])``: W in panels of 16 output columns with
    4-byte lanes, ``[ceil(N / 16), ceil(K / G), 16, G]`` (G = 1 for fp32, 2 for bf16), in the
    input's dtype; accumulates in fp32. bf16 runs AMX tiles where the CPU has them
    (``build_info()["cpu_amx"]``), else AVX512-BF16 dot products where it has those
    (``build_info()["cpu_bf16_dot"]``); a row's result never depends on the other rows. CPU only:
    the projections' inference path, models/linear.py."""
    return _ops.packed_linear(input, packed_weight, out_features)


def decoder_layer_(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    input_norm: torch.Tensor,
    post_norm: torch.Tensor,
    qkv_weight: torch.Tensor,
    o_weight: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    rope_positions: torch.Tensor,
    slots: torch.Tensor,
    tree_start: torch.Tensor | None,
    tree_seen: torch.Tensor | None,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    intermediate_size: int,
    eps: float,
    token_rows: torch.Tensor | None = None,
    output_rows: torch.Tensor | None = None,
    output_positions: torch.Tensor | None = None,
) -> None:
    """One pre-norm decoder layer (Llama / Qwen3: the native target's), in place, composed of the
    ops above in one call: ``residual += hidden``; ``u = RMSNorm(residual) * input_norm``;
    ``qkv = u @ qkv_weight^T``; ``qk_norm_rope_`` (neox RoPE at ``rope_positions``, per-head
    ``q_norm`` / ``k_norm`` if given) writing K and V into the caches at ``slots``;
    ``cached_attention`` of the queries ``[B, T, Hq, D]`` at ``positions [B, T]`` (the tree pair if
    given), scale ``D ** -0.5``; ``a = context @ o_weight^T``; ``residual += a``; ``hidden =
    down(silu_and_mul(gate_up(RMSNorm(residual) * post_norm)))``.

    hidden, residual: ``[B*T, H]``, same dtype; projection weights ``[N, K]`` as stored, or packed
    (``models.linear.pack_weight``, CPU: through ``packed_linear``). ``token_rows`` (int64 ``[N]``,
    increasing): hidden, residual, rope_positions and slots hold only these rows of the ``[B*T]``
    grid of positions (packed tokens: a prefill's padding costs nothing); the queries are placed
    in the grid for the attention, their contexts taken back. ``output_rows`` (int64 ``[R]``, rows of
    hidden) with ``output_positions`` (``[B, R / B]``, their positions; chains, not trees): every
    row's K/V is written, but only these rows attend and run the MLP (a prefill's last tokens);
    hidden's and residual's other rows are left as ``u`` and the stream entering the attention.
    """
    _ops.decoder_layer_(hidden, residual, input_norm, post_norm, qkv_weight, o_weight, gate_up_weight, down_weight,
                        q_norm, k_norm, k_cache, v_cache, cos_sin_cache, positions, rope_positions, slots, tree_start,
                        tree_seen, num_heads_q, num_heads_kv, head_dim, intermediate_size, eps, token_rows,
                        output_rows, output_positions)


@torch.library.register_fake("qspec_ext::cached_attention")
def _cached_attention_fake(query, k_cache, v_cache, positions, scale, window=0, tree_start=None, tree_seen=None):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.register_fake("qspec_ext::silu_and_mul")
def _silu_and_mul_fake(input):
    return input.new_empty(*input.shape[:-1], input.shape[-1] // 2)


@torch.library.register_fake("qspec_ext::packed_linear")
def _packed_linear_fake(input, packed_weight, out_features):
    return input.new_empty(input.shape[0], out_features)


@torch.library.register_fake("qspec_ext::rms_norm")
def _rms_norm_fake(input, weight, eps):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.register_fake("qspec_ext::eagle3_input_norm")
def _eagle3_input_norm_fake(embeds, hidden, embed_weight, hidden_weight, eps, norm_before_residual):
    tokens, width = embeds.shape
    return embeds.new_empty(tokens, 2 * width), embeds.new_empty(tokens, width)


@torch.library.register_fake("qspec_ext::gather_aux_hidden")
def _gather_aux_hidden_fake(aux, indices, residual, norm_mode, norm_weight, eps):
    return aux[0].new_empty(indices.shape[0], len(aux) * aux[0].shape[1])


def _verify_fake(draft_ids, *args):
    batch, k = draft_ids.shape
    return draft_ids.new_empty(batch, k + 1), draft_ids.new_empty(batch)


torch.library.register_fake("qspec_ext::verify_greedy")(_verify_fake)
torch.library.register_fake("qspec_ext::verify_sampling")(_verify_fake)


def _verify_tree_fake(draft_ids, *args):
    batch, nodes = draft_ids.shape
    return draft_ids.new_empty(batch, nodes + 1), draft_ids.new_empty(batch), draft_ids.new_empty(batch, nodes + 1)


torch.library.register_fake("qspec_ext::verify_tree_greedy")(_verify_tree_fake)
torch.library.register_fake("qspec_ext::verify_tree_sampling")(_verify_tree_fake)
