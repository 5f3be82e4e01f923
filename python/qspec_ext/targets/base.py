"""The interface every target implements (see targets/__init__.py for the kinds)."""

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from ..capture import AuxFeatures


class TargetOutput(NamedTuple):
    """What a target's forward returns: the logits and the aux features of the same rows."""

    logits: torch.Tensor
    features: AuxFeatures


@dataclass(frozen=True)
class Capabilities:
    """What a target can do beyond a chain forward; the decode loop asks these, never the class."""

    trees: bool  # tree attention in forward(tree=...) and commit_path after it
    compilable: bool  # forward traces as one static-shape graph (torch.compile fullgraph)


@runtime_checkable
class Target(Protocol):
    """A causal LM the decode loop can drive.

    ``config`` has ``vocab_size``, ``hidden_size``, ``num_hidden_layers`` and
    ``max_position_embeddings``; each forward returns its logits with the aux features of
    :attr:`aux_layer_ids` (the drafter's fc input)."""

    config: Any
    aux_layer_ids: list[int]
    capabilities: Capabilities
    max_length: int

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def setup(self, batch_size: int, max_length: int) -> None:
        """Prepares caches for ``batch_size`` requests of up to ``max_length`` positions."""

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, last_only: bool = False,
                tree=None) -> "TargetOutput":
        """Logits ``[B, T, V]`` of tokens ``[B, T]`` at positions ``[B, T]`` (-1 pads) and the aux
        features of those B*T rows; a call whose positions start below what the cache holds
        rewinds it."""

    def keep_requests(self, rows: list[int], lengths: list[int]) -> None:
        """The batch becomes requests ``rows`` (``rows[i] >= i``, distinct: request ``rows[i]`` is
        now request i, with its first ``lengths[i]`` cache positions); the decode loop drops
        finished requests this way, and the next forward's batch is len(rows)."""

    def get_input_embeddings(self) -> torch.nn.Embedding: ...

    def get_output_embeddings(self) -> torch.nn.Module: ...  # the lm_head (a drafter's starting point)
