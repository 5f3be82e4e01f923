"""Microbenchmark of the projections' CPU inference path: weights packed in panels of 16 columns
(qspec_ext.models.linear.Linear after pack_linears: ops.packed_linear) against F.linear on the
weight as stored.

    python benchmarks/bench_linear.py [--model smollm2] [--rows 1 4 8] [--dtypes fp32 bf16] [--cold] [--check] [--json PATH]
    python benchmarks/bench_linear.py --roofline docs/roofline.png [--rows 1 2 4 8 16 32 64]

Shapes: one decoder layer's projections (qkv, o, gate_up, down) and the lm_head of the model.
Bytes: the weight, the input rows and the output (a decode-size GEMM streams its weight). Baselines
in the same run: F.linear (MKL / oneDNN as torch picks) and torch.compile of it. A weight that fits
the CPU's caches is timed warm; in a model every layer's weights are new to the cache: --cold
gives each shape copies of the layer enough for 256 MB of weights, called in turn (each call's
weight was last read a few hundred MB ago, as in a decode step).

--roofline PNG: the peak of this machine's multiply-add instructions (a register-resident loop
compiled with gcc at run time, on every torch thread at once: fp32 FMA, 8 lanes on AVX2 or 16 on
AVX-512, and where the CPU has it AVX512-BF16's vdpbf16ps, which adds two products per lane) and
of a memory copy, then packed_linear's GFLOP/s and GB/s against them for the gate_up projection
at each --rows, warm and cold, fp32 and bf16; the PNG plots rows against both. On a CPU without
vdpbf16ps the bf16 path widens pairs to fp32 in registers: its roof is the fp32 FMA peak.
"""

import argparse
import ctypes
import itertools
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import CHECK_TOLERANCE, Row, add_common_args, compiled, copy_bandwidth, device_name, finish, time_fn

import qspec_ext
from qspec_ext.models.linear import Linear, pack_linears

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
COLD_BYTES = 256 * 1024 * 1024  # --cold: copies of a layer enough for this many bytes of weights
# name -> [(projection, in_features, out_features)]
MODELS = {
    "smollm2": [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
                ("lm_head", 576, 49152)],
    "qwen3-8b": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 24576), ("down", 12288, 4096)],
}


PEAK_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#define LOOP(ACC, N, INIT, STEP, SUM) { ACC a[N]; for (int j = 0; j < N; ++j) a[j] = INIT; \
  for (int64_t i = 0; i < iters; ++i) { _Pragma("GCC unroll 32") for (int j = 0; j < N; ++j) a[j] = STEP; } \
  float s = 0; for (int j = 1; j < N; ++j) a[0] = SUM; float out[16]; memcpy(out, &a[0], sizeof a[0]); \
  for (int j = 0; j < (int)(sizeof a[0] / 4); ++j) s += out[j]; return s; }
#include <string.h>
__attribute__((target("avx2,fma"))) float fma8(int64_t iters) {  /* 12 x 8 lanes x 2 flops per round */
  const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-3f);
  LOOP(__m256, 12, _mm256_set1_ps((float)j), _mm256_fmadd_ps(a[j], b, c), _mm256_add_ps(a[0], a[j]))
}
__attribute__((target("avx512f"))) float fma16(int64_t iters) {  /* 24 x 16 lanes x 2 flops */
  const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-3f);
  LOOP(__m512, 24, _mm512_set1_ps((float)j), _mm512_fmadd_ps(a[j], b, c), _mm512_add_ps(a[0], a[j]))
}
__attribute__((target("avx512f,avx512bf16"))) float dot16(int64_t iters) {  /* 24 x 16 lanes x 4 flops */
  const __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f80), c = (__m512bh)_mm512_set1_epi32(0x3a803a80);
  LOOP(__m512, 24, _mm512_set1_ps((float)j), _mm512_dpbf16_ps(a[j], b, c), _mm512_add_ps(a[0], a[j]))
}
"""
PEAK_FLOPS_PER_ITER = {"fma8": 12 * 8 * 2, "fma16": 24 * 16 * 2, "dot16": 24 * 16 * 4}


def instruction_peaks(threads: int) -> dict[str, float]:
    """FLOP/s of each multiply-add loop this CPU runs, on `threads` threads at once (ctypes calls
    release the GIL), the median of 3 runs of about 0.3 s."""
    work = Path(tempfile.mkdtemp())
    (work / "peak.c").write_text(PEAK_SOURCE)
    subprocess.run(["gcc", "-O3", "-shared", "-fPIC", "-o", str(work / "peak.so"), str(work / "peak.c")], check=True)
    library = ctypes.CDLL(str(work / "peak.so"))
    have = {"fma8": True, "fma16": qspec_ext.build_info()["cpu_avx512"],
            "dot16": qspec_ext.build_info()["cpu_bf16_dot"]}
    peaks = {}
    for name, flops in PEAK_FLOPS_PER_ITER.items():
        if not have[name]:
            continue
        fn = getattr(library, name)
        fn.argtypes, fn.restype = [ctypes.c_int64], ctypes.c_float
        iters = 1000
        while True:  # calibrate to ~0.3 s on one thread
            start = time.perf_counter()
            fn(iters)
            if time.perf_counter() - start > 0.1:
                iters = int(iters * 0.3 / (time.perf_counter() - start))
                break
            iters *= 4
        rates = []
        for _ in range(3):
            workers = [threading.Thread(target=fn, args=(iters,)) for _ in range(threads)]
            start = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            rates.append(threads * iters * flops / (time.perf_counter() - start))
        peaks[name] = sorted(rates)[1]
    return peaks


def roofline(args) -> int:
    """packed_linear's GFLOP/s and GB/s by rows against the instruction peaks and the copy bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = torch.get_num_threads()
    peaks = instruction_peaks(threads)
    bandwidth = copy_bandwidth("cpu", args.min_time)
    name, in_features, out_features = next(m for m in MODELS[args.model] if m[0] == "gate_up")
    results = {}
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        elt = torch.tensor([], dtype=dtype).element_size()
        for cold in (False, True):
            copies = -(-COLD_BYTES // (in_features * out_features * elt)) if cold else 1
            torch.manual_seed(0)
            layers = [Linear(in_features, out_features, bias=False).to(dtype) for _ in range(copies)]
            for layer in layers:
                pack_linears(layer)
            turn = itertools.cycle(layers)
            for count in args.rows:
                x = torch.randn(count, in_features).to(dtype)
                with torch.no_grad():
                    us = time_fn(lambda: next(turn)(x), "cpu", args.min_time).median_us
                flops = 2 * count * in_features * out_features
                moved = (in_features * out_features + count * (in_features + out_features)) * elt
                results[dtype_name, cold, count] = (flops / us / 1e3, moved / us / 1e3)
    fma = peaks.get("fma16", peaks["fma8"])
    dot = peaks.get("dot16")
    print(f"packed_linear roofline on {device_name('cpu')}: {name} {in_features}x{out_features}")
    print(f"  peaks ({threads} threads): " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peaks.items())
          + f"; copy {bandwidth / 1e9:.1f} GB/s")
    print(f"  {'dtype':>5} {'weights':>5} {'rows':>4} {'GFLOP/s':>8} {'% of peak':>9} {'GB/s':>6} {'% of copy':>9}")
    for (dtype_name, cold, count), (gflops, gbs) in results.items():
        roof = dot if dtype_name == "bf16" and dot else fma
        print(f"  {dtype_name:>5} {'cold' if cold else 'warm':>5} {count:>4} {gflops:8.1f} {100 * gflops * 1e9 / roof:8.0f}%"
              f" {gbs:6.1f} {100 * gbs * 1e9 / bandwidth:8.0f}%")
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (dtype_name, cold) in sorted({k[:2] for k in results}):
        xs = [c for c in args.rows]
        style = dict(marker="o", linestyle="--" if cold else "-", label=f"{dtype_name}, {'cold' if cold else 'warm'}")
        left.plot(xs, [results[dtype_name, cold, c][0] for c in xs], **style)
        right.plot(xs, [results[dtype_name, cold, c][1] for c in xs], **style)
    left.axhline(fma / 1e9, color="black", linewidth=1, label=f"FMA peak {fma / 1e9:.0f}")
    if dot:
        left.axhline(dot / 1e9, color="gray", linewidth=1, label=f"bf16 dot peak {dot / 1e9:.0f}")
    right.axhline(bandwidth / 1e9, color="black", linewidth=1, label=f"copy {bandwidth / 1e9:.0f} GB/s")
    for axis, unit in ((left, "GFLOP/s"), (right, "GB/s (weight + rows)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(args.rows, [str(r) for r in args.rows])
        axis.set_xlabel("rows (tokens per call)")
        axis.set_ylabel(unit)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(f"packed_linear, {name} {in_features}x{out_features}, {device_name('cpu')}", fontsize=10)
    figure.tight_layout()
    figure.savefig(args.roofline, dpi=110)
    print(f"  wrote {args.roofline}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="smollm2")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8], help="tokens per call (batch x (k+1))")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--cold", action="store_true", help="weights streamed from memory, not warm in cache")
    parser.add_argument("--roofline", metavar="PNG", help="instruction peaks and packed_linear against them, plotted")
    add_common_args(parser)
    args = parser.parse_args()
    if args.device != "cpu":
        parser.error("the packed path is the CPU's: run with --device cpu")
    if args.roofline:
        return roofline(args)
    rows, failures = [], 0
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        elt = torch.tensor([], dtype=dtype).element_size()
        for name, in_features, out_features in MODELS[args.model]:
            torch.manual_seed(0)
            copies = -(-COLD_BYTES // (in_features * out_features * elt)) if args.cold else 1
            layers = [Linear(in_features, out_features, bias=False).to(dtype) for _ in range(copies)]
            for layer in layers:
                pack_linears(layer)
            layer = layers[0]
            for count in args.rows:
                x = torch.randn(count, in_features).to(dtype)
                turn = itertools.cycle(layers)  # round-robin: with --cold, each call's weight is a cold one
                with torch.no_grad():
                    if args.check:
                        tol = CHECK_TOLERANCE[dtype] * 4  # the op and MKL sum in different orders
                        if not torch.allclose(layer(x).float(), F.linear(x, layer.weight).float(), atol=tol, rtol=tol):
                            failures += 1
                            print(f"CHECK FAILED: {dtype_name} {name} rows={count}")
                    baselines = {"F.linear": time_fn(lambda: F.linear(x, next(turn).weight), args.device, args.min_time)}
                    if not args.no_compile:
                        fn = compiled(F.linear)
                        baselines["compile"] = time_fn(lambda: fn(x, next(turn).weight), args.device, args.min_time)
                    ours = time_fn(lambda: next(turn)(x), args.device, args.min_time)
                moved = (in_features * out_features + count * (in_features + out_features)) * elt
                label = f"{name} {in_features}x{out_features} rows={count}"
                rows.append(Row(f"Linear[{args.model}]", dtype_name, label, moved, ours, baselines))
                print(f"  {dtype_name} {label}: {ours.median_us:.1f} us", file=sys.stderr, flush=True)
    weights = "cold weights (streamed from memory)" if args.cold else "warm weights"
    return finish(f"qspec_ext projections on panel-packed weights ({args.model}, {weights})", rows, args, failures)


if __name__ == "__main__":
    sys.exit(main())
