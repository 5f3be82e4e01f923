"""Readable pure-PyTorch specification of every qspec_ext op: the test oracle.

Shares no code with the kernels. Math is done in fp32 and cast back at the end.
"""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> None:
    total = x.float() + residual.float()
    residual.copy_(total.to(residual.dtype))
    normed = total * torch.rsqrt(total.pow(2).mean(dim=-1, keepdim=True) + eps)
    x.copy_((normed * weight.float()).to(x.dtype))


def eagle3_input_norm(
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    embed_weight: torch.Tensor,
    hidden_weight: torch.Tensor,
    eps: float = 1e-6,
    norm_before_residual: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    e_hat = rms_norm(embeds, embed_weight, eps)
    x_hat = rms_norm(hidden, hidden_weight, eps)
    residual = x_hat if norm_before_residual else hidden.clone()
    return torch.cat([e_hat, x_hat], dim=-1), residual


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotates the first 2 * cos.shape[-1] dims of x [..., heads, D]; cos, sin: [..., rot / 2]."""
    rot = 2 * cos.shape[-1]
    rotary, rest = x[..., :rot], x[..., rot:]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    if is_neox:
        first, second = rotary[..., : rot // 2], rotary[..., rot // 2 :]
    else:
        first, second = rotary[..., 0::2], rotary[..., 1::2]
    new_first = first * cos - second * sin
    new_second = second * cos + first * sin
    if is_neox:
        rotated = torch.cat([new_first, new_second], dim=-1)
    else:
        rotated = torch.stack([new_first, new_second], dim=-1).flatten(-2)
    return torch.cat([rotated, rest], dim=-1)


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
    tokens = qkv.shape[0]
    q_size, kv_size = num_heads_q * head_dim, num_heads_kv * head_dim
    q = qkv[:, :q_size].float().view(tokens, num_heads_q, head_dim)
    k = qkv[:, q_size : q_size + kv_size].float().view(tokens, num_heads_kv, head_dim)
    v = qkv[:, q_size + kv_size :].view(tokens, num_heads_kv, head_dim)
    if q_weight is not None:
        q = q * torch.rsqrt(q.pow(2).mean(dim=-1, keepdim=True) + eps) * q_weight.float()
        k = k * torch.rsqrt(k.pow(2).mean(dim=-1, keepdim=True) + eps) * k_weight.float()
    cos_sin = cos_sin_cache[positions.long()].float()
    cos, sin = cos_sin.chunk(2, dim=-1)
    q = apply_rope(q, cos, sin, is_neox).to(qkv.dtype)
    k = apply_rope(k, cos, sin, is_neox).to(qkv.dtype)
    qkv[:, :q_size] = q.flatten(1)
    qkv[:, q_size : q_size + kv_size] = k.flatten(1)
    if k_cache is not None:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        k_cache[slots] = k[keep]
        v_cache[slots] = v[keep]


def gather_aux_hidden(
    aux: list[torch.Tensor],
    indices: torch.Tensor,
    residual: list[torch.Tensor] | None = None,
    norm_mode: str = "none",
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    rows = indices.long().clamp(min=0)
    features = [a[rows].float() for a in aux]
    if residual is not None:
        features = [f + r[rows].float() for f, r in zip(features, residual)]
    if norm_mode == "fc_norm":
        features = [f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps) * w.float() for f, w in zip(features, norm_weight)]
    fc_input = torch.cat(features, dim=-1)
    if norm_mode == "norm_before_fc":
        fc_input = fc_input * torch.rsqrt(fc_input.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    fc_input[indices < 0] = 0
    return fc_input.to(aux[0].dtype)


# ----------------------------------------------------------------------------- attention


def cached_attention(query, k_cache, v_cache, positions, scale, window=0, tree_start=None, tree_seen=None):
    """Softmax attention of query [B, T, Hq, D] over every slot of the cache [B * L, Hkv, D],
    with a mask saying which slots each query sees (see ops.cached_attention)."""
    batch, tokens, heads, head_dim = query.shape
    length, kv_heads = k_cache.shape[0] // batch, k_cache.shape[1]
    group = heads // kv_heads
    keys = k_cache.view(batch, length, kv_heads, head_dim).float().repeat_interleave(group, dim=2)
    values = v_cache.view(batch, length, kv_heads, head_dim).float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,blhd->bhtl", query.float(), keys) * scale

    slot = torch.arange(length, device=query.device)
    position = positions.long()[:, :, None]  # [B, T, 1]
    if tree_start is None:
        seen = slot <= position
    else:
        start = tree_start[:, None, None]
        scratch = tree_seen.shape[2]
        offset = (slot - start).expand(batch, tokens, length)
        in_scratch = (offset >= 0) & (offset < scratch)
        marked = torch.zeros_like(in_scratch)
        if scratch > 0:
            marked = torch.gather(tree_seen, 2, offset.clamp(0, scratch - 1))
        seen = ((slot < start) | (in_scratch & marked)) & (start >= 0)
    if window > 0:
        seen = seen & (slot > position - window)
    seen = seen & (position >= 0)

    weights = torch.softmax(scores.masked_fill(~seen[:, None], float("-inf")), dim=-1)
    weights = weights.nan_to_num(0.0)  # a query that sees nothing gives zeros
    return torch.einsum("bhtl,blhd->bthd", weights, values).to(query.dtype)


# ----------------------------------------------------------------------------- projections


def packed_linear(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """input [M, K] @ weight [N, K]^T in float64, rounded once (ops.packed_linear takes the weight
    packed in panels; this one the weight as stored)."""
    return (input.double() @ weight.double().T).to(input.dtype)


def project(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    """x @ W^T for W [N, K] as stored, or packed in panels ([ceil(N / 16), ceil(K / G), 16, G]: column
    p * 16 + n is lane n of panel p, a lane G consecutive inputs), in the input's dtype."""
    if weight.dim() == 4:
        panels, lanes, panel, group = weight.shape
        weight = weight.transpose(1, 2).reshape(panels * panel, lanes * group)[:out_features, : x.shape[-1]]
    return packed_linear(x, weight)


# ----------------------------------------------------------------------------- activation


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [..., 2I] = (gate, up), in fp32, rounded once (differentiable: the
    models' training path)."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


# ----------------------------------------------------------------------------- verification

_MASK32 = 0xFFFFFFFF


def philox4x32_10(counter: list[int], key: list[int]) -> list[int]:
    """Philox-4x32-10 on Python ints (Salmon et al. 2011)."""
    c, k = list(counter), list(key)
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & _MASK32, (p0 >> 32) ^ c[3] ^ k[1], p0 & _MASK32]
        k = [(k[0] + 0x9E3779B9) & _MASK32, (k[1] + 0xBB67AE85) & _MASK32]
    return c


def verify_uniform(seed: int, position: int, use: int) -> float:
    """The uniform in [0, 1) the verification ops draw for (seed, position, use): use 0 accepts, 1 samples."""
    s, p = seed & 0xFFFFFFFFFFFFFFFF, position & 0xFFFFFFFFFFFFFFFF
    out = philox4x32_10([use, p & _MASK32, p >> 32, 0x5EED0001], [s & _MASK32, s >> 32])
    bits = (out[0] << 32) | out[1]
    return (bits >> 11) * 2.0**-53


def _emit_row(draft_ids, accepted, token, k):
    row = [-1] * (k + 1)
    row[:accepted] = draft_ids[:accepted]
    row[accepted] = token
    return row


def verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor, num_draft: torch.Tensor | None = None):
    batch, k = draft_ids.shape
    argmax = target_logits.argmax(dim=-1).tolist()
    out, accepted_counts = [], []
    for b in range(batch):
        n = k if num_draft is None else int(num_draft[b])
        drafts = draft_ids[b].tolist()
        accepted = 0
        while accepted < n and drafts[accepted] == argmax[b][accepted]:
            accepted += 1
        out.append(_emit_row(drafts, accepted, argmax[b][accepted], k))
        accepted_counts.append(accepted)
    return torch.tensor(out, dtype=torch.long), torch.tensor(accepted_counts, dtype=torch.long)


def draft_distribution(draft_probs: torch.Tensor, d2t: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """q over target ids [..., V] from draft probabilities over the draft (or target) vocabulary."""
    if d2t is None:
        return draft_probs.double()
    q = torch.zeros(*draft_probs.shape[:-1], vocab, dtype=torch.float64)
    target_ids = torch.arange(d2t.shape[0]) + d2t.long()
    q[..., target_ids] = draft_probs.double()
    return q


def _draw(weights: torch.Tensor, u: float) -> int:
    """Inverse CDF in index order: the first token whose cumulative weight exceeds u * total."""
    cumulative = weights.cumsum(0)
    above = (cumulative > u * cumulative[-1]) & (weights > 0)
    return int(above.nonzero()[0]) if above.any() else int((weights > 0).nonzero()[-1])


def verify_sampling(draft_ids, draft_probs, target_logits, temperature, seed, offset, d2t=None, num_draft=None):
    batch, k = draft_ids.shape
    vocab = target_logits.shape[-1]
    q_all = None if draft_probs is None else draft_distribution(draft_probs.cpu(), d2t, vocab)
    out, accepted_counts = [], []
    for b in range(batch):
        n = k if num_draft is None else int(num_draft[b])
        drafts = draft_ids[b].tolist()
        temp = float(temperature[b])
        logits = target_logits[b].double().cpu()
        if temp == 0.0:
            row, acc = verify_greedy(draft_ids[b : b + 1], target_logits[b : b + 1], None if num_draft is None else num_draft[b : b + 1])
            out.append(row[0].tolist())
            accepted_counts.append(int(acc[0]))
            continue
        s, o = int(seed[b]), int(offset[b])
        # A row has a distribution only if its max is finite (no NaN, not all -inf, no +inf).
        valid = [bool(torch.isfinite(logits[i].max()) and not torch.isnan(logits[i]).any()) for i in range(k + 1)]
        p = torch.softmax(logits / temp, dim=-1)
        accepted, emit = 0, "target"
        while accepted < n:
            x = drafts[accepted]
            if not valid[accepted]:
                emit = "argmax"
                break
            q_x = 1.0 if q_all is None else float(q_all[b, accepted, x])
            p_x = float(p[accepted, x])
            u = verify_uniform(s, o + accepted, 0)
            if not (p_x > 0 and q_x > 0 and u * q_x < p_x):
                emit = "residual"
                break
            accepted += 1
        if emit == "target" and not valid[accepted]:
            emit = "argmax"
        if emit == "argmax":
            token = int(target_logits[b, accepted].float().argmax())
        else:
            weights = p[accepted].clone()
            if emit == "residual":
                if q_all is None:
                    q = torch.zeros(vocab, dtype=torch.float64)
                    q[drafts[accepted]] = 1.0
                else:
                    q = q_all[b, accepted]
                residual = (p[accepted] - q).clamp(min=0)
                if residual.sum() > 0:
                    weights = residual
            token = _draw(weights, verify_uniform(s, o + accepted, 1))
        out.append(_emit_row(drafts, accepted, token, k))
        accepted_counts.append(accepted)
    return torch.tensor(out, dtype=torch.long), torch.tensor(accepted_counts, dtype=torch.long)


def verify_tree(draft_ids, parents, target_logits, temperature=None, seed=None, offset=None):
    """Tree verification, one request and one node at a time: from the root, the target's token
    at the current node (argmax, or a draw from softmax(row / T) keyed by offset + depth), then
    the lowest-index child holding it, until a node has none."""
    batch, nodes = draft_ids.shape
    out = torch.full((batch, nodes + 1), -1, dtype=torch.long)
    path = torch.full((batch, nodes + 1), -1, dtype=torch.long)
    accepted = torch.zeros(batch, dtype=torch.long)
    for b in range(batch):
        children = {}
        for i, parent in enumerate(parents[b].tolist()):
            if parent >= 0:
                children.setdefault(parent, []).append(i + 1)
        temp = 0.0 if temperature is None else float(temperature[b])
        node, depth = 0, 0
        while True:
            row = target_logits[b, node].double().cpu()
            has_distribution = bool(torch.isfinite(row.max())) and not bool(torch.isnan(row).any())
            if temp == 0.0 or not has_distribution:
                x = int(target_logits[b, node].float().argmax())
            else:
                x = _draw(torch.softmax(row / temp, dim=-1), verify_uniform(int(seed[b]), int(offset[b]) + depth, 1))
            out[b, depth], path[b, depth] = x, node
            match = [c for c in children.get(node, []) if int(draft_ids[b, c - 1]) == x]
            if not match:
                break
            node, depth = min(match), depth + 1
        accepted[b] = depth
    return out, accepted, path


# ----------------------------------------------------------------------------- decoder layer


def decoder_layer_(hidden, residual, input_norm, post_norm, qkv_weight, o_weight, gate_up_weight, down_weight,
                   q_norm, k_norm, k_cache, v_cache, cos_sin_cache, positions, rope_positions, slots, tree_start,
                   tree_seen, num_heads_q, num_heads_kv, head_dim, intermediate_size, eps, token_rows=None,
                   output_rows=None, output_positions=None) -> None:
    """One pre-norm decoder layer in place (see ops.decoder_layer_), from the reference ops."""
    batch, tokens = positions.shape
    width = hidden.shape[1]
    fused_add_rms_norm_(hidden, residual, input_norm, eps)
    qkv = project(hidden, qkv_weight, (num_heads_q + 2 * num_heads_kv) * head_dim)
    qk_norm_rope_(qkv, q_norm, k_norm, cos_sin_cache, rope_positions, num_heads_q, num_heads_kv, head_dim, eps, True,
                  k_cache, v_cache, slots)
    query = qkv[:, : num_heads_q * head_dim]
    if output_rows is not None:  # only these tokens go on
        query, positions = query[output_rows], output_positions
    elif token_rows is not None:  # packed tokens: their rows of the [B*T] grid, the others zero
        grid = query.new_zeros(batch * tokens, query.shape[1])
        grid[token_rows] = query
        query = grid
    query = query.reshape(*positions.shape, num_heads_q, head_dim)
    context = cached_attention(query, k_cache, v_cache, positions, head_dim**-0.5, 0, tree_start, tree_seen)
    context = context.reshape(positions.numel(), -1)
    if output_rows is None and token_rows is not None:
        context = context[token_rows]
    attended = project(context, o_weight, width)
    stream = residual if output_rows is None else residual[output_rows]
    fused_add_rms_norm_(attended, stream, post_norm, eps)
    gated = silu_and_mul(project(attended, gate_up_weight, 2 * intermediate_size))
    out = project(gated, down_weight, width)
    if output_rows is None:
        hidden.copy_(out)
    else:
        residual[output_rows] = stream
        hidden[output_rows] = out
