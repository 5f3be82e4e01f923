"""Microbenchmark of gather_aux_hidden on Qwen3-8B shapes (H 4096, n = 3 aux layers).

    python benchmarks/bench_aux_gather.py [--rows 1 8 64 2048] [--modes none fc_norm norm_before_fc] [--check] [--json PATH]

Baselines, timed in the same run: the eager composition serving systems use
(``torch.cat([h[idx] for h in aux], -1)`` plus ``F.rms_norm`` per chunk or over the
concatenation) and ``torch.compile`` of it. Source tensors hold 2 * N tokens (at
least 16); N random rows are gathered.
"""

import argparse
import sys

import torch
import torch.nn.functional as F
from common import CHECK_TOLERANCE, Row, add_common_args, compiled, finish, time_fn

import qspec_ext
from qspec_ext import reference as ref

HIDDEN, NUM_AUX = 4096, 3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ["none", "fc_norm", "norm_before_fc"]


def eager_composition(aux, indices, mode, weight, eps=1e-6):
    chunks = [h[indices] for h in aux]
    if mode == "fc_norm":
        chunks = [F.rms_norm(c, (c.shape[-1],), w, eps) for c, w in zip(chunks, weight)]
    fc_input = torch.cat(chunks, dim=-1)
    if mode == "norm_before_fc":
        fc_input = F.rms_norm(fc_input, (fc_input.shape[-1],), weight, eps)
    return fc_input


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 2048])
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    add_common_args(parser)
    args = parser.parse_args()
    rows, failures = [], 0
    for mode in args.modes:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            elt = torch.tensor([], dtype=dtype).element_size()
            for n_rows in args.rows:
                g = torch.Generator(device=args.device).manual_seed(0)
                tokens = max(2 * n_rows, 16)
                aux = [torch.randn(tokens, HIDDEN, generator=g, device=args.device).to(dtype) for _ in range(NUM_AUX)]
                indices = torch.randperm(tokens, generator=g, device=args.device)[:n_rows]
                weight = None
                if mode == "fc_norm":
                    weight = torch.rand(NUM_AUX, HIDDEN, generator=g, device=args.device).to(dtype) + 0.5
                elif mode == "norm_before_fc":
                    weight = torch.rand(NUM_AUX * HIDDEN, generator=g, device=args.device).to(dtype) + 0.5
                out = torch.empty(n_rows, NUM_AUX * HIDDEN, dtype=dtype, device=args.device)
                if args.check:
                    qspec_ext.gather_aux_hidden_out(aux, indices, out, None, mode, weight)
                    expected = ref.gather_aux_hidden(aux, indices, None, mode, weight)
                    if not torch.allclose(out.float(), expected.float(), atol=CHECK_TOLERANCE[dtype], rtol=CHECK_TOLERANCE[dtype]):
                        failures += 1
                        print(f"CHECK FAILED: {mode} {dtype_name} N={n_rows}")
                moved = 2 * n_rows * NUM_AUX * HIDDEN * elt  # read each selected row once, write the fc input
                baselines = {"eager": time_fn(lambda: eager_composition(aux, indices, mode, weight), args.device,
                                              args.min_time)}
                if not args.no_compile:
                    fn = compiled(eager_composition)
                    baselines["compile"] = time_fn(lambda: fn(aux, indices, mode, weight), args.device, args.min_time)
                variants = {
                    "gather_aux_hidden": lambda: qspec_ext.gather_aux_hidden(aux, indices, None, mode, weight),
                    "gather_aux_hidden_out": lambda: qspec_ext.gather_aux_hidden_out(aux, indices, out, None, mode,
                                                                                     weight),
                }
                for name, call in variants.items():
                    row = Row(f"{name}[{mode}]", dtype_name, f"N={n_rows}", moved,
                              time_fn(call, args.device, args.min_time), dict(baselines))
                    rows.append(row)
                print(f"  {mode} {dtype_name} N={n_rows}: {row.ours.median_us:.1f} us", file=sys.stderr, flush=True)
    return finish("qspec_ext aux hidden-state gather (Qwen3-8B: H 4096, 3 aux layers)", rows, args, failures)


if __name__ == "__main__":
    sys.exit(main())
