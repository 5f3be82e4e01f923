"""verify_greedy / verify_sampling: hand-built cases, the reference, and the distributions."""

import pytest
import torch
from conftest import DEVICES, assert_cuda_script_fails_with
from helpers import counts_pvalue

import qspec_ext
from qspec_ext import reference as ref
from qspec_ext.sampling import apply_top_k_top_p
from op_cases import sampling_case

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def logits_with_argmax(argmax: list[list[int]], vocab: int, seed: int = 0) -> torch.Tensor:
    """Random logits [B, K+1, V] whose row argmax is the given token."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(argmax), len(argmax[0]), vocab, generator=g)
    for b, row in enumerate(argmax):
        for i, token in enumerate(row):
            logits[b, i, token] = logits[b, i].max() + 1.0
    return logits


# ----------------------------------------------------------------------------- greedy


def test_greedy_hand_built(device):
    V = 11
    target = [[3, 5, 7, 9], [3, 5, 7, 9], [3, 5, 7, 9], [3, 5, 7, 9]]
    drafts = torch.tensor([[3, 5, 7], [4, 5, 7], [3, 5, 8], [3, 5, 7]], device=device)
    num_draft = torch.tensor([3, 3, 3, 1], device=device)
    out, accepted = qspec_ext.verify_greedy(drafts, logits_with_argmax(target, V).to(device), num_draft)
    # all accepted + bonus; first rejected; last rejected; ragged (1 draft) accepted + bonus from row 1
    assert out.tolist() == [[3, 5, 7, 9], [3, -1, -1, -1], [3, 5, 7, -1], [3, 5, -1, -1]]
    assert accepted.tolist() == [3, 0, 2, 1]


def test_greedy_ties_take_the_lowest_id(device):
    logits = torch.zeros(1, 2, 8, device=device)
    logits[0, 0, [2, 5]] = 3.0
    logits[0, 1, [6, 1]] = 3.0
    out, accepted = qspec_ext.verify_greedy(torch.tensor([[5]], device=device), logits)
    assert out.tolist() == [[2, -1]] and accepted.tolist() == [0]
    out, _ = qspec_ext.verify_greedy(torch.tensor([[2]], device=device), logits)
    assert out.tolist() == [[2, 1]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,k,vocab", [(1, 1, 7), (5, 3, 1000), (8, 7, 32000), (3, 32, 257)])
def test_greedy_matches_reference(device, dtype, batch, k, vocab):
    g = torch.Generator().manual_seed(batch * 100 + k)
    logits = torch.randn(batch, k + 1, vocab, generator=g).to(dtype)
    drafts = logits.float().argmax(-1)[:, :k].clone()
    flip = torch.rand(batch, k, generator=g) < 0.25
    drafts[flip] = torch.randint(0, vocab, (int(flip.sum()),), generator=g)
    num_draft = torch.randint(0, k + 1, (batch,), generator=g)
    expected = ref.verify_greedy(drafts, logits, num_draft)
    out, accepted = qspec_ext.verify_greedy(drafts.to(device), logits.to(device), num_draft.to(device))
    assert torch.equal(out.cpu(), expected[0]) and torch.equal(accepted.cpu(), expected[1])
    out_ids = torch.full((batch, k + 1), 99, dtype=torch.long, device=device)
    num_accepted = torch.full((batch,), 99, dtype=torch.long, device=device)
    qspec_ext.verify_greedy_out(drafts.to(device), logits.to(device), out_ids, num_accepted, num_draft.to(device))
    assert torch.equal(out_ids.cpu(), expected[0]) and torch.equal(num_accepted.cpu(), expected[1])


def test_greedy_nan_and_inf_rows_follow_torch_argmax(device):
    logits = torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(0))
    logits[0, 0, 4] = float("nan")
    logits[0, 0, 7] = float("nan")
    logits[1, :, :] = float("-inf")
    drafts = torch.tensor([[4, (int(logits[0, 1].argmax()) + 1) % 10], [0, 0]])  # row 1 of request 0 rejects
    out, accepted = qspec_ext.verify_greedy(drafts.to(device), logits.to(device))
    assert out.cpu().tolist() == [[4, int(logits[0, 1].argmax()), -1], [0, 0, 0]]
    assert accepted.tolist() == [1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("special", ["max", "nan"])
def test_greedy_argmax_in_every_lane_and_the_tail(device, special, dtype):
    """The row's max (or its one NaN) in the first and the second 8 lanes of a 16-wide pass, and in
    the vocab's tail past the last whole 16."""
    vocab, spots = 100, [3, 11, 37, 58, 97]
    logits = torch.randn(len(spots), 2, vocab, generator=torch.Generator().manual_seed(1)).to(dtype)
    for row, spot in enumerate(spots):
        logits[row, 0, spot] = float("nan") if special == "nan" else 10.0
    expected = logits[:, 0].float().argmax(-1)  # torch: the first NaN, else the first max
    assert expected.tolist() == spots
    out, accepted = qspec_ext.verify_greedy((expected[:, None] + 1).to(device), logits.to(device))  # rejected
    assert out[:, 0].cpu().tolist() == spots and accepted.tolist() == [0] * len(spots)


# ----------------------------------------------------------------------------- sampling vs reference


def to_device(case, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


@pytest.mark.parametrize("q_kind", ["onehot", "full", "d2t"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sampling_matches_reference(device, q_kind, dtype):
    case = sampling_case(16, 5, 300, dtype, q_kind, seed=7, draft_vocab=120)
    expected = ref.verify_sampling(**case)
    out, accepted = qspec_ext.verify_sampling(**to_device(case, device))
    assert torch.equal(out.cpu(), expected[0])
    assert torch.equal(accepted.cpu(), expected[1])


@pytest.mark.parametrize("q_kind", ["full", "d2t"])
def test_sampling_across_vocab_splits_matches_reference(device, q_kind):
    """Rows longer than one split (verify.h's kVerifySplitIds = 8192 ids): each softmax partial is
    summed split by split, and the decisions are still the reference's."""
    case = sampling_case(12, 3, 3 * 8192 + 77, torch.float32, q_kind, seed=13, draft_vocab=5000)
    case["target_logits"] = case["target_logits"] * 0.25  # flat rows: many terms count in every split
    case["temperature"] = torch.tensor([0.0, 0.6, 1.0] * 4)
    expected = ref.verify_sampling(**case)
    out, accepted = qspec_ext.verify_sampling(**to_device(case, device))
    assert torch.equal(out.cpu(), expected[0]) and torch.equal(accepted.cpu(), expected[1])


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
@pytest.mark.parametrize("split", ["0", "always"])
@pytest.mark.parametrize("q_kind", ["onehot", "full", "d2t"])
@pytest.mark.parametrize("vocab,dtype", [(32000, torch.bfloat16), (151936, torch.float32), (1000, torch.float16), (77, torch.float32)])
def test_sampling_cpu_equals_cuda(q_kind, vocab, dtype, split, monkeypatch):
    """CPU and CUDA share the per-element math and the summation order: every decision and
    every draw is the same, token for token, with one block per row and with split-V
    (QSPEC_VERIFY_SPLIT=always)."""
    monkeypatch.setenv("QSPEC_VERIFY_SPLIT", split)
    case = sampling_case(64, 7, vocab, dtype, q_kind, seed=11, draft_vocab=min(4000, vocab // 2))
    cpu = qspec_ext.verify_sampling(**case)
    gpu = qspec_ext.verify_sampling(**to_device(case, "cuda"))
    assert torch.equal(cpu[0], gpu[0].cpu()) and torch.equal(cpu[1], gpu[1].cpu())
    g_cpu = qspec_ext.verify_greedy(case["draft_ids"], case["target_logits"], case["num_draft"])
    g_gpu = qspec_ext.verify_greedy(*(case[k].cuda() for k in ("draft_ids", "target_logits", "num_draft")))
    assert torch.equal(g_cpu[0], g_gpu[0].cpu())


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
def test_split_setting_is_checked(monkeypatch):
    monkeypatch.setenv("QSPEC_VERIFY_SPLIT", "yes")
    case = to_device(sampling_case(2, 3, 500, torch.float32, "full", seed=1), "cuda")
    with pytest.raises(RuntimeError, match="QSPEC_VERIFY_SPLIT.*must be 0, 1 or always, got 'yes'"):
        qspec_ext.verify_sampling(**case)


def test_sampling_replays_and_depends_on_offset(device):
    case = to_device(sampling_case(32, 4, 500, torch.float32, "full", seed=3), device)
    case["temperature"] = torch.ones(32, device=device)
    first = qspec_ext.verify_sampling(**case)
    again = qspec_ext.verify_sampling(**case)
    assert torch.equal(first[0], again[0])
    shifted = qspec_ext.verify_sampling(**(case | {"offset": case["offset"] + 1}))
    assert not torch.equal(first[0], shifted[0])


def test_temperature_zero_rows_are_greedy(device):
    case = sampling_case(12, 4, 200, torch.float32, "full", seed=5)
    case["temperature"] = torch.zeros(12)
    out, accepted = qspec_ext.verify_sampling(**to_device(case, device))
    greedy = ref.verify_greedy(case["draft_ids"], case["target_logits"], case["num_draft"])
    assert torch.equal(out.cpu(), greedy[0]) and torch.equal(accepted.cpu(), greedy[1])


# ----------------------------------------------------------------------------- distributions

SEEDS = 20000


def first_tokens(vocab, k, q_kind, temperature, device, top_k=None, top_p=None, seed=0):
    """Runs one verification per seed on the same target rows; returns out_ids, p rows, drafts, q."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1, k + 1, vocab, generator=g) * 1.5
    logits = apply_top_k_top_p(base, top_k, top_p) if (top_k is not None or top_p is not None) else base
    p = torch.softmax(logits[0].double() / temperature, -1)
    d2t = draft_probs = None
    if q_kind == "onehot":
        drafts = base[0, :k].argmax(-1).expand(SEEDS, k).clone()
        q = torch.zeros(k, vocab, dtype=torch.float64)
        q[torch.arange(k), drafts[0]] = 1.0
    else:
        width = vocab // 2 if q_kind == "d2t" else vocab
        draft_q = torch.softmax(torch.randn(k, width, generator=g) * 2.5, -1)  # far from p
        draft_ids = torch.multinomial(draft_q, SEEDS, replacement=True, generator=g).t()
        draft_probs = draft_q.expand(SEEDS, k, width).contiguous()
        if q_kind == "d2t":
            targets = torch.randperm(vocab, generator=g)[:width].sort().values
            d2t = targets - torch.arange(width)
            drafts = targets[draft_ids]
            q = torch.zeros(k, vocab, dtype=torch.float64)
            q[:, targets] = draft_q.double()
        else:
            drafts, q = draft_ids, draft_q.double()
    out, accepted = qspec_ext.verify_sampling(
        drafts.to(device), None if draft_probs is None else draft_probs.to(device),
        logits.expand(SEEDS, k + 1, vocab).contiguous().to(device), torch.full((SEEDS,), temperature, device=device),
        torch.arange(SEEDS, device=device) * 7919 + 17, torch.zeros(SEEDS, dtype=torch.long, device=device),
        None if d2t is None else d2t.to(device),
    )
    return out.cpu(), accepted.cpu(), p, drafts, q


@pytest.mark.parametrize(
    "q_kind,temperature,filters",
    [
        ("full", 1.0, {}),
        ("full", 0.3, {}),
        ("onehot", 1.0, {}),
        ("onehot", 0.3, {}),
        ("d2t", 1.0, {}),
        ("full", 1.0, {"top_k": torch.tensor([5])}),
        ("onehot", 1.0, {"top_p": torch.tensor([0.8])}),
        ("d2t", 0.7, {"top_k": torch.tensor([8]), "top_p": torch.tensor([0.9])}),
    ],
)
def test_emitted_tokens_follow_the_target_distribution(device, q_kind, temperature, filters):
    vocab, k = 12, 2
    out, accepted, p, drafts, q = first_tokens(vocab, k, q_kind, temperature, device, **filters)
    # The first emitted token follows p at row 0 ...
    counts = torch.bincount(out[:, 0], minlength=vocab)
    assert counts_pvalue(counts, p[0]) > 1e-3
    # ... and the whole emitted sequence too: when the first draft was kept, the next token
    # follows row 1 (the target's distribution after that draft).
    kept = (accepted >= 1) & (drafts[:, 0] == drafts[0, 0]) if q_kind == "onehot" else accepted >= 1
    if q_kind != "onehot":
        kept = kept & (drafts[:, 0] == out[:, 0])
    second = out[kept, 1]
    assert len(second) > SEEDS // 20, "too few kept first drafts for the test to have power"
    assert counts_pvalue(torch.bincount(second, minlength=vocab), p[1]) > 1e-3
    # Acceptance of the first draft matches sum_x min(p, q).
    rate = (accepted >= 1).double().mean().item()
    expected_rate = torch.minimum(p[0], q[0]).sum().item()
    assert abs(rate - expected_rate) < 5 * (expected_rate * (1 - expected_rate) / SEEDS) ** 0.5 + 1e-3
    if filters:
        assert torch.all(p[0][out[:, 0]] > 0), "a filtered-out token was emitted"


def test_zero_probability_drafts_are_never_accepted(device):
    vocab, batch = 16, 4000
    logits = torch.randn(batch, 2, vocab)
    logits[:, 0, 3] = float("-inf")  # p(3) = 0
    drafts = torch.full((batch, 1), 3)
    probs = torch.full((batch, 1, vocab), 1.0 / vocab)
    args = (torch.ones(batch), torch.arange(batch), torch.zeros(batch, dtype=torch.long))
    _, accepted = qspec_ext.verify_sampling(drafts.to(device), probs.to(device), logits.to(device),
                                            *(a.to(device) for a in args))
    assert int(accepted.sum()) == 0
    probs[:, 0, 3] = 0.0  # q(3) = 0, p(3) > 0
    logits[:, 0, 3] = 5.0
    _, accepted = qspec_ext.verify_sampling(drafts.to(device), probs.to(device), logits.to(device),
                                            *(a.to(device) for a in args))
    assert int(accepted.sum()) == 0


def test_drafts_outside_the_draft_vocabulary_are_rejected(device):
    vocab, batch = 20, 500
    d2t = torch.tensor([0, 0, 0, 0])  # draft vocab = target ids 0..3
    drafts = torch.full((batch, 1), 9)
    probs = torch.full((batch, 1, 4), 0.25)
    _, accepted = qspec_ext.verify_sampling(
        drafts.to(device), probs.to(device), torch.zeros(batch, 2, vocab, device=device),
        torch.ones(batch, device=device), torch.arange(batch, device=device),
        torch.zeros(batch, dtype=torch.long, device=device), d2t.to(device))
    assert int(accepted.sum()) == 0


def test_nan_and_inf_rows_do_not_crash(device):
    logits = torch.randn(3, 3, 10)
    logits[0, 0, 2] = float("nan")
    logits[1, 1, :] = float("-inf")
    logits[2, :, :] = float("nan")
    drafts = torch.tensor([[2, 2], [int(logits[1, 0].argmax()), 1], [0, 0]])
    out, accepted = qspec_ext.verify_sampling(
        drafts.to(device), None, logits.to(device), torch.ones(3, device=device), torch.arange(3, device=device),
        torch.zeros(3, dtype=torch.long, device=device))
    out, accepted = out.cpu(), accepted.cpu()
    # A row without a distribution rejects its draft and emits torch.argmax of the row.
    assert out[0].tolist() == [2, -1, -1] and accepted[0] == 0
    assert out[2].tolist() == [0, -1, -1] and accepted[2] == 0
    expected = ref.verify_sampling(drafts, None, logits, torch.ones(3), torch.arange(3), torch.zeros(3, dtype=torch.long))
    assert torch.equal(out, expected[0]) and torch.equal(accepted, expected[1])


# ----------------------------------------------------------------------------- opcheck, compile, top-k/top-p


def test_opcheck(device):
    case = to_device(sampling_case(6, 3, 50, torch.float32, "d2t", draft_vocab=20), device)
    args = [case[k] for k in ("draft_ids", "draft_probs", "target_logits", "temperature", "seed", "offset", "d2t",
                              "num_draft")]
    torch.library.opcheck(torch.ops.qspec_ext.verify_sampling.default, args)
    out = (torch.empty(6, 4, dtype=torch.long, device=device), torch.empty(6, dtype=torch.long, device=device))
    torch.library.opcheck(torch.ops.qspec_ext.verify_sampling_out.default, (*args, *out))
    greedy = (case["draft_ids"], case["target_logits"], case["num_draft"])
    torch.library.opcheck(torch.ops.qspec_ext.verify_greedy.default, greedy)
    torch.library.opcheck(torch.ops.qspec_ext.verify_greedy_out.default, (*greedy, *out))


def test_torch_compile_fullgraph(device):
    case = to_device(sampling_case(6, 3, 50, torch.float32, "full"), device)

    def step(draft_ids, draft_probs, logits, temperature, seed, offset, num_draft):
        out, accepted = qspec_ext.verify_sampling(draft_ids, draft_probs, logits, temperature, seed, offset, None,
                                                  num_draft)
        greedy, _ = qspec_ext.verify_greedy(draft_ids, logits, num_draft)
        return out, accepted + 1, greedy

    args = [case[k] for k in ("draft_ids", "draft_probs", "target_logits", "temperature", "seed", "offset",
                              "num_draft")]
    for a, b in zip(step(*args), torch.compile(step, fullgraph=True)(*args)):
        assert torch.equal(a, b)


def test_top_k_top_p_helper():
    logits = torch.tensor([[[3.0, 1.0, 2.0, 0.0, -1.0]], [[0.0, 0.0, 5.0, 1.0, 2.0]]])
    masked = apply_top_k_top_p(logits, top_k=torch.tensor([2, 0]), top_p=None)
    assert torch.isinf(masked[0, 0]).tolist() == [False, True, False, True, True]
    assert not torch.isinf(masked[1]).any()
    probs = torch.softmax(logits, -1)
    masked = apply_top_k_top_p(logits, top_p=torch.tensor([0.5, 0.95]))
    kept = ~torch.isinf(masked)
    assert kept[0, 0].tolist() == [True, False, False, False, False]  # p(top) = 0.67 >= 0.5
    assert kept[1, 0].tolist() == [False, False, True, False, True]  # 0.925 < 0.95 <= 0.925 + 0.046
    assert probs[1, 0][kept[1, 0]].sum() >= 0.95


# ----------------------------------------------------------------------------- bad input

BAD = [
    (dict(draft_ids=torch.zeros(2, 0, dtype=torch.long)), "verify_sampling: argument 'draft_ids' must hold 1 to 32 draft tokens per request, got 0"),
    (dict(draft_ids=torch.zeros(2, 33, dtype=torch.long)), "argument 'draft_ids' must hold 1 to 32 draft tokens per request, got 33"),
    (dict(draft_ids=torch.zeros(2, 3, dtype=torch.int32)), "argument 'draft_ids' must be int64, got Int"),
    (dict(draft_ids=torch.tensor([[0, 1, 50], [0, 1, 2]])), "argument 'draft_ids' must hold target-vocab ids in [0, 50), got 50 at [0, 2]"),
    (dict(draft_ids=torch.tensor([[0, 1, 2], [0, -3, 2]])), "argument 'draft_ids' must hold target-vocab ids in [0, 50), got -3 at [1, 1]"),
    (dict(target_logits=torch.zeros(2, 3, 50)), "argument 'target_logits' must have shape [batch, num_draft_tokens + 1, vocab] = [2, 4, vocab], got [2, 3, 50]"),
    (dict(target_logits=torch.zeros(2, 4, 50, dtype=torch.float64)), "argument 'target_logits' must be float32, float16 or bfloat16, got Double"),
    (dict(temperature=torch.tensor([1.0, -0.5])), "argument 'temperature' must hold finite values >= 0 (0 = greedy), got -0.5 at index 1"),
    (dict(temperature=torch.ones(3)), "argument 'temperature' must have shape [2], got [3]"),
    (dict(seed=torch.zeros(2, dtype=torch.int32)), "argument 'seed' must have dtype [Long], got Int"),
    (dict(num_draft=torch.tensor([1, 4])), "argument 'num_draft' must hold values in [0, 4) (drafts per request, at most K), got 4 at index 1"),
    (dict(d2t=torch.zeros(20, dtype=torch.long)), "argument 'draft_probs' must have shape [batch, num_draft_tokens, draft_vocab] = [2, 3, 20], got [2, 3, 50]"),
    (dict(d2t=torch.full((50,), 1)), "argument 'd2t' must map every draft id into [0, 50), got draft id 49 -> 50"),
    (dict(draft_probs=None, d2t=torch.zeros(50, dtype=torch.long)), "argument 'd2t' maps draft_probs to target ids and must come with draft_probs"),
    (dict(draft_probs=torch.ones(2, 3, 50, dtype=torch.float64)), "argument 'draft_probs' must be float32 or the dtype of target_logits (Float), got Double"),
    (dict(d2t=torch.tensor([1, -1] + [0] * 48)), "argument 'd2t' must map draft ids to strictly increasing target ids (a sorted draft vocabulary, as EAGLE-3 and speculators build it), got draft id 0 -> 1 and 1 -> 0"),
    (dict(d2t=torch.zeros(0, dtype=torch.long), draft_probs=torch.zeros(2, 3, 0)), "argument 'd2t' must map at least one draft id, got an empty tensor"),
    (dict(num_draft=torch.tensor([1, 0, 2, 0])[::2]), "argument 'num_draft' must be contiguous, got strides [2]"),
    (dict(seed=torch.zeros(1, dtype=torch.long).expand(2)), "argument 'seed' must be contiguous, got strides [0]"),
    (dict(offset=torch.zeros(4, dtype=torch.long)[::2]), "argument 'offset' must be contiguous"),
    (dict(temperature=torch.ones(4)[::2]), "argument 'temperature' must be contiguous"),
    (dict(d2t=torch.zeros(100, dtype=torch.long)[::2]), "argument 'd2t' must be contiguous"),
]


@pytest.mark.parametrize("change,message", BAD)
def test_bad_input(change, message):
    args = dict(draft_ids=torch.zeros(2, 3, dtype=torch.long), draft_probs=torch.full((2, 3, 50), 0.02),
                target_logits=torch.zeros(2, 4, 50), temperature=torch.ones(2), seed=torch.zeros(2, dtype=torch.long),
                offset=torch.zeros(2, dtype=torch.long), d2t=None, num_draft=None) | change
    with pytest.raises(RuntimeError) as info:
        qspec_ext.verify_sampling(**args)
    assert "qspec_ext.verify_sampling: " + message.removeprefix("verify_sampling: ") in str(info.value)


def test_bad_out_buffers():
    drafts, logits = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, 50)
    with pytest.raises(RuntimeError, match=r"qspec_ext\.verify_greedy_out: argument 'out_ids' must have shape \[2, 4\], got \[2, 3\]"):
        qspec_ext.verify_greedy_out(drafts, logits, torch.empty(2, 3, dtype=torch.long), torch.empty(2, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"qspec_ext\.verify_greedy_out: argument 'num_accepted' must have dtype \[Long\], got Int"):
        qspec_ext.verify_greedy_out(drafts, logits, torch.empty(2, 4, dtype=torch.long), torch.empty(2, dtype=torch.int32))


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
def test_cuda_out_of_range_draft_fails_loudly():
    assert_cuda_script_fails_with(
        """
        import torch, qspec_ext
        out = qspec_ext.verify_greedy(torch.tensor([[0, 77]], device="cuda"), torch.zeros(1, 3, 50, device="cuda"))
        torch.cuda.synchronize()
        """,
        "qspec_ext.verify: draft_ids[0, 1] = 77 outside [0, vocab=50)",
    )
