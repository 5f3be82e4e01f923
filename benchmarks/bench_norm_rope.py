"""Microbenchmark of the attention-prologue ops on Qwen3-8B drafter shapes.

    python benchmarks/bench_norm_rope.py [--tokens 1 16 256 4096] [--dtypes bf16 fp32] [--check] [--json PATH]

Compares, in the same run, the fused op with the eager pure-PyTorch reference
(qspec_ext.reference) and torch.compile of that reference.
"""

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from common import CHECK_TOLERANCE, Row, add_common_args, compiled, finish, restorer, time_fn

import qspec_ext
from qspec_ext import reference as ref

# Qwen3-8B: hidden 4096, 32 q heads, 8 kv heads, head_dim 128.
HIDDEN, HEADS_Q, HEADS_KV, HEAD_DIM = 4096, 32, 8, 128
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPS = ["qk_norm_rope_", "qk_norm_rope_+cache", "rms_norm", "fused_add_rms_norm_", "eagle3_input_norm"]


@dataclass
class Case:
    ours: Callable[[], object]  # our op on prepared inputs
    bind: Callable[[Callable], Callable[[], object]]  # a reference implementation on the same inputs
    reference: Callable  # the eager reference
    bytes: int  # bytes the op must move at least
    check: Callable[[], list]  # (ours, reference) output pairs on fresh inputs
    to_compile: Callable | None = None  # what torch.compile gets, if not the reference
    setup: Callable[[], None] | None = None  # restores the inputs an in-place op overwrites, before every call


def fused_add_rms_norm_functional(x, residual, weight, eps):
    """The reference with outputs instead of in-place updates: inductor fails on the in-place form
    (KeyError in the scheduler, torch 2.14), so the torch.compile baseline uses this one."""
    x, residual = x.clone(), residual.clone()
    ref.fused_add_rms_norm_(x, residual, weight, eps)
    return x, residual


def make_case(op: str, tokens: int, dtype: torch.dtype, device: str) -> Case:
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device=device).to(dtype)  # noqa: E731
    w = torch.rand(HIDDEN, generator=g, device=device) + 0.5  # fp32 weights, as checkpoints keep them
    elt = torch.tensor([], dtype=dtype).element_size()
    if op.startswith("qk_norm_rope_"):
        qkv = rnd(tokens, (HEADS_Q + 2 * HEADS_KV) * HEAD_DIM)
        cache = qspec_ext.rope_cos_sin_cache(tokens + 4096, HEAD_DIM, device=device)
        positions = torch.arange(tokens, device=device) + 4096
        args = (w[:HEAD_DIM], w[HEAD_DIM : 2 * HEAD_DIM], cache, positions, HEADS_Q, HEADS_KV, HEAD_DIM, 1e-6, True)
        moved = 2 * tokens * (HEADS_Q + HEADS_KV) * HEAD_DIM * elt
        kv = {}
        if op.endswith("+cache"):
            slots = tokens * 2
            kv = dict(
                k_cache=torch.zeros(slots, HEADS_KV, HEAD_DIM, dtype=dtype, device=device),
                v_cache=torch.zeros(slots, HEADS_KV, HEAD_DIM, dtype=dtype, device=device),
                slot_mapping=torch.randperm(slots, generator=g, device=device)[:tokens],
            )
            moved += 3 * tokens * HEADS_KV * HEAD_DIM * elt  # read V, write K and V rows
        work_qkv, work_kv = qkv.clone(), {k: v.clone() for k, v in kv.items()}

        def check():
            a, b = qkv.clone(), qkv.clone()
            ka = {k: v.clone() for k, v in kv.items()}
            kb = {k: v.clone() for k, v in kv.items()}
            qspec_ext.qk_norm_rope_(a, *args, **ka)
            ref.qk_norm_rope_(b, *args, **kb)
            return [(a, b)] + [(ka[k], kb[k]) for k in ("k_cache", "v_cache") if k in ka]

        return Case(
            lambda: qspec_ext.qk_norm_rope_(work_qkv, *args, **work_kv),
            lambda fn: (lambda: fn(work_qkv, *args, **work_kv)),
            ref.qk_norm_rope_,
            moved,
            check,
            setup=restorer(work_qkv),  # the caches are only written to, from qkv
        )
    x, r = rnd(tokens, HIDDEN), rnd(tokens, HIDDEN)
    if op == "rms_norm":
        return Case(
            lambda: qspec_ext.rms_norm(x, w, 1e-6), lambda fn: (lambda: fn(x, w, 1e-6)), ref.rms_norm,
            2 * tokens * HIDDEN * elt, lambda: [(qspec_ext.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))],
        )
    if op == "fused_add_rms_norm_":
        xw, rw = x.clone(), r.clone()

        def check():
            a, ra, b, rb = x.clone(), r.clone(), x.clone(), r.clone()
            qspec_ext.fused_add_rms_norm_(a, ra, w, 1e-6)
            ref.fused_add_rms_norm_(b, rb, w, 1e-6)
            return [(a, b), (ra, rb)]

        return Case(
            lambda: qspec_ext.fused_add_rms_norm_(xw, rw, w, 1e-6), lambda fn: (lambda: fn(xw, rw, w, 1e-6)),
            ref.fused_add_rms_norm_, 4 * tokens * HIDDEN * elt, check, to_compile=fused_add_rms_norm_functional,
            setup=restorer(xw, rw),
        )
    if op == "eagle3_input_norm":
        call = lambda f: f(x, r, w, w, 1e-6, True)  # noqa: E731
        return Case(
            lambda: call(qspec_ext.eagle3_input_norm), lambda fn: (lambda: call(fn)), ref.eagle3_input_norm,
            5 * tokens * HIDDEN * elt, lambda: list(zip(call(qspec_ext.eagle3_input_norm), call(ref.eagle3_input_norm))),
        )
    raise ValueError(f"unknown op {op}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    add_common_args(parser)
    args = parser.parse_args()
    rows, failures = [], 0
    for op in args.ops:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            for tokens in args.tokens:
                case = make_case(op, tokens, dtype, args.device)
                if args.check:
                    for a, b in case.check():
                        if not torch.allclose(a.float(), b.float(), atol=CHECK_TOLERANCE[dtype], rtol=CHECK_TOLERANCE[dtype]):
                            failures += 1
                            print(f"CHECK FAILED: {op} {dtype_name} T={tokens}: max diff {(a.float() - b.float()).abs().max():.3g}")
                timed = lambda fn: time_fn(fn, args.device, args.min_time, setup=case.setup)  # noqa: E731
                row = Row(op, dtype_name, f"T={tokens}", case.bytes, timed(case.ours))
                row.baselines["eager"] = timed(case.bind(case.reference))
                if not args.no_compile:
                    row.baselines["compile"] = timed(case.bind(compiled(case.to_compile or case.reference)))
                rows.append(row)
                print(f"  {op} {dtype_name} T={tokens}: {row.ours.median_us:.1f} us", file=sys.stderr, flush=True)
    return finish("qspec_ext norm / RoPE prologue (Qwen3-8B: H 4096, 32/8 heads, D 128)", rows, args, failures)


if __name__ == "__main__":
    sys.exit(main())
