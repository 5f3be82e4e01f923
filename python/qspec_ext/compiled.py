"""Decode steps without per-op overhead: a whole speculative step (draft, verify forward,
verification, drafter prefill) and the models' own forwards (prompt prefill, plain decoding)
compiled as static-shape graphs (``fullgraph=True, dynamic=False``), the custom ops inside
them through their fake kernels; inductor on CPU, CUDA graphs (``mode="reduce-overhead"``) on
CUDA.

Shapes are fixed per ``generate`` call: batch, drafts per step, and lengths rounded up to a
multiple of :data:`BUCKET` (the cache, and the prompt prefill, padded with position -1), so
another prompt in the same bucket reuses the graphs instead of recompiling.
"""

import torch

BUCKET = 64


def compile_for_decoding(where: str, *models) -> None:
    """Compiles each model's forward in place (idempotent: a model compiled once stays compiled)."""
    from .models import Eagle3Drafter, Qwen3Target

    # One graph per (batch, drafts per step, bucket) by design: more than dynamo's default 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for model in models:
        if not isinstance(model, (Qwen3Target, Eagle3Drafter)):
            raise ValueError(f"{where}: compile=True needs a Qwen3Target and an Eagle3Drafter (static caches, "
                             f"one graph per step), got {type(model).__name__}")
        if getattr(model, "_compiled_call_impl", None) is None:
            model.compile(fullgraph=True, dynamic=False, mode=_mode(model.lm_head.weight.device))


def compiled_step(step, device: torch.device):
    """``step`` (a function of device tensors, no host synchronization) as one graph per shape."""
    return torch.compile(step, fullgraph=True, dynamic=False, mode=_mode(device))


def _mode(device: torch.device) -> str | None:
    return "reduce-overhead" if torch.device(device).type == "cuda" else None


def bucketed(length: int, compiled: bool) -> int:
    """length, rounded up to the bucket when the steps are compiled."""
    return -(-length // BUCKET) * BUCKET if compiled else length


def mark_static(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """KV caches keep their addresses for the whole generate call: CUDA graphs may capture them."""
    for pair in caches:
        for cache in pair:
            torch._dynamo.mark_static_address(cache)
