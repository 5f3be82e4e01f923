"""Readable pure-PyTorch specification of every qspec_ext op: the test oracle.

Shares no code with the kernels. Math is done in fp32 and cast back at the end.
"""

import torch


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
