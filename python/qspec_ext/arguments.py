"""Validation of the public Python API's arguments: each check raises TypeError (wrong kind of
value) or ValueError (right kind, wrong value) naming the caller, the argument, what was
expected and what came. Every check runs once per call, on the host, before any work."""

import math
import os
import numbers
from collections.abc import Sequence

import torch


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def check_int(where: str, name: str, value, low: int | None = None, high: int | None = None) -> int:
    """An int in [low, high] (either bound optional)."""
    if not _is_int(value):
        raise TypeError(f"{where}: {name} must be an int, got {_describe(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
        raise ValueError(f"{where}: {name} must be {bounds}, got {value}")
    return int(value)


def check_bool(where: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be a bool, got {_describe(value)}")
    return value


def check_float(where: str, name: str, value, low: float, high: float = math.inf, low_open: bool = False) -> float:
    """A finite real in [low, high] ((low, high] with low_open)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be a number, got {_describe(value)}")
    value = float(value)
    above = value > low if low_open else value >= low
    if not (math.isfinite(value) and above and value <= high):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]" if math.isfinite(high) else None
        expected = f"in {interval}" if interval else f"a finite number {'>' if low_open else '>='} {low:g}"
        raise ValueError(f"{where}: {name} must be {expected}, got {value}")
    return value


def check_prompts(where: str, prompts, vocab_size: int) -> list[list[int]]:
    """A non-empty list of non-empty token-id sequences (lists, tuples or 1-D integer tensors),
    every id in [0, vocab_size). Returns them as lists of ints."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"{where}: prompts as a tensor must be 2-D [num_prompts, length], got shape {list(prompts.shape)}")
        prompts = list(prompts)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"{where}: prompts must be a list of token-id lists, got {_describe(prompts)}")
    if len(prompts) == 0:
        raise ValueError(f"{where}: prompts must hold at least one prompt, got an empty list")
    result = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
                raise TypeError(f"{where}: prompts[{i}] must be a 1-D integer tensor, got {prompt.dtype} of shape {list(prompt.shape)}")
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise TypeError(f"{where}: prompts[{i}] must be a list of token ids, got {_describe(prompt)}")
        if len(prompt) == 0:
            raise ValueError(f"{where}: prompts[{i}] is empty: every prompt needs at least one token")
        for j, token in enumerate(prompt):
            if not _is_int(token):
                raise TypeError(f"{where}: prompts[{i}][{j}] must be an int token id, got {_describe(token)}")
            if not 0 <= token < vocab_size:
                raise ValueError(
                    f"{where}: token id {token} at prompts[{i}][{j}] is outside the vocabulary [0, {vocab_size})")
        result.append([int(t) for t in prompt])
    return result


def check_stop_ids(where: str, eos_token_id, vocab_size: int) -> list[int]:
    """None, one id or a sequence of ids, each in [0, vocab_size): the ids that end a request."""
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.tolist()
    ids = [eos_token_id] if _is_int(eos_token_id) else eos_token_id
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{where}: eos_token_id must be an int, a sequence of ints or None, got {_describe(eos_token_id)}")
    return sorted({check_int(where, "eos_token_id", i, 0, vocab_size - 1) for i in ids})


def check_sampling(where: str, vocab_size: int, max_new_tokens, temperature, top_k, top_p, eos_token_id,
                   seed) -> list[int]:
    """Checks the sampling arguments of a generate call; returns the stop ids."""
    check_int(where, "max_new_tokens", max_new_tokens, 0)
    check_float(where, "temperature", temperature, 0.0)
    if top_k is not None:
        check_int(where, "top_k", top_k, 1)
    if top_p is not None:
        check_float(where, "top_p", top_p, 0.0, 1.0, low_open=True)
    check_int(where, "seed", seed, 0, 2**40)  # seeds of the requests are seed * 1_000_003 + index, in int64
    return check_stop_ids(where, eos_token_id, vocab_size)


def check_pair(target, drafter) -> None:
    """The drafter fits the target: vocabulary, hidden size, aux layers, draft vocabulary mapping."""
    where = "SpeculativeDecoder"
    t, d = target.config, drafter.config
    if d.vocab_size != t.vocab_size:
        raise ValueError(f"{where}: the drafter's vocab_size {d.vocab_size} differs from the target's {t.vocab_size}")
    if d.hidden_size != t.hidden_size:
        raise ValueError(f"{where}: the drafter's hidden_size {d.hidden_size} differs from the target's {t.hidden_size}")
    ids = list(target.aux_layer_ids)
    if len(ids) != d.num_aux:
        raise ValueError(f"{where}: the target exposes {len(ids)} aux layers {ids}, the drafter's fc takes {d.num_aux}")
    layers = t.num_hidden_layers
    bad = [i for i in ids if not 0 <= i <= layers]
    if bad:
        raise ValueError(f"{where}: aux layer ids {bad} are outside [0, {layers}] for a target of {layers} layers")
    d2t = getattr(drafter, "d2t", None)
    if d2t is not None:
        targets = torch.arange(d2t.shape[0], device=d2t.device) + d2t
        if int(targets.min()) < 0 or int(targets.max()) >= t.vocab_size:
            raise ValueError(f"{where}: the drafter's d2t maps draft ids outside the target vocabulary [0, {t.vocab_size})")


def check_load(where: str, path, dtype, device) -> None:
    """The common arguments of the from_pretrained loaders."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: path must be a directory path (str or PathLike), got {_describe(path)}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{where}: dtype must be a floating torch.dtype or None, got {_describe(dtype)}")
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"{where}: device must name a torch device like 'cpu' or 'cuda:0', got {device!r}") from e


def check_aux_layer_ids(where: str, ids, num_layers: int) -> None:
    """Aux layer ids: distinct ints in [0, num_layers] (id L = the input of decoder layer L, id N =
    the last layer's output before the final norm)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{where}: aux_layer_ids must be a list of ints, got {_describe(ids)}")
    for i in ids:
        check_int(where, "aux_layer_ids entries", i)
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad or len(set(ids)) != len(ids) or not ids:
        raise ValueError(f"{where}: aux_layer_ids must be distinct ids in [0, {num_layers}] for a model of "
                         f"{num_layers} layers, got {list(ids)}")
