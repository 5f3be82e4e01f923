"""Prompt lookup: drafts copied from the request's own context (the prompt and what it generated)
where its newest tokens occurred before, EAGLE-3 drafts where they did not; verified as a chain.

Summaries and chat answers copy spans of the prompt and of themselves, which an n-gram match
predicts well and a one-layer drafter predicts poorly (llama.cpp's lookup decoding, vLLM's
``ngram`` proposer). Each step, per request: the longest n in ``ngram`` (largest first) whose last
n tokens occur earlier in the context; the k tokens after their latest occurrence are the drafts.
The EAGLE-3 chain drafts every step too (one graph, no host synchronization), and is used where no
n-gram matched (:class:`LookupDrafting`), or the EAGLE-2 tree gets the copied span as one more
branch (:class:`LookupTreeDrafting`). Either way a draft is a deterministic proposal: verification
stays lossless.
"""

import torch

from ..arguments import check_int
from ..models.eagle3 import DraftState
from .base import Penalty, Proposal, check_propose
from .chain import ChainDrafting
from .tree import TreeAttention, TreeDrafting, tree_ancestors


def lookup_drafts(tokens: torch.Tensor, length: torch.Tensor, k: int, ngram: tuple[int, ...]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens [B, L]``: each request's tokens by position, valid below ``length [B]``. Returns
    (drafts ``[B, k]``, found ``[B]`` bool): for the largest n of ``ngram`` whose last n tokens
    (positions length - n .. length - 1) also start at an earlier position s (s + n < length, the
    latest such s), the tokens from s + n on. A continuation that runs into the suffix repeats
    with its period (length - s - n), as the pattern itself would."""
    batch, width = tokens.shape
    drafts = torch.zeros(batch, k, dtype=tokens.dtype, device=tokens.device)
    found = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    draft_index = torch.arange(k, device=tokens.device)
    for n in sorted(ngram, reverse=True):
        if n >= width:
            continue
        suffix = tokens.gather(1, (length[:, None] - n + torch.arange(n, device=tokens.device)).clamp(0, width - 1))
        match = (tokens.unfold(1, n, 1) == suffix[:, None, :]).all(dim=-1)  # [B, L - n + 1] by start
        starts = torch.arange(match.shape[1], device=tokens.device)
        usable = match & (starts + n < length[:, None]) & (length[:, None] > n)
        latest = torch.where(usable, starts, -1).max(dim=1).values
        new = (latest >= 0) & ~found
        period = (length - latest - n).clamp(min=1)
        copied = tokens.gather(1, ((latest + n)[:, None] + draft_index % period[:, None]).clamp(0, width - 1))
        drafts = torch.where(new[:, None], copied, drafts)
        found |= new
    return drafts, found


class LookupDrafting(ChainDrafting):
    """k drafts per step: prompt lookup (:func:`lookup_drafts` over n-grams of ``ngram`` tokens)
    where a match exists, the EAGLE-3 chain's drafts elsewhere; chain verification. Pass it to
    :class:`~qspec_ext.decode.SpeculativeDecoder` as ``drafting=`` (the loop keeps each request's
    tokens for it: ``needs_context``)."""

    kind = "lookup"
    needs_context = True

    def __init__(self, drafter, k: int, ngram: tuple[int, ...] = (6, 5, 4), check_bounds: bool = True):
        if drafter.config.parallel_drafting:
            raise ValueError("LookupDrafting: prompt lookup falls back to a chain EAGLE-3 drafter; got a P-EAGLE "
                             "(parallel) drafter")
        if not ngram or min(ngram) < 1:
            raise ValueError(f"LookupDrafting: ngram must list n-gram sizes >= 1, got {ngram}")
        super().__init__(drafter, k, check_bounds)
        self.ngram = tuple(ngram)

    def propose(self, root: torch.Tensor, state: DraftState, penalty: Penalty | None = None,
                context: torch.Tensor | None = None) -> Proposal:
        """``context [B, L]``: each request's tokens by position through ``root`` (its newest)."""
        check_propose(self, penalty, context)
        copied, found = lookup_drafts(context, root + 1, self.k, self.ngram)
        drafts = torch.where(found[:, None], copied, self.draft(state, penalty))
        return Proposal(drafts, torch.arange(self.k + 1, device=root.device)[None])


class LookupTreeDrafting(TreeDrafting):
    """An EAGLE-2 tree (:class:`~qspec_ext.drafting.tree.TreeDrafting`) with a prompt-lookup branch:
    ``lookup_tokens`` nodes in a chain under the root, the :func:`lookup_drafts` continuation where
    a match exists, placed first (where both branches hold the token the target picks, verification
    follows the copied span). Verified losslessly as any tree: a branch of wrong drafts is rejected
    at its first node."""

    kind = "lookup-tree"
    needs_context = True

    def __init__(self, target, drafter, depth: int, topk: int, num_draft_tokens: int | None = None,
                 lookup_tokens: int | None = None, ngram: tuple[int, ...] = (6, 5, 4), check_bounds: bool = True):
        super().__init__(target, drafter, depth, topk, num_draft_tokens, check_bounds)
        self.lookup_tokens = check_int("LookupTreeDrafting", "lookup_tokens", lookup_tokens or depth, 1, 32)
        self.ngram = tuple(ngram)
        self.tree_tokens = self.num_draft_tokens
        self.num_draft_tokens += self.lookup_tokens
        self.max_depth = max(depth, self.lookup_tokens)
        self.cache_margin = self.max_depth + max(self.num_draft_tokens + 1, (depth - 1) * topk + 1)

    def propose(self, root: torch.Tensor, state: DraftState, penalty=None,
                context: torch.Tensor | None = None) -> Proposal:
        check_propose(self, penalty, context)
        tree_ids, tree_parents = self.draft(state)
        copied, _ = lookup_drafts(context, root + 1, self.lookup_tokens, self.ngram)
        batch, n = copied.shape[0], self.lookup_tokens
        # Nodes 1..n: the copied chain (node 1 under the root); then the tree, its node ids moved by n.
        chain_parents = torch.arange(n, device=root.device).expand(batch, n)
        parents = torch.cat([chain_parents, torch.where(tree_parents > 0, tree_parents + n, 0)], dim=1)
        draft_ids = torch.cat([copied, tree_ids], dim=1)
        ancestors = tree_ancestors(parents)
        tree = TreeAttention(root, ancestors, self.target.max_length)
        return Proposal(draft_ids, ancestors.sum(-1) - 1, parents, tree)
