"""Decode steps without per-op overhead: a whole speculative step (draft, verify forward,
verification, drafter prefill) and the models' own forwards (prompt prefill, plain decoding)
compiled as static-shape graphs (``fullgraph=True, dynamic=False``), the custom ops inside
them through their fake kernels; inductor on CPU, CUDA graphs (``mode="reduce-overhead"``) on
CUDA.

The caller's models are left as they are (calling one still runs it eagerly): the compiled
forwards are separate callables, kept with each model so that every generate call with the same
model reuses their graphs.
Shapes are fixed per ``generate`` call: batch, drafts per step, and lengths rounded up to a
multiple of :data:`BUCKET` (the cache, and the prompt prefill, padded with position -1), so
another prompt in the same bucket reuses the graphs instead of recompiling.
"""

import contextlib
import functools
import weakref

import torch

BUCKET = 64
# One graph per (batch, drafts per step, bucket) by design: more than dynamo's default 8.
RECOMPILE_LIMIT = 64


def check_compilable(where: str, *models) -> None:
    for model in models:
        if not model.capabilities.compilable:
            raise ValueError(f"{where}: compile=True needs a target whose forward compiles to one static-shape graph "
                             f"(NativeTarget); {type(model).__name__} runs eagerly")


# model -> {(method, mode): the compiled function of its class}: kept outside the model (a copy or
# a pickle of the model carries nothing of it), weakly (the model's lifetime is the caller's).
_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def compiled_method(model: torch.nn.Module, name: str):
    """``model.<name>`` as a compiled callable (built once per model, method and mode; the model
    itself is not changed)."""
    mode = _mode(model.device)
    methods = _COMPILED.setdefault(model, {})
    if (name, mode) not in methods:
        # The class's function, not the bound method: the cache holds no reference to the model.
        methods[name, mode] = torch.compile(getattr(type(model), name), fullgraph=True, dynamic=False, mode=mode)
    return functools.partial(methods[name, mode], model)


def compiled_step(step, device: torch.device):
    """``step`` (a function of device tensors, no host synchronization) as one graph per shape."""
    return torch.compile(step, fullgraph=True, dynamic=False, mode=_mode(device))


def compiling(enabled: bool):
    """The context compiled calls run in: dynamo's recompile limit raised for these graphs only."""
    if not enabled:
        return contextlib.nullcontext()
    limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch._dynamo.config.patch(recompile_limit=limit)


def _mode(device: torch.device) -> str | None:
    return "reduce-overhead" if torch.device(device).type == "cuda" else None


def bucketed(length: int, compiled: bool) -> int:
    """length, rounded up to the bucket when the steps are compiled."""
    return -(-length // BUCKET) * BUCKET if compiled else length
