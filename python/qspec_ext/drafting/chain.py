"""Chain drafting: k sequential EAGLE-3 draft steps, verified as a chain."""

from dataclasses import dataclass

import torch

from ..models.layers import TreeAttention
from ..ops import verify_greedy, verify_sampling


@dataclass
class Proposal:
    """One step's drafts. The target reads [last token, draft_ids] at positions
    position + depths; ``tree`` (trees only) says where they go and what they see."""

    draft_ids: torch.Tensor  # [B, N] target-vocab ids
    depths: torch.Tensor  # [B or 1, N+1]: the depth of each row (0 = the last verified token)
    parents: torch.Tensor | None = None  # [B, N] (trees)
    tree: TreeAttention | None = None


class ChainDrafting:
    """k greedy drafts per step from k sequential drafter steps."""

    kind = "chain"
    topk = 1

    def __init__(self, drafter, k: int):
        self.drafter, self.k = drafter, k
        self.max_depth = k  # most drafts one step can accept
        self.num_draft_tokens = k
        self.cache_margin = 2 * k  # k accepted past the last new token, then k - 1 drafted beyond

    def draft(self, penalty=None) -> torch.Tensor:
        if penalty is None:  # (drafters written for the loop before the penalty take no such argument)
            return self.drafter.draft(self.k, parallel=False)[0]
        return self.drafter.draft(self.k, parallel=False, penalty=penalty)[0]

    def propose(self, root: torch.Tensor, penalty=None) -> Proposal:
        """root [B]: the position of each request's last verified token (-1: inactive);
        ``penalty``: (repetition penalty, seen tokens [B, V]) for the drafts (Eagle3Drafter.draft)."""
        # Made afresh each step: a tensor kept from one compiled step to the next would be a
        # CUDA graph's output that a later replay may overwrite.
        drafts = self.draft() if penalty is None else self.draft(penalty)
        return Proposal(drafts, torch.arange(self.k + 1, device=root.device)[None])

    def verify(self, proposal: Proposal, logits: torch.Tensor, seeds: torch.Tensor | None,
               offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(out_ids, num_accepted, path) from the target's logits (already divided by the
        temperature and filtered when seeds are given; greedy when seeds is None)."""
        drafts = proposal.draft_ids
        if seeds is None:
            out, accepted = verify_greedy(drafts, logits)
        else:
            ones = torch.ones(drafts.shape[0], device=drafts.device)
            out, accepted = verify_sampling(drafts, None, logits, ones, seeds, offset)
        rows = proposal.depths.expand_as(out)
        return out, accepted, torch.where(rows <= accepted[:, None], rows, -1)

    def keep(self, proposal: Proposal, path: torch.Tensor) -> None:
        """A chain's accepted rows already sit at their positions: nothing to move."""
