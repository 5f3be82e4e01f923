"""The CPU kernels' work split: every op gives the same bits on two threads as on one.

The rest of the suite may run on one thread per pytest-xdist worker, where at::parallel_for hands
a kernel its whole range at once; these cases are sized so that two threads each get a part (more
than one grain of 2^16 elements), and a kernel that ignored its part's bounds would differ.
"""

import pytest
import torch

import qspec_ext.ops as qops
from qspec_ext.models.linear import pack_weight
from qspec_ext.rope import rope_cos_sin_cache


def rms_norm(dtype):
    x, w = torch.randn(64, 4096, dtype=dtype), torch.randn(4096, dtype=dtype)
    return lambda: [qops.rms_norm(x, w)]


def fused_add_rms_norm(dtype):
    x, r, w = torch.randn(64, 4096, dtype=dtype), torch.randn(64, 4096, dtype=dtype), torch.randn(4096, dtype=dtype)

    def run():
        xs, rs = x.clone(), r.clone()
        qops.fused_add_rms_norm_(xs, rs, w)
        return [xs, rs]

    return run


def eagle3_input_norm(dtype):
    e, h = torch.randn(64, 1024, dtype=dtype), torch.randn(64, 3 * 1024, dtype=dtype)
    we, wh = torch.randn(1024, dtype=dtype), torch.randn(1024, dtype=dtype)
    return lambda: list(torch.ops.qspec_ext.eagle3_input_norm(e, h[:, :1024], we, wh, 1e-6, False))


def qk_norm_rope(dtype):
    tokens, hq, hkv, d = 256, 8, 2, 64
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, dtype=dtype)
    qw, kw = torch.randn(d, dtype=dtype), torch.randn(d, dtype=dtype)
    cache = rope_cos_sin_cache(512, d, 10000.0)
    positions = torch.randint(0, 512, (tokens,))
    slots = torch.randperm(tokens)

    def run():
        out, k, v = qkv.clone(), torch.zeros(tokens, hkv, d, dtype=dtype), torch.zeros(tokens, hkv, d, dtype=dtype)
        qops.qk_norm_rope_(out, qw, kw, cache, positions, hq, hkv, d, k_cache=k, v_cache=v, slot_mapping=slots)
        return [out, k, v]

    return run


def silu_and_mul(dtype):
    x = torch.randn(64, 2 * 2048, dtype=dtype)
    return lambda: [qops.silu_and_mul(x)]


def gather_aux_hidden(dtype):
    aux = [torch.randn(96, 1024, dtype=dtype) for _ in range(3)]
    residual = [torch.randn(96, 1024, dtype=dtype) for _ in range(3)]
    indices, w = torch.randperm(96)[:80], torch.randn(3, 1024, dtype=dtype)
    return lambda: [qops.gather_aux_hidden(aux, indices, residual, "fc_norm", w)]


def packed_linear(dtype):
    x, w = torch.randn(16, 512, dtype=dtype), torch.randn(1000, 512, dtype=dtype)
    packed = pack_weight(w)
    return lambda: [qops.packed_linear(x, packed, 1000), qops.packed_linear(x[:1], packed, 1000)]


def cached_attention(dtype):
    # One request of 203 keys: split in two (128 keys at least a split) on one thread or two.
    batch, length, hq, hkv, d = 1, 256, 16, 2, 64
    query = torch.randn(batch, 4, hq, d, dtype=dtype)
    k, v = torch.randn(batch * length, hkv, d, dtype=dtype), torch.randn(batch * length, hkv, d, dtype=dtype)
    positions = torch.tensor([[200, 201, 202, -1]])
    return lambda: [qops.cached_attention(query, k, v, positions, d**-0.5),
                    qops.cached_attention(query[:, :1], k, v, positions[:, :1], d**-0.5)]


def verify(dtype):
    batch, k, vocab = 8, 4, 4096
    logits = torch.randn(batch, k + 1, vocab, dtype=dtype)
    drafts = logits[:, :k].argmax(-1)
    drafts[::3, 2] = 0  # some requests reject a draft
    temperature, seed, offset = torch.full((batch,), 0.8), torch.arange(batch), torch.zeros(batch, dtype=torch.int64)
    parents = torch.tensor([[0, 0, 1, 1]]).repeat(batch, 1)
    return lambda: [*qops.verify_greedy(drafts, logits),
                    *qops.verify_sampling(drafts, None, logits, temperature, seed, offset),
                    *qops.verify_tree_greedy(drafts, parents, logits),
                    *qops.verify_tree_sampling(drafts, parents, logits, temperature, seed, offset)]


CASES = [rms_norm, fused_add_rms_norm, eagle3_input_norm, qk_norm_rope, silu_and_mul, gather_aux_hidden,
         packed_linear, cached_attention, verify]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__)
def test_two_threads_give_the_bits_of_one(case, dtype):
    run = case(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)
