"""End-to-end decoding: speculative (chain, P-EAGLE parallel and tree drafting) vs plain, in
one run, in three modes: eager with the custom ops, eager with the pure-PyTorch reference
ops, and compiled (compile=True: static-shape graphs, CUDA graphs on CUDA).

    python benchmarks/bench_decode.py [--target DIR --draft DIR [--draft-parallel DIR]] [-k 3]
                                      [--topk 4 --num-draft-tokens 16] [--drafting chain tree parallel]
                                      [--batch 1 4] [--device cuda]
                                      [--dtype bf16] [--modes eager compiled] [--profile] [--json PATH]

The pair defaults to the shipped demo pair (python/qspec_ext/demo_pair, its chain drafter
for chains and trees, its P-EAGLE drafter for parallel drafting); prompts are held-out
standard-library code, tokenized with the target's tokenizer.json. Reports tokens/s of plain
and speculative decoding (in the same mode), the speed-up over the whole run and over the decode
phase (after each request's first token: DecodeStats.decode_tokens_per_second), the mean
acceptance length, and the
cost of one drafter step as a fraction of one target verify forward (k + 1 tokens); compiled
rows also the compile time (the untimed warm-up run's extra time). --check fails when the
greedy outputs differ.
"""

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
from common import device_name

import qspec_ext
from qspec_ext import Eagle3Drafter, NativeTarget, SpeculativeDecoder, generate_plain
from qspec_ext.bench import interleaved_calls, interleaved_rounds
from qspec_ext.demo import DEMO_DIR, demo_prompts


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES = {"eager": dict(use_custom_ops=True, compile=False), "reference-ops": dict(use_custom_ops=False, compile=False),
         "compiled": dict(use_custom_ops=True, compile=True)}


def load_pair(target_dir: str, draft_dir: str, device: str, dtype: torch.dtype, use_custom_ops: bool):
    config = json.loads(open(f"{draft_dir}/config.json").read())
    target = NativeTarget.from_pretrained(target_dir, dtype=dtype, device=device, use_custom_ops=use_custom_ops,
                                         aux_layer_ids=config.get("eagle_aux_hidden_state_layer_ids"))
    drafter = Eagle3Drafter.from_pretrained(draft_dir, dtype=dtype, device=device, target=target,
                                            use_custom_ops=use_custom_ops)
    return target, drafter


def step_times(device: str, target, drafter, batch: int, k: int, repeats: int = 50,
               profile: str | None = None) -> tuple[float, float]:
    """Seconds per target verify forward (k + 1 tokens per request) and per drafter step (one
    token), on caches of the largest size the generate calls used; ``profile``: print the top ops
    of the drafter steps under that title."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    target.setup(batch, max(target.max_length, 16))
    drafter.setup(batch, max(drafter.max_length, 16))
    tokens = torch.ones(batch, k + 1, dtype=torch.long, device=device)
    positions = torch.arange(8, 9 + k, device=device).expand(batch, -1).contiguous()
    hidden = torch.zeros(batch, 1, drafter.config.hidden_size, dtype=drafter.fc.weight.dtype, device=device)
    calls = {"target": lambda: target(tokens, positions),
             "drafter": lambda: drafter.step(hidden, tokens[:, :1], positions[:, :1])}
    with torch.no_grad():
        for call in calls.values():
            for _ in range(3):
                call()
        rounds = interleaved_calls(calls, rounds=5, repeat=repeats // 5, sync=sync)
    seconds = {name: min(times) for name, times in rounds.items()}  # the least disturbed round
    if profile:
        from torch.profiler import profile as profiler

        with torch.no_grad(), profiler() as prof:
            for _ in range(repeats):
                calls["drafter"]()
            sync()
        print(f"\n{profile}: one drafter step, {repeats} calls")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48))
    return seconds["target"], seconds["drafter"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("-k", type=int, default=3, help="draft tokens per step (chain, parallel), tree depth")
    parser.add_argument("--draft-parallel", help="P-EAGLE drafter (default: the shipped pair's, if --draft is not given)")
    parser.add_argument("--topk", type=int, default=4, help="tree drafting: children per node")
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="tree drafting: nodes (default k * topk)")
    parser.add_argument("--drafting", nargs="+", choices=["chain", "tree", "parallel"],
                        default=["chain", "tree", "parallel"], help="drafting strategies to run")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="weights and activations")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--repeat", type=int, default=3, help="interleaved timed rounds (medians reported)")
    parser.add_argument("--profile", action="store_true", help="print the profile of a drafter step in each mode")
    parser.add_argument("--check", action="store_true", help="fail if greedy speculative output differs from plain")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--min-time", type=float, default=0.0, help="accepted for gpu_check.sh; unused")
    parser.add_argument("--no-compile", action="store_true", help="accepted for gpu_check.sh; unused")
    args = parser.parse_args()
    from qspec_ext.text import load_tokenizer

    target_dir, draft_dir = args.target or str(DEMO_DIR / "target"), args.draft or str(DEMO_DIR / "draft")
    parallel_dir = args.draft_parallel or (None if args.draft else str(DEMO_DIR / "draft-parallel"))
    tokenizer = load_tokenizer(target_dir)
    texts = demo_prompts(max(args.batch))
    rows, failures = [], 0
    eager_plain = {}
    for mode in args.modes:
        dtype, compile = DTYPES[args.dtype], MODES[mode]["compile"]
        target, drafter = load_pair(target_dir, draft_dir, args.device, dtype, MODES[mode]["use_custom_ops"])
        decoders = {"chain": SpeculativeDecoder(target, drafter, args.k, compile=compile),
                    "tree": SpeculativeDecoder(target, drafter, args.k, topk=args.topk,
                                               num_draft_tokens=args.num_draft_tokens, compile=compile)}
        if parallel_dir is not None and Path(parallel_dir).is_dir():
            parallel = Eagle3Drafter.from_pretrained(parallel_dir, dtype=dtype, device=args.device, target=target,
                                                     use_custom_ops=MODES[mode]["use_custom_ops"])
            decoders["parallel"] = SpeculativeDecoder(target, parallel, args.k, compile=compile)
        decoders = {kind: decoder for kind, decoder in decoders.items() if kind in args.drafting}
        for batch in args.batch:
            prompts = [tokenizer.encode(t).ids for t in texts[:batch]]
            configs = {"plain": partial(generate_plain, target, compile=compile)}
            configs |= {drafting: decoder.generate for drafting, decoder in decoders.items()}
            if not compile:
                for generate in configs.values():
                    generate(prompts, max_new_tokens=4)  # warm-up
            # Compiled, the warm-up is the same run untimed: it builds every graph the timed run uses.
            timed = interleaved_rounds(configs, prompts, len(prompts), args.repeat, warmup=lambda name: compile,
                                       max_new_tokens=args.max_new_tokens)
            plain, plain_rate = timed.results["plain"][0], timed.median("plain")
            eager_plain.setdefault(batch, plain_rate)
            for drafting, decoder in decoders.items():
                spec, spec_rate = timed.results[drafting][0], timed.median(drafting)
                if spec.tokens != plain.tokens:
                    failures += 1
                    print(f"MISMATCH: {drafting} mode={mode} batch={batch}: speculative output differs")
                title = f"{mode}, batch {batch}" if args.profile and drafting == "chain" else None
                target_s, drafter_s = step_times(args.device, target, decoder.drafter, batch, args.k, profile=title)
                rows.append(dict(mode=mode, batch=batch, drafting=drafting, k=args.k,
                                 num_draft_tokens=decoder.drafting.num_draft_tokens,
                                 plain_tokens_per_s=plain_rate, spec_tokens_per_s=spec_rate,
                                 speedup=timed.speedup(drafting, ["plain"]),
                                 plain_vs_first_mode=plain_rate / eager_plain[batch],
                                 decode_speedup=timed.speedup(drafting, ["plain"], decode=True),
                                 mean_acceptance_length=spec.stats.mean_acceptance_length,
                                 acceptance_per_position=spec.stats.acceptance_rate_per_position,
                                 target_verify_ms=target_s * 1e3, drafter_step_ms=drafter_s * 1e3,
                                 drafter_step_vs_verify=drafter_s / target_s,
                                 compile_s=timed.compile_time[drafting]))
    print(f"\nqspec_ext decoding on {device_name(args.device)} (qspec_ext {qspec_ext.__version__}, "
          f"{target_dir}, {args.dtype}, k={args.k}, {args.max_new_tokens} new tokens)")
    print(f"{'mode':>13}  {'batch':>5}  {'drafting':>8}  {'nodes':>5}  {'plain tok/s':>11}  {'spec tok/s':>10}  "
          f"{'speed-up':>8}  {'decode speed-up':>15}  {'accept len':>10}  {'draft step/verify':>17}  "
          f"{'plain vs ' + args.modes[0]:>17}  compile s")
    for r in rows:
        print(f"{r['mode']:>13}  {r['batch']:>5}  {r['drafting']:>8}  {r['num_draft_tokens']:>5}  "
              f"{r['plain_tokens_per_s']:>11.1f}  {r['spec_tokens_per_s']:>10.1f}"
              f"  {r['speedup']:>7.2f}x  {r['decode_speedup']:>14.2f}x  {r['mean_acceptance_length']:>10.2f}"
              f"  {r['drafter_step_vs_verify']:>17.2f}"
              f"  {r['plain_vs_first_mode']:>16.2f}x  {r['compile_s']:.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name(args.device), "dtype": args.dtype, "rows": rows}, f, indent=1)
    if args.check:
        print("check: speculative output equals plain decoding" if failures == 0 else f"check: {failures} mismatches")
    # In bf16 / fp16 the verify forward (k + 1 tokens) and plain decoding (1 token) round
    # differently, so a greedy tie can flip: only --check makes a mismatch an error.
    return 1 if failures and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
