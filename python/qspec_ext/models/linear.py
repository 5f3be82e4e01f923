"""The projections of the drafter and the native target.

On CPU, inference runs on a copy of each weight packed into panels of 16 output columns
(:func:`pack_weight`), by the op ``qspec_ext.ops.packed_linear`` (C++, eager and compiled alike): a
decode step's GEMM has a few rows, so it streams each panel once and every weight loaded serves all
the rows; bf16 runs AVX512-BF16 dot products where the CPU has them, else widens the weights in
registers, so bf16 streams half the bytes of fp32 on any x86 CPU. (Before, oneDNN's packed weights:
on CPUs without AVX-512 oneDNN keeps the plain layout, has no bf16 kernels and costs 50-100 us a
call; see benchmarks/HISTORY.md.) ``pack_linears(model)`` packs at
``setup``; autograd, autocast, CUDA and fp16 run ``F.linear`` on the weight itself, which stays the
one source of truth (a weight changed after packing is noticed and used unpacked until the next
``setup`` packs it again).

An inference-only model (the native target) keeps one copy: ``pack_linears(model, release=True)``
hands each weight no other module shares over to its packed copy, as vLLM's CPU backend does. The
weight stays a parameter of the same shape and dtype, on the meta device (no storage: reading its
values fails loudly); ``state_dict``, ``.to()`` and ``load_state_dict`` restore it exactly from the
packed copy (:func:`unpack_weight`), and the paths that need it dense unpack it per call.
"""

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from .checkpoint import trim_heap


PANEL = 16  # output columns per panel of a packed weight (csrc/cpu/packed_linear.cpp: kPanel)


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes ``packed_linear`` runs: fp32 and bf16 (fp16 and others stay unpacked)."""
    return (torch.float32, torch.bfloat16)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` as panels of 16 output columns with 4-byte lanes, ``[ceil(N / 16), ceil(K / G),
    16, G]``, G = 4 / element size (fp32 1, bf16 2): column n of ``input @ weight.T`` is lane ``n % 16``
    of panel ``n // 16``, and a lane holds G consecutive inputs (bf16: the pair one AVX512-BF16 dot
    product sums); zeros past N and K."""
    out_features, in_features = weight.shape
    group = max(1, 4 // weight.element_size())
    panels, lanes = -(-out_features // PANEL), -(-in_features // group)
    padded = weight.new_zeros(panels * PANEL, lanes * group)
    padded[:out_features, :in_features] = weight
    return padded.view(panels, PANEL, lanes, group).transpose(1, 2).contiguous()


def unpack_weight(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The weight ``[N, K]`` :func:`pack_weight` packed, exactly."""
    panels, lanes, _, group = packed.shape
    dense = packed.transpose(1, 2).reshape(panels * PANEL, lanes * group)
    return dense[:out_features, :in_features].contiguous()


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

    def packed_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The packed weight when it serves ``x``: CPU inference (no autograd, no autocast) in its
        dtype, no bias, while it still holds the weight's values; else None."""
        # Called a few hundred times a decode step: the checks read the parameter dict directly
        # (nn.Module's attribute lookup costs more than the checks). Under torch.compile the weight's
        # address and version cannot be traced: compiled steps skip the check (every generate call's
        # setup repacks changed weights first: pack_linears).
        packed, params = self.packed_weight, self._parameters
        if (packed is not None and x.dtype == packed.dtype and x.is_cpu and params["bias"] is None
                and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
                and (torch.compiler.is_compiling() or params["weight"].is_meta
                     or self.packed_from == weight_key(params["weight"]))):
            return packed
        return None

    def inference_weight(self, x: torch.Tensor) -> torch.Tensor:
        """The weight an op projecting ``x`` takes (``decoder_layer_``): packed where it serves, else dense."""
        packed = self.packed_for(x)
        return self.dense_weight() if packed is None else packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed_for(x)
        if packed is None:
            return F.linear(x, self.dense_weight(), self.bias)
        if x.dim() == 2:
            return ops.packed_linear(x, packed, self.out_features)
        out = ops.packed_linear(x.reshape(-1, x.shape[-1]), packed, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The weight's values: itself, or unpacked from the packed copy it was handed over to."""
        return unpack_weight(self.packed_weight, self.out_features, self.in_features) if self.released else self.weight

    def restore_weight(self) -> None:
        """Gives a released weight its dense values back (the packed copy stays valid)."""
        if self.released:
            self.weight = nn.Parameter(self.dense_weight(), requires_grad=False)
            self.packed_from = weight_key(self.weight)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.released:
            destination[prefix + "weight"] = self.dense_weight()

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
            module.packed_weight = pack_weight(weight.detach())
            module.packed_from = weight_key(weight)
        if release and uses[id(weight)] == 1:
            module.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
            del weight
            trim_heap()  # the dense copy's pages go back now, before the next module packs
            released += 1
    return released
