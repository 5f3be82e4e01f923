"""Targets: the models speculative decoding speeds up, behind one interface (:class:`Target`).

- :class:`NativeTarget` (native.py): dense Qwen3 and Llama checkpoints on the qspec_ext ops, with a static
  KV cache, tree attention and compiled steps;
- :class:`HFTarget` (hf.py): any transformers causal LM (MoE and hybrid linear-attention models
  included), chains only, eager.

:func:`load_target` picks the class from the checkpoint's ``model_type``.
"""

from pathlib import Path

import torch

from ..models.checkpoint import CheckpointError, read_config
from ..shipped import resolve_source
from .base import Capabilities, Target, TargetOutput
from .hf import HFTarget
from .native import NATIVE_MODEL_TYPES, NativeTarget, unsupported

__all__ = ["Capabilities", "HFTarget", "NativeTarget", "Target", "TargetOutput", "load_target"]


def load_target(source, dtype: torch.dtype | None = None, device=None, aux_layer_ids: list[int] | None = None,
                backend: str = "auto") -> Target:
    """A target from a checkpoint directory, a hub id or a model name ("smollm2", "tiny": see
    :mod:`qspec_ext.shipped`). ``backend``: "native" (:class:`NativeTarget`),
    "transformers" (:class:`HFTarget`), or "auto": native for the model types it runs
    (:data:`NATIVE_MODEL_TYPES`, without biases or another activation), transformers for the others."""
    if backend not in ("auto", "native", "transformers"):
        raise ValueError(f"load_target: backend must be 'auto', 'native' or 'transformers', got {backend!r}")
    directory = resolve_source(source)
    config = read_config(Path(directory))
    model_type = config.get("model_type")
    if backend == "native" and model_type not in NATIVE_MODEL_TYPES:
        raise CheckpointError(f"{directory / 'config.json'}: the native target runs model_type "
                              f"{' | '.join(NATIVE_MODEL_TYPES)}, got {model_type!r} (backend='transformers' runs it)")
    if backend == "native" or (backend == "auto" and model_type in NATIVE_MODEL_TYPES and not unsupported(config)):
        return NativeTarget.from_pretrained(directory, dtype=dtype, device=device, aux_layer_ids=aux_layer_ids)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype or torch.float32)
    return HFTarget(model.to(device) if device is not None else model, aux_layer_ids)
