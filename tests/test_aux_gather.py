"""gather_aux_hidden(_out) against the reference, and the capture side (AuxHiddenCapture)."""

import itertools
import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, assert_close, assert_cuda_script_fails_with

import qspec_ext
from qspec_ext import reference as ref
from op_cases import make_inputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MODES = ["none", "fc_norm", "norm_before_fc"]


def grid():
    cases = []
    rows_cycle = itertools.cycle([1, 5, 300])
    for i, (n, hidden, mode, dtype) in enumerate(itertools.product([1, 3, 4], [64, 4096, 5120], MODES, DTYPES)):
        cases.append(dict(n=n, hidden=hidden, rows=next(rows_cycle), dtype=dtype, mode=mode, residual=i % 2 == 1,
                          strided=i % 3 == 2, weight_f32=i % 4 != 3,
                          index_dtype=torch.int32 if i % 5 == 0 else torch.int64))
    return cases


CASES = grid()


def case_id(c):
    return "-".join([f"n{c['n']}", f"H{c['hidden']}", f"N{c['rows']}", str(c["dtype"]).split(".")[-1], c["mode"]]
                    + [k for k in ("residual", "strided") if c[k]])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gather_aux_hidden(device, case):
    aux, indices, res, weight = make_inputs(device=device, **case)
    out = qspec_ext.gather_aux_hidden(aux, indices, res, case["mode"], weight, 1e-6)
    expected = ref.gather_aux_hidden(aux, indices, res, case["mode"], weight, 1e-6)
    assert out.shape == (case["rows"], case["n"] * case["hidden"]) and out.dtype == case["dtype"]
    assert_close(out, expected)
    assert torch.all(out[indices < 0] == 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_aux_hidden_out_into_strided_buffer(device, mode, dtype):
    aux, indices, res, weight = make_inputs(3, 256, 17, dtype, device, mode, residual=True)
    buffer = torch.full((17, 3 * 256 + 8), 5.0, dtype=dtype, device=device)
    out = buffer[:, :-8]
    qspec_ext.gather_aux_hidden_out(aux, indices, out, res, mode, weight, 1e-5)
    assert_close(out, ref.gather_aux_hidden(aux, indices, res, mode, weight, 1e-5))
    assert torch.all(buffer[:, -8:] == 5.0), "columns past the view must be untouched"
    assert torch.all(out[indices < 0] == 0)


def test_fc_norm_matches_speculators_style(device):
    """EAGLE 3.1 fc_norm: each aux feature normalized by its own RMSNorm, then concatenated."""
    aux, indices, _, weight = make_inputs(3, 128, 9, torch.float32, device, "fc_norm", padding=False)
    rows = indices.long()
    expected = torch.cat([F.rms_norm(a[rows], (128,), w, 1e-6) for a, w in zip(aux, weight)], dim=-1)
    out = qspec_ext.gather_aux_hidden(aux, indices, None, "fc_norm", weight, 1e-6)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_norm_before_fc_is_one_norm_over_the_concat(device):
    aux, indices, _, weight = make_inputs(3, 128, 9, torch.float32, device, "norm_before_fc", padding=False)
    concat = torch.cat([a[indices] for a in aux], dim=-1)
    expected = F.rms_norm(concat, (3 * 128,), weight, 1e-6)
    out = qspec_ext.gather_aux_hidden(aux, indices, None, "norm_before_fc", weight, 1e-6)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_no_norm_is_plain_concat(device):
    aux, indices, res, _ = make_inputs(4, 64, 12, torch.bfloat16, device, "none", residual=True, padding=False)
    expected = torch.cat([(a[indices].float() + r[indices].float()).to(torch.bfloat16) for a, r in zip(aux, res)], -1)
    assert torch.equal(qspec_ext.gather_aux_hidden(aux, indices, res), expected)


def test_empty_indices(device):
    aux, _, _, _ = make_inputs(3, 64, 4, torch.float32, device, "none")
    out = qspec_ext.gather_aux_hidden(aux, torch.empty(0, dtype=torch.long, device=device))
    assert out.shape == (0, 192)


@pytest.mark.parametrize("mode", MODES)
def test_opcheck(device, mode):
    aux, indices, res, weight = make_inputs(3, 64, 6, torch.bfloat16, device, mode, residual=mode == "fc_norm")
    args = (aux, indices, res, mode, weight, 1e-6)
    torch.library.opcheck(torch.ops.qspec_ext.gather_aux_hidden.default, args)
    out = torch.empty(6, 192, dtype=torch.bfloat16, device=device)
    torch.library.opcheck(torch.ops.qspec_ext.gather_aux_hidden_out.default, (*args, out))


def test_torch_compile_fullgraph(device):
    aux, indices, res, weight = make_inputs(3, 64, 6, torch.float32, device, "fc_norm", residual=True)
    out = torch.empty(6, 192, device=device)

    def step(a0, a1, a2, r0, r1, r2, idx, out):
        fc_in = qspec_ext.gather_aux_hidden([a0, a1, a2], idx, [r0, r1, r2], "fc_norm", weight)
        qspec_ext.gather_aux_hidden_out([a0, a1, a2], idx, out, None, "none")
        return fc_in * 2

    eager_out = out.clone()
    expected = step(*aux, *res, indices, eager_out)
    got = torch.compile(step, fullgraph=True)(*aux, *res, indices, out)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    torch.testing.assert_close(out, eager_out, atol=0, rtol=0)


# ----------------------------------------------------------------------------- bad input

BAD = [
    (dict(aux=[]), r"argument 'aux' must hold 1 to 8 tensors, got 0"),
    (dict(aux="nine"), r"argument 'aux' must hold 1 to 8 tensors, got 9"),
    (dict(aux="shape"), r"argument 'aux\[1\]' must have the shape of aux\[0\] \[10, 64\], got \[10, 32\]"),
    (dict(aux="dtype"), r"argument 'aux\[2\]' must have the dtype of aux\[0\] \(Float\), got Half"),
    (dict(aux="rank"), r"argument 'aux\[0\]' must have shape \[num_tokens, hidden_size\], got \[10, 64, 1\]"),
    (dict(residual="count"), r"argument 'residual' must hold one tensor per aux tensor \(3\), got 2"),
    (dict(residual="shape"), r"argument 'residual\[0\]' must have the shape of aux\[0\] \[10, 64\], got \[9, 64\]"),
    (dict(norm_mode="layer_norm"), r"argument 'norm_mode' must be \"none\", \"fc_norm\" or \"norm_before_fc\", got \"layer_norm\""),
    (dict(norm_mode="fc_norm", norm_weight="flat"), r"argument 'norm_weight' must have shape \[n, hidden_size\] = \[3, 64\] for norm_mode \"fc_norm\", got \[192\]"),
    (dict(norm_mode="norm_before_fc", norm_weight="2d"), r"argument 'norm_weight' must have shape \[n \* hidden_size\] = \[192\] for norm_mode \"norm_before_fc\", got \[3, 64\]"),
    (dict(norm_mode="fc_norm"), r"argument 'norm_weight' is required for norm_mode \"fc_norm\""),
    (dict(norm_weight="2d"), r"argument 'norm_weight' must be None for norm_mode \"none\""),
    (dict(indices=torch.tensor([0, 10])), r"argument 'indices' must hold values in \[-1, 10\) \(source rows, -1 = padding\), got 10 at index 1"),
    (dict(indices=torch.tensor([-2, 1])), r"argument 'indices' must hold values in \[-1, 10\).* got -2 at index 0"),
    (dict(indices=torch.tensor([0.0])), r"argument 'indices' must be int32 or int64, got Float"),
    (dict(indices=torch.zeros(2, 2, dtype=torch.long)), r"argument 'indices' must have shape \[num_rows\], got \[2, 2\]"),
    (dict(indices=torch.tensor([0, 5, 3, 1])[::2]), r"argument 'indices' must be contiguous, got strides \[2\]"),
    (dict(norm_mode="norm_before_fc", norm_weight=torch.ones(384)[::2]), r"argument 'norm_weight' must be contiguous"),
]


def resolve_bad(change):
    aux = [torch.randn(10, 64) for _ in range(3)]
    args = dict(aux=aux, indices=torch.tensor([0, 3]), residual=None, norm_mode="none", norm_weight=None)
    special = {
        ("aux", "nine"): lambda: [torch.randn(10, 64)] * 9,
        ("aux", "shape"): lambda: [aux[0], torch.randn(10, 32), aux[2]],
        ("aux", "dtype"): lambda: [aux[0], aux[1], aux[2].half()],
        ("aux", "rank"): lambda: [a[..., None] for a in aux],
        ("residual", "count"): lambda: aux[:2],
        ("residual", "shape"): lambda: [a[:9] for a in aux],
        ("norm_weight", "flat"): lambda: torch.ones(192),
        ("norm_weight", "2d"): lambda: torch.ones(3, 64),
    }
    for key, value in change.items():
        args[key] = special[(key, value)]() if isinstance(value, str) and (key, value) in special else value
    return args


@pytest.mark.parametrize("change,message", BAD)
def test_bad_input(change, message):
    with pytest.raises(RuntimeError, match=r"qspec_ext\.gather_aux_hidden: " + message):
        qspec_ext.gather_aux_hidden(**resolve_bad(change))


def test_bad_out_buffer():
    aux = [torch.randn(10, 64) for _ in range(3)]
    idx = torch.tensor([0, 3])
    with pytest.raises(RuntimeError, match=r"qspec_ext\.gather_aux_hidden_out: argument 'out' must have shape \[num_rows, n \* hidden_size\] = \[2, 192\], got \[2, 191\]"):
        qspec_ext.gather_aux_hidden_out(aux, idx, torch.empty(2, 191))
    with pytest.raises(RuntimeError, match=r"qspec_ext\.gather_aux_hidden_out: argument 'out' must have the dtype of aux \(Float\), got BFloat16"):
        qspec_ext.gather_aux_hidden_out(aux, idx, torch.empty(2, 192, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"qspec_ext\.gather_aux_hidden_out: argument 'out' must have a contiguous last dimension"):
        qspec_ext.gather_aux_hidden_out(aux, idx, torch.empty(192, 2).t())
    with pytest.raises(RuntimeError, match=r"qspec_ext\.gather_aux_hidden_out: argument 'out' is written in place and must not have overlapping rows"):
        qspec_ext.gather_aux_hidden_out(aux, idx, torch.empty(1, 192).expand(2, 192))


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
def test_device_mismatch():
    aux = [torch.randn(10, 64, device="cuda") for _ in range(3)]
    with pytest.raises(RuntimeError, match=r"argument 'aux\[1\]' must be on cuda:0, got cpu"):
        qspec_ext.gather_aux_hidden([aux[0], aux[1].cpu(), aux[2]], torch.tensor([0], device="cuda"))
    with pytest.raises(RuntimeError, match=r"argument 'indices' must be on cuda:0, got cpu"):
        qspec_ext.gather_aux_hidden(aux, torch.tensor([0]))


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
def test_cuda_out_of_range_index_fails_loudly():
    assert_cuda_script_fails_with(
        """
        import torch, qspec_ext
        aux = [torch.randn(10, 64, device="cuda") for _ in range(3)]
        qspec_ext.gather_aux_hidden(aux, torch.tensor([0, 10], device="cuda"))
        torch.cuda.synchronize()
        """,
        "qspec_ext.gather_aux_hidden: indices[1] = 10 outside [-1, num_tokens=10)",
    )


# ----------------------------------------------------------------------------- capture side


@pytest.mark.parametrize(
    "layers,expected",
    [(28, [2, 14, 25]), (36, [2, 18, 33]), (40, [2, 20, 37]), (64, [2, 32, 61]), (94, [2, 47, 91]), (6, [2, 3])],
)
def test_default_aux_layer_ids(layers, expected):
    assert qspec_ext.default_aux_layer_ids(layers) == expected


@pytest.mark.parametrize("layers,expected", [(1, [0]), (2, [1]), (3, [0, 1, 2]), (4, [1, 2]), (5, [2])])
def test_default_aux_layer_ids_small_models_warn(layers, expected, caplog):
    with caplog.at_level(logging.WARNING, logger="qspec_ext.capture"):
        ids = qspec_ext.default_aux_layer_ids(layers)
    assert ids == expected
    assert all(0 <= i < layers for i in ids) and ids == sorted(set(ids))
    assert "do not fit" in caplog.text


def test_capture_hf_model_matches_output_hidden_states():
    import transformers
    config = transformers.Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    capture = qspec_ext.AuxHiddenCapture.attach(model, [1, 3, 6])
    tokens = torch.randint(0, 97, (2, 5))
    with torch.no_grad():
        out = model(tokens, output_hidden_states=True)
    hidden, residual, packed_row = capture.features()
    assert residual is None and packed_row is None
    torch.testing.assert_close(hidden[0], out.hidden_states[1].reshape(10, 64))
    torch.testing.assert_close(hidden[1], out.hidden_states[3].reshape(10, 64))
    # Id N is the last layer's output before the final norm, unlike HF's hidden_states[N].
    assert not torch.allclose(hidden[2], out.hidden_states[6].reshape(10, 64))
    last_before_norm = hidden[2]
    torch.testing.assert_close(model.model.norm(last_before_norm), out.hidden_states[6].reshape(10, 64))
    idx = torch.tensor([9, 0, -1])
    fc_in = capture.gather(idx)
    expected = torch.cat([out.hidden_states[1], out.hidden_states[3], last_before_norm.view(2, 5, 64)], -1).reshape(10, -1)
    torch.testing.assert_close(fc_in[:2], expected[[9, 0]])
    assert torch.all(fc_in[2] == 0)
    capture.detach()
    capture.clear()
    with torch.no_grad():
        model(tokens)
    with pytest.raises(RuntimeError, match=r"no feature recorded for aux layers \[1, 3, 6\]"):
        capture.features()


def test_features_with_fused_residual_add_it():
    h = [torch.randn(2, 3, 16) for _ in range(3)]
    r = [torch.randn(2, 3, 16) for _ in range(3)]
    features = qspec_ext.AuxFeatures.of([0, 2], [(layer, h[layer], r[layer]) for layer in range(3)])
    out = features.gather(torch.tensor([4, 1]), out=torch.empty(2, 32))
    expected = torch.cat([(h[0] + r[0]).view(6, 16), (h[2] + r[2]).view(6, 16)], -1)[[4, 1]]
    torch.testing.assert_close(out, expected)
