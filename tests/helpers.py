"""Helpers shared by several test files."""

import torch

from qspec_ext.drafting import ChainDrafting, ParallelDrafting


def draft(drafter, state, k: int, return_probs: bool = False):
    """k greedy drafts ``[B, k]`` (target ids) from a prefilled ``state``, the drafter's own kind
    (chain or P-EAGLE), and the distributions ``[B, k, Vd]`` they come from if asked."""
    logits = (ParallelDrafting if drafter.config.parallel_drafting else ChainDrafting)(drafter, k).logits(state)
    return drafter.draft_to_target(logits.argmax(dim=-1)), torch.softmax(logits, dim=-1) if return_probs else None
