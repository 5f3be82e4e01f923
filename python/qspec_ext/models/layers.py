"""Building blocks shared by the drafter and the built-in target: weight holders named
as in the checkpoints, and attention over a static per-request KV cache."""

import math
from dataclasses import dataclass

import torch
from torch import nn

from .. import reference
from ..rope import rope_cos_sin_cache
from .checkpoint import reuse_freed_heap
from .linear import Linear


def mark_static(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """KV caches keep their addresses for the whole generate call: CUDA graphs may capture them."""
    for pair in caches:
        for cache in pair:
            torch._dynamo.mark_static_address(cache)


def static_caches(existing: list[tuple[torch.Tensor, torch.Tensor]], layers: int, shape: tuple[int, ...],
                  like: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) caches of ``shape`` in ``like``'s dtype and device: the existing ones when
    they fit (the next generate call reuses them; their stale entries are never read: attention
    reads only the slots each query sees, written before), else new zeroed ones. On the CPU the
    heap then keeps freed activations mapped for the next step (:func:`reuse_freed_heap`)."""
    if existing and len(existing) == layers and all(
            c.shape == shape and c.dtype == like.dtype and c.device == like.device for pair in existing for c in pair):
        return existing
    if like.device.type == "cpu":
        reuse_freed_heap()
    caches = [(like.new_zeros(shape), like.new_zeros(shape)) for _ in range(layers)]
    mark_static(caches)
    return caches


def keep_requests(caches: list[tuple[torch.Tensor, torch.Tensor]], rows: list[int], lengths: list[int],
                  max_length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-request caches ``[B * max_length, ...]`` narrowed to the requests ``rows``: request
    ``rows[i]``'s first ``lengths[i]`` slots are copied to request i's (``rows[i] >= i``, distinct:
    each copy reads a request no earlier copy wrote), and the caches returned are views of the
    first ``len(rows)`` requests' slots (the same memory)."""
    if any(r < i for i, r in enumerate(rows)) or len(set(rows)) != len(rows):
        raise ValueError(f"keep_requests: rows must be distinct with rows[i] >= i, got {rows}")
    for k_cache, v_cache in caches:
        for i, (r, n) in enumerate(zip(rows, lengths)):
            if r != i and n > 0:
                k_cache[i * max_length : i * max_length + n] = k_cache[r * max_length : r * max_length + n]
                v_cache[i * max_length : i * max_length + n] = v_cache[r * max_length : r * max_length + n]
    kept = [(k[: len(rows) * max_length], v[: len(rows) * max_length]) for k, v in caches]
    mark_static(kept)
    return kept


def static_cos_sin(existing: torch.Tensor | None, max_length: int, config, device) -> torch.Tensor:
    """The RoPE table ``[max_length, rot]`` (fp32) of a model's config: the existing one when it
    fits, so that graphs reading it (a static input, like the caches) see the same address."""
    if existing is not None and existing.shape[0] == max_length and existing.device == torch.device(device):
        return existing
    table = rope_cos_sin_cache(max_length, config.head_dim, config.rope_theta, torch.float32, device,
                               config.rope_scaling)
    torch._dynamo.mark_static_address(table)
    return table


class RMSNormWeight(nn.Module):
    """Holds an RMSNorm weight (the ops apply it)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))


def named_parts_in_checkpoints(module: nn.Module, fused: str, parts: dict[str, int]) -> None:
    """``module.<fused>`` is one Linear whose output rows are several projections of the same
    input (q/k/v, gate/up: one matmul instead of several). Checkpoints name the parts
    separately, ``<part>.weight``: ``state_dict()`` splits the weight into them (row slices,
    views) and ``load_state_dict()`` joins them."""
    names, widths = list(parts), list(parts.values())

    def split(module, state_dict, prefix, local_metadata):
        weight = state_dict.pop(prefix + fused + ".weight")
        for name, rows in zip(names, weight.split(widths)):
            state_dict[prefix + name + ".weight"] = rows

    def join(module, state_dict, prefix, *args):
        keys = [prefix + name + ".weight" for name in names]
        if all(key in state_dict for key in keys):  # else strict loading reports what is missing
            state_dict[prefix + fused + ".weight"] = torch.cat([state_dict.pop(key) for key in keys])

    module.register_state_dict_post_hook(split)
    module.register_load_state_dict_pre_hook(join)
    module.__dict__.setdefault("checkpoint_joins", []).append(join)


def join_checkpoint_parts(model: nn.Module, state_dict: dict) -> None:
    """Joins the parts of every fused projection in ``state_dict`` in place, as loading does, one
    module at a time: each part is freed as soon as it is copied (``load_state_dict`` works on a
    copy of the dict, so the caller's dict would hold every part until it returns)."""
    for name, module in model.named_modules():
        for join in module.__dict__.get("checkpoint_joins", ()):
            join(module, state_dict, name + "." if name else "")


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the differentiable (training) path computes it, in x's dtype."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox RoPE of ``x [B, L, heads, D]`` with ``cos`` / ``sin`` ``[L, D/2]`` or ``[B, L, D/2]``."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
              own_index: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor:
    """The differentiable attention core (training): queries ``q [B, L, heads, D]`` over keys and
    values ``k, v [B, S, heads, D]`` where ``allowed [..., L, S]`` is true, and over each pair of
    ``own_index`` (``[B, L, heads, D]`` each: training-time test's later draft steps) the key at the
    query's own index only; one softmax over all of them. Returns ``[B, L, heads, D]``."""
    D, S = q.shape[-1], k.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~allowed, float("-inf"))
    diagonal = [(q * ks).sum(-1).transpose(1, 2)[..., None] / math.sqrt(D) for ks, _ in own_index]
    weights = torch.cat([scores, *diagonal], dim=-1).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", weights[..., :S].to(v.dtype), v)
    for i, (_, vs) in enumerate(own_index):
        out = out + weights[..., S + i].transpose(1, 2)[..., None].to(vs.dtype) * vs
    return out


class Attention(nn.Module):
    def __init__(self, hidden: int, input_width: int, heads: int, kv_heads: int, head_dim: int, qk_norm: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        parts = dict(q_proj=heads * head_dim, k_proj=kv_heads * head_dim, v_proj=kv_heads * head_dim)
        self.qkv_proj = Linear(input_width, sum(parts.values()), bias=False)
        named_parts_in_checkpoints(self, "qkv_proj", parts)
        self.o_proj = Linear(heads * head_dim, hidden, bias=False)
        if qk_norm:
            self.q_norm = RMSNormWeight(head_dim)
            self.k_norm = RMSNormWeight(head_dim)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The packed [T, (Hq + 2 Hkv) * D] projection qk_norm_rope_ works on."""
        return self.qkv_proj(x)

    def qkv_rope(self, u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The differentiable path (training): q, k, v ``[B, L, heads, D]`` of ``u [B, L, in]``,
        q / k normalized per head (Qwen3) and rotated; k and v repeated to the query heads."""
        B, L, _ = u.shape
        D = self.head_dim
        q, k, v = self.qkv(u).view(B, L, -1, D).split([self.heads, self.kv_heads, self.kv_heads], 2)
        q_norm, k_norm = self.qk_norm_weights()
        if q_norm is not None:
            q, k = rms(q, q_norm, eps), rms(k, k_norm, eps)
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        group = self.heads // self.kv_heads
        return q, k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)

    def qk_norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        q_norm = self._modules.get("q_norm")  # not hasattr: a missing module raises inside nn.Module, slowly
        return (None, None) if q_norm is None else (q_norm.weight, self.k_norm.weight)

    def forward_cached(self, kernels, u: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], cos_sin: torch.Tensor,
                       at: "CachedPositions", eps: float, window: int | None = None,
                       only: "LastTokens | None" = None) -> torch.Tensor:
        """o_proj(attention) of u (the forward's token rows, ``[B*T, in]`` or packed) at the
        forward's positions ``at``: packed QKV, qk_norm_rope_ with the K/V written into the cache,
        cached_attention over the slots in use. Chains use the slot of each position, causal by
        position; a draft tree brings its own slots and what each node sees (:class:`~qspec_ext.drafting.tree.TreeAttention`).
        ``only`` (:meth:`CachedPositions.last_tokens`): every token's K/V is written, but only
        those tokens attend (a last layer whose other rows nobody reads): returns their ``[B, H]``."""
        batch, tokens = at.positions.shape
        qkv = self.qkv(u)
        kernels.qk_norm_rope_(qkv, *self.qk_norm_weights(), cos_sin, at.rope_positions, self.heads, self.kv_heads,
                          self.head_dim, eps, True, *cache, at.slots)
        q = qkv[:, : self.heads * self.head_dim]
        positions = at.positions
        if only is not None:
            if at.tree_args != (None, None):
                raise ValueError("Attention.forward_cached: only is for chains, not draft trees")
            q, positions = q[only.rows], only.positions
        elif at.token_rows is not None:  # packed tokens: their queries in the [B*T] grid, padding zero
            q = q.new_zeros(batch * tokens, q.shape[1]).index_copy_(0, at.token_rows, q)
        q = q.reshape(*positions.shape, self.heads, self.head_dim)
        context = kernels.cached_attention(q, *cache, positions, self.head_dim**-0.5, window or 0, *at.tree_args)
        context = context.reshape(positions.numel(), -1)
        if only is None and at.token_rows is not None:
            context = context[at.token_rows]
        return self.o_proj(context)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        named_parts_in_checkpoints(self, "gate_up_proj", dict(gate_proj=intermediate, up_proj=intermediate))
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, kernels=reference) -> torch.Tensor:
        """down_proj(silu(gate) * up) with ``kernels``' silu_and_mul: the models' cached forwards pass
        theirs (the custom op), training keeps the differentiable reference."""
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """A pre-norm Llama / Qwen3 decoder layer (Qwen3's per-head q/k RMSNorm where ``qk_norm``): the
    native target's layers and the drafter's past its first. Inference runs in place on the stream
    (:meth:`forward_cached`), training on the differentiable :meth:`attention_input` / :meth:`output`."""

    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, qk_norm: bool,
                 eps: float, input_width: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNormWeight(hidden)
        self.self_attn = Attention(hidden, input_width or hidden, heads, kv_heads, head_dim, qk_norm)
        self.post_attention_layernorm = RMSNormWeight(hidden)
        self.mlp = MLP(hidden, intermediate)
        self.intermediate, self.eps = intermediate, eps

    def forward_cached(self, kernels, hidden: torch.Tensor, residual: torch.Tensor,
                       cache: tuple[torch.Tensor, torch.Tensor], cos_sin: torch.Tensor, at: "CachedPositions",
                       window: int | None = None, only: "LastTokens | None" = None) -> None:
        """In place on the stream ``hidden + residual`` ``[B*T, H]`` (its two parts updated), the
        layer's K/V written into ``cache`` at the forward's positions ``at``: ``kernels.decoder_layer_``.
        ``only``: every token's K/V is written, but only the ``only`` rows attend and run the MLP
        (a last layer: nobody reads the other rows, left half-way). A sliding ``window`` (which the
        fused op does not take): the same steps, op by op."""
        attn, mlp = self.self_attn, self.mlp
        if window is None:
            output = (only.rows, only.positions) if only is not None else (None, None)
            kernels.decoder_layer_(hidden, residual, self.input_layernorm.weight, self.post_attention_layernorm.weight,
                                   attn.qkv_proj.inference_weight(hidden), attn.o_proj.inference_weight(hidden),
                                   mlp.gate_up_proj.inference_weight(hidden), mlp.down_proj.inference_weight(hidden),
                                   *attn.qk_norm_weights(), *cache, cos_sin, at.positions, at.rope_positions, at.slots,
                                   *at.tree_args, attn.heads, attn.kv_heads, attn.head_dim,
                                   self.intermediate, self.eps, at.token_rows, *output)
            return
        kernels.fused_add_rms_norm_(hidden, residual, self.input_layernorm.weight, self.eps)
        out, stream = self.attention_and_mlp(kernels, hidden, residual, cache, cos_sin, at, window, only)
        if only is None:
            hidden.copy_(out)
        else:
            residual[only.rows], hidden[only.rows] = stream, out

    def attention_and_mlp(self, kernels, u: torch.Tensor, residual: torch.Tensor,
                          cache: tuple[torch.Tensor, torch.Tensor], cos_sin: torch.Tensor, at: "CachedPositions",
                          window: int | None, only: "LastTokens | None") -> tuple[torch.Tensor, torch.Tensor]:
        """The cached layer after its input norm, op by op: attention of the normalized rows ``u``,
        the residual add and norm, the MLP. Returns the MLP's output and the residual stream (of the
        ``only`` rows, if given; else ``residual`` itself, updated in place)."""
        out = self.self_attn.forward_cached(kernels, u, cache, cos_sin, at, self.eps, window, only)
        if only is not None:
            residual = residual[only.rows]
        kernels.fused_add_rms_norm_(out, residual, self.post_attention_layernorm.weight, self.eps)
        return self.mlp(out, kernels), residual

    def attention_input(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The differentiable path: (residual, attention input) of the stream h."""
        return h, rms(h, self.input_layernorm.weight, self.eps)

    def output(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The differentiable path: h = residual + o_proj(attended [B, L, heads, D]), then
        h + MLP(RMSNorm(h))."""
        B, L = attended.shape[:2]
        h = residual + self.self_attn.o_proj(attended.reshape(B, L, -1))
        return h + self.mlp(rms(h, self.post_attention_layernorm.weight, self.eps))


class CachedPositions:
    """A forward's token positions ``[B, T]`` (-1 pads) and what every layer's cached attention
    derives from them, once per forward: each token's cache slot ``[B*T]`` (its position's slot in
    its request's rows, which start at b * max_length; its draft tree's scratch slot; -1 pads), the
    RoPE positions (padding rotated as 0, its rows unused) and the attention arguments of ``tree`` (a
    :class:`~qspec_ext.drafting.tree.TreeAttention`, or None: a chain).

    ``packed``: where the grid has padding, the forward runs its tokens only: ``token_rows`` holds
    their rows of the ``[B*T]`` grid (None: all of them), ``slots`` and ``rope_positions`` are
    theirs, and ``packed_row`` ``[B*T]`` maps a grid row to its token's row (-1: padding). Finds
    the padding on the host (a synchronization): for prefills, whose prompts differ in length."""

    def __init__(self, positions: torch.Tensor, max_length: int, tree=None,
                 packed: bool = False):
        self.positions = positions
        if tree is None:
            start = torch.arange(positions.shape[0], device=positions.device)[:, None] * max_length
            self.slots = torch.where(positions >= 0, start + positions, -1).reshape(-1)
        else:
            self.slots = tree.slots
        self.rope_positions = positions.reshape(-1).clamp(min=0)
        self.tree_args = (None, None) if tree is None else (tree.start, tree.seen)
        self.token_rows = self.packed_row = None
        if packed:
            if tree is not None:
                raise ValueError("CachedPositions: packed is for prefills, not draft trees")
            present = positions.reshape(-1) >= 0
            rows = present.nonzero()[:, 0]
            if rows.numel() < present.numel():
                self.token_rows = rows
                self.slots, self.rope_positions = self.slots[rows], self.rope_positions[rows]
                self.packed_row = torch.full(present.shape, -1, dtype=torch.long, device=rows.device)
                self.packed_row[rows] = torch.arange(rows.numel(), device=rows.device)

    def tokens(self, grid: torch.Tensor) -> torch.Tensor:
        """The forward's rows of ``grid`` ``[B*T, ...]``: all, or its tokens' when packed."""
        return grid if self.token_rows is None else grid[self.token_rows]

    def last_tokens(self) -> "LastTokens":
        """Each request's last token (its largest position): its row among the forward's token
        rows and its position."""
        batch, tokens = self.positions.shape
        last = torch.arange(batch, device=self.positions.device) * tokens + self.positions.argmax(dim=1)
        rows = last if self.packed_row is None else self.packed_row[last]
        return LastTokens(rows, self.positions.reshape(-1)[last][:, None])


@dataclass
class LastTokens:
    """Each request's last token in a forward (:meth:`CachedPositions.last_tokens`)."""

    rows: torch.Tensor  # [B]: rows of the forward's tokens
    positions: torch.Tensor  # [B, 1]
