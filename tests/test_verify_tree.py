"""verify_tree_greedy / verify_tree_sampling: hand-built trees, random trees against the
reference, the lossless law, opcheck and bad input."""


import pytest
import torch
from conftest import DEVICES, assert_cuda_script_fails_with
from helpers import counts_pvalue

import qspec_ext
from qspec_ext import reference as ref
from qspec_ext.sampling import apply_top_k_top_p
from op_cases import sampling_args, tree_case


def test_hand_built_tree(device):
    # root -> 1 (tok 4), 2 (tok 5); 1 -> 3 (tok 6), 4 (tok 6: repeated sibling); 4 -> 5 (tok 7)
    parents = torch.tensor([[0, 0, 1, 1, 4]], device=device)
    drafts = torch.tensor([[4, 5, 6, 6, 7]], device=device)
    logits = torch.zeros(1, 6, 10, device=device)
    for node, token in enumerate([4, 6, 0, 1, 7, 9]):  # argmax per node row
        logits[0, node, token] = 1.0
    out, accepted, path = qspec_ext.verify_tree_greedy(drafts, parents, logits)
    # root emits 4 -> node 1; node 1 emits 6 -> node 3 (the lowest of 3 and 4); node 3 emits 1: no child, stop.
    assert out.tolist() == [[4, 6, 1, -1, -1, -1]]
    assert accepted.tolist() == [2]
    assert path.tolist() == [[0, 1, 3, -1, -1, -1]]
    logits[0, 0] = 0.0
    logits[0, 0, 5] = 1.0  # the root picks node 2, a leaf: its row's argmax is the bonus
    out, accepted, path = qspec_ext.verify_tree_greedy(drafts, parents, logits)
    assert out.tolist()[0][:3] == [5, 0, -1] and accepted.tolist() == [1] and path.tolist()[0][:3] == [0, 2, -1]


def test_no_drafts_emits_the_root_token(device):
    logits = torch.randn(3, 1, 17, device=device)
    empty = torch.zeros(3, 0, dtype=torch.long, device=device)
    out, accepted, path = qspec_ext.verify_tree_greedy(empty, empty, logits)
    assert out[:, 0].tolist() == logits[:, 0].argmax(-1).tolist()
    assert accepted.tolist() == [0, 0, 0] and path.tolist() == [[0]] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,num_nodes,branching,max_depth", [(1, 1, 1, 1), (5, 8, 1, 8), (6, 16, 4, 4),
                                                                  (4, 64, 8, 8), (3, 30, 2, 3)])
def test_greedy_matches_reference(device, dtype, batch, num_nodes, branching, max_depth):
    drafts, parents, logits = tree_case(batch, num_nodes, 97, dtype, seed=num_nodes, branching=branching,
                                        max_depth=max_depth, unused=0.3)
    expected = ref.verify_tree(drafts, parents, logits)
    got = qspec_ext.verify_tree_greedy(drafts.to(device), parents.int().to(device), logits.to(device))
    for a, b in zip(got, expected):
        assert torch.equal(a.cpu(), b)
    assert int(expected[1].max()) >= min(2, max_depth), "the case should accept some drafts"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_nodes,branching,max_depth", [(8, 1, 8), (24, 3, 5), (64, 8, 8)])
def test_sampling_matches_reference(device, dtype, num_nodes, branching, max_depth):
    batch = 12
    drafts, parents, logits = tree_case(batch, num_nodes, 211, dtype, seed=3 + num_nodes, branching=branching,
                                        max_depth=max_depth, unused=0.2)
    temperature, seed, offset = sampling_args(batch)
    expected = ref.verify_tree(drafts, parents, logits, temperature, seed, offset)
    got = qspec_ext.verify_tree_sampling(*(t.to(device) for t in (drafts, parents, logits, temperature, seed, offset)))
    for a, b in zip(got, expected):
        assert torch.equal(a.cpu(), b)


def test_temperature_zero_is_greedy_and_sampling_replays(device):
    drafts, parents, logits = (t.to(device) for t in tree_case(8, 20, 64, torch.float32, seed=5))
    zeros = torch.zeros(8, device=device)
    seed = torch.arange(8, device=device)
    offset = torch.full((8,), 100, device=device)
    greedy = qspec_ext.verify_tree_greedy(drafts, parents, logits)
    sampled = qspec_ext.verify_tree_sampling(drafts, parents, logits, zeros, seed, offset)
    assert all(torch.equal(a, b) for a, b in zip(greedy, sampled))
    ones = torch.ones(8, device=device)
    first = qspec_ext.verify_tree_sampling(drafts, parents, logits, ones, seed, offset)
    again = qspec_ext.verify_tree_sampling(drafts, parents, logits, ones, seed, offset)
    other = qspec_ext.verify_tree_sampling(drafts, parents, logits, ones, seed, offset + 1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])


def test_out_variants(device):
    drafts, parents, logits = (t.to(device) for t in tree_case(4, 10, 50, torch.float32, seed=2))
    temperature, seed, offset = (t.to(device) for t in sampling_args(4))
    bufs = [torch.full((4, 11), 9, dtype=torch.long, device=device), torch.empty(4, dtype=torch.long, device=device),
            torch.full((4, 11), 9, dtype=torch.long, device=device)]
    qspec_ext.verify_tree_greedy_out(drafts, parents, logits, *bufs)
    assert all(torch.equal(a, b) for a, b in zip(bufs, qspec_ext.verify_tree_greedy(drafts, parents, logits)))
    qspec_ext.verify_tree_sampling_out(drafts, parents, logits, temperature, seed, offset, *bufs)
    expected = qspec_ext.verify_tree_sampling(drafts, parents, logits, temperature, seed, offset)
    assert all(torch.equal(a, b) for a, b in zip(bufs, expected))


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
@pytest.mark.parametrize("vocab,dtype", [(151936, torch.bfloat16), (32000, torch.float32), (77, torch.float16)])
def test_cpu_equals_cuda(vocab, dtype):
    """CPU walks lazily, CUDA computes every node's token first: the same decisions."""
    drafts, parents, logits = tree_case(16, 32, vocab, dtype, seed=9, branching=4, unused=0.25)
    temperature, seed, offset = sampling_args(16)
    for args in ((drafts, parents, logits), (drafts, parents, logits, temperature, seed, offset)):
        op = qspec_ext.verify_tree_greedy if len(args) == 3 else qspec_ext.verify_tree_sampling
        cpu, gpu = op(*args), op(*(t.cuda() for t in args))
        assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu))


SEEDS = 20000


@pytest.mark.parametrize("temperature,filters", [(1.0, {}), (0.5, {}), (1.0, {"top_k": 4}), (0.8, {"top_p": 0.8})])
def test_emitted_sequence_follows_the_target(device, temperature, filters):
    """A fixed tree (root -> 3 top-k children, the first with 2 children of its own) and a
    fixed small-vocabulary target: over many seeds, the first emitted token follows row 0,
    and the second token, given the first landed on a child, follows that child's row."""
    vocab = 8
    g = torch.Generator().manual_seed(1)
    base = torch.randn(1, 6, vocab, generator=g) * 1.5
    if filters:
        k = torch.tensor([filters["top_k"]]) if "top_k" in filters else None
        p_ = torch.tensor([filters["top_p"]]) if "top_p" in filters else None
        base = apply_top_k_top_p(base.view(6, vocab), None if k is None else k.expand(6),
                                 None if p_ is None else p_.expand(6)).view(1, 6, vocab)
    top = base[0, 0].topk(3).indices.tolist()
    top1 = base[0, 1].topk(2).indices.tolist()
    parents = torch.tensor([[0, 0, 0, 1, 1]])
    drafts = torch.tensor([[top[0], top[1], top[2], top1[0], top1[1]]])
    args = [t.expand(SEEDS, *t.shape[1:]).contiguous().to(device) for t in (drafts, parents, base)]
    out, accepted, path = qspec_ext.verify_tree_sampling(
        *args, torch.full((SEEDS,), temperature, device=device), torch.arange(SEEDS, device=device) * 7919 + 3,
        torch.zeros(SEEDS, dtype=torch.long, device=device))
    out, path = out.cpu(), path.cpu()
    p = torch.softmax(base[0].double() / temperature, -1)
    assert counts_pvalue(torch.bincount(out[:, 0], minlength=vocab), p[0]) > 1e-3
    for node in (1, 2):  # the second token after landing on node 1 or 2 follows that node's row
        landed = path[:, 1] == node
        assert int(landed.sum()) > 200, "too few walks reach the node for the test to have power"
        assert counts_pvalue(torch.bincount(out[landed, 1], minlength=vocab), p[node]) > 1e-3
    # The tree accepts exactly when the target's draw is one of the root's children.
    assert abs(float((accepted >= 1).double().mean()) - float(p[0, top].sum())) < 0.02
    if filters:
        assert torch.all(p[0][out[:, 0]] > 0), "a filtered-out token was emitted"


def test_opcheck_and_compile(device):
    drafts, parents, logits = (t.to(device) for t in tree_case(3, 6, 40, torch.float32, seed=4))
    temperature, seed, offset = (t.to(device) for t in sampling_args(3))
    out = [torch.empty(3, 7, dtype=torch.long, device=device), torch.empty(3, dtype=torch.long, device=device),
           torch.empty(3, 7, dtype=torch.long, device=device)]
    ops = torch.ops.qspec_ext
    torch.library.opcheck(ops.verify_tree_greedy.default, (drafts, parents, logits))
    torch.library.opcheck(ops.verify_tree_greedy_out.default, (drafts, parents, logits, *out))
    torch.library.opcheck(ops.verify_tree_sampling.default, (drafts, parents, logits, temperature, seed, offset))
    torch.library.opcheck(ops.verify_tree_sampling_out.default,
                          (drafts, parents, logits, temperature, seed, offset, *out))

    def step(d, p, l, t, s, o):
        sampled = qspec_ext.verify_tree_sampling(d, p, l, t, s, o)
        return sampled[0], sampled[1] + 1, qspec_ext.verify_tree_greedy(d, p, l)[2]

    args = (drafts, parents, logits, temperature, seed, offset)
    for a, b in zip(step(*args), torch.compile(step, fullgraph=True)(*args)):
        assert torch.equal(a, b)


BAD = [
    (dict(parents=torch.tensor([[0, 2, 1], [0, 0, 0]])), "argument 'parents' must hold the parent of node i + 1 in [0, i] (nodes in topological order) or -1 (unused), got 2 at [0, 1]"),
    (dict(parents=torch.tensor([[0, 0, 1], [0, -2, 0]])), "argument 'parents' must hold the parent of node i + 1 in [0, i] (nodes in topological order) or -1 (unused), got -2 at [1, 1]"),
    (dict(parents=torch.tensor([[0, -1, 2], [0, 0, 0]])), "argument 'parents' must not hang a node under an unused one: node 3 has parent 2, which is unused, at [0, 2]"),
    (dict(parents=torch.zeros(2, 4, dtype=torch.long)), "argument 'parents' must have the shape of draft_ids [2, 3], got [2, 4]"),
    (dict(parents=torch.zeros(2, 3, dtype=torch.int16)), "argument 'parents' must be int32 or int64, got Short"),
    (dict(parents=torch.zeros(3, 2, dtype=torch.long).t()), "argument 'parents' must be contiguous"),
    (dict(draft_ids=torch.tensor([[0, 1, 50], [0, 1, 2]])), "argument 'draft_ids' must hold target-vocab ids in [0, 50) at used nodes, got 50 at [0, 2]"),
    (dict(draft_ids=torch.zeros(2, 3, dtype=torch.int32)), "argument 'draft_ids' must be int64, got Int"),
    (dict(target_logits=torch.zeros(2, 3, 50)), "argument 'target_logits' must have shape [batch, num_nodes + 1, vocab] = [2, 4, vocab], got [2, 3, 50]"),
    (dict(target_logits=torch.zeros(2, 4, 50, dtype=torch.float64)), "argument 'target_logits' must be float32, float16 or bfloat16, got Double"),
    (dict(temperature=torch.tensor([1.0, float("inf")])), "argument 'temperature' must hold finite values >= 0 (0 = greedy), got inf at index 1"),
    (dict(seed=torch.zeros(3, dtype=torch.long)), "argument 'seed' must have shape [2], got [3]"),
]


@pytest.mark.parametrize("change,message", BAD)
def test_bad_input(change, message):
    args = dict(draft_ids=torch.zeros(2, 3, dtype=torch.long), parents=torch.tensor([[0, 0, 1], [0, 1, 2]]),
                target_logits=torch.zeros(2, 4, 50), temperature=torch.ones(2), seed=torch.zeros(2, dtype=torch.long),
                offset=torch.zeros(2, dtype=torch.long)) | change
    with pytest.raises(RuntimeError) as info:
        qspec_ext.verify_tree_sampling(**args)
    assert "qspec_ext.verify_tree_sampling: " + message in str(info.value)


def test_unused_nodes_ignore_their_draft_ids():
    parents = torch.tensor([[0, -1, -1]])
    drafts = torch.tensor([[3, -7, 10**9]])
    logits = torch.zeros(1, 4, 5)
    logits[0, 0, 3] = 1.0
    out, accepted, path = qspec_ext.verify_tree_greedy(drafts, parents, logits)
    assert accepted.tolist() == [1] and path.tolist() == [[0, 1, -1, -1]]


def test_bad_out_buffers():
    drafts, parents, logits = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, 50)
    good = [torch.empty(2, 4, dtype=torch.long), torch.empty(2, dtype=torch.long), torch.empty(2, 4, dtype=torch.long)]
    with pytest.raises(RuntimeError, match=r"qspec_ext\.verify_tree_greedy_out: argument 'path' must have shape \[2, 4\], got \[2, 3\]"):
        qspec_ext.verify_tree_greedy_out(drafts, parents, logits, good[0], good[1], torch.empty(2, 3, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"argument 'out_ids' must not share memory with 'path'"):
        qspec_ext.verify_tree_greedy_out(drafts, parents, logits, good[0], good[1], good[0])


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
def test_cuda_bad_parents_fail_loudly():
    assert_cuda_script_fails_with(
        """
        import torch, qspec_ext
        qspec_ext.verify_tree_greedy(torch.zeros(1, 2, dtype=torch.long, device="cuda"),
                                     torch.tensor([[0, 5]], device="cuda"), torch.zeros(1, 3, 50, device="cuda"))
        torch.cuda.synchronize()
        """,
        "qspec_ext.verify_tree: parents[0, 1] = 5 must be in [0, 1] (topological order) or -1",
    )
