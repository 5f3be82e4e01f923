"""decoder_layer_: one pre-norm decoder layer in one call, against the reference composition
(dense and packed weights, with and without q/k norms, chains with padding and draft trees, the
caches it writes), opcheck, compile, the native target on it, bad input."""

import pytest
import torch
from conftest import assert_close

from qspec_ext import ops, reference
from op_cases import LENGTH, layer_args


def cloned(args: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def run_both(args: dict) -> tuple[dict, dict]:
    got, expected = cloned(args), cloned(args)
    with torch.no_grad():
        ops.decoder_layer_(**got)
        reference.decoder_layer_(**expected)
    return got, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("tree", [False, True])
def test_matches_the_reference_composition(device, dtype, packed, qk_norm, tree):
    if packed and device != "cpu":
        pytest.skip("packed weights are the CPU's inference path")
    args = layer_args(device, dtype, packed=packed, qk_norm=qk_norm, tree=tree)
    got, expected = run_both(args)
    for name in ("hidden", "residual", "k_cache", "v_cache"):
        assert_close(got[name], expected[name])
    # It changed what it updates: the stream, and the caches at the written slots only.
    assert not torch.equal(got["hidden"], args["hidden"]) and not torch.equal(got["residual"], args["residual"])
    written = args["slots"][args["slots"] >= 0]
    unwritten = torch.ones(args["k_cache"].shape[0], dtype=torch.bool, device=device)
    unwritten[written] = False
    assert torch.equal(got["k_cache"][unwritten], args["k_cache"][unwritten])
    assert not torch.equal(got["k_cache"][written], args["k_cache"][written])


def test_the_residual_is_the_stream_entering_the_mlp(device):
    # residual' = residual + hidden + attention: with zero o_weight the attention adds nothing.
    args = layer_args(device, torch.float32)
    args["o_weight"] = torch.zeros_like(args["o_weight"])
    stream = args["hidden"] + args["residual"]
    got, _ = run_both(args)
    assert_close(got["residual"], stream)


def packed_tokens(args: dict, rows: list[int]) -> dict:
    """The same call on the tokens at grid rows ``rows`` only (token_rows)."""
    index = torch.tensor(rows, device=args["hidden"].device)
    per_token = {name: args[name][index] for name in ("hidden", "residual", "rope_positions", "slots")}
    return dict(cloned(args), **per_token, token_rows=index)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_tokens_match_their_rows_of_the_grid(device, dtype):
    """token_rows (a prefill without its padding): the tokens' new stream and the caches are the
    grid call's, for the op and for the reference; the padding row (grid row 2: the first request
    one token shorter) is not run."""
    args = layer_args(device, dtype)
    positions = torch.tensor([[5, 6, -1], [9, 10, 11]], device=device)
    start = torch.arange(2, device=device)[:, None] * LENGTH
    args.update(positions=positions, rope_positions=positions.reshape(-1).clamp(min=0),
                slots=torch.where(positions >= 0, start + positions, -1).reshape(-1))
    grid, grid_reference = run_both(args)
    rows = [0, 1, 3, 4, 5]
    packed = packed_tokens(args, rows)
    got, expected = cloned(packed), cloned(packed)
    with torch.no_grad():
        ops.decoder_layer_(**got)
        reference.decoder_layer_(**expected)
    for name in ("hidden", "residual"):
        assert_close(got[name], grid[name][rows])
        assert_close(expected[name], grid_reference[name][rows])
    for name in ("k_cache", "v_cache"):
        assert_close(got[name], grid[name])
        assert_close(expected[name], grid_reference[name])


def output_rows_only(args: dict, rows: list[int], positions: list[int]) -> dict:
    """The same call, finishing only hidden's rows ``rows`` (one per request) at ``positions``."""
    device = args["hidden"].device
    return dict(cloned(args), token_rows=args.get("token_rows"), output_rows=torch.tensor(rows, device=device),
                output_positions=torch.tensor(positions, device=device)[:, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_output_rows_finish_only_those_rows(device, dtype, packed):
    """output_rows (a prefill's last layer): those rows of hidden and residual are the full call's,
    the caches too; the other rows stay half-way (hidden the input norm, residual the stream), for
    the op and the reference, on the grid and on packed tokens."""
    args = layer_args(device, dtype)
    full, full_reference = run_both(args)
    # Each request's last token: grid rows 2 and 4 (the second request's last is padding), or
    # packed rows 2 and 4 of grid rows [0, 1, 2, 3, 4].
    call = packed_tokens(args, [0, 1, 2, 3, 4]) if packed else args
    only = output_rows_only(call, [2, 4], [7, 10])
    got, expected = cloned(only), cloned(only)
    with torch.no_grad():
        ops.decoder_layer_(**got)
        reference.decoder_layer_(**expected)
    for result, whole in ((got, full), (expected, full_reference)):
        for name in ("hidden", "residual"):
            assert_close(result[name][[2, 4]], whole[name][[2, 4]])
        for name in ("k_cache", "v_cache"):
            assert_close(result[name], whole[name])
        stream = (call["hidden"].float() + call["residual"].float()).to(dtype)
        others = [0, 1, 3]
        assert_close(result["residual"][others], stream[others])
        assert_close(result["hidden"][others], reference.rms_norm(stream, call["input_norm"], 1e-6)[others])


def test_opcheck_and_compile(device):
    args = layer_args(device, torch.float32)
    torch.library.opcheck(torch.ops.qspec_ext.decoder_layer_.default, tuple(cloned(args).values()))
    torch.library.opcheck(torch.ops.qspec_ext.decoder_layer_.default,
                          tuple(packed_tokens(args, [0, 2, 3, 4]).values()))
    torch.library.opcheck(torch.ops.qspec_ext.decoder_layer_.default,
                          tuple(output_rows_only(args, [2, 4], [7, 10]).values()))
    if device == "cpu":
        packed = layer_args(device, torch.bfloat16, packed=True)
        torch.library.opcheck(torch.ops.qspec_ext.decoder_layer_.default, tuple(cloned(packed).values()))

    def layer(a: dict) -> torch.Tensor:
        ops.decoder_layer_(**a)
        return a["hidden"] * 2

    compiled_args, eager_args = cloned(args), cloned(args)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    assert_close(compiled(compiled_args), layer(eager_args))
    assert_close(compiled_args["k_cache"], eager_args["k_cache"])


@pytest.mark.parametrize("change,message", [
    (dict(hidden=torch.randn(6, 48, 1)), "argument 'hidden' must be 2-D [tokens, hidden_size], got [6, 48, 1]"),
    (dict(residual=torch.randn(6, 47)), "argument 'residual' must match hidden [6, 48]"),
    (dict(positions=torch.tensor([[5, 6], [9, 10]])), "argument 'positions' must be [batch, tokens] with batch * tokens"
                                                      " = hidden's 6 rows, got [2, 2]"),
    (dict(o_weight=torch.randn(48, 63)), "argument 'o_weight' must be [48, 64] (or packed, 4-D), got [48, 63]"),
    (dict(intermediate_size=0), "argument 'intermediate_size' must be positive, got 0"),
    (dict(o_weight=torch.randn(48, 64).double()), "argument 'o_weight' must have hidden's dtype Float and device cpu, "
                                                  "got Double on cpu"),
])
def test_bad_input_names_the_op_and_the_argument(change, message):
    args = dict(layer_args("cpu", torch.float32), **change)
    with pytest.raises(RuntimeError, match="decoder_layer_") as error:
        ops.decoder_layer_(**args)
    assert message in str(error.value)


@pytest.mark.parametrize("rows,message", [
    (torch.tensor([0, 1, 2, 3], dtype=torch.int32), "argument 'token_rows' must be int64 [5] (hidden's rows) on cpu, "
                                                    "got Int [4]"),
    (torch.tensor([0, 2, 1, 3, 4]), "argument 'token_rows' must be increasing rows of the [batch * tokens] = 6 grid "
                                    "of positions, got 1 at index 2"),
    (torch.tensor([0, 1, 2, 3, 6]), "grid of positions, got 6 at index 4"),
    (torch.tensor([-1, 1, 2, 3, 4]), "grid of positions, got -1 at index 0"),
])
def test_bad_token_rows_name_the_op_and_the_argument(rows, message):
    args = packed_tokens(layer_args("cpu", torch.float32), [0, 1, 2, 3, 4])
    with pytest.raises(RuntimeError, match="decoder_layer_") as error:
        ops.decoder_layer_(**dict(args, token_rows=rows))
    assert message in str(error.value)


@pytest.mark.parametrize("change,message", [
    (dict(output_positions=None), "argument 'output_positions' must be given with output_rows, got None"),
    (dict(output_rows=None), "argument 'output_rows' must be given with output_positions, got None"),
    (dict(output_rows=torch.tensor([2, 4], dtype=torch.int32)), "argument 'output_rows' must be int64 [rows] on cpu, "
                                                                "got Int [2]"),
    (dict(output_rows=torch.tensor([2, 6])), "argument 'output_rows' must be rows of hidden, in [0, 6), got 6 at "
                                             "index 1"),
    (dict(output_rows=torch.tensor([-1, 4])), "in [0, 6), got -1 at index 0"),
    (dict(output_positions=torch.tensor([[7, 10]])), "argument 'output_positions' must be Long [2, 1] (output_rows' 2 "
                                                     "tokens in 2 requests), got Long [1, 2]"),
    (dict(output_positions=torch.tensor([[7], [10]], dtype=torch.int32)), "got Int [2, 1]"),
])
def test_bad_output_rows_name_the_op_and_the_argument(change, message):
    args = dict(output_rows_only(layer_args("cpu", torch.float32), [2, 4], [7, 10]), **change)
    with pytest.raises(RuntimeError, match="decoder_layer_") as error:
        ops.decoder_layer_(**args)
    assert message in str(error.value)


def test_output_rows_are_for_chains():
    args = output_rows_only(layer_args("cpu", torch.float32, tree=True), [2, 4], [7, 10])
    with pytest.raises(RuntimeError, match="argument 'output_rows' is for chains, not draft trees"):
        ops.decoder_layer_(**args)
