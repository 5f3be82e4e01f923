"""The projections of the drafter and the native target.

On CPU, inference runs on a copy of each weight pre-packed into oneDNN's blocked layout (what
vLLM's CPU backend and Inductor's freezing pass do): a decode step of a weight-bound model then
streams its weights at the memory's speed, where MKL's plain fp32 / bf16 GEMMs at 1-8 rows do not
(SmolLM2-135M's 576 x 49152 lm_head, one row: 11 ms fp32 and 6 ms bf16 unpacked, 5 ms and 3 ms
packed; see benchmarks/HISTORY.md). ``pack_linears(model)`` packs at ``setup``; autograd, autocast,
CUDA and fp16 run ``F.linear`` on the weight itself, which stays the one source of truth (a weight
changed after packing is noticed and used unpacked until the next ``setup`` packs it again).
"""

import torch
import torch.nn.functional as F
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packed_matmul(input: torch.Tensor, packed_weight: torch.Tensor) -> torch.Tensor:
    """``input [M, K] @ W^T -> [M, N]`` for ``packed_weight`` = ``torch.ops.mkldnn._reorder_linear_weight(W [N, K])``."""
    return torch.ops.mkldnn._linear_pointwise(input, packed_weight, None, "none", [], "")


# The same as an op of our own, for compiled graphs: Inductor lowers mkldnn._linear_pointwise only for
# weights that are graph constants (its freezing pass), and a compiled decode step takes the weights as
# inputs. Eager calls skip it: a Python custom op costs about 15 us a call.
@torch.library.custom_op("qspec_ext::onednn_linear", mutates_args=())
def onednn_linear(input: torch.Tensor, packed_weight: torch.Tensor) -> torch.Tensor:
    return packed_matmul(input, packed_weight)


@onednn_linear.register_fake
def _onednn_linear_fake(input, packed_weight):
    return input.new_empty(input.shape[0], packed_weight.shape[0])


def weight_key(weight: torch.Tensor) -> tuple:
    """Changes whenever the weight's values may have: its storage, in-place version, dtype or device."""
    return weight.data_ptr(), weight._version, weight.dtype, weight.device


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same checkpoints) whose CPU inference uses the packed weight
    :func:`pack_linears` made, while it still matches the weight."""

    packed_weight: torch.Tensor | None = None
    packed_from: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed, compiling = self.packed_weight, torch.compiler.is_compiling()
        if (packed is not None and x.device.type == "cpu" and x.dtype == packed.dtype and self.bias is None
                and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
                and (compiling or self.packed_from == weight_key(self.weight))):
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            out = (onednn_linear if compiling else packed_matmul)(rows, packed)
            return out.view(*x.shape[:-1], packed.shape[0])
        return F.linear(x, self.weight, self.bias)


@torch.no_grad()
def pack_linears(model: nn.Module) -> None:
    """(Re)packs the weight of every :class:`Linear` in ``model`` that is on the CPU in fp32 or
    bf16 and changed since it was last packed; drops the packed copy of the others."""
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        weight = module.weight
        if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or not onednn_available():
            module.packed_weight = module.packed_from = None
        elif module.packed_from != weight_key(weight):
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
            module.packed_from = weight_key(weight)
