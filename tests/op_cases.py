"""Inputs for the kernel tests, shared with test_cuda_graphs.py: one builder per op (random,
seeded) and the tolerances the comparisons use."""

import random
from dataclasses import dataclass

import torch

import qspec_ext
from qspec_ext.drafting.tree import TreeAttention
from qspec_ext.models.linear import pack_weight
from qspec_ext.rope import rope_cos_sin_cache


ATTENTION_TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
                        torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def attention_inputs(batch, tokens, heads_q, heads_kv, head_dim, max_length, dtype, device, seed=0, contexts=None,
                     scratch=None):
    """Query as the models pass it (a strided view of a packed QKV projection), caches, and
    positions: request b's tokens at the last positions of a context of contexts[b] tokens
    (random by default); with ``scratch``, a draft tree: tree_start [B] (request 1 inactive when
    B > 1), tree_seen [B, T, scratch] random, positions start + depth."""
    g = torch.Generator().manual_seed(seed)
    width = (heads_q + 2 * heads_kv) * head_dim
    qkv = torch.randn(batch * tokens, width, generator=g).to(dtype)
    query = qkv[:, : heads_q * head_dim].reshape(batch, tokens, heads_q, head_dim)
    k_cache = torch.randn(batch * max_length, heads_kv, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(batch * max_length, heads_kv, head_dim, generator=g).to(dtype)
    if contexts is None:
        contexts = torch.randint(tokens, max_length + 1, (batch,), generator=g).tolist()
    tree_start = tree_seen = None
    if scratch is None:
        positions = torch.stack([torch.arange(c - tokens, c) for c in contexts])
    else:
        start = [min(c, max_length - scratch) for c in contexts]
        tree_start = torch.tensor(start)
        if batch > 1:
            tree_start[1] = -1
        tree_seen = torch.rand(batch, tokens, scratch, generator=g) < 0.5
        depth = torch.randint(0, scratch, (batch, tokens), generator=g)
        positions = torch.where(tree_start[:, None] >= 0, tree_start[:, None] + depth, -1)
    if batch > 2:
        positions[2, -1] = -1  # a padding query
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dict(query=query.to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device),
                positions=positions.to(device), scale=head_dim**-0.5, tree_start=to(tree_start),
                tree_seen=to(tree_seen))


def make_inputs(n, hidden, rows, dtype, device, mode, residual=False, strided=False, weight_f32=True, seed=0,
                index_dtype=torch.int64, padding=True):
    g = torch.Generator().manual_seed(seed)
    tokens = rows + 7
    def feature():
        t = torch.randn(tokens, hidden + (5 if strided else 0), generator=g).to(dtype).to(device)
        return t[:, :hidden]
    aux = [feature() * (i + 1) for i in range(n)]
    res = [feature() for _ in range(n)] if residual else None
    indices = torch.randint(0, tokens, (rows,), generator=g)
    if padding and rows > 1:
        indices[1::4] = -1
    indices = indices.to(index_dtype).to(device)
    wdt = torch.float32 if weight_f32 else dtype
    weight = None
    if mode == "fc_norm":
        weight = (torch.rand(n, hidden, generator=g) + 0.5).to(wdt).to(device)
    elif mode == "norm_before_fc":
        weight = (torch.rand(n * hidden, generator=g) + 0.5).to(wdt).to(device)
    return aux, indices, res, weight


def layer_args(device, dtype, *, packed=False, qk_norm=True, tree=False, seed=0):
    """Arguments of one call: 2 requests x 3 tokens at positions 5-7 and 9-11 (the second
    request's last token padding), caches holding earlier keys and values."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).to(device)

    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    weights = [rand(qkv_width, HIDDEN, scale=0.2), rand(HIDDEN, HEADS * HEAD_DIM, scale=0.2),
               rand(2 * INTERMEDIATE, HIDDEN, scale=0.2), rand(HIDDEN, INTERMEDIATE, scale=0.2)]
    if packed:
        weights = [pack_weight(w) for w in weights]
    positions = torch.tensor([[5, 6, 7], [9, 10, -1]], device=device)
    batch, tokens = positions.shape
    if tree:  # each request's 3 tokens: a root and two children, from slot position[b, 0] on
        seen = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool, device=device)
        at = TreeAttention(positions[:, 0], seen.expand(batch, -1, -1).contiguous(), LENGTH)
        slots, tree_args = at.slots, (at.start, at.seen)
    else:
        start = torch.arange(batch, device=device)[:, None] * LENGTH
        slots, tree_args = torch.where(positions >= 0, start + positions, -1).reshape(-1), (None, None)
    norms = (rand(HEAD_DIM, scale=0.1) + 1, rand(HEAD_DIM, scale=0.1) + 1) if qk_norm else (None, None)
    return dict(
        hidden=rand(batch * tokens, HIDDEN), residual=rand(batch * tokens, HIDDEN),
        input_norm=rand(HIDDEN, scale=0.1) + 1, post_norm=rand(HIDDEN, scale=0.1) + 1,
        qkv_weight=weights[0], o_weight=weights[1], gate_up_weight=weights[2], down_weight=weights[3],
        q_norm=norms[0], k_norm=norms[1],
        k_cache=rand(batch * LENGTH, KV_HEADS, HEAD_DIM), v_cache=rand(batch * LENGTH, KV_HEADS, HEAD_DIM),
        cos_sin_cache=rope_cos_sin_cache(LENGTH, HEAD_DIM, 10000.0, torch.float32, device),
        positions=positions, rope_positions=positions.reshape(-1).clamp(min=0), slots=slots,
        tree_start=tree_args[0], tree_seen=tree_args[1], num_heads_q=HEADS, num_heads_kv=KV_HEADS,
        head_dim=HEAD_DIM, intermediate_size=INTERMEDIATE, eps=1e-6)


@dataclass
class RopeCase:
    tokens: int
    heads_q: int
    heads_kv: int
    head_dim: int
    rot: int
    dtype: torch.dtype
    is_neox: bool
    norm: bool = True
    weight_f32: bool = False
    cache_f32: bool = True
    positions_i64: bool = True
    strided: bool = False
    kv_cache: bool = False

    def __str__(self):
        flags = [
            f"T{self.tokens}", f"h{self.heads_q}x{self.heads_kv}", f"D{self.head_dim}", f"rot{self.rot}",
            str(self.dtype).split(".")[-1], "neox" if self.is_neox else "gptj",
        ]
        flags += [name for name in ("weight_f32", "strided", "kv_cache") if getattr(self, name)]
        flags += [] if self.norm else ["no_norm"]
        flags += [] if self.cache_f32 else ["cos_sin_act"]
        flags += [] if self.positions_i64 else ["pos_i32"]
        return "-".join(flags)


def make_rope_inputs(case: RopeCase, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    width = (case.heads_q + 2 * case.heads_kv) * case.head_dim
    qkv = (torch.randn(case.tokens, width, generator=g) * 2).to(case.dtype).to(device)
    if case.strided:
        qkv = strided_rows(qkv, pad=case.head_dim + 2)
    wdt = torch.float32 if case.weight_f32 else case.dtype
    q_w = (torch.rand(case.head_dim, generator=g) + 0.5).to(wdt).to(device) if case.norm else None
    k_w = (torch.rand(case.head_dim, generator=g) + 0.5).to(wdt).to(device) if case.norm else None
    max_pos = case.tokens + 50
    cache = qspec_ext.rope_cos_sin_cache(max_pos, case.rot, theta=10000.0, device=device)
    if not case.cache_f32:
        cache = cache.to(case.dtype)
    pdt = torch.int64 if case.positions_i64 else torch.int32
    positions = torch.randint(0, max_pos, (case.tokens,), generator=g).to(pdt).to(device)
    kv = {}
    if case.kv_cache:
        slots = case.tokens + 9
        perm = torch.randperm(slots, generator=g)[: case.tokens]
        perm[::3] = -1  # some tokens skip the cache write
        kv = dict(
            k_cache=torch.zeros(slots, case.heads_kv, case.head_dim, dtype=case.dtype, device=device),
            v_cache=torch.zeros(slots, case.heads_kv, case.head_dim, dtype=case.dtype, device=device),
            slot_mapping=perm.to(pdt).to(device),
        )
    args = (q_w, k_w, cache, positions, case.heads_q, case.heads_kv, case.head_dim, 1e-6, case.is_neox)
    return qkv, args, kv


def sampling_case(batch, k, vocab, dtype, q_kind, seed=0, draft_vocab=None):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, k + 1, vocab, generator=g) * 2).to(dtype)
    temperature = torch.tensor([[0.0, 0.3, 1.0, 1.7][b % 4] for b in range(batch)])
    d2t = draft_probs = None
    if q_kind == "onehot":
        drafts = logits.float().argmax(-1)[:, :k].clone()
        drafts[:, ::2] = torch.randint(0, vocab, (batch, (k + 1) // 2), generator=g)
    else:
        width = draft_vocab if q_kind == "d2t" else vocab
        draft_probs = torch.softmax(torch.randn(batch, k, width, generator=g) * 2, -1)
        draft_ids = torch.multinomial(draft_probs.view(-1, width), 1, generator=g).view(batch, k)
        if q_kind == "d2t":
            targets = torch.randperm(vocab, generator=g)[:width].sort().values
            d2t = targets - torch.arange(width)
            drafts = targets[draft_ids]
        else:
            drafts = draft_ids
    seeds = torch.randint(0, 2**62, (batch,), generator=g)
    offsets = torch.randint(0, 10**6, (batch,), generator=g)
    num_draft = torch.randint(0, k + 1, (batch,), generator=g)
    return dict(draft_ids=drafts, draft_probs=draft_probs, target_logits=logits, temperature=temperature,
                seed=seeds, offset=offsets, d2t=d2t, num_draft=num_draft)


def tree_case(batch, num_nodes, vocab, dtype, seed=0, branching=3, max_depth=6, unused=0.0, duplicates=True):
    """Random trees whose drafts are often the target's argmax (most nodes have a child, at a
    random sibling index, holding it, so walks go deep and take every branch), some drafts
    repeated among siblings, the logits of some rows NaN or -inf."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    logits = torch.randn(batch, num_nodes + 1, vocab, generator=g) * 2
    parents = torch.tensor([random_tree(num_nodes, branching, max_depth, rng, unused if b % 2 else 0.0)
                            for b in range(batch)], dtype=torch.long).view(batch, num_nodes)
    argmax = logits.argmax(-1)
    drafts = torch.randint(0, vocab, (batch, num_nodes), generator=g)
    for b in range(batch):
        children = {}
        for i, parent in enumerate(parents[b].tolist()):
            if parent >= 0:
                children.setdefault(parent, []).append(i)
        for parent, kids in children.items():
            if rng.random() < 0.85:
                drafts[b, rng.choice(kids)] = argmax[b, parent]
            if duplicates and len(kids) > 1 and rng.random() < 0.3:  # a repeated sibling token
                first, second = rng.sample(kids, 2)
                drafts[b, max(first, second)] = drafts[b, min(first, second)]
        drafts[b, parents[b] == -1] = -5  # ignored
    if batch > 2 and num_nodes > 1:
        logits[1, 1] = float("nan")
        logits[2, 0] = float("-inf")
    return drafts, parents, logits.to(dtype)


def sampling_args(batch, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    temperature = torch.tensor([[0.0, 0.4, 1.0, 1.6][b % 4] for b in range(batch)])
    return temperature, torch.randint(0, 2**62, (batch,), generator=g), torch.randint(0, 10**6, (batch,), generator=g)


HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, LENGTH = 48, 4, 2, 16, 40, 32


def strided_rows(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """The same values in a wider buffer: rows strided, last dim contiguous."""
    wide = torch.full((t.shape[0], t.shape[1] + pad), 7.0, dtype=t.dtype, device=t.device)
    wide[:, : t.shape[1]] = t
    return wide[:, : t.shape[1]]


def random_tree(num_nodes: int, branching: int, max_depth: int, rng: random.Random, unused: float = 0.0) -> list[int]:
    """parents [N] of a random tree in topological (breadth-first) order, at most `branching`
    children per node and `max_depth` levels; a fraction `unused` of the trailing nodes is -1."""
    parents, depth, frontier = [], {0: 0}, [0]
    while len(parents) < num_nodes and frontier:
        node = frontier.pop(0)
        for _ in range(rng.randint(1, branching)):
            if len(parents) == num_nodes or depth[node] == max_depth:
                break
            child = len(parents) + 1
            parents.append(node)
            depth[child] = depth[node] + 1
            frontier.append(child)
    cut = len(parents) - int(unused * len(parents))
    return parents[:cut] + [-1] * (num_nodes - cut)
