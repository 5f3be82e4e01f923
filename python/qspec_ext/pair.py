"""Loading a target and its drafter together: the one path the CLI, the demo and the scripts use."""

import torch

from .models import Eagle3Drafter
from .models.checkpoint import read_config, resolve_checkpoint
from .targets import Target, load_target

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_pair(target_source, draft_source, device="cpu", dtype: str | torch.dtype = "fp32",
              backend: str = "auto") -> tuple[Target, Eagle3Drafter]:
    """The target (exposing the drafter's aux layers) and the drafter (borrowing the target's
    embeddings when it ships none). ``backend``: see :func:`qspec_ext.targets.load_target`."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"load_pair: dtype must be one of {list(DTYPES)} or a torch.dtype, got {dtype!r}")
        dtype = DTYPES[dtype]
    draft_dir = resolve_checkpoint(draft_source)
    aux_ids = read_config(draft_dir).get("eagle_aux_hidden_state_layer_ids")
    target = load_target(target_source, dtype=dtype, device=device, aux_layer_ids=aux_ids, backend=backend)
    drafter = Eagle3Drafter.from_pretrained(draft_dir, dtype=dtype, device=device, target=target)
    return target, drafter
