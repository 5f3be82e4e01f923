"""Microbenchmark of the projections' CPU inference path: weights packed in panels of 16 columns
(qspec_ext.models.linear.Linear after pack_linears: ops.packed_linear) against F.linear on the
weight as stored.

    python benchmarks/bench_linear.py [--model smollm2] [--rows 1 4 8] [--dtypes fp32 bf16] [--cold] [--check] [--json PATH]

Shapes: one decoder layer's projections (qkv, o, gate_up, down) and the lm_head of the model.
Bytes: the weight, the input rows and the output (a decode-size GEMM streams its weight). Baselines
in the same run: F.linear (MKL / oneDNN as torch picks) and torch.compile of it. A weight that fits
the CPU's caches is timed warm; in a model every layer's weights are new to the cache: --cold
gives each shape copies of the layer enough for 256 MB of weights, called in turn (each call's
weight was last read a few hundred MB ago, as in a decode step).
"""

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F
from common import CHECK_TOLERANCE, Row, add_common_args, compiled, finish, time_fn

from qspec_ext.models.linear import Linear, pack_linears

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
COLD_BYTES = 256 * 1024 * 1024  # --cold: copies of a layer enough for this many bytes of weights
# name -> [(projection, in_features, out_features)]
MODELS = {
    "smollm2": [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
                ("lm_head", 576, 49152)],
    "qwen3-8b": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 24576), ("down", 12288, 4096)],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="smollm2")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8], help="tokens per call (batch x (k+1))")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--cold", action="store_true", help="weights streamed from memory, not warm in cache")
    add_common_args(parser)
    args = parser.parse_args()
    if args.device != "cpu":
        parser.error("the packed path is the CPU's: run with --device cpu")
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
