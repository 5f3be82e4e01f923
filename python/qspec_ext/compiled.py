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
    return _owning_results(functools.partial(methods[name, mode], model), mode, [model])


def compiled_step(step, device: torch.device, models):
    """``step`` (a function of device tensors, no host synchronization) as one graph per shape;
    ``models``: those whose attributes it sets (the drafter's state)."""
    mode = _mode(device)
    return _owning_results(torch.compile(step, fullgraph=True, dynamic=False, mode=mode), mode, models)


def _owning_results(fn, mode: str | None, models):
    """fn, whose results and the attributes it rebinds on ``models`` stay valid after the next
    compiled call.

    CUDA graphs (reduce-overhead) replay into memory they own: a replay overwrites the tensors
    the last one returned. Decoding keeps them across calls (the drafter's state, the tokens),
    so on CUDA each call starts a new graph step and its tensors are copied out of the graph's
    memory (as torch.compiler.cudagraph_mark_step_begin asks); on CPU fn is returned as is.
    Only results and rebound top-level attributes are copied: tensors a call leaves inside an
    object it keeps (the target's ``capture``) are valid until the next compiled call only, and
    decoding reads them before it.
    An attribute's copy goes into the tensors the last call left there when they have its layout:
    a model's tensor attributes are static inputs of the graphs that read them (the drafter's state,
    of the step), and a static input at a new address makes CUDA graphs record the graph again."""
    if mode != "reduce-overhead":
        return fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        before = [dict(vars(model)) for model in models]
        result = fn(*args, **kwargs)
        for model, attributes in zip(models, before):
            kept = _KEPT.setdefault(model, {})
            for name, value in list(vars(model).items()):
                if attributes.get(name) is value or value is None:
                    continue
                pairs = _same_layout_pairs(kept[name], value) if name in kept else None
                if pairs is None:
                    kept[name] = _copied(value)
                for destination, source in pairs or []:
                    destination.copy_(source)
                setattr(model, name, kept[name])
        return _copied(result)

    return call


# model -> {attribute: the value compiled calls last set there, in memory of ours}; weakly keyed.
_KEPT: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


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


def _same_layout_pairs(old, new):
    """(tensor of old, tensor of new) in order when the two values have one layout (structure,
    tensor shapes, dtypes and devices, the other values equal); None when they differ."""
    if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
        same = (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.shape == new.shape
                and old.dtype == new.dtype and old.device == new.device)
        return [(old, new)] if same else None
    if type(old) is not type(new):
        return None
    if isinstance(new, (tuple, list)):
        parts = [_same_layout_pairs(a, b) for a, b in zip(old, new)] if len(old) == len(new) else [None]
    elif isinstance(new, dict):
        parts = [_same_layout_pairs(old[k], new[k]) for k in new] if old.keys() == new.keys() else [None]
    elif dataclasses.is_dataclass(new):
        parts = [_same_layout_pairs(getattr(old, f.name), getattr(new, f.name)) for f in dataclasses.fields(new)]
    else:
        try:
            return [] if old is new or bool(old == new) else None
        except (TypeError, ValueError, RuntimeError):  # an array-like: no single truth value
            return None
    return None if any(p is None for p in parts) else [pair for p in parts for pair in p]


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
