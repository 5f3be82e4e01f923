"""The projections of the drafter and the native target.

On CPU, inference runs on a copy of each weight pre-packed into oneDNN's blocked layout (what
vLLM's CPU backend and Inductor's freezing pass do): a decode step of a weight-bound model then
streams its weights at the memory's speed, where MKL's plain fp32 / bf16 GEMMs at 1-8 rows do not
(SmolLM2-135M's 576 x 49152 lm_head, one row: 11 ms fp32 and 6 ms bf16 unpacked, 5 ms and 3 ms
packed; see benchmarks/HISTORY.md). ``pack_linears(model)`` packs at ``setup``, and the op
``qspec_ext.ops.packed_linear`` (C++, eager and compiled alike) runs them; autograd, autocast,
CUDA and fp16 run ``F.linear`` on the weight itself, which stays the one source of truth (a weight
changed after packing is noticed and used unpacked until the next ``setup`` packs it again).

An inference-only model (the native target) keeps one copy: ``pack_linears(model, release=True)``
hands each weight no other module shares over to its packed copy, as vLLM's CPU backend does. The
weight stays a parameter of the same shape and dtype, on the meta device (no storage: reading its
values fails loudly); ``state_dict``, ``.to()`` and ``load_state_dict`` restore it exactly from the
packed copy (``to_dense()``), and the paths that need it dense unpack it per call.
"""

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from .checkpoint import trim_heap


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN runs packed on this CPU: fp32 everywhere, bf16 only with AVX-512 (BW, VL,
    DQ) or AVX-NE-CONVERT (an AVX2-only CPU has no bf16 primitives: its weights stay unpacked)."""
    if not onednn_available():
        return ()
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def weight_key(weight: torch.Tensor) -> tuple:
    """Changes whenever the weight's values may have: its storage, in-place version, dtype or device."""
    return weight.data_ptr(), weight._version, weight.dtype, weight.device


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same checkpoints) whose CPU inference uses the packed weight
    :func:`pack_linears` made, while it still matches the weight."""

    packed_weight: torch.Tensor | None = None
    packed_from: tuple | None = None

    @property
    def released(self) -> bool:
        """The weight was handed over to the packed copy (``pack_linears(..., release=True)``)."""
        return self.packed_weight is not None and self.weight.is_meta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed, compiling = self.packed_weight, torch.compiler.is_compiling()
        if (packed is not None and x.device.type == "cpu" and x.dtype == packed.dtype and self.bias is None
                and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
                and (compiling or self.weight.is_meta or self.packed_from == weight_key(self.weight))):
            out = ops.packed_linear(x.reshape(-1, x.shape[-1]), packed)
            return out.view(*x.shape[:-1], packed.shape[0])
        return F.linear(x, packed.to_dense() if self.released else self.weight, self.bias)

    def restore_weight(self) -> None:
        """Gives a released weight its dense values back (the packed copy stays valid)."""
        if self.released:
            self.weight = nn.Parameter(self.packed_weight.to_dense(), requires_grad=False)
            self.packed_from = weight_key(self.weight)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.released:
            destination[prefix + "weight"] = self.packed_weight.to_dense()

    def _load_from_state_dict(self, *args, **kwargs):
        self.restore_weight()
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        self.restore_weight()
        return super()._apply(fn, recurse)


@torch.no_grad()
def pack_linears(model: nn.Module, release: bool = False) -> int:
    """(Re)packs the weight of every :class:`Linear` in ``model`` that is on the CPU in a dtype of
    :func:`packable_dtypes` and changed since it was last packed; drops the packed copy of the others. ``release``
    (an inference-only model): each packed weight no other parameter slot shares (a tied
    embedding stays dense) is handed over to its packed copy, one module at a time (peak memory:
    the weights plus one module's). Returns how many weights it released."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False)) if release else None
    packable, released = packable_dtypes(), 0
    for module in model.modules():
        if not isinstance(module, Linear) or module.released:
            continue
        weight = module.weight
        if weight.device.type != "cpu" or weight.dtype not in packable:
            module.packed_weight = module.packed_from = None
            continue
        if module.packed_from != weight_key(weight):
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
            module.packed_from = weight_key(weight)
        if release and uses[id(weight)] == 1:
            module.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
            del weight
            trim_heap()  # the dense copy's pages go back now, before the next module packs
            released += 1
    return released
