"""Building blocks shared by the drafter and the built-in target: weight holders named
as in the checkpoints, and attention over a static per-request KV cache."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNormWeight(nn.Module):
    """Holds an RMSNorm weight (the ops apply it)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))


class Attention(nn.Module):
    def __init__(self, hidden: int, input_width: int, heads: int, kv_heads: int, head_dim: int, qk_norm: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(input_width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(input_width, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(input_width, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        if qk_norm:
            self.q_norm = RMSNormWeight(head_dim)
            self.k_norm = RMSNormWeight(head_dim)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The packed [T, (Hq + 2 Hkv) * D] projection qk_norm_rope_ works on."""
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def qk_norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (self.q_norm.weight, self.k_norm.weight) if hasattr(self, "q_norm") else (None, None)

    def forward_cached(self, ops, u: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], cos_sin: torch.Tensor,
                       positions: torch.Tensor, eps: float, window: int | None = None) -> torch.Tensor:
        """o_proj(attention) of u ``[B*T, in]`` at positions ``[B, T]`` (-1 pads): packed QKV,
        qk_norm_rope_ with the K/V written into the cache, attention over the cache."""
        batch, tokens = positions.shape
        max_length = cache[0].shape[0] // batch
        qkv = self.qkv(u)
        ops.qk_norm_rope_(qkv, *self.qk_norm_weights(), cos_sin, positions.reshape(-1).clamp(min=0), self.heads,
                          self.kv_heads, self.head_dim, eps, True, *cache, cache_slots(positions, max_length))
        q = qkv[:, : self.heads * self.head_dim].view(batch, tokens, self.heads, self.head_dim)
        context = cached_attention(q.transpose(1, 2), *cache, positions, max_length, window)
        return self.o_proj(context.transpose(1, 2).reshape(batch * tokens, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def cache_slots(positions: torch.Tensor, max_length: int) -> torch.Tensor:
    """KV-cache slot of each token ``[B*T]``: request b's rows start at b * max_length; -1 pads."""
    batch, tokens = positions.shape
    start = torch.arange(batch, device=positions.device)[:, None] * max_length
    return torch.where(positions >= 0, start + positions, -1).reshape(-1)


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     max_length: int, window: int | None = None) -> torch.Tensor:
    """Causal attention of q ``[B, Hq, T, D]`` over a ``[B * max_length, Hkv, D]`` cache, masked
    by position (a key is seen when its position is <= the query's, and within the window).
    Entries past a query's position may be stale drafts: the mask hides them."""
    batch, _, _, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    keys = k_cache.view(batch, max_length, kv_heads, head_dim).transpose(1, 2)
    values = v_cache.view(batch, max_length, kv_heads, head_dim).transpose(1, 2)
    key_pos = torch.arange(max_length, device=q.device)
    query_pos = positions[:, None, :, None]
    mask = key_pos <= query_pos
    if window is not None:
        mask = mask & (key_pos > query_pos - window)
    mask = mask | ((query_pos < 0) & (key_pos == 0))  # padding queries: any finite row
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
