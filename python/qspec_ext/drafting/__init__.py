"""Drafting strategies: what the decode loop asks of a drafter each step, behind one small
interface (:class:`Drafting`): propose drafts, verify them against the target's logits,
and keep what was accepted.

- :class:`ChainDrafting` (chain.py): k sequential EAGLE-3 draft steps, chain verification;
- :class:`ParallelDrafting` (parallel.py): P-EAGLE, k drafts from one drafter forward;
- :class:`TreeDrafting` (tree.py): an EAGLE-2 dynamic tree, tree verification.
"""

from ..arguments import check_int
from .chain import ChainDrafting, Proposal
from .parallel import ParallelDrafting
from .tree import TreeDrafting

Drafting = ChainDrafting | ParallelDrafting | TreeDrafting

__all__ = ["ChainDrafting", "Drafting", "ParallelDrafting", "Proposal", "TreeDrafting", "make_drafting"]


def make_drafting(target, drafter, num_speculative_tokens: int, topk: int = 1,
                  num_draft_tokens: int | None = None) -> Drafting:
    """The strategy for these settings: a tree when topk > 1, else the drafter's own kind
    (P-EAGLE drafters draft in parallel, EAGLE-3 drafters in a chain)."""
    where = "SpeculativeDecoder"
    check_int(where, "topk", topk, 1, 64)
    if topk == 1:
        if num_draft_tokens is not None and num_draft_tokens != num_speculative_tokens:
            raise ValueError(f"{where}: num_draft_tokens={num_draft_tokens} needs a tree (topk > 1); a chain "
                             f"verifies num_speculative_tokens={num_speculative_tokens} drafts")
        kind = ParallelDrafting if drafter.config.parallel_drafting else ChainDrafting
        return kind(drafter, num_speculative_tokens)
    return TreeDrafting(target, drafter, num_speculative_tokens, topk, num_draft_tokens)
