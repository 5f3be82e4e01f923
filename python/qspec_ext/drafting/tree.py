"""Tree drafting: an EAGLE-2 dynamic tree per request (:func:`tree_draft`), one target forward
over the tree with tree attention, lossless tree verification, and the accepted path's K/V moved
to consecutive cache slots."""

import torch

from ..arguments import check_int
from ..models.eagle3 import DraftState
from ..ops import verify_tree_greedy, verify_tree_sampling
from .base import Proposal, check_propose


class TreeAttention:
    """Where draft-tree tokens go and what they see. The tree's scratch region is the cache
    slots from ``start[b]`` (the position of the tree's first token) on; token j of this call is
    written at ``start + first + j`` (consecutive slots, whatever its depth) and attends to the
    context (slots before ``start``) and to the scratch slots ``start + s`` its row of
    ``seen [B, T, S]`` marks (its ancestors and itself). Inactive requests (start < 0) write
    nothing."""

    def __init__(self, start: torch.Tensor, seen: torch.Tensor, max_length: int, first: int = 0):
        batch, tokens, _ = seen.shape
        device = seen.device
        base = torch.arange(batch, device=device)[:, None] * max_length
        slot = start[:, None] + first + torch.arange(tokens, device=device)
        self.slots = torch.where((start >= 0)[:, None], base + slot, -1).reshape(-1)
        self.start, self.seen = start.long(), seen  # what cached_attention takes


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """``ancestors [B, N+1, N+1]``: node j's row marks j and its ancestors up to the root (node
    0), for ``parents [B, N]`` (node i+1's parent, or -1 for an unused node: only itself)."""
    batch, nodes = parents.shape
    device = parents.device
    reach = torch.eye(nodes + 1, dtype=torch.bool, device=device).expand(batch, -1, -1).clone()
    # Row i+1 marks its parent (an unused node writes False over column 0, already False).
    reach[:, 1:].scatter_(2, parents.long().clamp(min=0)[..., None], (parents >= 0)[..., None])
    # Pointer doubling: after i rounds each row holds its ancestors up to 2^i levels up.
    for _ in range(max(1, (nodes + 1).bit_length())):
        reach = (reach.float() @ reach.float()) > 0
    return reach


def commit_path(caches: list[tuple[torch.Tensor, torch.Tensor]], tree: TreeAttention, path: torch.Tensor) -> None:
    """Moves the K/V of tree rows ``path [B, N+1]`` (-1 = none) to slots ``start + 0, 1, ...`` in
    every layer's cache (all sources are read before any write). Static shapes: every row is
    copied, the rows off the path onto themselves (inactive requests: slot 0, never a tree's)."""
    batch, tokens = path.shape
    slots = tree.slots.view(batch, tokens)
    target = slots.clamp(min=0)
    source = torch.where((path >= 0) & (slots >= 0), slots.gather(1, path.clamp(min=0)), target)
    source, target = source.reshape(-1), target.reshape(-1)
    for k_cache, v_cache in caches:
        k_cache.index_copy_(0, target, k_cache.index_select(0, source))
        v_cache.index_copy_(0, target, v_cache.index_select(0, source))


def tree_draft(drafter, state: DraftState, depth: int, topk: int,
               num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An EAGLE-2 dynamic draft tree per request, from ``state`` (the last prefilled pair).

    Depth 1: the topk tokens of the draft distribution. Each further step runs the topk
    current leaves (the beam) through the drafter at once, each attending to the context and
    its own ancestors, and scores their topk children by cumulative log-probability; the
    topk best children are the next beam. Of all candidates, the ``num_draft_tokens`` best
    (ties to the earlier) form the tree: a parent scores at least as well as its children and
    comes first, so the set holds every chosen node's ancestors. Returns target-vocab
    ``draft_ids [B, N]`` and ``parents [B, N]`` (node i+1's parent, 0 = the root) in
    topological order, the layout of ``verify_tree_*``.

    The beam's K/V go to the (depth - 1) * topk cache slots after the last prefilled pair;
    the next prefill overwrites them. Unchecked: :class:`TreeDrafting` checks that they fit."""
    if drafter.config.parallel_drafting:
        raise ValueError("tree_draft: tree drafting asked of a P-EAGLE (parallel) drafter")
    candidates = topk + (depth - 1) * topk * topk
    if not 1 <= num_draft_tokens <= candidates:
        raise ValueError(f"tree_draft: num_draft_tokens must be in [1, {candidates}] "
                         f"(topk + (depth - 1) * topk^2 candidates), got {num_draft_tokens}")
    B, device = state.logits.shape[0], state.logits.device
    beam_scores, beam_tokens = torch.log_softmax(state.logits.float(), dim=-1).topk(topk, dim=-1)
    scores, tokens = [beam_scores], [beam_tokens]
    pool_parents = [torch.full((B, topk), -1, dtype=torch.long, device=device)]  # -1: the root
    beam = torch.arange(topk, device=device).expand(B, topk)  # pool index of each beam node
    hidden = state.hidden[:, None].expand(B, topk, -1)
    # Each beam node's ancestors, as offsets into the beam slots (step * topk + beam index).
    lineage = torch.empty(B, topk, 0, dtype=torch.long, device=device)
    start = state.next_position
    for step in range(depth - 1):
        own = step * topk + torch.arange(topk, device=device).expand(B, topk)
        lineage = torch.cat([lineage, own[..., None]], dim=-1)
        seen = torch.zeros(B, topk, (step + 1) * topk, dtype=torch.bool, device=device)
        seen.scatter_(2, lineage, True)
        tree = TreeAttention(start, seen, drafter.max_length, first=step * topk)
        positions = (start + step)[:, None].expand(B, topk)
        logits, x_next = drafter.tree_step(hidden, drafter.draft_to_target(beam_tokens), positions, tree)
        child_scores, child_tokens = torch.log_softmax(logits.float(), dim=-1).topk(topk, dim=-1)
        total = (beam_scores[..., None] + child_scores).view(B, topk * topk)
        scores.append(total)
        tokens.append(child_tokens.view(B, topk * topk))
        pool_parents.append(beam[..., None].expand(B, topk, topk).reshape(B, topk * topk))
        beam_scores, best = total.topk(topk, dim=-1)
        parent = best // topk
        beam = topk + step * topk * topk + best
        beam_tokens = child_tokens.view(B, topk * topk).gather(1, best)
        hidden = x_next.gather(1, parent[..., None].expand(-1, -1, x_next.shape[-1]))
        lineage = lineage.gather(1, parent[..., None].expand(-1, -1, lineage.shape[-1]))
    scores, tokens, pool_parents = torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(pool_parents, 1)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :num_draft_tokens]
    chosen = order.sort(dim=1).values  # pool order is topological
    node_of = torch.zeros_like(scores, dtype=torch.long)
    node_of.scatter_(1, chosen, torch.arange(1, num_draft_tokens + 1, device=device).expand(B, -1))
    parent_pool = pool_parents.gather(1, chosen)
    parents = torch.where(parent_pool < 0, 0, node_of.gather(1, parent_pool.clamp(min=0)))
    return drafter.draft_to_target(tokens.gather(1, chosen)), parents


class TreeDrafting:
    """An EAGLE-2 tree of ``depth`` and ``topk`` per step, its ``num_draft_tokens`` best nodes
    verified. ``check_bounds``: as :class:`~qspec_ext.drafting.chain.ChainDrafting`'s."""

    kind = "tree"
    needs_context = False

    def __init__(self, target, drafter, depth: int, topk: int, num_draft_tokens: int | None,
                 check_bounds: bool = True):
        where = type(self).__name__
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
        self.target, self.drafter, self.check_bounds = target, drafter, check_bounds
        self.depth, self.topk, self.num_draft_tokens = depth, topk, num_draft_tokens
        self.max_depth = min(depth, num_draft_tokens)  # most drafts one step can accept
        # The target's tree takes N + 1 slots from the last verified token; the drafter's beam
        # (depth - 1) * topk. A finished request kept as padding (compiled steps) drafts once more
        # from up to max_depth tokens past its last new token.
        self.cache_margin = depth + max(num_draft_tokens + 1, (depth - 1) * topk + 1)

    def draft(self, state: DraftState) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft_ids [B, N], parents [B, N]): :func:`tree_draft`."""
        if self.check_bounds:
            self.drafter.check_draft_room(type(self).__name__, state, (self.depth - 1) * self.topk,
                                          f"a tree of depth {self.depth} and topk {self.topk}")
        return tree_draft(self.drafter, state, self.depth, self.topk, self.num_draft_tokens)

    def propose(self, root: torch.Tensor, state: DraftState, penalty=None, context=None) -> Proposal:
        check_propose(self, penalty, context)
        draft_ids, parents = self.draft(state)
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

    def commit(self, proposal: Proposal, path: torch.Tensor) -> None:
        """Moves the accepted path's K/V to consecutive cache slots (the target's)."""
        self.target.commit_path(proposal.tree, path)
