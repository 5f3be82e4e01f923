"""The capture side of EAGLE-3 target features (aux hidden states).

The feature of aux layer L is the residual stream ENTERING decoder layer L (HF's
``output_hidden_states[L]``); id N (the layer count) is the last layer's output before
the final norm. A target's forward returns them as :class:`AuxFeatures` (references, no
copies) beside its logits; :meth:`AuxFeatures.gather` hands them to
:func:`qspec_ext.gather_aux_hidden`, which reads each selected row once and writes the
drafter's fc input. :class:`AuxHiddenCapture` records them from hooks on a transformers model.
"""

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from .ops import gather_aux_hidden, gather_aux_hidden_out

logger = logging.getLogger(__name__)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers ``(2, N // 2, N - 3)``, made safe for small N.

    For N < 6 the defaults collide or fall outside ``[0, N)``; then the unique ids in
    range are kept, sorted, and a warning says so.
    """
    if num_layers < 1:
        raise ValueError(f"default_aux_layer_ids: num_layers must be >= 1, got {num_layers}")
    wanted = [2, num_layers // 2, num_layers - 3]
    ids = sorted({i for i in wanted if 0 <= i < num_layers})
    if ids != wanted:
        logger.warning(
            "default_aux_layer_ids: the defaults %s do not fit a %d-layer model; using %s", wanted, num_layers, ids
        )
    return ids


class AuxFeatures(NamedTuple):
    """The aux features of one target forward, in aux-layer order: ``hidden[i]`` ``[rows, H]``, the
    stream entering aux layer i, and ``residual[i]`` its residual part where the target keeps the
    two apart (None: no layer does; :meth:`gather` adds them). ``packed_row`` ``[B*T]``: the forward
    ran its tokens packed; the row holding each token of its ``[B, T]`` grid (-1: padding), which
    :meth:`gather`'s indices still count in."""

    hidden: tuple[torch.Tensor, ...]
    residual: tuple[torch.Tensor, ...] | None = None
    packed_row: torch.Tensor | None = None

    @classmethod
    def of(cls, layer_ids: Sequence[int], records: Sequence[tuple[int, torch.Tensor, torch.Tensor | None]],
           packed_row: torch.Tensor | None = None) -> "AuxFeatures":
        """From the (layer id, hidden, residual or None) records of one forward."""
        hidden = {i: h.reshape(-1, h.shape[-1]) for i, h, _ in records}
        residual = {i: r.reshape(-1, r.shape[-1]) for i, _, r in records if r is not None}
        missing = [i for i in layer_ids if i not in hidden]
        if missing:
            raise RuntimeError(f"AuxFeatures: no feature recorded for aux layers {missing}")
        # Some layers carry a separate residual (e.g. layer 0, the embeddings, has none): the
        # others add zeros. Rare (aux layer 0 only), so a zero tensor beats a second code path.
        both = tuple(residual.get(i, torch.zeros_like(hidden[i])) for i in layer_ids) if residual else None
        return cls(tuple(hidden[i] for i in layer_ids), both, packed_row)

    def gather(
        self,
        indices: torch.Tensor,
        norm_mode: str = "none",
        norm_weight: torch.Tensor | None = None,
        eps: float = 1e-6,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The drafter's fc input ``[N, n*H]`` for the tokens at ``indices`` (-1 = padding)."""
        hidden, residual = list(self.hidden), None if self.residual is None else list(self.residual)
        if self.packed_row is not None:
            indices = torch.where(indices >= 0, self.packed_row[indices.clamp(min=0)], -1)
        if out is None:
            return gather_aux_hidden(hidden, indices, residual, norm_mode, norm_weight, eps)
        gather_aux_hidden_out(hidden, indices, out, residual, norm_mode, norm_weight, eps)
        return out


class AuxHiddenCapture:
    """Records the aux-layer features of a transformers model from hooks (:meth:`attach`): each
    forward's streams entering the aux layers, kept by reference as ``[tokens, H]`` views;
    :meth:`features` hands them out as :class:`AuxFeatures`."""

    def __init__(self, layer_ids: Sequence[int]):
        if len(layer_ids) == 0 or len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"AuxHiddenCapture: layer_ids must be non-empty and unique, got {list(layer_ids)}")
        self.layer_ids = list(layer_ids)
        self._hidden: dict[int, torch.Tensor] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def record(self, layer_id: int, hidden: torch.Tensor) -> None:
        """Keeps (a flat view of) the stream entering layer ``layer_id`` if it is an aux layer."""
        if layer_id in self.layer_ids:
            self._hidden[layer_id] = hidden

    def features(self) -> AuxFeatures:
        """What the latest forward recorded."""
        return AuxFeatures.of(self.layer_ids, [(i, h, None) for i, h in self._hidden.items()])

    def gather(self, indices: torch.Tensor, norm_mode: str = "none", norm_weight: torch.Tensor | None = None,
               eps: float = 1e-6, out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`AuxFeatures.gather` of the latest forward's features."""
        return self.features().gather(indices, norm_mode, norm_weight, eps, out)

    def clear(self) -> None:
        self._hidden.clear()

    @classmethod
    def attach(cls, model: nn.Module, layer_ids: Sequence[int] | None = None) -> "AuxHiddenCapture":
        """Hooks a transformers decoder-only model (``model.model.layers`` and ``model.model.norm``).

        Each aux layer's input hidden states are recorded on every forward; id N records the
        input of the final norm. ``layer_ids`` default to :func:`default_aux_layer_ids`.
        """
        decoder = model.model if hasattr(model, "model") else model
        layers = decoder.layers
        ids = list(layer_ids) if layer_ids is not None else default_aux_layer_ids(len(layers))
        bad = [i for i in ids if not 0 <= i <= len(layers)]
        if bad:
            raise ValueError(f"AuxHiddenCapture.attach: aux layer ids {bad} outside [0, {len(layers)}]")
        capture = cls(ids)

        def hook_for(layer_id: int):
            def hook(module, args, kwargs):
                hidden = args[0] if args else kwargs["hidden_states"]
                capture.record(layer_id, hidden)

            return hook

        for i in ids:
            target = layers[i] if i < len(layers) else decoder.norm
            capture._hooks.append(target.register_forward_pre_hook(hook_for(i), with_kwargs=True))
        return capture

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
