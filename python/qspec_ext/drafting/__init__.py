"""Drafting strategies: what the decode loop asks of a drafter each step, behind one small
interface (:class:`Drafting`): propose drafts from the drafter's state, verify them against the
target's logits, and commit what was accepted.

- :class:`ChainDrafting` (chain.py): k sequential EAGLE-3 draft steps, chain verification;
- :class:`ParallelDrafting` (parallel.py): P-EAGLE, k drafts from one drafter forward;
- :class:`TreeDrafting` (tree.py): an EAGLE-2 dynamic tree, tree verification;
- :class:`LookupDrafting` (lookup.py): prompt lookup (n-gram matches in the request's own tokens),
  the EAGLE-3 chain where nothing matches; chain verification. :class:`LookupTreeDrafting`: the
  EAGLE-2 tree with the copied span as one more branch.

The drafter (models/eagle3.py) is the network: its forward, and its prefill, which returns the
:class:`~qspec_ext.models.eagle3.DraftState` these strategies draft from.
"""

from ..arguments import check_int
from .base import Drafting, Penalty, Proposal
from .chain import ChainDrafting, chain_logits
from .lookup import LookupDrafting, LookupTreeDrafting, lookup_drafts
from .parallel import ParallelDrafting, parallel_logits
from .tree import TreeDrafting, tree_draft

__all__ = ["ChainDrafting", "Drafting", "LookupDrafting", "LookupTreeDrafting", "ParallelDrafting", "Penalty", "Proposal",
           "TreeDrafting", "chain_logits", "lookup_drafts", "make_drafting", "parallel_logits", "tree_draft"]


def make_drafting(target, drafter, num_speculative_tokens: int, topk: int = 1,
                  num_draft_tokens: int | None = None, check_bounds: bool = True) -> Drafting:
    """The strategy for these settings: a tree when topk > 1, else the drafter's own kind
    (P-EAGLE drafters draft in parallel, EAGLE-3 drafters in a chain)."""
    where = "make_drafting"
    check_int(where, "topk", topk, 1, 64)
    if topk == 1:
        if num_draft_tokens is not None and num_draft_tokens != num_speculative_tokens:
            raise ValueError(f"{where}: num_draft_tokens={num_draft_tokens} needs a tree (topk > 1); a chain "
                             f"verifies num_speculative_tokens={num_speculative_tokens} drafts")
        kind = ParallelDrafting if drafter.config.parallel_drafting else ChainDrafting
        return kind(drafter, num_speculative_tokens, check_bounds)
    return TreeDrafting(target, drafter, num_speculative_tokens, topk, num_draft_tokens, check_bounds)
