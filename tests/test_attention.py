"""cached_attention: the kernels against the pure-PyTorch reference (chains, GQA, sliding
windows, draft trees, padding, dtypes, key splits), that they read only the slots a query sees,
opcheck, compile, and bad input."""

import os
import textwrap

import pytest
import torch
from conftest import assert_close
from helpers import run_children, run_here

from qspec_ext import ops, reference
from op_cases import ATTENTION_TOLERANCES, attention_inputs


def check_against_reference(inputs, window=0):
    got = ops.cached_attention(**inputs, window=window)
    expected = reference.cached_attention(**inputs, window=window)
    assert got.shape == inputs["query"].shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, **ATTENTION_TOLERANCES[expected.dtype])
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads_q,heads_kv,head_dim", [(4, 4, 64), (9, 3, 64), (16, 2, 128), (2, 1, 40), (3, 1, 36),
                                                      (2, 2, 6)])
@pytest.mark.parametrize("tokens", [1, 4, 13, 40])
def test_chains_match_the_reference(device, dtype, heads_q, heads_kv, head_dim, tokens):
    inputs = attention_inputs(3, tokens, heads_q, heads_kv, head_dim, 200, dtype, device)
    check_against_reference(inputs)


# Queries per KV head (tokens x heads_q / heads_kv): 16 and 20 take the CPU's query-lane kernel, 3
# and 6 the grouped one (AVX-512).
@pytest.mark.parametrize("window", [1, 5, 64])
@pytest.mark.parametrize("tokens,heads_q", [(4, 8), (1, 6)])
def test_a_sliding_window_matches_the_reference(device, window, tokens, heads_q):
    check_against_reference(attention_inputs(3, tokens, heads_q, 2, 64, 300, torch.float32, device), window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scratch", [1, 6, 24])
@pytest.mark.parametrize("tokens,heads_q", [(5, 8), (2, 6)])
def test_draft_trees_match_the_reference(device, dtype, scratch, tokens, heads_q):
    inputs = attention_inputs(3, tokens, heads_q, 2, 64, 160, dtype, device, scratch=scratch)
    got = check_against_reference(inputs)
    assert (got[1] == 0).all()  # the inactive request


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,heads_q,heads_kv", [(1, 7, 1), (2, 2, 1), (1, 2, 2), (3, 2, 1)])
@pytest.mark.parametrize("head_dim", [16, 80, 256])
def test_decode_queries_match_the_reference(device, dtype, tokens, heads_q, heads_kv, head_dim):
    """Fewer than 8 queries per KV head (decode steps): on AVX-512 the grouped kernel, its groups of
    three queries (7 = 3 + 3 + 1) and its head_dim chunks (256 = 2 x 128, 80 = 64 + 16)."""
    check_against_reference(attention_inputs(3, tokens, heads_q, heads_kv, head_dim, 90, dtype, device))


def test_long_contexts_split_over_keys_and_match_the_reference(device):
    # One request, one KV head: the kernels split its keys over several work items and merge them.
    for contexts in ([3001], [129], [4096]):
        check_against_reference(attention_inputs(1, 2, 4, 1, 64, 4096, torch.float32, device, contexts=contexts))
    check_against_reference(attention_inputs(2, 1, 8, 8, 128, 8192, torch.bfloat16, device, contexts=[8000, 17]))
    check_against_reference(attention_inputs(1, 4, 8, 2, 64, 4096, torch.bfloat16, device, contexts=[3001]))


@pytest.mark.parametrize("heads_q", [4, 8])  # 6 and 12 queries per KV head: both CPU kernels
def test_padding_queries_and_queries_that_see_nothing_give_zeros(device, heads_q):
    inputs = attention_inputs(3, 3, heads_q, 2, 64, 50, torch.float32, device)
    inputs["positions"][0] = -1
    # The output is allocated uninitialized: freed NaNs of its size first, which the allocator
    # hands back to it, so an element the kernel leaves unwritten shows.
    nans = torch.full(inputs["query"].shape, float("nan"), device=device)
    del nans
    got = check_against_reference(inputs)
    assert (got[0] == 0).all() and (got[2, -1] == 0).all()
    tree = attention_inputs(2, 2, heads_q, 2, 64, 50, torch.float32, device, contexts=[0, 0], scratch=3)
    tree["tree_seen"][0, 0] = False  # no context, no scratch slot: nothing seen
    assert (check_against_reference(tree)[0, 0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["chain", "window", "tree"])
@pytest.mark.parametrize("tokens,heads_q,head_dim", [(4, 8, 64), (2, 6, 64), (2, 6, 40)])  # each CPU kernel
def test_only_the_slots_a_query_sees_are_read(device, case, dtype, tokens, heads_q, head_dim):
    """Every slot no query sees holds NaN (K and V): a kernel that read one, even to mask it, would
    return NaN; the result equals the reference on the clean cache."""
    window = 7 if case == "window" else 0
    scratch = 6 if case == "tree" else None
    inputs = attention_inputs(3, tokens, heads_q, 2, head_dim, 256, dtype, device, scratch=scratch)
    expected = reference.cached_attention(**inputs, window=window)
    seen = torch.zeros(3, 256, dtype=torch.bool)
    for b in range(3):
        for t in range(tokens):
            p = int(inputs["positions"][b, t])
            if p < 0:
                continue
            if case == "tree":
                start = int(inputs["tree_start"][b])
                if start < 0:
                    continue
                seen[b, :start] = True
                seen[b, start : start + 6] |= inputs["tree_seen"][b, t].cpu()
            else:
                seen[b, max(0, p - window + 1) if window else 0 : p + 1] = True
    unseen = ~seen.reshape(-1).to(device)
    for cache in (inputs["k_cache"], inputs["v_cache"]):
        cache[unseen] = float("nan")
    got = ops.cached_attention(**inputs, window=window)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, **ATTENTION_TOLERANCES[dtype])


@pytest.mark.parametrize("dtype,switch", [(torch.bfloat16, "QSPEC_CPU_BF16_DOT"), (torch.float32, "QSPEC_CPU_AVX512"),
                                          (torch.bfloat16, "QSPEC_CPU_AVX512")])
def test_both_cpu_kernels_match_the_reference(dtype, switch):
    """Calls with at least 8 queries per KV head take the query-lane kernel: bf16 on a CPU with
    AVX512-BF16 (vdpbf16ps), fp32 on one with AVX-512; fewer (and fp16), with head_dim a multiple
    of 16, the grouped one on AVX-512. A child process with the switch at 0 checks the other
    kernels on the same calls, on any CPU (QSPEC_CPU_AVX512=0: the row kernel for every dtype)."""
    script = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, %r)
        from op_cases import ATTENTION_TOLERANCES, attention_inputs
        from qspec_ext import ops, reference
        dtype = getattr(torch, %r)
        for tokens, heads_q, heads_kv, head_dim, scratch in [(4, 9, 3, 64, None), (40, 9, 3, 64, None),
                                                             (5, 8, 2, 64, 6), (4, 4, 2, 38, None),
                                                             (7, 6, 3, 21, None), (1, 9, 3, 64, None),
                                                             (2, 6, 2, 128, 5), (1, 4, 4, 64, None)]:
            if dtype == torch.bfloat16 and head_dim %% 2:
                continue  # bf16 lanes take element pairs: an odd head_dim stays on the other kernel
            inputs = attention_inputs(3, tokens, heads_q, heads_kv, head_dim, 300, dtype, "cpu", scratch=scratch)
            torch.testing.assert_close(ops.cached_attention(**inputs), reference.cached_attention(**inputs),
                                       **ATTENTION_TOLERANCES[dtype])
        print("ok")
    """ % (os.path.dirname(__file__), str(dtype).removeprefix("torch.")))
    (other,) = run_children(script, [{switch: "0"}])
    assert other.returncode == 0 and other.stdout.split()[-1] == "ok", other.stderr
    assert run_here(script).split()[-1] == "ok"  # the switch as this process has it: on unless set to 0


def test_integer_positions_and_expanded_index_tensors(device):
    inputs = attention_inputs(2, 3, 4, 2, 64, 40, torch.float32, device, scratch=4)
    expected = reference.cached_attention(**inputs)
    inputs["positions"] = inputs["positions"].int()
    inputs["tree_seen"] = inputs["tree_seen"][:, :1].expand(2, 3, 4)  # strided (stride 0)
    assert_close(ops.cached_attention(**inputs), reference.cached_attention(**inputs))
    assert expected.shape == inputs["query"].shape


def test_opcheck_and_compile(device):
    chain = attention_inputs(3, 2, 4, 2, 64, 64, torch.float32, device)
    tree = attention_inputs(3, 2, 4, 2, 64, 64, torch.float32, device, scratch=5)
    for inputs in (chain, tree):
        args = [inputs[k] for k in ("query", "k_cache", "v_cache", "positions", "scale")]
        torch.library.opcheck(torch.ops.qspec_ext.cached_attention.default,
                              (*args, 3, inputs["tree_start"], inputs["tree_seen"]))
    compiled = torch.compile(lambda inputs: ops.cached_attention(**inputs) * 2, fullgraph=True, dynamic=False)
    assert_close(compiled(chain), ops.cached_attention(**chain) * 2)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(query=a["query"][0]), "argument 'query' must have shape [batch, tokens, heads_q, head_dim]"),
    (lambda a: a.update(query=a["query"].transpose(2, 3)), "argument 'query' must have a contiguous last dimension"),
    (lambda a: a.update(k_cache=a["k_cache"].half()), "argument 'k_cache' must have the dtype of query"),
    (lambda a: a.update(v_cache=a["v_cache"][:-1]), "argument 'v_cache' must have the shape of k_cache"),
    (lambda a: a.update(k_cache=a["k_cache"][:-1], v_cache=a["v_cache"][:-1]), "a multiple of batch=3"),
    (lambda a: a.update(k_cache=a["k_cache"][:, :1].expand(-1, 3, -1).contiguous(),
                        v_cache=a["v_cache"][:, :1].expand(-1, 3, -1).contiguous()), "divides heads_q=4"),
    (lambda a: a.update(positions=a["positions"][:2]), "argument 'positions' must have shape [3, 2]"),
    (lambda a: a.update(positions=a["positions"].float()), "argument 'positions' must be int32 or int64"),
    (lambda a: a["positions"].__setitem__((1, 1), 64), "argument 'positions' must hold values in [-1, 64)"),
    (lambda a: a["positions"].__setitem__((0, 0), -2), "argument 'positions' must hold values in [-1, 64)"),
    (lambda a: a.update(window=-1), "argument 'window' must be >= 0"),
    (lambda a: a.update(tree_start=torch.zeros(3, dtype=torch.long)), "'tree_start/tree_seen' must both be given"),
    (lambda a: a.update(tree_start=torch.zeros(3, dtype=torch.long), tree_seen=torch.ones(3, 2, 65, dtype=torch.bool)),
     "scratch size (dim 2) <= max_length=64"),
    (lambda a: a.update(tree_start=torch.full((3,), 64), tree_seen=torch.ones(3, 2, 4, dtype=torch.bool)),
     "argument 'tree_start' must hold values in [-1, 64)"),
    (lambda a: a.update(tree_start=torch.zeros(3, dtype=torch.int32), tree_seen=torch.ones(3, 2, 4, dtype=torch.bool)),
     "argument 'tree_start' must be an int64 tensor"),
])
def test_bad_input_names_the_argument(change, message):
    inputs = attention_inputs(3, 2, 4, 2, 64, 64, torch.float32, "cpu")
    inputs["window"] = 0
    change(inputs)
    with pytest.raises(RuntimeError, match="qspec_ext.cached_attention: argument '") as error:
        ops.cached_attention(**inputs)
    assert message in str(error.value)


def test_the_result_does_not_depend_on_the_cache_allocated(device):
    """The same context in a 64-slot and a 4096-slot cache gives the same output: bit for bit on
    the CPU (one split: the kernel only walks the used slots); on CUDA the number of key splits
    follows the cache allocated (no host sync), so the sums are added in another order."""
    small = attention_inputs(2, 3, 8, 2, 64, 64, torch.float32, device, contexts=[40, 64])
    large = dict(small)
    for name in ("k_cache", "v_cache"):
        grown = torch.randn(2, 4096, 2, 64, device=device)
        grown[:, :64] = small[name].view(2, 64, 2, 64)
        large[name] = grown.view(2 * 4096, 2, 64)
    tolerance = 0 if device == "cpu" else 1e-5
    torch.testing.assert_close(ops.cached_attention(**large), ops.cached_attention(**small), rtol=tolerance,
                               atol=tolerance)
