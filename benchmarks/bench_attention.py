"""Microbenchmark of cached_attention: decode attention over a static KV cache, by the context used.

    python benchmarks/bench_attention.py [--shape smollm2|qwen3-8b] [--batch 1 8] [--tokens 1 4]
        [--context 512 8192] [--cache 8192] [--dtypes fp32 bf16] [--check] [--no-compile] [--json PATH]

Each request's T query tokens sit at the last positions of a context of --context tokens in a
cache of max(--cache, context) slots per request. Baselines, timed in the same run: the masked
SDPA composition the models used before this op (``F.scaled_dot_product_attention`` over the
whole cache with a position mask, gpt-fast's way) and ``torch.compile`` of it. Bytes: the K and V
of the used context, the queries and the output (what a kernel must move). --check compares the
op with the composition.
"""

import argparse
import sys

import torch
import torch.nn.functional as F
from common import CHECK_TOLERANCE, Row, add_common_args, compiled, finish, time_fn

import qspec_ext

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHAPES = {"smollm2": (9, 3, 64), "qwen3-8b": (32, 8, 128)}  # heads_q, heads_kv, head_dim


def masked_sdpa(query, k_cache, v_cache, positions, scale):
    batch, _, _, head_dim = query.shape
    length, kv_heads = k_cache.shape[0] // batch, k_cache.shape[1]
    keys = k_cache.view(batch, length, kv_heads, head_dim).transpose(1, 2)
    values = v_cache.view(batch, length, kv_heads, head_dim).transpose(1, 2)
    mask = torch.arange(length, device=query.device) <= positions[:, None, :, None]
    out = F.scaled_dot_product_attention(query.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default=None,
                        help="attention shape (default: smollm2 on CPU, qwen3-8b on CUDA)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4], help="query tokens per request (k+1)")
    parser.add_argument("--context", type=int, nargs="+", default=None,
                        help="used context (default 512 8192 on CPU, 1024 8192 32768 on CUDA)")
    parser.add_argument("--cache", type=int, default=8192, help="slots per request allocated (at least the context)")
    parser.add_argument("--dtypes", nargs="+", default=None, choices=list(DTYPES),
                        help="default fp32 bf16 on CPU, bf16 on CUDA")
    add_common_args(parser)
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    shape = args.shape or ("qwen3-8b" if cuda else "smollm2")
    heads_q, heads_kv, head_dim = SHAPES[shape]
    contexts = args.context or ([1024, 8192, 32768] if cuda else [512, 8192])
    dtypes = args.dtypes or (["bf16"] if cuda else ["fp32", "bf16"])
    rows, failures = [], 0
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        elt = torch.tensor([], dtype=dtype).element_size()
        for batch in args.batch:
            for tokens in args.tokens:
                for context in contexts:
                    length = max(args.cache, context)
                    g = torch.Generator(device=args.device).manual_seed(0)
                    randn = lambda *s: torch.randn(*s, generator=g, device=args.device).to(dtype)  # noqa: E731
                    query = randn(batch, tokens, heads_q, head_dim)
                    k_cache, v_cache = randn(batch * length, heads_kv, head_dim), randn(batch * length, heads_kv, head_dim)
                    positions = torch.arange(context - tokens, context, device=args.device).expand(batch, tokens)
                    positions = positions.contiguous()
                    scale = head_dim**-0.5
                    if args.check:
                        got = qspec_ext.ops.cached_attention(query, k_cache, v_cache, positions, scale)
                        expected = masked_sdpa(query, k_cache, v_cache, positions, scale)
                        tol = CHECK_TOLERANCE[dtype] * 4  # two different fp32 summation orders
                        if not torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol):
                            failures += 1
                            print(f"CHECK FAILED: {dtype_name} B={batch} T={tokens} context={context}")
                    moved = (2 * batch * context * heads_kv * head_dim + 2 * query.numel()) * elt
                    composition = (query, k_cache, v_cache, positions, scale)
                    baselines = {"masked_sdpa": time_fn(lambda: masked_sdpa(*composition), args.device, args.min_time)}
                    if not args.no_compile:
                        fn = compiled(masked_sdpa)
                        baselines["compile"] = time_fn(lambda: fn(*composition), args.device, args.min_time)
                    ours = time_fn(lambda: qspec_ext.ops.cached_attention(*composition), args.device, args.min_time)
                    label = f"B={batch} T={tokens} ctx={context} cache={length}"
                    rows.append(Row(f"cached_attention[{shape}]", dtype_name, label, moved, ours, baselines))
                    print(f"  {dtype_name} {label}: {ours.median_us:.1f} us", file=sys.stderr, flush=True)
    return finish(f"qspec_ext cached decode attention ({shape}: {heads_q} q heads, {heads_kv} kv heads, "
                  f"head_dim {head_dim})", rows, args, failures)


if __name__ == "__main__":
    sys.exit(main())
