"""Chain drafting: k sequential EAGLE-3 draft steps, verified as a chain."""

import torch

from ..models.eagle3 import DraftState
from ..ops import verify_greedy, verify_sampling
from ..sampling import apply_repetition_penalty
from .base import Penalty, Proposal


def in_draft_vocabulary(drafter, penalty: Penalty | None) -> Penalty | None:
    """The penalty with its seen tokens as the drafter's vocabulary ``[B, Vd]``."""
    if penalty is None:
        return None
    factor, seen = penalty
    vocab = torch.arange(drafter.config.draft_vocab_size, device=seen.device)
    return factor, seen[:, drafter.draft_to_target(vocab)]


def chain_logits(drafter, state: DraftState, k: int, penalty: Penalty | None = None) -> torch.Tensor:
    """The draft logits ``[B, k, Vd]`` of k sequential drafter steps from ``state``, each fed the
    previous step's greedy token and x_next. ``penalty`` (in the draft vocabulary): each step's
    logits get the repetition penalty of the tokens seen and drafted before it, as the target's
    verification rows will. The steps' K/V go to the positions after the state's; the next
    prefill overwrites them. Unchecked: :class:`ChainDrafting` checks that they fit."""
    logits, hidden, position = state.logits, state.hidden, state.next_position
    factor, seen = penalty if penalty is not None else (1.0, None)
    # Copied out at each step: a compiled step (a CUDA graph) reuses its output buffers.
    rows = logits.new_empty(logits.shape[0], k, logits.shape[1])
    rows[:, 0] = logits = logits if seen is None else apply_repetition_penalty(logits, seen, factor)
    for i in range(1, k):
        choice = logits.argmax(dim=-1)
        if seen is not None:
            seen = seen.scatter(1, choice[:, None], True)
        token = drafter.draft_to_target(choice)
        step_logits, hidden = drafter.step(hidden[:, None], token[:, None], position[:, None])
        logits = step_logits[:, 0]
        rows[:, i] = logits = logits if seen is None else apply_repetition_penalty(logits, seen, factor)
        hidden, position = hidden[:, 0], position + 1
    return rows


class ChainDrafting:
    """k greedy drafts per step from k sequential drafter steps. ``check_bounds``: each draft
    checks that its positions fit the drafter's cache (a host synchronization; the decode loop
    sizes the cache once per generate call and turns it off)."""

    kind = "chain"
    topk = 1
    needs_context = False  # True: propose reads each request's tokens (context)

    def __init__(self, drafter, k: int, check_bounds: bool = True):
        if drafter.config.parallel_drafting != (self.kind == "parallel"):
            kind = "a P-EAGLE (parallel) drafter" if drafter.config.parallel_drafting else "a chain EAGLE-3 drafter"
            raise ValueError(f"{type(self).__name__}: {self.kind} drafting asked of {kind}")
        self.drafter, self.k, self.check_bounds = drafter, k, check_bounds
        self.max_depth = k  # most drafts one step can accept
        self.num_draft_tokens = k
        self.cache_margin = 2 * k  # k accepted past the last new token, then k - 1 drafted beyond

    def logits(self, state: DraftState, penalty: Penalty | None = None) -> torch.Tensor:
        """The draft logits ``[B, k, Vd]``; ``penalty`` in the target's vocabulary."""
        if self.check_bounds:
            self.drafter.check_draft_room(type(self).__name__, state, self.k - 1, f"{self.k} drafts")
        return chain_logits(self.drafter, state, self.k, in_draft_vocabulary(self.drafter, penalty))

    def draft(self, state: DraftState, penalty: Penalty | None = None) -> torch.Tensor:
        """The k greedy drafts ``[B, k]`` (target-vocabulary ids)."""
        return self.drafter.draft_to_target(self.logits(state, penalty).argmax(dim=-1))

    def propose(self, root: torch.Tensor, state: DraftState, penalty: Penalty | None = None,
                context: torch.Tensor | None = None) -> Proposal:
        """root [B]: the position of each request's last verified token (-1: inactive);
        ``penalty``: (repetition penalty, seen tokens [B, V]) for the drafts; ``context``: unused
        (see ``needs_context``)."""
        # Made afresh each step: a tensor kept from one compiled step to the next would be a
        # CUDA graph's output that a later replay may overwrite.
        return Proposal(self.draft(state, penalty), torch.arange(self.k + 1, device=root.device)[None])

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

    def commit(self, proposal: Proposal, path: torch.Tensor) -> None:
        """A chain's accepted rows already sit at their positions: nothing to move."""
