"""Tree drafting: an EAGLE-2 dynamic tree per request (Eagle3Drafter.draft_tree), one target
forward over the tree with tree attention, lossless tree verification, and the accepted
path's K/V moved to consecutive cache slots."""

import torch

from ..arguments import check_int
from ..models.layers import TreeAttention, tree_ancestors
from ..ops import verify_tree_greedy, verify_tree_sampling
from .chain import Proposal


class TreeDrafting:
    kind = "tree"

    def __init__(self, target, drafter, depth: int, topk: int, num_draft_tokens: int | None):
        where = "SpeculativeDecoder"
        if not target.capabilities.trees:
            raise ValueError(f"{where}: tree drafting (topk > 1) needs a target that runs tree attention "
                             f"(NativeTarget); {type(target).__name__} verifies chains only")
        if drafter.config.parallel_drafting:
            raise ValueError(f"{where}: tree drafting (topk > 1) needs a chain EAGLE-3 drafter, got a P-EAGLE one")
        candidates = topk + (depth - 1) * topk * topk
        if num_draft_tokens is None:
            num_draft_tokens = min(candidates, depth * topk)
        check_int(where, "num_draft_tokens", num_draft_tokens, 1)
        if num_draft_tokens > candidates:
            raise ValueError(f"{where}: num_draft_tokens={num_draft_tokens} exceeds the {candidates} candidates of a "
                             f"tree of depth {depth} and topk {topk} (topk + (depth - 1) * topk^2)")
        self.target, self.drafter = target, drafter
        self.depth, self.topk, self.num_draft_tokens = depth, topk, num_draft_tokens
        self.max_depth = min(depth, num_draft_tokens)  # most drafts one step can accept
        # The target's tree takes N + 1 slots from the last verified token; the drafter's beam
        # (depth - 1) * topk; a request may end depth tokens past its last new token.
        self.cache_margin = depth + max(num_draft_tokens + 1, (depth - 1) * topk + 1)

    def propose(self, root: torch.Tensor) -> Proposal:
        draft_ids, parents = self.drafter.draft_tree(self.depth, self.topk, self.num_draft_tokens)
        ancestors = tree_ancestors(parents)
        depths = ancestors.sum(-1) - 1
        tree = TreeAttention(root, ancestors, self.target.max_length)
        return Proposal(draft_ids, depths, parents, tree)

    def verify(self, proposal: Proposal, logits: torch.Tensor, seeds: torch.Tensor | None,
               offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if seeds is None:
            return verify_tree_greedy(proposal.draft_ids, proposal.parents, logits)
        ones = torch.ones(logits.shape[0], device=logits.device)
        return verify_tree_sampling(proposal.draft_ids, proposal.parents, logits, ones, seeds, offset)

    def keep(self, proposal: Proposal, path: torch.Tensor) -> None:
        self.target.keep_path(proposal.tree, path)
