"""What every drafting strategy is: the :class:`Drafting` protocol the decode loop drives, the
:class:`Proposal` one step hands to the target, and the :data:`Penalty` the loop passes along."""

from dataclasses import dataclass
from typing import Protocol

import torch

from ..models.eagle3 import DraftState

# (repetition penalty, the tokens each request has seen [B, V] bool), as the loop's sampler gives it
Penalty = tuple[float, torch.Tensor]


@dataclass
class Proposal:
    """One step's drafts. The target reads [last token, draft_ids] at positions
    position + depths; ``tree`` (trees only: a :class:`~qspec_ext.drafting.tree.TreeAttention`)
    says where they go and what they see."""

    draft_ids: torch.Tensor  # [B, N] target-vocab ids
    depths: torch.Tensor  # [B or 1, N+1]: the depth of each row (0 = the last verified token)
    parents: torch.Tensor | None = None  # [B, N] (trees)
    tree: object | None = None  # (drafting/tree.py imports this module)


class Drafting(Protocol):
    kind: str  # "chain", "parallel", "tree", "lookup" or "lookup-tree"
    topk: int  # children per node (1: a chain)
    max_depth: int  # most drafts one step can accept
    num_draft_tokens: int  # rows the target verifies past the last token
    cache_margin: int  # positions past a request's new tokens that a step may write
    needs_context: bool  # propose reads each request's tokens by position (context [B, L])

    def propose(self, root: torch.Tensor, state: DraftState, penalty: Penalty | None = None,
                context: torch.Tensor | None = None) -> Proposal: ...

    def verify(self, proposal: Proposal, logits: torch.Tensor, seeds: torch.Tensor | None,
               offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def commit(self, proposal: Proposal, path: torch.Tensor) -> None: ...


def check_propose(drafting, penalty: Penalty | None, context: torch.Tensor | None) -> None:
    """What a strategy's propose cannot take: a repetition penalty for a tree (its rows would each
    need their own ancestors' counts), no context for one that ``needs_context``."""
    where = f"{type(drafting).__name__}.propose"
    if penalty is not None and drafting.topk > 1:
        raise ValueError(f"{where}: a repetition penalty runs with chain and parallel drafting, not trees")
    if context is None and drafting.needs_context:
        raise ValueError(f"{where}: needs each request's tokens (context); the decode loop gives them to a "
                         f"drafting with needs_context")
