"""Parallel drafting (P-EAGLE): the k drafts of a step from one drafter forward over the
last prefilled pair and k - 1 mask slots; verified as a chain."""

import torch

from ..models.eagle3 import DraftState
from ..sampling import apply_repetition_penalty
from .base import Penalty
from .chain import ChainDrafting, in_draft_vocabulary


def parallel_logits(drafter, state: DraftState, k: int) -> torch.Tensor:
    """The draft logits ``[B, k, Vd]`` of one P-EAGLE forward: the state's logits give draft 1,
    mask slots at the k - 1 next positions give drafts 2..k (their K/V written there; the next
    prefill overwrites them; unchecked: :class:`ParallelDrafting` checks that they fit)."""
    first = state.logits[:, None]
    if k == 1:
        return first
    B = first.shape[0]
    positions = state.next_position[:, None] + torch.arange(k - 1, device=first.device)
    tokens = torch.full_like(positions, drafter.config.mask_token_id)
    features = drafter.mask_hidden.expand(B, k - 1, -1)
    slots = drafter.parallel_slots(features, tokens, positions)
    return torch.cat([first, slots.float()], dim=1)


class ParallelDrafting(ChainDrafting):
    kind = "parallel"

    def logits(self, state: DraftState, penalty: Penalty | None = None) -> torch.Tensor:
        """As the chain's; the penalty is of the tokens seen before the step (not its own drafts:
        they come from one forward)."""
        if self.check_bounds:
            self.drafter.check_draft_room(type(self).__name__, state, self.k - 1, f"{self.k} drafts")
        logits = parallel_logits(self.drafter, state, self.k)
        if penalty is None:
            return logits
        factor, seen = in_draft_vocabulary(self.drafter, penalty)
        return apply_repetition_penalty(logits, seen, factor)
