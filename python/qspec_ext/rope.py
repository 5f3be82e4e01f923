"""RoPE cos/sin tables in the layout the kernels read."""

import torch


def rope_cos_sin_cache(
    max_position: int,
    rotary_dim: int,
    theta: float = 1_000_000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    inv_freq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns ``[max_position, rotary_dim]``: cos of each angle in the first half, sin in the second.

    Angles are ``position * inv_freq`` with ``inv_freq = theta ** (-2i / rotary_dim)``
    unless ``inv_freq`` (``[rotary_dim // 2]``, e.g. from a scaled RoPE) is given.
    Computed in fp32 (fp64 for the angles), then cast to ``dtype``.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rope_cos_sin_cache: rotary_dim must be a positive even number, got {rotary_dim}")
    if inv_freq is None:
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
        inv_freq = 1.0 / (theta**exponents)
    elif inv_freq.shape != (rotary_dim // 2,):
        raise ValueError(
            f"rope_cos_sin_cache: inv_freq must have shape [{rotary_dim // 2}], got {list(inv_freq.shape)}"
        )
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq.to(torch.float64))
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return cache.to(dtype=dtype, device=device)
