"""Decode steps without per-op overhead: a whole speculative step (draft, verify forward,
verification, drafter prefill) and the target's forward for plain decoding steps compiled as
static-shape graphs (``fullgraph=True, dynamic=False``), the custom ops inside
them through their fake kernels; inductor on CPU, CUDA graphs (``mode="reduce-overhead"``) on
CUDA.

The caller's models are left as they are (calling one still runs it eagerly): the compiled
forwards are separate callables, kept with each model so that every generate call with the same
model reuses their graphs.
Shapes are fixed per ``generate`` call: batch, drafts per step, and the cache length rounded up
to a multiple of :data:`BUCKET`, so another prompt in the same bucket reuses the graphs instead
of recompiling. (The prompt prefill runs eagerly: see decode.py.)
"""

import contextlib
import copy as copy_module
import dataclasses
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
    return _owning_results(functools.partial(methods[name, mode], model), mode)


def compiled_step(step, device: torch.device):
    """``step`` (a function of device tensors, no host synchronization, that sets no attribute:
    what it carries to the next step it returns) as one graph per shape."""
    mode = _mode(device)
    return _owning_results(torch.compile(step, fullgraph=True, dynamic=False, mode=mode), mode)


def _owning_results(fn, mode: str | None):
    """fn, whose results stay valid after the next compiled call.

    CUDA graphs (reduce-overhead) replay into memory they own: a replay overwrites the tensors
    the last one returned. Decoding keeps them across calls (the tokens, the drafter's state), so
    on CUDA each call starts a new graph step and its results are copied out of the graph's
    memory (as torch.compiler.cudagraph_mark_step_begin asks); on CPU fn is returned as is."""
    if mode != "reduce-overhead":
        return fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return _copied(fn(*args, **kwargs))

    return call


def _copied(value):
    """value with every tensor in it copied (through tuples, lists, dicts and dataclasses)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        copies = [_copied(v) for v in value]
        return type(value)(*copies) if hasattr(value, "_fields") else type(value)(copies)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        copy = copy_module.copy(value)  # no __init__ / __post_init__ run again
        for field in dataclasses.fields(value):
            object.__setattr__(copy, field.name, _copied(getattr(value, field.name)))
        return copy
    return value


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
