"""RoPE: inverse frequencies (with the scaling types checkpoints ask for) and cos/sin tables
in the layout the kernels read."""

import math
from collections.abc import Mapping

import torch


def rope_config(config: Mapping, default_theta: float) -> tuple[float, dict | None]:
    """``(theta, scaling)`` of an HF config dict: transformers 5's ``rope_parameters`` (theta and
    scaling in one dict) or the older ``rope_theta`` + ``rope_scaling``. ``scaling`` keeps every
    field of the scaling type (None for "default"); the one parser of the target, the drafter and
    the trainer."""
    rope = dict(config.get("rope_parameters") or {})
    nested = [key for key, value in rope.items() if isinstance(value, Mapping)]
    if nested:
        raise ValueError(f"rope_config: rope_parameters per layer type ({', '.join(nested)}) are not supported; "
                         f"one RoPE for every layer is")
    theta = rope.pop("rope_theta", None)
    if theta is None:
        theta = config.get("rope_theta", default_theta)
    scaling = rope or dict(config.get("rope_scaling") or {}) or None
    if scaling is not None:
        if "type" in scaling and "rope_type" not in scaling:  # the pre-4.45 spelling
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    return float(theta), scaling


def rope_parameters(theta: float, scaling: dict | None) -> dict:
    """The inverse of :func:`rope_config`: transformers 5's ``rope_parameters`` dict."""
    return {"rope_theta": theta, **(scaling or {"rope_type": "default"})}


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """Returns ``(inv_freq [rotary_dim // 2] fp64, attention_factor)`` for a RoPE config.

    scaling (HF ``rope_scaling`` / ``rope_parameters`` without the theta): None or
    ``rope_type`` "default"; "linear" (``factor``); "llama3" (``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``); "yarn" (``factor``,
    ``original_max_position_embeddings``, ``beta_fast`` = 32, ``beta_slow`` = 1,
    ``attention_factor``, default 0.1 ln(factor) + 1). attention_factor scales cos and sin.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rope_inv_freq: rotary_dim must be a positive even number, got {rotary_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    original = float(scaling.get("original_max_position_embeddings", 8192))
    if kind == "llama3":
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= original / low) & (wavelen >= original / high)
        return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled), 1.0
    if kind == "yarn":
        beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))

        def correction_dim(rotations: float) -> float:
            return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), rotary_dim - 1)
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
        attention = scaling.get("attention_factor")
        return inv, float(attention) if attention is not None else 0.1 * math.log(factor) + 1.0
    raise ValueError(f"rope_inv_freq: unsupported rope_type {kind!r} (default, linear, llama3, yarn)")


def rope_cos_sin_cache(
    max_position: int,
    rotary_dim: int,
    theta: float = 1_000_000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    scaling: dict | None = None,
) -> torch.Tensor:
    """Returns ``[max_position, rotary_dim]``: cos of each angle in the first half, sin in the second.

    Angles are ``position * inv_freq`` (see :func:`rope_inv_freq`), computed in fp64, then
    cast to ``dtype``.
    """
    inv_freq, attention_factor = rope_inv_freq(rotary_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1) * attention_factor
    return cache.to(dtype=dtype, device=device)
