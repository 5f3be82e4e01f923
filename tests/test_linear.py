"""The projections' CPU inference path (weights packed in panels, ops.packed_linear) against F.linear
on the weight and the float64 reference."""

import textwrap

import pytest
import torch
import torch.nn.functional as F
from helpers import run_children, run_here
from torch._inductor.utils import run_and_get_code

import qspec_ext
from qspec_ext import ops, reference
from qspec_ext.models.linear import Linear, pack_linears, pack_weight, unpack_weight

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def packed(in_features, out_features, dtype, seed=0):
    torch.manual_seed(seed)
    layer = Linear(in_features, out_features, bias=False).to(dtype)
    pack_linears(layer)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (2, 3, 64)])
@pytest.mark.parametrize("out_features", [96, 1000])
def test_packed_inference_equals_f_linear(dtype, shape, out_features):
    layer = packed(64, out_features, dtype)
    assert layer.packed_weight is not None
    x = torch.randn(shape).to(dtype)
    with torch.no_grad():
        got = layer(x)
    expected = F.linear(x.float(), layer.weight.float())
    assert got.shape == (*shape[:-1], out_features) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, **TOLERANCE[dtype])


def test_packed_path_runs_only_under_no_grad_and_takes_strided_rows():
    layer = packed(64, 32, torch.float32)
    x = torch.randn(8, 128)[:, ::2]  # rows of 64 with stride 2
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-4, rtol=1e-4)
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).sum().backward()  # autograd: F.linear on the weight, so the weight gets its gradient
    torch.testing.assert_close(layer.weight.grad, x.detach().sum(0).expand(32, -1))


def test_a_weight_changed_after_packing_is_used_not_the_stale_copy():
    layer = packed(64, 32, torch.float32)
    x = torch.randn(4, 64)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # e.g. an optimizer step
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-4, rtol=1e-4)
        layer.load_state_dict({"weight": torch.randn(32, 64)})
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-4, rtol=1e-4)
        stale = layer.packed_weight
        pack_linears(layer)
        assert layer.packed_weight is not stale
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype, group", [(torch.float32, 1), (torch.bfloat16, 2)])
def test_packing_keeps_every_value_and_pads_with_zeros(dtype, group):
    weight = torch.randn(37, 23).to(dtype)
    packed = pack_weight(weight)
    lanes = -(-23 // group)
    assert packed.shape == (3, lanes, 16, group) and packed.is_contiguous()
    # panel 1: columns 16..31, lane = column % 16; a lane holds inputs 2 * 2 .. 2 * 2 + group - 1
    assert torch.equal(packed[1, 2, :, 0], weight[16:32, 2 * group])
    assert torch.equal(packed[1, 2, 7], weight[23, 2 * group:3 * group])
    assert torch.equal(packed[2, :, 5:], torch.zeros(lanes, 11, group, dtype=dtype))  # columns past N
    assert torch.equal(packed[:, -1, :, 23 - (lanes - 1) * group:], torch.zeros(3, 16, lanes * group - 23, dtype=dtype))
    assert torch.equal(unpack_weight(packed, 37, 23), weight)


def test_fp16_and_other_dtypes_are_not_packed():
    layer = packed(64, 32, torch.float16)
    assert layer.packed_weight is None
    layer.float()
    pack_linears(layer)
    assert layer.packed_weight is not None
    layer.half()
    pack_linears(layer)
    assert layer.packed_weight is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# register tiles of 4 rows (AVX512-BF16: 8) and every tail, blocks of 64 rows
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 17, 130])
@pytest.mark.parametrize("out_features", [16, 80, 1000])
@pytest.mark.parametrize("in_features", [48, 46, 47])  # bf16: pairs of pairs, one pair over, an odd input
def test_packed_linear_op_equals_the_reference(dtype, rows, out_features, in_features):
    torch.manual_seed(rows)
    weight = torch.randn(out_features, in_features).to(dtype)
    x = torch.randn(rows, 2 * in_features).to(dtype)[:, ::2]  # strided rows, as a reshaped activation may be
    got = ops.packed_linear(x, pack_weight(weight), out_features)
    assert got.shape == (rows, out_features) and got.dtype == dtype
    torch.testing.assert_close(got.float(), reference.packed_linear(x, weight).float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_passes_opcheck(dtype):
    weight = torch.randn(40, 24).to(dtype)
    torch.library.opcheck(torch.ops.qspec_ext.packed_linear.default,
                          (torch.randn(5, 24).to(dtype), pack_weight(weight), 40))


@pytest.mark.parametrize("bad, match", [
    (lambda x, p: (x[None], p, 32), "'input' must be 2-D"),
    (lambda x, p: (x[:, :63], p, 32), "'input' must have 64 columns"),
    (lambda x, p: (x.double(), p.double(), 32), "'input' must be float32 or bfloat16"),
    (lambda x, p: (x.bfloat16(), p, 32), "'input' must have the packed weight's dtype"),
    (lambda x, p: (x, p[:, :, :8], 32), "'packed_weight' must be 4-D"),
    (lambda x, p: (x.bfloat16(), p.bfloat16(), 32), r"'packed_weight' must be 4-D \[ceil\(out_features / 16\), ceil\(in_features / 2\), 16, 2\]"),
    (lambda x, p: (x, p, 33), "'out_features' must need the packed weight's 2 panels"),
    (lambda x, p: (x, p, 16), "'out_features' must need the packed weight's 2 panels"),
    (lambda x, p: (x, p.transpose(0, 1).contiguous().transpose(0, 1), 32), "'packed_weight' must be contiguous"),
])
def test_packed_linear_rejects_bad_input(bad, match):
    packed_weight = pack_weight(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match=f"qspec_ext.packed_linear: argument {match}"):
        ops.packed_linear(*bad(torch.randn(3, 64), packed_weight))


@pytest.mark.parametrize("dtype,switch,feature,fast,other", [
    ("bfloat16", "QSPEC_CPU_BF16_DOT", "cpu_bf16_dot", "dot", "widened"),
    ("bfloat16", "QSPEC_CPU_AMX", "cpu_amx", "amx", "no-amx"),
    ("float32", "QSPEC_CPU_AVX512", "cpu_avx512", "fma", "8-lane"),
])
def test_both_kernels_of_a_dtype_match_the_reference(dtype, switch, feature, fast, other):
    """bf16 runs AMX tiles where the CPU has them, else AVX512-BF16 dot products where it has those,
    fp32 AVX-512 FMA tiles (8 rows, even and odd inputs) where it has AVX-512; a child process with
    the switch at 0 checks the next kernel (AVX512-BF16 dots, bf16 pairs widened, 8-lane fp32 tiles)
    too, on any CPU: tiles and their tails, odd in_features, inputs past whole AMX chunks, a last
    panel of 16 and of 8 columns. Each row's result is the same bits whether computed alone or with
    the others (a verify step's rows then equal a plain step's)."""
    script = textwrap.dedent("""
        import torch, qspec_ext
        from qspec_ext import ops, reference
        from qspec_ext.models.linear import pack_weight
        torch.manual_seed(0)
        dtype = getattr(torch, %r)
        tolerance = dict(atol=3e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
        for rows, in_features, out_features in [(1, 46, 80), (5, 47, 72), (17, 64, 80), (3, 1, 16), (20, 130, 48),
                                                (4, 96, 32)]:
            weight, x = torch.randn(out_features, in_features).to(dtype), torch.randn(rows, in_features).to(dtype)
            packed = pack_weight(weight)
            got = ops.packed_linear(x, packed, out_features)
            torch.testing.assert_close(got.float(), reference.packed_linear(x, weight).float(), **tolerance)
            alone = torch.cat([ops.packed_linear(x[i:i + 1], packed, out_features) for i in range(rows)])
            assert torch.equal(alone, got), (rows, in_features, out_features)
        print(%r if qspec_ext.build_info()[%r] else %r)
    """ % (dtype, fast, feature, other))
    (switched_off,) = run_children(script, [{switch: "0"}])
    assert switched_off.returncode == 0, switched_off.stderr
    assert switched_off.stdout.split()[-1] == other
    # The switch as this process has it: on unless set to 0.
    assert run_here(script).split()[-1] == (fast if qspec_ext.build_info()[feature] else other)


def test_the_op_compiles_into_a_static_graph():
    layer = packed(64, 48, torch.bfloat16)
    x = torch.randn(2, 3, 64).bfloat16()
    with torch.no_grad():
        eager = layer(x)
        compiled, code = run_and_get_code(torch.compile(layer, fullgraph=True, dynamic=False), x)
    assert compiled.shape == (2, 3, 48)
    torch.testing.assert_close(compiled, eager)
    assert "torch.ops.qspec_ext.packed_linear" in "".join(code)  # the packed path, compiled (no F.linear)


def test_released_weights_live_only_in_the_packed_copy_and_come_back_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(64, 48, bias=False), Linear(48, 16, bias=False))
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    pack_linears(model, release=True)
    assert all(m.released and m.weight.is_meta and m.weight.shape == dense[f"{i}.weight"].shape
               for i, m in enumerate(model))
    x = torch.randn(3, 64)
    expected = F.linear(F.linear(x, dense["0.weight"]), dense["1.weight"])
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-4)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # a path that needs the dense weight
            torch.testing.assert_close(model(x).float(), expected, atol=5e-2, rtol=5e-2)
    saved = model.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in dense.items())
    pack_linears(model, release=True)  # again: nothing to pack, the packed copies stay
    assert all(m.released for m in model)
    model.to(torch.bfloat16)  # .to() brings the dense weights back, then converts them
    assert not any(m.released for m in model)
    assert all(torch.equal(model.state_dict()[k], v.bfloat16()) for k, v in dense.items())


def test_load_state_dict_into_a_released_model_and_tied_weights_stay_dense():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(dict(embed=torch.nn.Embedding(16, 8), head=Linear(8, 16, bias=False),
                                     proj=Linear(8, 8, bias=False)))
    model.head.weight = model.embed.weight  # tied
    pack_linears(model, release=True)
    assert not model.head.released and model.head.packed_weight is not None and model.proj.released
    new = torch.randn(8, 8)
    model.proj.load_state_dict({"weight": new})
    assert not model.proj.released and torch.equal(model.proj.weight, new)
    with torch.no_grad():
        torch.testing.assert_close(model.proj(torch.eye(8)), new.T, atol=1e-5, rtol=1e-5)


def test_the_native_target_keeps_one_copy_of_its_projections_after_setup():
    from qspec_ext.targets import load_target

    target = load_target("tiny", dtype=torch.float32)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    tokens = torch.tensor([[5, 17, 42, 7]])
    positions = torch.arange(4)[None]
    target.setup(1, 16)
    logits = target(tokens, positions).logits
    linears = [m for m in target.modules() if isinstance(m, Linear)]
    tied = target.lm_head.weight is target.model.embed_tokens.weight
    assert all(m.released for m in linears if not (tied and m is target.lm_head))
    after = target.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    target.setup(1, 16)  # set up again: the same packed copies, the same logits
    torch.testing.assert_close(target(tokens, positions).logits, logits)
