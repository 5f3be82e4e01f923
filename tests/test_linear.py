"""The projections' CPU inference path (oneDNN-packed weights) against F.linear on the weight."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from qspec_ext import ops, reference
from qspec_ext.models.linear import Linear, onednn_available, pack_linears, packable_dtypes

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}
BF16_PACKED = torch.bfloat16 in packable_dtypes()
needs_bf16_packing = pytest.mark.skipif(not BF16_PACKED, reason="this CPU has no oneDNN bf16 (AVX2 only)")


def packed(in_features, out_features, dtype, seed=0):
    torch.manual_seed(seed)
    layer = Linear(in_features, out_features, bias=False).to(dtype)
    pack_linears(layer)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_packing)])
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


def test_bf16_is_packed_exactly_where_onednn_runs_it_and_computes_either_way():
    layer = packed(64, 32, torch.bfloat16)
    assert (layer.packed_weight is not None) == BF16_PACKED == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    x = torch.randn(3, 64).bfloat16()
    with torch.no_grad():
        torch.testing.assert_close(layer(x).float(), F.linear(x.float(), layer.weight.float()), atol=3e-2, rtol=2e-2)


def test_fp16_and_other_dtypes_are_not_packed():
    layer = packed(64, 32, torch.float16)
    assert layer.packed_weight is None
    layer.float()
    pack_linears(layer)
    assert layer.packed_weight is not None
    layer.half()
    pack_linears(layer)
    assert layer.packed_weight is None


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_packing)])
@pytest.mark.parametrize("rows", [1, 4, 17])
def test_packed_linear_op_equals_the_reference(dtype, rows):
    torch.manual_seed(rows)
    weight = torch.randn(80, 48).to(dtype)
    x = torch.randn(rows, 96).to(dtype)[:, ::2]  # strided rows, as a reshaped activation may be
    got = ops.packed_linear(x, torch.ops.mkldnn._reorder_linear_weight(weight, 1))
    assert got.shape == (rows, 80) and got.dtype == dtype
    torch.testing.assert_close(got.float(), reference.packed_linear(x, weight).float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("bad, match", [
    (lambda x, p: (x[None], p), "'input' must be 2-D"),
    (lambda x, p: (x[:, :63], p), "'input' must have 64 columns"),
    (lambda x, p: (x.double(), p), "'input' must have the packed weight's dtype"),
])
def test_packed_linear_rejects_bad_input(bad, match):
    packed_weight = torch.ops.mkldnn._reorder_linear_weight(torch.randn(32, 64), 1)
    with pytest.raises(RuntimeError, match=f"qspec_ext.packed_linear: argument {match}"):
        ops.packed_linear(*bad(torch.randn(3, 64), packed_weight))


def test_the_op_compiles_into_a_static_graph():
    # (torch.library.opcheck cannot run this op: it reads tensor storages, and a packed weight, fp32 or
    # bf16, is an opaque oneDNN tensor; compiling runs the fake kernel on it.)
    dtype = torch.bfloat16 if BF16_PACKED else torch.float32
    layer = packed(64, 48, dtype)
    x = torch.randn(2, 3, 64).to(dtype)
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

    target = load_target("tiny", dtype=torch.float32)  # (bf16 is packed only where oneDNN runs it)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    tokens = torch.tensor([[5, 17, 42, 7]])
    positions = torch.arange(4)[None]
    target.setup(1, 16)
    logits = target(tokens, positions)
    linears = [m for m in target.modules() if isinstance(m, Linear)]
    tied = target.lm_head.weight is target.model.embed_tokens.weight
    assert all(m.released for m in linears if not (tied and m is target.lm_head))
    after = target.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    target.setup(1, 16)  # set up again: the same packed copies, the same logits
    torch.testing.assert_close(target(tokens, positions), logits)
