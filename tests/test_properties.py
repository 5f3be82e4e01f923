"""Property-based tests (hypothesis): every op against ``qspec_ext.reference`` on drawn inputs.

Hypothesis draws only parameters (shapes, dtypes, layouts, a seed for the values), so a
falsifying example prints as a short recipe; the tensors are built from it on the CPU,
the reference runs there, and the op runs on the device on strided copies.
"""

import pytest
import torch
from conftest import DEVICES, assert_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qspec_ext
from qspec_ext import reference as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INDEX_DTYPES = [torch.int32, torch.int64]
MODES = ["none", "fc_norm", "norm_before_fc"]
PROPERTY = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
FILL = 7.0  # what the columns past a strided view hold; ops must leave them alone

on_devices = pytest.mark.parametrize("device", DEVICES)

# ----------------------------------------------------------------------------- strategies

value_seeds = st.integers(0, 2**32 - 1)
dtypes = st.sampled_from(DTYPES)
index_dtypes = st.sampled_from(INDEX_DTYPES)
optional_index_dtypes = st.sampled_from([None, *INDEX_DTYPES])
row_counts = st.integers(0, 17)  # 0 and 1 rows included
widths = st.one_of(st.integers(1, 160), st.sampled_from([255, 511, 1000, 4097]))  # odd widths included
pads = st.sampled_from([0, 1, 5, 16])  # extra columns of the buffer the rows live in (0: contiguous)
epsilons = st.sampled_from([1e-6, 1e-5])
scales = st.sampled_from([0.01, 1.0, 30.0])  # moderate: fp16 must not overflow
rates = st.sampled_from([0.0, 0.3, 1.0])
accept_rates = st.sampled_from([0.5, 0.9, 1.0])  # how often a draft is the target's argmax / the drafter's pick
vocabs = st.one_of(st.integers(1, 300), st.sampled_from([1000, 4099]))
temperatures = st.one_of(st.just(0.0), st.sampled_from([0.3, 1.0]), st.floats(0.05, 3.0))


def weight_dtypes(dtype):
    """Norm weights (and cos/sin tables, draft probs): fp32 or the activation dtype."""
    return st.sampled_from([torch.float32, dtype])


def per_request(strategy, batch):
    return st.lists(strategy, min_size=batch, max_size=batch)


# ----------------------------------------------------------------------------- tensor helpers


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def normal(g, shape, dtype, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def norm_weight(g, shape, dtype):
    return (torch.rand(shape, generator=g) + 0.5).to(dtype)


def random_ids(g, shape, high):
    return torch.randint(0, high, shape, generator=g)


def mix(g, preferred, high, keep_rate):
    """preferred ids where a coin with keep_rate lands, uniform ids in [0, high) elsewhere."""
    keep = torch.rand(preferred.shape, generator=g) < keep_rate
    return torch.where(keep, preferred, random_ids(g, preferred.shape, high))


def in_wider_buffer(t, pad, device):
    """t's values on device in a buffer `pad` columns wider (rows strided, last dim contiguous).

    Returns (view, buffer)."""
    width = t.shape[-1]
    buffer = torch.full((*t.shape[:-1], width + pad), FILL, dtype=t.dtype, device=device)
    buffer[..., :width] = t.to(device)
    return buffer[..., :width], buffer


def strided(t, pad, device):
    return None if t is None else in_wider_buffer(t, pad, device)[0]


def to_device(t, device):
    return None if t is None else t.to(device)


def assert_padding_untouched(buffer, width):
    assert torch.all(buffer[..., width:] == FILL), "columns past the view were written"


# ----------------------------------------------------------------------------- norms


@st.composite
def rms_norm_cases(draw):
    dtype = draw(dtypes)
    lead = draw(st.lists(st.integers(0, 6), max_size=2))  # [] = one 1-D row
    return dict(shape=(*lead, draw(widths)), dtype=dtype, weight_dtype=draw(weight_dtypes(dtype)), pad=draw(pads),
                eps=draw(epsilons), scale=draw(scales), seed=draw(value_seeds))


@on_devices
@settings(max_examples=50, **PROPERTY)
@given(c=rms_norm_cases())
def test_rms_norm(device, c):
    g = gen(c["seed"])
    x = normal(g, c["shape"], c["dtype"], c["scale"])
    w = normal(g, c["shape"][-1:], c["weight_dtype"])
    out = qspec_ext.rms_norm(strided(x, c["pad"], device), w.to(device), c["eps"])
    assert_close(out.cpu(), ref.rms_norm(x, w, c["eps"]))


@st.composite
def fused_add_cases(draw):
    dtype = draw(dtypes)
    return dict(rows=draw(row_counts), width=draw(widths), dtype=dtype, weight_dtype=draw(weight_dtypes(dtype)),
                input_pad=draw(pads), residual_pad=draw(pads), eps=draw(epsilons), scale=draw(scales),
                seed=draw(value_seeds))


@on_devices
@settings(max_examples=50, **PROPERTY)
@given(c=fused_add_cases())
def test_fused_add_rms_norm(device, c):
    g = gen(c["seed"])
    shape = (c["rows"], c["width"])
    x, r = normal(g, shape, c["dtype"], c["scale"]), normal(g, shape, c["dtype"], c["scale"])
    w = normal(g, shape[-1:], c["weight_dtype"])
    x_ref, r_ref = x.clone(), r.clone()
    ref.fused_add_rms_norm_(x_ref, r_ref, w, c["eps"])
    x_dev, x_buffer = in_wider_buffer(x, c["input_pad"], device)
    r_dev, r_buffer = in_wider_buffer(r, c["residual_pad"], device)
    qspec_ext.fused_add_rms_norm_(x_dev, r_dev, w.to(device), c["eps"])
    assert_close(r_dev.cpu(), r_ref)
    assert_close(x_dev.cpu(), x_ref)
    assert_padding_untouched(x_buffer, c["width"])
    assert_padding_untouched(r_buffer, c["width"])


@st.composite
def eagle3_input_cases(draw):
    dtype = draw(dtypes)
    return dict(rows=draw(row_counts), width=draw(widths), dtype=dtype, embed_weight_dtype=draw(weight_dtypes(dtype)),
                hidden_weight_dtype=draw(weight_dtypes(dtype)), embeds_pad=draw(pads), hidden_pad=draw(pads),
                norm_before_residual=draw(st.booleans()), eps=draw(epsilons), scale=draw(scales),
                seed=draw(value_seeds))


@on_devices
@settings(max_examples=50, **PROPERTY)
@given(c=eagle3_input_cases())
def test_eagle3_input_norm(device, c):
    g = gen(c["seed"])
    shape = (c["rows"], c["width"])
    e, h = normal(g, shape, c["dtype"]), normal(g, shape, c["dtype"], c["scale"])
    we, wh = normal(g, shape[-1:], c["embed_weight_dtype"]), normal(g, shape[-1:], c["hidden_weight_dtype"])
    flags = (c["eps"], c["norm_before_residual"])
    x_ref, res_ref = ref.eagle3_input_norm(e, h, we, wh, *flags)
    x, res = qspec_ext.eagle3_input_norm(strided(e, c["embeds_pad"], device), strided(h, c["hidden_pad"], device),
                                         we.to(device), wh.to(device), *flags)
    assert_close(x.cpu(), x_ref)
    assert_close(res.cpu(), res_ref)


# ----------------------------------------------------------------------------- qk_norm_rope_


@st.composite
def rope_cases(draw):
    dtype = draw(dtypes)
    head_dim = 2 * draw(st.integers(1, 256))
    heads_kv = draw(st.integers(1, 3))
    tokens = draw(st.integers(0, 9))
    return dict(
        tokens=tokens, heads_q=heads_kv * draw(st.integers(1, 3)), heads_kv=heads_kv, head_dim=head_dim,
        rot=2 * draw(st.integers(1, head_dim // 2)), dtype=dtype, is_neox=draw(st.booleans()),
        norm=draw(st.booleans()), weight_dtype=draw(weight_dtypes(dtype)), cos_sin_dtype=draw(weight_dtypes(dtype)),
        max_position=draw(st.integers(1, 64)), positions_dtype=draw(index_dtypes), qkv_pad=draw(pads),
        kv_cache=draw(st.booleans()), num_slots=tokens + draw(st.integers(0, 8)), slots_dtype=draw(index_dtypes),
        skip_rate=draw(rates), cache_pad=draw(pads), eps=draw(epsilons), seed=draw(value_seeds),
    )


def make_rope(c):
    """(qkv, positional op args, kv-cache kwargs) on the CPU, contiguous."""
    g = gen(c["seed"])
    T, D, hq, hkv = c["tokens"], c["head_dim"], c["heads_q"], c["heads_kv"]
    qkv = normal(g, (T, (hq + 2 * hkv) * D), c["dtype"], 2.0)
    q_w = norm_weight(g, D, c["weight_dtype"]) if c["norm"] else None
    k_w = norm_weight(g, D, c["weight_dtype"]) if c["norm"] else None
    cos_sin = (torch.rand(c["max_position"], c["rot"], generator=g) * 2 - 1).to(c["cos_sin_dtype"])  # any table
    positions = random_ids(g, (T,), c["max_position"]).to(c["positions_dtype"])
    args = [q_w, k_w, cos_sin, positions, hq, hkv, D, c["eps"], c["is_neox"]]
    kv = {}
    if c["kv_cache"]:
        slots = torch.randperm(c["num_slots"], generator=g)[:T]  # distinct
        slots[torch.rand(T, generator=g) < c["skip_rate"]] = -1
        kv = dict(k_cache=normal(g, (c["num_slots"], hkv, D), c["dtype"]),
                  v_cache=normal(g, (c["num_slots"], hkv, D), c["dtype"]), slot_mapping=slots.to(c["slots_dtype"]))
    return qkv, args, kv


@on_devices
@settings(max_examples=60, **PROPERTY)
@given(c=rope_cases())
def test_qk_norm_rope(device, c):
    qkv, args, kv = make_rope(c)
    expected, kv_expected = qkv.clone(), {k: v.clone() for k, v in kv.items()}
    ref.qk_norm_rope_(expected, *args, **kv_expected)

    qkv_dev, qkv_buffer = in_wider_buffer(qkv, c["qkv_pad"], device)
    caches = {k: in_wider_buffer(kv[k], c["cache_pad"], device) for k in ("k_cache", "v_cache") if kv}
    kv_dev = {k: view for k, (view, _) in caches.items()}
    if kv:
        kv_dev["slot_mapping"] = kv["slot_mapping"].to(device)
    args_dev = [to_device(a, device) if isinstance(a, torch.Tensor) else a for a in args]
    qspec_ext.qk_norm_rope_(qkv_dev, *args_dev, **kv_dev)

    assert_close(qkv_dev.cpu(), expected)
    v_start = (c["heads_q"] + c["heads_kv"]) * c["head_dim"]
    assert torch.equal(qkv_dev[:, v_start:].cpu(), qkv[:, v_start:]), "V must be untouched"
    assert_padding_untouched(qkv_buffer, qkv.shape[1])
    if kv:
        assert_close(kv_dev["k_cache"].cpu(), kv_expected["k_cache"])
        assert torch.equal(kv_dev["v_cache"].cpu(), kv_expected["v_cache"])
        for _, buffer in caches.values():
            assert_padding_untouched(buffer, c["head_dim"])


# ----------------------------------------------------------------------------- gather_aux_hidden(_out)


@st.composite
def gather_cases(draw):
    dtype = draw(dtypes)
    return dict(
        n=draw(st.integers(1, 8)), hidden=draw(widths), tokens=draw(st.integers(1, 12)),
        rows=draw(st.integers(0, 15)), dtype=dtype, index_dtype=draw(index_dtypes), padding_rate=draw(rates),
        residual=draw(st.booleans()), mode=draw(st.sampled_from(MODES)), weight_dtype=draw(weight_dtypes(dtype)),
        aux_pad=draw(pads), residual_pad=draw(pads), out_pad=draw(pads), eps=draw(epsilons), scale=draw(scales),
        seed=draw(value_seeds),
    )


def aux_norm_weight(g, mode, n, hidden, dtype):
    shape = {"none": None, "fc_norm": (n, hidden), "norm_before_fc": (n * hidden,)}[mode]
    return None if shape is None else norm_weight(g, shape, dtype)


@on_devices
@settings(max_examples=50, **PROPERTY)
@given(c=gather_cases())
def test_gather_aux_hidden(device, c):
    g = gen(c["seed"])
    n, H, rows = c["n"], c["hidden"], c["rows"]
    aux = [normal(g, (c["tokens"], H), c["dtype"], c["scale"]) for _ in range(n)]
    residual = [normal(g, (c["tokens"], H), c["dtype"], c["scale"]) for _ in range(n)] if c["residual"] else None
    indices = random_ids(g, (rows,), c["tokens"])
    indices[torch.rand(rows, generator=g) < c["padding_rate"]] = -1
    indices = indices.to(c["index_dtype"])
    weight = aux_norm_weight(g, c["mode"], n, H, c["weight_dtype"])
    expected = ref.gather_aux_hidden(aux, indices, residual, c["mode"], weight, c["eps"])

    args = ([strided(a, c["aux_pad"], device) for a in aux], indices.to(device))
    kwargs = dict(residual=None if residual is None else [strided(r, c["residual_pad"], device) for r in residual],
                  norm_mode=c["mode"], norm_weight=to_device(weight, device), eps=c["eps"])
    out = qspec_ext.gather_aux_hidden(*args, **kwargs)
    assert_close(out.cpu(), expected)
    assert torch.all(out.cpu()[indices < 0] == 0), "padding rows must be zeros"

    out_view, out_buffer = in_wider_buffer(torch.full((rows, n * H), 5.0, dtype=c["dtype"]), c["out_pad"], device)
    qspec_ext.gather_aux_hidden_out(*args, out_view, **kwargs)
    assert_close(out_view.cpu(), expected)
    assert_padding_untouched(out_buffer, n * H)


# ----------------------------------------------------------------------------- verification

# Rows with NaN, no finite logit or a +inf logit have no distribution at temperature > 0.
SPECIALS = ("nan", "all_nan", "all_neg_inf", "masked", "pos_inf")


def make_logits(g, batch, k, vocab, dtype, ties, special_rate):
    """[B, K+1, V] logits; rows picked at special_rate get NaN / inf / -inf of a kind from SPECIALS."""
    if ties:  # few distinct values: many argmax ties
        logits = torch.randint(-2, 3, (batch, k + 1, vocab), generator=g).float()
    else:
        logits = torch.randn(batch, k + 1, vocab, generator=g) * 2
    logits = logits.to(dtype)
    for b, i in (torch.rand(batch, k + 1, generator=g) < special_rate).nonzero().tolist():
        kind = SPECIALS[int(torch.randint(len(SPECIALS), (1,), generator=g))]
        cols = torch.rand(vocab, generator=g) < 0.3
        cols[int(torch.randint(vocab, (1,), generator=g))] = True
        if kind.startswith("all_"):
            cols[:] = True
        logits[b, i, cols] = {"nan": float("nan"), "all_nan": float("nan"), "all_neg_inf": float("-inf"),
                              "masked": float("-inf"), "pos_inf": float("inf")}[kind]
    return logits


def ragged(g, batch, k, dtype):
    return None if dtype is None else torch.randint(0, k + 1, (batch,), generator=g).to(dtype)


def pad_unused_drafts(drafts, num_draft):
    """-1 past each request's num_draft: those slots must not be read."""
    if num_draft is not None:
        drafts[torch.arange(drafts.shape[1]) >= num_draft.long()[:, None]] = -1
    return drafts


def out_buffers(batch, k, device):
    return (torch.full((batch, k + 1), 99, dtype=torch.long, device=device),
            torch.full((batch,), 99, dtype=torch.long, device=device))


def assert_same_tokens(got, expected, batch, k):
    """(out_ids, num_accepted) exactly equal to the reference's."""
    out, accepted = (t.cpu() for t in got)
    out_ref, accepted_ref = expected[0].view(batch, k + 1), expected[1].view(batch)
    assert out.shape == (batch, k + 1) and accepted.shape == (batch,)
    assert torch.equal(out, out_ref), f"out_ids {out.tolist()} != reference {out_ref.tolist()}"
    assert torch.equal(accepted, accepted_ref), f"num_accepted {accepted.tolist()} != reference {accepted_ref.tolist()}"


@st.composite
def greedy_cases(draw):
    return dict(
        batch=draw(st.integers(0, 6)), k=draw(st.integers(1, 32)), vocab=draw(vocabs), dtype=draw(dtypes),
        ties=draw(st.booleans()), special_rate=draw(rates), accept_rate=draw(accept_rates),
        num_draft_dtype=draw(optional_index_dtypes), logits_pad=draw(pads), drafts_pad=draw(pads),
        seed=draw(value_seeds),
    )


@on_devices
@settings(max_examples=50, **PROPERTY)
@given(c=greedy_cases())
def test_verify_greedy(device, c):
    g = gen(c["seed"])
    B, K, V = c["batch"], c["k"], c["vocab"]
    logits = make_logits(g, B, K, V, c["dtype"], c["ties"], c["special_rate"])
    num_draft = ragged(g, B, K, c["num_draft_dtype"])
    drafts = pad_unused_drafts(mix(g, logits.argmax(-1)[:, :K], V, c["accept_rate"]), num_draft)
    expected = ref.verify_greedy(drafts, logits, num_draft)

    args = (strided(drafts, c["drafts_pad"], device), strided(logits, c["logits_pad"], device))
    assert_same_tokens(qspec_ext.verify_greedy(*args, to_device(num_draft, device)), expected, B, K)
    out = out_buffers(B, K, device)
    qspec_ext.verify_greedy_out(*args, *out, to_device(num_draft, device))
    assert_same_tokens(out, expected, B, K)


@st.composite
def sampling_cases(draw):
    batch, dtype, vocab = draw(st.integers(0, 6)), draw(dtypes), draw(vocabs)
    q_kind = draw(st.sampled_from(["onehot", "full", "d2t"]))  # q: argmax drafts, over the target / draft vocab
    return dict(
        batch=batch, k=draw(st.integers(1, 32)), vocab=vocab, dtype=dtype, q_kind=q_kind,
        draft_vocab=draw(st.integers(1, vocab)) if q_kind == "d2t" else None, d2t_dtype=draw(index_dtypes),
        probs_dtype=draw(weight_dtypes(dtype)), q_near_p=draw(st.booleans()),
        probs_spread=draw(st.sampled_from([0.3, 2.0, 6.0])), probs_zero_rate=draw(st.sampled_from([0.0, 0.3])),
        ties=draw(st.booleans()), special_rate=draw(rates), accept_rate=draw(accept_rates),
        num_draft_dtype=draw(optional_index_dtypes), temperature=draw(per_request(temperatures, batch)),
        seed=draw(per_request(st.integers(-(2**63), 2**63 - 1), batch)),
        offset=draw(per_request(st.integers(0, 2**40), batch)),
        logits_pad=draw(pads), probs_pad=draw(pads), drafts_pad=draw(pads), value_seed=draw(value_seeds),
    )


def make_sampling(c):
    """The verify_sampling arguments on the CPU, contiguous (draft_probs / d2t None where c says so)."""
    g = gen(c["value_seed"])
    B, K, V = c["batch"], c["k"], c["vocab"]
    temperature = torch.tensor(c["temperature"], dtype=torch.float32)
    logits = make_logits(g, B, K, V, c["dtype"], c["ties"], c["special_rate"])
    draft_probs = d2t = None
    if c["q_kind"] == "onehot":
        drafts = mix(g, logits.argmax(-1)[:, :K], V, c["accept_rate"])
    else:
        width = c["draft_vocab"] or V
        targets = torch.arange(V)
        if c["q_kind"] == "d2t":  # EAGLE's d2t: strictly increasing target ids minus arange
            targets = torch.randperm(V, generator=g)[:width].sort().values
            d2t = (targets - torch.arange(width)).to(c["d2t_dtype"])
        scores = torch.randn(B, K, width, generator=g) * c["probs_spread"]
        if c["q_near_p"]:  # a drafter close to the target: many acceptances
            scaled = logits[:, :K].float() / temperature.clamp(min=0.05)[:, None, None]
            scores += scaled.nan_to_num(0.0, 50.0, -50.0)[..., targets]
        probs = torch.softmax(scores, -1)
        probs[torch.rand(B, K, width, generator=g) < c["probs_zero_rate"]] = 0.0  # q(x) = 0 drafts
        picked = torch.zeros(B, K, dtype=torch.long)
        if B:
            picked = torch.multinomial(probs.view(-1, width) + 1e-9, 1, generator=g).view(B, K)
        draft_probs = probs.to(c["probs_dtype"])
        drafts = mix(g, targets[picked], V, c["accept_rate"])  # random ids may lie outside the draft vocab
    num_draft = ragged(g, B, K, c["num_draft_dtype"])
    return dict(draft_ids=pad_unused_drafts(drafts, num_draft), draft_probs=draft_probs, target_logits=logits,
                temperature=temperature, seed=torch.tensor(c["seed"], dtype=torch.long),
                offset=torch.tensor(c["offset"], dtype=torch.long), d2t=d2t, num_draft=num_draft)


@on_devices
@settings(max_examples=60, **PROPERTY)
@given(c=sampling_cases())
def test_verify_sampling(device, c):
    case = make_sampling(c)
    expected = ref.verify_sampling(**case)

    pad_of = {"draft_ids": c["drafts_pad"], "target_logits": c["logits_pad"], "draft_probs": c["probs_pad"]}
    dev = {k: strided(t, pad_of[k], device) if k in pad_of else to_device(t, device) for k, t in case.items()}
    assert_same_tokens(qspec_ext.verify_sampling(**dev), expected, c["batch"], c["k"])
    out_ids, num_accepted = out_buffers(c["batch"], c["k"], device)
    qspec_ext.verify_sampling_out(**dev, out_ids=out_ids, num_accepted=num_accepted)
    assert_same_tokens((out_ids, num_accepted), expected, c["batch"], c["k"])


# ----------------------------------------------------------------------------- non-contiguous index tensors


def rope_call(length, idx, device):
    qkv = torch.randn(length, 4 * 8, device=device)
    caches = dict(k_cache=torch.zeros(length, 1, 8, device=device), v_cache=torch.zeros(length, 1, 8, device=device))
    cos_sin = torch.rand(16, 8, device=device)

    def call(positions, slot_mapping):
        qspec_ext.qk_norm_rope_(qkv, None, None, cos_sin, positions, 2, 1, 8, 1e-6, True, **caches,
                                slot_mapping=slot_mapping)

    return call, dict(positions=torch.arange(length, **idx) % 16, slot_mapping=torch.arange(length, **idx)), \
        [qkv, *caches.values()]


def gather_call(out_variant):
    def make(length, idx, device):
        aux = [torch.randn(length + 2, 4, device=device) for _ in range(2)]
        out = torch.zeros(length, 8, device=device)

        def call(indices):
            if out_variant:
                qspec_ext.gather_aux_hidden_out(aux, indices, out)
            else:
                qspec_ext.gather_aux_hidden(aux, indices)

        return call, dict(indices=torch.arange(length, **idx)), [out]

    return make


def verify_call(sampling, out_variant):
    def make(length, idx, device):
        drafts = torch.zeros(length, 2, dtype=torch.long, device=device)
        logits = torch.randn(length, 3, 6, device=device)
        out_ids, num_accepted = out_buffers(length, 2, device)
        args = dict(num_draft=torch.ones(length, **idx))
        if sampling:
            probs = torch.full((length, 2, length), 1.0 / length, device=device)  # draft vocab: target ids 0..L-1
            args |= dict(d2t=torch.zeros(length, **idx), temperature=torch.ones(length, device=device),
                         seed=torch.arange(length, device=device),
                         offset=torch.zeros(length, dtype=torch.long, device=device))
            op = qspec_ext.verify_sampling_out if out_variant else qspec_ext.verify_sampling
            head = (drafts, probs, logits)
        else:
            op = qspec_ext.verify_greedy_out if out_variant else qspec_ext.verify_greedy
            head = (drafts, logits)
        outs = dict(out_ids=out_ids, num_accepted=num_accepted) if out_variant else {}
        return (lambda **a: op(*head, **a, **outs)), args, [out_ids, num_accepted]

    return make


VALID_CALLS = {  # op -> (length, index tensor options, device) -> (call(**index args), index args, written tensors)
    "qk_norm_rope_": rope_call,
    "gather_aux_hidden": gather_call(False), "gather_aux_hidden_out": gather_call(True),
    "verify_greedy": verify_call(False, False), "verify_greedy_out": verify_call(False, True),
    "verify_sampling": verify_call(True, False), "verify_sampling_out": verify_call(True, True),
}
NON_CONTIGUOUS_ARGS = [
    ("qk_norm_rope_", "positions"), ("qk_norm_rope_", "slot_mapping"),
    ("gather_aux_hidden", "indices"), ("gather_aux_hidden_out", "indices"),
    ("verify_greedy", "num_draft"), ("verify_greedy_out", "num_draft"),
    *[(op, arg) for op in ("verify_sampling", "verify_sampling_out")
      for arg in ("num_draft", "d2t", "temperature", "seed", "offset")],
]
layouts = st.one_of(st.tuples(st.just("step"), st.integers(2, 4)), st.tuples(st.just("expand"), st.integers(0, 3)))


def non_contiguous(t, layout):
    """t's values (all t[0] for "expand") as a non-contiguous view of a longer buffer.

    The buffer holds valid values (t[0]) throughout and reading the view as if it were
    contiguous stays inside it, so a kernel that ignores the strides computes silently
    instead of crashing."""
    kind, k = layout
    length = len(t)
    buffer = torch.full((length * k if kind == "step" else k + length,), t[0].item(), dtype=t.dtype, device=t.device)
    if kind == "step":
        buffer[::k] = t
        return buffer[::k]
    return buffer[k : k + 1].expand(length)


@on_devices
@pytest.mark.parametrize("op,arg", NON_CONTIGUOUS_ARGS, ids=str)
@settings(max_examples=25, **PROPERTY)
@given(length=st.integers(2, 6), layout=layouts, index_dtype=index_dtypes)
def test_non_contiguous_index_is_rejected(device, op, arg, length, layout, index_dtype):
    """A non-contiguous index tensor raises, naming the op, the argument and "contiguous"; nothing is written."""
    call, args, written = VALID_CALLS[op](length, dict(dtype=index_dtype, device=device), device)
    call(**args)  # valid as is
    before = [t.clone() for t in written]
    args[arg] = non_contiguous(args[arg], layout)
    assert not args[arg].is_contiguous()
    with pytest.raises(RuntimeError) as info:
        call(**args)
    message = str(info.value)
    assert f"qspec_ext.{op}:" in message and f"'{arg}'" in message and "contiguous" in message, message
    assert all(torch.equal(a, b) for a, b in zip(written, before)), "a rejected call must not write"
