"""Every op captured in a CUDA graph and replayed on static inputs equals an eager call.

Decode loops capture their steps in CUDA graphs, so no op may synchronize with the host
or bake its inputs' values into the launch. Each case captures one call, replays it on
the captured inputs and again after new values were copied into the same buffers
(in-place ops get their inputs restored first), and compares everything the call returned
or wrote with an eager call on the same values, exactly: same kernel, same inputs.
"""

import pytest
import torch
from op_cases import RopeCase, attention_inputs, layer_args, make_rope_inputs, sampling_case, tree_case
from op_cases import make_inputs as aux_inputs
from op_cases import sampling_args as tree_sampling_args

import qspec_ext  # noqa: F401  (registers the ops)

ops = torch.ops.qspec_ext


def norm_args(op: str, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=g).to(dtype).cuda()

    x, w = randn(7, 4096), randn(4096, dtype=torch.float32)
    if op == "rms_norm":
        return [x, w, 1e-6]
    if op == "fused_add_rms_norm_":
        return [x, randn(7, 4096), w, 1e-6]
    return [x, randn(7, 4096), w, randn(4096), 1e-6, True]  # eagle3_input_norm


def rope_args(kv_cache: bool):
    case = RopeCase(16, 32, 8, 128, 128, torch.bfloat16, True, weight_f32=True, kv_cache=kv_cache)

    def make(seed):
        qkv, args, kv = make_rope_inputs(case, "cuda", seed)
        return [qkv, *args, kv.get("k_cache"), kv.get("v_cache"), kv.get("slot_mapping")]

    return make


def aux_args(seed, out=False):
    aux, indices, residual, weight = aux_inputs(3, 4096, 5, torch.bfloat16, "cuda", "fc_norm", residual=True, seed=seed)
    args = [aux, indices, residual, "fc_norm", weight, 1e-6]
    return args + [torch.full((5, 3 * 4096), 7.0, dtype=torch.bfloat16, device="cuda")] if out else args


def verify_args(seed, sampling, out=False):
    case = {k: v.cuda() if isinstance(v, torch.Tensor) else v
            for k, v in sampling_case(8, 4, 32000, torch.bfloat16, "d2t", seed=seed, draft_vocab=4000).items()}
    keys = ["draft_ids", "draft_probs", "target_logits", "temperature", "seed", "offset", "d2t", "num_draft"]
    args = [case[k] for k in (keys if sampling else ["draft_ids", "target_logits", "num_draft"])]
    return args + [torch.full((8, 5), -7, device="cuda"), torch.full((8,), -7, device="cuda")] if out else args


def tree_args(seed, sampling, out=False):
    drafts, parents, logits = tree_case(8, 24, 32000, torch.bfloat16, seed=seed, branching=3, unused=0.25)
    args = [drafts, parents, logits] + (list(tree_sampling_args(8, seed)) if sampling else [])
    outputs = [torch.full((8, 25), -7), torch.full((8,), -7), torch.full((8, 25), -7)] if out else []
    return [t.cuda() for t in args + outputs]


def attention_args(seed, tree):
    a = attention_inputs(4, 4, 16, 4, 128, 1024, torch.bfloat16, "cuda", seed=seed, scratch=8 if tree else None)
    return [a["query"], a["k_cache"], a["v_cache"], a["positions"], a["scale"], 0, a["tree_start"], a["tree_seen"]]


def silu_args(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7, 2 * 4096, generator=g).to(torch.bfloat16).cuda()]


# (op, case id, inputs for a seed: the op's positional arguments)
CASES = [
    ("rms_norm", "T7-H4096-bf16", lambda s: norm_args("rms_norm", s)),
    ("fused_add_rms_norm_", "T7-H4096-bf16", lambda s: norm_args("fused_add_rms_norm_", s)),
    ("eagle3_input_norm", "T7-H4096-bf16-norm_before_residual", lambda s: norm_args("eagle3_input_norm", s)),
    ("qk_norm_rope_", "qwen3", rope_args(kv_cache=False)),
    ("qk_norm_rope_", "qwen3-kv_cache", rope_args(kv_cache=True)),
    ("gather_aux_hidden", "n3-H4096-N5-fc_norm", aux_args),
    ("gather_aux_hidden_out", "n3-H4096-N5-fc_norm", lambda s: aux_args(s, out=True)),
    ("cached_attention", "B4-T4-Hq16-Hkv4-D128-L1024-bf16", lambda s: attention_args(s, tree=False)),
    ("cached_attention", "B4-T4-Hq16-Hkv4-D128-L1024-bf16-tree", lambda s: attention_args(s, tree=True)),
    ("silu_and_mul", "T7-I4096-bf16", silu_args),
    ("decoder_layer_", "B2-T3-H48-bf16-tree", lambda s: list(layer_args("cuda", torch.bfloat16, tree=True, seed=s).values())),
    ("verify_greedy", "B8-K4-V32000", lambda s: verify_args(s, sampling=False)),
    ("verify_greedy_out", "B8-K4-V32000", lambda s: verify_args(s, sampling=False, out=True)),
    ("verify_sampling", "B8-K4-V32000-d2t", lambda s: verify_args(s, sampling=True)),
    ("verify_sampling_out", "B8-K4-V32000-d2t", lambda s: verify_args(s, sampling=True, out=True)),
    ("verify_tree_greedy", "B8-N24-V32000", lambda s: tree_args(s, sampling=False)),
    ("verify_tree_greedy_out", "B8-N24-V32000", lambda s: tree_args(s, sampling=False, out=True)),
    ("verify_tree_sampling", "B8-N24-V32000", lambda s: tree_args(s, sampling=True)),
    ("verify_tree_sampling_out", "B8-N24-V32000", lambda s: tree_args(s, sampling=True, out=True)),
]


def tensors(x) -> list[torch.Tensor]:
    """The tensors in x (a tensor, None, a scalar or nested lists/tuples of them), in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in tensors(y)]
    return []


def load(static, seed: int, make) -> None:
    for dst, src in zip(tensors(static), tensors(make(seed)), strict=True):
        dst.copy_(src)


def assert_equal(got, expected, what: str) -> None:
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        # The tree cases' logits hold NaN rows on purpose: NaN equals NaN here.
        assert a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all()), \
            f"{what}: tensor {i} of the results and arguments differs from eager"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("op,make", [pytest.param(op, make, id=f"{op}-{name}") for op, name, make in CASES])
def test_graph_replay_equals_eager(op, make):
    fn = getattr(ops, op)
    static = make(0)
    side = torch.cuda.Stream()  # warm up outside the capture stream, as torch.cuda.graphs asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn(*static)
    for seed in (0, 1):  # the captured values, then new ones in the same buffers
        load(static, seed, make)
        graph.replay()
        eager_args = make(seed)
        eager_result = fn(*eager_args)
        torch.cuda.synchronize()
        assert_equal(tensors(result) + tensors(static), tensors(eager_result) + tensors(eager_args),
                     f"{op} replay with inputs of seed {seed}")


def test_every_op_has_a_graph_case():
    registered = {n.removeprefix("qspec_ext::") for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("qspec_ext::")}
    covered = {op for op, _, _ in CASES} | {"packed_linear"}  # CPU only: its packed weights are the CPU inference path
    assert registered - covered == set(), (
        f"ops without a CUDA-graph case in tests/test_cuda_graphs.py: {sorted(registered - covered)}")
    assert covered - registered == set(), f"CUDA-graph cases for ops that are not registered: {sorted(covered - registered)}"
