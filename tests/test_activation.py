"""silu_and_mul: the kernels against the pure-PyTorch reference (dtypes, shapes, strided rows,
widths that no vector divides, saturating gates), opcheck, compile, the models' MLP, bad input."""

import pytest
import torch
from conftest import assert_close

from qspec_ext import ops, reference
from qspec_ext.models.layers import MLP


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2), (5, 2 * 37), (3, 4, 2 * 1536), (2 * 64,), (0, 8)])
def test_silu_and_mul_matches_the_reference(device, dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = (4 * torch.randn(*shape, generator=g)).to(dtype).to(device)
    got = ops.silu_and_mul(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.is_contiguous() and got.dtype == dtype
    assert_close(got, reference.silu_and_mul(x))


def test_gates_that_saturate_the_exponential(device):
    gate = torch.tensor([-1e4, -100.0, -88.5, -88.2, -87.5, -20.0, 0.0, 20.0, 88.5, 100.0, 1e4, 1.0])
    up = torch.linspace(-3, 3, gate.numel())
    x = torch.cat([gate, up])[None].to(device)
    got = ops.silu_and_mul(x)
    assert torch.isfinite(got).all()
    assert_close(got, reference.silu_and_mul(x))


def test_strided_rows(device):
    wide = torch.randn(6, 2 * 48 + 5, device=device)  # rows of a wider buffer: a row stride past the width
    x = wide[:, : 2 * 48]
    assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x))
    unaligned = wide[:, 1 : 1 + 2 * 48]  # rows that no vector width divides the start of
    assert_close(ops.silu_and_mul(unaligned), reference.silu_and_mul(unaligned))


def test_the_mlp_on_the_op_equals_the_mlp_on_the_reference(device):
    torch.manual_seed(0)
    mlp = MLP(64, 96).to(device)
    x = torch.randn(7, 64, device=device)
    with torch.no_grad():
        assert_close(mlp(x, ops), mlp(x))


def test_opcheck_and_compile(device):
    x = torch.randn(3, 5, 2 * 40, device=device)
    torch.library.opcheck(torch.ops.qspec_ext.silu_and_mul.default, (x,))
    compiled = torch.compile(lambda t: ops.silu_and_mul(t) * 2, fullgraph=True, dynamic=False)
    assert_close(compiled(x), ops.silu_and_mul(x) * 2)


@pytest.mark.parametrize("x,message", [
    (torch.randn(3, 7), "must have an even last dimension (the gate half, then the up half), got shape [3, 7]"),
    (torch.randn(8, 4).T, "argument 'input' must have a contiguous last dimension"),
    (torch.ones(3, 4, dtype=torch.int64), "argument 'input' must be"),
    (torch.tensor(1.0), "argument 'input' must have at least 1 dimension"),
])
def test_bad_input_names_the_argument(x, message):
    with pytest.raises(RuntimeError, match="qspec_ext.silu_and_mul: argument 'input'") as error:
        ops.silu_and_mul(x)
    assert message in str(error.value)
