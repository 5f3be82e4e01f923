"""rms_norm, fused_add_rms_norm_, eagle3_input_norm and qk_norm_rope_ against the reference."""

import itertools
import os

import pytest
import torch
from conftest import DEVICES, assert_close, assert_cuda_script_fails_with

import qspec_ext
from qspec_ext import reference as ref
from op_cases import RopeCase, make_rope_inputs, strided_rows

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ----------------------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 4096), (257, 80), (3, 5, 128), (64,), (4, 5120)])
@pytest.mark.parametrize("weight_f32", [False, True])
def test_rms_norm(device, dtype, shape, weight_f32):
    x = torch.randn(shape, dtype=dtype, device=device) * 3
    w = torch.randn(shape[-1], dtype=torch.float32 if weight_f32 else dtype, device=device)
    assert_close(qspec_ext.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_rows(device, dtype):
    x = strided_rows(torch.randn(33, 200, dtype=dtype, device=device))
    w = torch.randn(200, dtype=dtype, device=device)
    out = qspec_ext.rms_norm(x, w, 1e-5)
    assert out.is_contiguous()
    assert_close(out, ref.rms_norm(x, w, 1e-5))


def test_views_that_start_inside_their_storage(device):
    """Rows at a storage offset (a slice past the first row and column; one row of a 1-D slice): the
    kernels' row views keep the offset."""
    big = torch.randn(9, 300, device=device)
    w = torch.randn(200, device=device)
    for take in (lambda t: t[2:, 7:207], lambda t: t[4, 50:250]):
        x = take(big)
        assert x.storage_offset() > 0
        assert_close(qspec_ext.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
        x_op, r = take(big.clone()), torch.randn(x.shape, device=device)
        x_ref, r_ref = x.clone(), r.clone()
        ref.fused_add_rms_norm_(x_ref, r_ref, w, 1e-6)
        qspec_ext.fused_add_rms_norm_(x_op, r, w, 1e-6)
        assert_close(x_op, x_ref)
        assert_close(r, r_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 4096), (257, 96), (2, 3, 128)])
@pytest.mark.parametrize("strided", [False, True])
def test_fused_add_rms_norm(device, dtype, shape, strided):
    x = torch.randn(shape, dtype=dtype, device=device)
    r = torch.randn(shape, dtype=dtype, device=device)
    if strided and len(shape) == 2:
        x, r = strided_rows(x), strided_rows(r, pad=5)
    w = torch.randn(shape[-1], dtype=torch.float32, device=device)
    x_ref, r_ref = x.clone(), r.clone()
    ref.fused_add_rms_norm_(x_ref, r_ref, w, 1e-6)
    qspec_ext.fused_add_rms_norm_(x, r, w, 1e-6)
    assert_close(r, r_ref)
    assert_close(x, x_ref)


def test_fused_add_rms_norm_normalizes_the_fp32_sum():
    # Values whose bf16-rounded sum normalizes differently from the exact sum.
    x = torch.tensor([[1.0, 1.0 / 256, 0.5, -0.25]], dtype=torch.bfloat16)
    r = torch.tensor([[256.0, 1.0, 0.5, 0.25]], dtype=torch.bfloat16)
    w = torch.ones(4)
    expected_sum = x.float() + r.float()
    qspec_ext.fused_add_rms_norm_(x, r, w, 1e-6)
    exact = expected_sum * torch.rsqrt(expected_sum.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(r, expected_sum.to(torch.bfloat16))
    assert torch.equal(x, exact.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 4096), (300, 72)])
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3_input_norm(device, dtype, tokens, hidden, norm_before_residual):
    e = torch.randn(tokens, hidden, dtype=dtype, device=device)
    h = strided_rows(torch.randn(tokens, hidden, dtype=dtype, device=device) * 4)
    we = torch.randn(hidden, dtype=torch.float32, device=device)
    wh = torch.randn(hidden, dtype=dtype, device=device)
    x, res = qspec_ext.eagle3_input_norm(e, h, we, wh, 1e-6, norm_before_residual)
    x_ref, res_ref = ref.eagle3_input_norm(e, h, we, wh, 1e-6, norm_before_residual)
    assert x.shape == (tokens, 2 * hidden) and res.shape == (tokens, hidden)
    assert_close(x, x_ref)
    assert_close(res, res_ref)
    if norm_before_residual:
        assert torch.equal(res, x[:, hidden:])
    else:
        assert torch.equal(res, h)


def test_norms_of_zero_and_tiny_rows_depend_on_eps(device):
    """A zero row normalizes to 0 (not NaN) and a tiny row (mean square << eps) stays small:
    both only hold if eps enters the norm where it should."""
    hidden = 64
    x = torch.randn(4, hidden, device=device)
    x[0] = 0.0
    x[1] *= 1e-4  # mean(x^2) ~ 1e-8, far below eps
    w = torch.rand(hidden, device=device) + 0.5
    eps = 1e-5
    out = qspec_ext.rms_norm(x, w, eps)
    assert_close(out, ref.rms_norm(x, w, eps))
    assert torch.all(out[0] == 0) and out[1].abs().max() < 0.3  # ~1 if eps were dropped
    r = torch.zeros_like(x)
    x_ref, r_ref = x.clone(), r.clone()
    qspec_ext.fused_add_rms_norm_(x, r, w, eps)
    ref.fused_add_rms_norm_(x_ref, r_ref, w, eps)
    assert_close(x, x_ref)
    e = torch.zeros(2, hidden, device=device)
    h = torch.randn(2, hidden, device=device) * 1e-4
    assert_close(qspec_ext.eagle3_input_norm(e, h, w, w, eps)[0], ref.eagle3_input_norm(e, h, w, w, eps)[0])
    qkv = torch.randn(2, 4 * 16, device=device)
    qkv[0] = 0.0
    qkv[1] *= 1e-4
    cos_sin = qspec_ext.rope_cos_sin_cache(8, 16, device=device)
    args = (w[:16], w[16:32], cos_sin, torch.tensor([1, 2], device=device), 2, 1, 16, eps, True)
    expected = qkv.clone()
    qspec_ext.qk_norm_rope_(qkv, *args)
    ref.qk_norm_rope_(expected, *args)
    assert_close(qkv, expected)


# ----------------------------------------------------------------------------- qk_norm_rope_


def rope_grid() -> list[RopeCase]:
    """Every head_dim x dtype x pairing, with the other dimensions cycled through."""
    cases = []
    token_counts = itertools.cycle([1, 7, 257, 4096])
    head_counts = itertools.cycle([(4, 1), (2, 2), (8, 2), (6, 3)])
    for i, (head_dim, dtype, is_neox) in enumerate(
        itertools.product([64, 80, 128, 256, 512], DTYPES, [True, False])
    ):
        tokens = next(token_counts)
        heads_q, heads_kv = next(head_counts)
        if tokens == 4096:
            heads_q, heads_kv = 2, 1  # keep the big cases small
        partial = i % 3 == 1
        cases.append(
            RopeCase(
                tokens, heads_q, heads_kv, head_dim, head_dim // 2 if partial else head_dim, dtype, is_neox,
                norm=i % 7 != 6, weight_f32=i % 4 < 2, cache_f32=i % 5 != 3, positions_i64=i % 2 == 0,
                strided=i % 3 == 2, kv_cache=i % 2 == 1,
            )
        )
    # The combinations the Qwen3 drafter uses, explicitly.
    cases.append(RopeCase(16, 32, 8, 128, 128, torch.bfloat16, True, weight_f32=True, kv_cache=True))
    cases.append(RopeCase(5, 16, 2, 64, 32, torch.bfloat16, True, weight_f32=True, strided=True, kv_cache=True))
    return cases


ROPE_CASES = rope_grid()


def clone_kv(kv):
    return {k: v.clone() for k, v in kv.items()}


@pytest.mark.parametrize("case", ROPE_CASES, ids=str)
def test_qk_norm_rope(device, case):
    qkv, args, kv = make_rope_inputs(case, device)
    expected, kv_expected = qkv.clone(), clone_kv(kv)
    ref.qk_norm_rope_(expected, *args, **kv_expected)
    v_before = qkv[:, (case.heads_q + case.heads_kv) * case.head_dim :].clone()
    qspec_ext.qk_norm_rope_(qkv, *args, **kv)
    assert_close(qkv, expected)
    assert torch.equal(qkv[:, (case.heads_q + case.heads_kv) * case.head_dim :], v_before), "V must be untouched"
    if case.kv_cache:
        assert_close(kv["k_cache"], kv_expected["k_cache"])
        assert torch.equal(kv["v_cache"], kv_expected["v_cache"])
        written = kv["slot_mapping"][kv["slot_mapping"] >= 0].long()
        untouched = torch.ones(kv["k_cache"].shape[0], dtype=torch.bool, device=device)
        untouched[written] = False
        assert torch.all(kv["k_cache"][untouched] == 0) and torch.all(kv["v_cache"][untouched] == 0)
        # What went into the cache is exactly what the op left in qkv.
        k_rows = qkv[:, case.heads_q * case.head_dim : (case.heads_q + case.heads_kv) * case.head_dim]
        keep = kv["slot_mapping"] >= 0
        assert torch.equal(kv["k_cache"][written].flatten(1), k_rows[keep])


def test_qk_norm_rope_strided_rows_leave_padding_alone(device):
    case = RopeCase(9, 4, 2, 64, 64, torch.bfloat16, True, strided=True)
    qkv, args, _ = make_rope_inputs(case, device)
    base = qkv.as_strided((qkv.shape[0], qkv.stride(0)), (qkv.stride(0), 1))
    padding_before = base[:, qkv.shape[1] :].clone()
    qspec_ext.qk_norm_rope_(qkv, *args)
    assert torch.equal(base[:, qkv.shape[1] :], padding_before)


def test_qk_norm_rope_keeps_fp32_between_norm_and_rope():
    # bf16 activations: rounding the normalized value to bf16 before rotating would differ.
    case = RopeCase(64, 4, 2, 128, 128, torch.bfloat16, True, weight_f32=True)
    qkv, args, _ = make_rope_inputs(case, "cpu", seed=3)
    expected = qkv.clone()
    ref.qk_norm_rope_(expected, *args)
    qspec_ext.qk_norm_rope_(qkv, *args)
    mismatches = (qkv != expected).float().mean().item()
    assert mismatches < 0.01, f"{mismatches:.2%} of elements differ from the fp32-throughout reference"


def test_qk_norm_rope_matches_transformers_qwen3():
    import transformers
    from transformers.models.qwen3 import modeling_qwen3 as hf

    config = transformers.Qwen3Config(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    tokens, D, hq, hkv = 11, 64, 4, 2
    q_norm, k_norm = hf.Qwen3RMSNorm(D, eps=1e-6), hf.Qwen3RMSNorm(D, eps=1e-6)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5)
        k_norm.weight.uniform_(0.5, 1.5)
    rotary = hf.Qwen3RotaryEmbedding(config)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * D)
    positions = torch.arange(100, 100 + tokens)

    q = q_norm(qkv[:, : hq * D].view(1, tokens, hq, D)).transpose(1, 2)
    k = k_norm(qkv[:, hq * D : (hq + hkv) * D].view(1, tokens, hkv, D)).transpose(1, 2)
    cos, sin = rotary(qkv, positions[None])
    q_hf, k_hf = hf.apply_rotary_pos_emb(q, k, cos, sin)

    cache = qspec_ext.rope_cos_sin_cache(256, D, theta=config.rope_parameters["rope_theta"])
    ours = qkv.clone()
    qspec_ext.qk_norm_rope_(ours, q_norm.weight, k_norm.weight, cache, positions, hq, hkv, D, 1e-6, True)
    torch.testing.assert_close(ours[:, : hq * D], q_hf.transpose(1, 2).reshape(tokens, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        ours[:, hq * D : (hq + hkv) * D], k_hf.transpose(1, 2).reshape(tokens, -1), atol=1e-5, rtol=1e-5
    )


# ----------------------------------------------------------------------------- opcheck / compile

OPCHECK_CASES = [c for i, c in enumerate(ROPE_CASES) if i % 5 == 0 and c.tokens <= 257]


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck_qk_norm_rope(device, case):
    qkv, args, kv = make_rope_inputs(case, device)
    torch.library.opcheck(torch.ops.qspec_ext.qk_norm_rope_.default, (qkv, *args), kv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_norms(device, dtype):
    x = torch.randn(5, 96, dtype=dtype, device=device)
    r = torch.randn(5, 96, dtype=dtype, device=device)
    w = torch.randn(96, device=device)
    torch.library.opcheck(torch.ops.qspec_ext.rms_norm.default, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.qspec_ext.rms_norm.default, (x.view(5, 2, 48), w[:48], 1e-6))
    torch.library.opcheck(torch.ops.qspec_ext.fused_add_rms_norm_.default, (x.clone(), r.clone(), w, 1e-6))
    for nbr in (False, True):
        torch.library.opcheck(torch.ops.qspec_ext.eagle3_input_norm.default, (x, r, w, w.to(dtype), 1e-6, nbr))


def test_torch_compile_fullgraph_matches_eager(device):
    case = RopeCase(9, 4, 2, 64, 64, torch.bfloat16, True, weight_f32=True, kv_cache=True)
    qkv, args, kv = make_rope_inputs(case, device)
    e = torch.randn(9, 128, dtype=torch.bfloat16, device=device)
    w = torch.rand(128, device=device)

    def prologue(qkv, e, h, k_cache, v_cache, slot_mapping):
        x, residual = qspec_ext.eagle3_input_norm(e, h, w, w, 1e-6, True)
        qspec_ext.fused_add_rms_norm_(h, residual, w, 1e-6)
        qspec_ext.qk_norm_rope_(qkv, *args, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
        return qspec_ext.rms_norm(x, torch.ones(256, device=x.device), 1e-6), residual

    inputs = lambda: (qkv.clone(), e.clone(), (e * 2).clone(), *clone_kv(kv).values())  # noqa: E731
    eager_in, compiled_in = inputs(), inputs()
    eager_out = prologue(*eager_in)
    compiled_out = torch.compile(prologue, fullgraph=True)(*compiled_in)
    for a, b in zip((*eager_out, *eager_in), (*compiled_out, *compiled_in)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ----------------------------------------------------------------------------- bad input


def good_rope_inputs(device="cpu"):
    return make_rope_inputs(RopeCase(4, 4, 2, 64, 64, torch.float32, True, kv_cache=True), device)


def call_rope(qkv_in, args, kv, **changes):
    qkv = changes.pop("qkv", qkv_in)
    names = ["q_weight", "k_weight", "cos_sin_cache", "positions", "num_heads_q", "num_heads_kv", "head_dim",
             "eps", "is_neox"]
    kwargs = dict(zip(names, args)) | kv | changes
    qspec_ext.qk_norm_rope_(qkv, **kwargs)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda q, a, kv: dict(qkv=q[:, :-64]), r"'qkv' must have shape \[num_tokens, \(num_heads_q \+ 2 \* num_heads_kv\) \* head_dim\] = \[num_tokens, 512\], got \[4, 448\]"),
        (lambda q, a, kv: dict(qkv=q[None]), r"'qkv' must have shape .* got \[1, 4, 512\]"),
        (lambda q, a, kv: dict(num_heads_q=3), r"'num_heads_q' must be a multiple of num_heads_kv \(2\), got 3"),
        (lambda q, a, kv: dict(head_dim=63), r"'head_dim' must be even and in \[2, 512\], got 63"),
        (lambda q, a, kv: dict(head_dim=1024), r"'head_dim' must be even and in \[2, 512\], got 1024"),
        (lambda q, a, kv: dict(num_heads_kv=0), r"'num_heads_q/num_heads_kv' must be positive, got 4 and 0"),
        (lambda q, a, kv: dict(cos_sin_cache=a[2][:, :31]), r"'cos_sin_cache' must have an even rotary_dim .* got 31"),
        (lambda q, a, kv: dict(cos_sin_cache=torch.zeros(8, 128)), r"'cos_sin_cache' must have an even rotary_dim \(size of dim 1\) in \[2, head_dim=64\], got 128"),
        (lambda q, a, kv: dict(cos_sin_cache=a[2].double()), r"'cos_sin_cache' must be float32 or the dtype of qkv"),
        (lambda q, a, kv: dict(qkv=q.double()), r"'qkv' must be float32, float16 or bfloat16, got Double"),
        (lambda q, a, kv: dict(q_weight=a[0].half()), r"'q_weight' must be float32 or the activation dtype Float, got Half"),
        (lambda q, a, kv: dict(k_weight=a[1][:32]), r"'k_weight' must have shape \[64\], got \[32\]"),
        (lambda q, a, kv: dict(k_weight=None), r"'q_weight/k_weight' must both be given"),
        (lambda q, a, kv: dict(positions=a[3][:2]), r"'positions' must have shape \[4\], got \[2\]"),
        (lambda q, a, kv: dict(positions=a[3].float()), r"'positions' must be int32 or int64, got Float"),
        (lambda q, a, kv: dict(positions=torch.tensor([0, 1, 54, 2])), r"'positions' must hold values in \[0, 54\) \(rows of cos_sin_cache\), got 54 at index 2"),
        (lambda q, a, kv: dict(positions=torch.tensor([0, -1, 3, 2])), r"'positions' must hold values in \[0, 54\).* got -1 at index 1"),
        (lambda q, a, kv: dict(slot_mapping=torch.tensor([0, 13, 1, 2])), r"'slot_mapping' must hold values in \[-1, 13\) \(cache slots, -1 = skip\), got 13 at index 1"),
        (lambda q, a, kv: dict(k_cache=kv["k_cache"].half()), r"'k_cache' must have the dtype of qkv \(Float\), got Half"),
        (lambda q, a, kv: dict(v_cache=kv["v_cache"][:, :1]), r"'v_cache' must have shape \[num_slots, 2, 64\], got \[13, 1, 64\]"),
        (lambda q, a, kv: dict(v_cache=kv["v_cache"][:5]), r"'v_cache' must have as many slots as k_cache \(13\), got 5"),
        (lambda q, a, kv: dict(slot_mapping=None), r"'k_cache/v_cache/slot_mapping' must all be given or all be None"),
        (lambda q, a, kv: dict(positions=torch.arange(8)[::2]), r"'positions' must be contiguous \(the kernels read it with stride 1\), got strides \[2\]"),
        (lambda q, a, kv: dict(positions=torch.tensor([3]).expand(4)), r"'positions' must be contiguous .* got strides \[0\]"),
        (lambda q, a, kv: dict(slot_mapping=torch.tensor([0, 2, 4, 0])), r"'slot_mapping' must not write one cache slot twice, got slot 0 more than once"),
        (lambda q, a, kv: dict(slot_mapping=torch.arange(8)[1::2]), r"'slot_mapping' must be contiguous"),
        (lambda q, a, kv: dict(qkv=q[:1].expand(4, -1)), r"'qkv' is written in place and must not have overlapping rows, got shape \[4, 512\] and strides \[0, 1\]"),
        (lambda q, a, kv: dict(v_cache=kv["k_cache"]), r"'k_cache' must not share memory with 'v_cache'"),
        # One strided cache view twice; two dense (head-major, so not contiguous) views sharing a head.
        (lambda q, a, kv: (lambda c: dict(k_cache=c, v_cache=c))(torch.zeros(13, 4, 64)[:, :2]),
         r"'k_cache' must not share memory with 'v_cache'"),
        (lambda q, a, kv: (lambda f: dict(k_cache=f[0:2].transpose(0, 1), v_cache=f[1:3].transpose(0, 1)))(
            torch.zeros(4, 13, 64)), r"'k_cache' must not share memory with 'v_cache'"),
        (lambda q, a, kv: dict(q_weight=torch.ones(128)[::2], k_weight=torch.ones(128)[::2]), r"'q_weight' must be contiguous"),
    ],
)
def test_qk_norm_rope_bad_input(change, message):
    qkv, args, kv = good_rope_inputs()
    before = qkv.clone()
    with pytest.raises(RuntimeError, match=r"qspec_ext\.qk_norm_rope_: argument " + message):
        call_rope(qkv, args, kv, **change(qkv, args, kv))
    assert torch.equal(qkv, before), "a rejected call must not modify its inputs"


def test_qk_norm_rope_takes_head_major_caches_side_by_side():
    """K and V caches as dense, not contiguous, views of one buffer that do not overlap are taken,
    and written as contiguous caches are."""
    qkv, args, kv = good_rope_inputs()
    buffer = torch.zeros(4, 13, 64)  # [K heads, V heads] x slots x head_dim
    call_rope(qkv.clone(), args, kv)
    call_rope(qkv.clone(), args, kv, k_cache=buffer[0:2].transpose(0, 1), v_cache=buffer[2:4].transpose(0, 1))
    assert torch.equal(buffer[0:2].transpose(0, 1), kv["k_cache"])
    assert torch.equal(buffer[2:4].transpose(0, 1), kv["v_cache"])


def test_norm_bad_input():
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match=r"qspec_ext\.rms_norm: argument 'weight' must have shape \[64\], got \[32\]"):
        qspec_ext.rms_norm(x, torch.ones(32))
    with pytest.raises(RuntimeError, match=r"qspec_ext\.rms_norm: argument 'input' must have a contiguous last dimension"):
        qspec_ext.rms_norm(x.t(), torch.ones(4))
    with pytest.raises(RuntimeError, match=r"qspec_ext\.rms_norm: argument 'input' must be float32, float16 or bfloat16, got Int"):
        qspec_ext.rms_norm(x.int(), torch.ones(64))
    with pytest.raises(RuntimeError, match=r"qspec_ext\.rms_norm: argument 'input' must have rows with one common stride"):
        qspec_ext.rms_norm(torch.randn(4, 6, 64)[:, ::2].transpose(0, 1), torch.ones(64))
    with pytest.raises(RuntimeError, match=r"qspec_ext\.fused_add_rms_norm_: argument 'residual' must have the dtype of input \(Float\), got BFloat16"):
        qspec_ext.fused_add_rms_norm_(x, x.bfloat16(), torch.ones(64))
    with pytest.raises(RuntimeError, match=r"qspec_ext\.fused_add_rms_norm_: argument 'residual' must have the shape of input \[4, 64\], got \[4, 32\]"):
        qspec_ext.fused_add_rms_norm_(x, x[:, :32].contiguous(), torch.ones(64))
    with pytest.raises(RuntimeError, match=r"qspec_ext\.eagle3_input_norm: argument 'hidden' must have the shape of embeds \[4, 64\], got \[3, 64\]"):
        qspec_ext.eagle3_input_norm(x, x[:3], torch.ones(64), torch.ones(64))
    with pytest.raises(RuntimeError, match=r"qspec_ext\.eagle3_input_norm: argument 'hidden_weight' must be float32 or the activation dtype Float, got Half"):
        qspec_ext.eagle3_input_norm(x, x, torch.ones(64), torch.ones(64).half())
    with pytest.raises(RuntimeError, match=r"qspec_ext\.rms_norm: argument 'weight' must be contiguous"):
        qspec_ext.rms_norm(x, torch.ones(128)[::2])
    with pytest.raises(RuntimeError, match=r"qspec_ext\.fused_add_rms_norm_: argument 'input' is written in place and must not have overlapping rows"):
        qspec_ext.fused_add_rms_norm_(x[:1].expand(4, 64), x.clone(), torch.ones(64))
    with pytest.raises(RuntimeError, match=r"qspec_ext\.fused_add_rms_norm_: argument 'residual' must not share memory with 'input'"):
        qspec_ext.fused_add_rms_norm_(x, x, torch.ones(64))
    rows = torch.randn(4, 100)[:, :64]  # strided rows, the same view twice
    with pytest.raises(RuntimeError, match=r"qspec_ext\.fused_add_rms_norm_: argument 'residual' must not share memory with 'input'"):
        qspec_ext.fused_add_rms_norm_(rows, rows, torch.ones(64))


def test_launch_sizes_are_checked_on_the_host():
    """Shapes whose CUDA grid would exceed 2^31 - 1 blocks are rejected on every device (stride-0
    views make them without the memory)."""
    rows = torch.zeros(1, 8).expand(2**31, 8)
    with pytest.raises(RuntimeError, match=r"qspec_ext\.rms_norm: argument 'input' is too large: its number of rows = 2147483648 exceeds 2147483647"):
        qspec_ext.rms_norm(rows, torch.ones(8))
    with pytest.raises(RuntimeError, match=r"qspec_ext\.eagle3_input_norm: argument 'embeds' is too large: its number of rows = 2147483648"):
        qspec_ext.eagle3_input_norm(rows, rows, torch.ones(8), torch.ones(8))
    heads = 2**21 + 1  # (heads + 2) * head_dim elements per row would pass 2^30 at head_dim 512
    with pytest.raises(RuntimeError, match=r"qspec_ext\.qk_norm_rope_: argument 'num_heads_q/num_heads_kv' must have num_heads_q \+ 2 \* num_heads_kv at most 2097152, got 2097155"):
        qspec_ext.qk_norm_rope_(torch.zeros(1, (heads + 2) * 2), None, None, torch.zeros(4, 2), torch.zeros(1, dtype=torch.long), heads, 1, 2)
    batch = 2**31 // 33 + 1
    drafts = torch.zeros(1, 32, dtype=torch.long).expand(batch, 32)
    with pytest.raises(RuntimeError, match=rf"qspec_ext\.verify_greedy: argument 'draft_ids' is too large: batch \* \(num_draft_tokens \+ 1\) \(one block per target row\) = {batch * 33} exceeds 2147483647"):
        qspec_ext.verify_greedy(drafts, torch.zeros(1, 33, 4).expand(batch, 33, 4))


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
def test_device_mismatch_is_rejected():
    qkv, args, kv = good_rope_inputs("cuda")
    with pytest.raises(RuntimeError, match=r"qspec_ext\.qk_norm_rope_: argument 'positions' must be on cuda:0, got cpu"):
        call_rope(qkv, args, kv, positions=args[3].cpu())
    with pytest.raises(RuntimeError, match=r"qspec_ext\.rms_norm: argument 'weight' must be on cuda:0, got cpu"):
        qspec_ext.rms_norm(qkv, torch.ones(qkv.shape[1]))


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
@pytest.mark.parametrize("bad", ["positions", "slot_mapping"])
def test_cuda_out_of_range_index_fails_loudly(bad):
    script = f"""
        import torch, qspec_ext
        T, D = 4, 64
        qkv = torch.randn(T, 8 * D, device="cuda")
        cache = qspec_ext.rope_cos_sin_cache(16, D, device="cuda")
        pos = torch.tensor([0, 1, 2, 3], device="cuda")
        slots = torch.tensor([0, 1, 2, 3], device="cuda")
        kc = torch.zeros(8, 2, D, device="cuda"); vc = torch.zeros(8, 2, D, device="cuda")
        if "{bad}" == "positions": pos[2] = 99
        else: slots[1] = 8
        qspec_ext.qk_norm_rope_(qkv, None, None, cache, pos, 4, 2, D, 1e-6, True, kc, vc, slots)
        torch.cuda.synchronize()
    """
    assert_cuda_script_fails_with(script, f"qspec_ext.qk_norm_rope_: {bad}[")


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
@pytest.mark.parametrize("is_neox", [True, False])
def test_rope_without_norm_is_bit_identical_on_cpu_and_cuda(is_neox):
    """RoPE alone rounds every product and sum explicitly on both devices: the same bits."""
    qkv = torch.randn(37, (8 + 2 * 2) * 128)
    cache = qspec_ext.rope_cos_sin_cache(4096, 96, theta=10000.0)
    positions = torch.randint(0, 4096, (37,))
    on_cuda = qkv.cuda()
    qspec_ext.qk_norm_rope_(qkv, None, None, cache, positions, 8, 2, 128, 1e-6, is_neox)
    qspec_ext.qk_norm_rope_(on_cuda, None, None, cache.cuda(), positions.cuda(), 8, 2, 128, 1e-6, is_neox)
    assert torch.equal(qkv, on_cuda.cpu())


def test_build_info():
    info = qspec_ext.build_info()
    assert info["version"] == qspec_ext.__version__
    assert info["torch_version"] == torch.__version__
    # One binary for every torch from 2.10 and CPython from 3.10 (the wheel CI installs beside 2.11 to 2.14).
    assert info["torch_versions"] == ">=2.10" and "stable ABI" in info["abi"]
    assert qspec_ext._C.__file__.endswith(".abi3.so")
    # QSPEC_CUDA=1 (as CI sets) demands the CUDA kernels, GPU or not; they load where torch has CUDA.
    if os.environ.get("QSPEC_CUDA") == "1":
        assert info["cuda_kernels_built"] and info["cuda_archs"]
    assert info["cuda_kernels"] == (info["cuda_kernels_off_because"] is None)
    if info["cuda_kernels_built"] and torch.version.cuda is not None:
        torch_major, built_major = (int(v.split(".")[0]) for v in (torch.version.cuda, info["cuda_version_built"]))
        assert info["cuda_kernels"] == (torch_major >= built_major)
    for op in ("rms_norm", "fused_add_rms_norm_", "eagle3_input_norm", "qk_norm_rope_"):
        kernels = torch._C._dispatch_dump(f"qspec_ext::{op}")
        assert "CPU: registered" in kernels
        assert ("CUDA: registered" in kernels) == info["cuda_kernels"]


def test_cpu_and_cuda_share_the_entry_code():
    """Every op family's entry points (argument checks, output allocation) are written once, in
    csrc/<family>_entry.h, which the CPU and the CUDA file both include; neither repeats a check."""
    from pathlib import Path

    csrc = Path(__file__).resolve().parents[1] / "csrc"
    for family, checks in {"norm_rope": ("check_rms_norm(", "check_fused_add_rms_norm(", "check_qk_norm_rope(",
                                         "check_eagle3_input_norm("),
                           "aux_gather": ("check_gather_aux_hidden(",), "verify": ("check_verify(",)}.items():
        entry = (csrc / f"{family}_entry.h").read_text()
        for source in (csrc / "cpu" / f"{family}.cpp", csrc / "cuda" / f"{family}.cu"):
            text = source.read_text()
            assert f'#include "{family}_entry.h"' in text, source
            assert not [c for c in checks if c in text], f"{source} repeats the entry's checks"
        assert all(c in entry for c in checks)
