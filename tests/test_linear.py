"""The projections' CPU inference path (oneDNN-packed weights) against F.linear on the weight."""

import pytest
import torch
import torch.nn.functional as F

from qspec_ext.models.linear import Linear, onednn_available, pack_linears

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")

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


def test_fp16_and_other_dtypes_are_not_packed():
    layer = packed(64, 32, torch.float16)
    assert layer.packed_weight is None
    layer.float()
    pack_linears(layer)
    assert layer.packed_weight is not None
    layer.half()
    pack_linears(layer)
    assert layer.packed_weight is None


def test_the_op_compiles_into_a_static_graph():
    # (torch.library.opcheck cannot run this op: it reads tensor storages, and a packed weight is an
    # opaque oneDNN tensor; compiling runs the fake kernel on it.)
    layer = packed(64, 48, torch.bfloat16)
    x = torch.randn(2, 3, 64).bfloat16()
    with torch.no_grad():
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)(x)
    assert compiled.shape == (2, 3, 48)
    torch.testing.assert_close(compiled, eager)
