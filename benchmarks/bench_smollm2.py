"""The real pair (SmolLM2-135M-Instruct + the drafters trained here) on the held-out prompts
(qspec_ext/prompts/heldout.jsonl: coding, math, summarization, chat; disjoint from training).

    python benchmarks/bench_smollm2.py acceptance [-k 1 3 5 7] [--per-category 21] [--max-new-tokens 128]
        [--greedy-only] [--drafters DIR ...] [--dtypes bf16]   # the first of --dtypes (default fp32)
    python benchmarks/bench_smollm2.py speed [--batch 1 4] [--prompts 8] [--rounds 3] [-k 3 5]
        [--drafting chain parallel tree --topk 2] [--adaptive] [--dtypes fp32 bf16] [--modes eager compiled]
    python benchmarks/bench_smollm2.py memory [--dtypes fp32 bf16] [--batch 1 4] [--prompts 8] [-k 3]
    (all: [--drafting chain parallel] [--json PATH])

acceptance: mean acceptance length (tokens per target forward) and acceptance per draft position
by category and k, greedy and sampled at the seed card's settings (temperature 0.6, top-p 0.95,
top-k 20), each category's prompts decoded together (acceptance does not depend on batching).

speed: tokens/s of plain decoding (each of --dtypes, eager and compiled) and speculative decoding
(each of --dtypes, each of --modes (default eager), each k), greedy, chat prompts through the template, stopping at the end of the turn,
one process, the configurations interleaved round by round (A B C ... A B C ...): medians with the
spread; each speed-up is the median of its rounds' ratios, against plain decoding in the same dtype
and mode and against the fastest plain configuration of that round.

memory: for each dtype, a fresh process loads the pair and decodes the chat prompts (speculative,
the first --drafting and k, then plain), three times over: its peak resident memory above what it
held before loading (with the tokenizer and prompts loaded, after the tiny pair decoded once in
that dtype and was freed: the runtime's own memory), against the bytes of the weights (target and drafter, in that dtype, tied and
borrowed tensors once) plus the KV caches; and the growth of resident memory from the first pass
to the third (a leak grows with every step).
"""

import argparse
import gc
import itertools
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

from common import print_child_result, run_child

from qspec_ext import SpeculativeDecoder, generate_plain, load_pair
from qspec_ext.bench import in_batches, interleaved_rounds
from qspec_ext.drafting import LookupDrafting, LookupTreeDrafting
from qspec_ext.models.checkpoint import trim_heap
from qspec_ext.prompts import CATEGORIES, heldout_prompts
from qspec_ext.shipped import SMOLLM2_DIR, drafter_dir, target_dir
from qspec_ext.text import chat_ids, stop_ids

SAMPLING = dict(temperature=0.6, top_p=0.95, top_k=20)


def requests(category: str | None, count: int) -> list[list[int]]:
    directory = target_dir("smollm2")
    return [chat_ids(directory, [{"role": "user", "content": r["prompt"]}])
            for r in heldout_prompts(category)[:count]]


def decoder(target, drafter, drafting: str, k: int, args) -> SpeculativeDecoder:
    """chain / parallel: the drafter's kind; lookup: prompt lookup, the chain where nothing matches;
    tree / lookup-tree: an EAGLE-2 tree of depth k and --topk (with a copied branch of k nodes)."""
    if drafting == "lookup":
        return SpeculativeDecoder(target, drafter, k, drafting=LookupDrafting(drafter, k, check_bounds=False))
    if drafting == "lookup-tree":
        return SpeculativeDecoder(target, drafter, k, drafting=LookupTreeDrafting(
            target, drafter, k, args.topk, None, check_bounds=False))
    return SpeculativeDecoder(target, drafter, k, topk=args.topk if drafting == "tree" else 1)


def acceptance(args) -> list[dict]:
    stops = stop_ids(target_dir("smollm2"))
    rows = []
    drafters = [(str(d), d) for d in args.drafters] or [("shipped", SMOLLM2_DIR)]
    modes = [("greedy", {}), ("sampled", SAMPLING)][:1 if args.greedy_only else 2]
    for name, directory in drafters:
        for drafting in args.drafting:
            target, drafter = load_pair("smollm2", directory / ("draft-parallel" if drafting == "parallel" else "draft"),
                                        dtype=args.dtypes[0])
            for category in CATEGORIES:
                prompts = requests(category, args.per_category)
                for mode, sampling in modes:
                    for k in args.k:
                        s = decoder(target, drafter, drafting, k, args).generate(
                            prompts, args.max_new_tokens, eos_token_id=stops, repetition_penalty=args.repetition_penalty,
                            **sampling).stats
                        rows.append(dict(drafters=name, drafting=drafting, category=category, mode=mode, k=k,
                                         acceptance_length=s.mean_acceptance_length,
                                         per_position=s.acceptance_rate_per_position, tokens=s.num_generated_tokens))
                        print(f"{name} {drafting:>8} {category:>13} {mode:>7} k={k}: {s.mean_acceptance_length:.2f} "
                              f"({' '.join(f'{a:.2f}' for a in s.acceptance_rate_per_position)})", file=sys.stderr)
    print(f"mean acceptance length (tokens per target forward), {args.per_category} prompts per category x "
          f"{args.max_new_tokens} new tokens at most")
    for (name, _), drafting, (mode, _) in itertools.product(drafters, args.drafting, modes):
        print(f"{name} {drafting}, {mode}: {'category':>13} " + " ".join(f"{'k=' + str(k):>6}" for k in args.k))
        mine = [r for r in rows if (r["drafters"], r["drafting"], r["mode"]) == (name, drafting, mode)]
        for category in (*CATEGORIES, "all"):
            cells = []
            for k in args.k:
                at_k = [r for r in mine if r["k"] == k and category in ("all", r["category"])]
                # all: weighted by the categories' generated tokens (as one run over every prompt)
                weight = sum(r["tokens"] / r["acceptance_length"] for r in at_k)
                cells.append(sum(r["tokens"] for r in at_k) / weight)
            print(f"{'':>{len(name) + len(drafting) + len(mode) + 4}}{category:>13} " + " ".join(f"{c:>6.2f}" for c in cells))
    return rows


def speed(args) -> list[dict]:
    stops = stop_ids(target_dir("smollm2"))
    prompts = requests("chat", args.prompts)
    configs = {}  # name -> (dtype, mode, callable(prompts) -> GenerateResult)
    for dtype in args.dtypes:
        target, chain = load_pair("smollm2", drafter_dir("smollm2"), dtype=dtype)
        for compiled in (False, True):
            name = f"plain {dtype} {'compiled' if compiled else 'eager'}"
            configs[name] = (dtype, compiled, lambda p, t=target, c=compiled: generate_plain(
                t, p, args.max_new_tokens, eos_token_id=stops, compile=c))
        for drafting in args.drafting:
            drafter = chain if drafting != "parallel" else load_pair(
                "smollm2", drafter_dir("smollm2", parallel=True), dtype=dtype)[1]
            for k, mode in itertools.product(args.k, args.modes):
                spec = decoder(target, drafter, drafting, k, args)
                if mode == "compiled":
                    spec = SpeculativeDecoder(target, drafter, k, compile=True, drafting=spec.drafting)
                name = f"{drafting} k={k} topk={args.topk}" if "tree" in drafting else f"{drafting} k={k}"
                configs[f"{name} {dtype} {mode}"] = (dtype, mode == "compiled", lambda p, d=spec: d.generate(
                    p, args.max_new_tokens, eos_token_id=stops))
            if args.adaptive and drafting in ("chain", "parallel"):
                for mode in args.modes:  # one decoder per mode: what it measures carries across rounds and batches
                    adaptive = SpeculativeDecoder(target, drafter, 5, compile=mode == "compiled", adaptive=True)
                    configs[f"{drafting} k=auto {dtype} {mode}"] = (dtype, mode == "compiled", lambda p, d=adaptive: (
                        d.generate(p, args.max_new_tokens, eos_token_id=stops)))
    last = list(configs)[-1]
    rows = []
    print(f"SmolLM2-135M-Instruct, {args.prompts} held-out chat prompts, at most {args.max_new_tokens} new tokens, "
          f"greedy, {torch.get_num_threads()} threads; medians over {args.rounds} interleaved rounds (spread)")
    for batch in args.batch:
        timed = interleaved_rounds({name: run for name, (_, _, run) in configs.items()}, prompts, batch, args.rounds,
                                   warmup=lambda name: True,  # untimed first: setup, packing, graphs
                                   on_run=lambda name, r: print(f"batch {batch}: round {r + 1}/{args.rounds} done",
                                                                file=sys.stderr) if name == last else None)
        plain_names = [n for n in configs if n.startswith("plain")]
        best_plain = [max(rates) for rates in zip(*(timed.rates(n) for n in plain_names))]
        print(f"batch {batch}: fastest plain per round {', '.join(f'{b:.1f}' for b in best_plain)} tok/s")
        for name, (dtype, compiled, _) in configs.items():
            same = f"plain {dtype} {'compiled' if compiled else 'eager'}"
            low, high = timed.spread(name)
            row = dict(config=name, batch=batch, tokens_per_second=timed.median(name), spread=[low, high],
                       vs_same_plain=timed.speedup(name, [same]), vs_fastest_plain=timed.speedup(name, plain_names),
                       same_tokens_as_plain=timed.results[name][0].tokens
                       == timed.results[f"plain {dtype} eager"][0].tokens)
            rows.append(row)
            print(f"  {name:>26} {row['tokens_per_second']:7.1f} tok/s ({low:.1f}-{high:.1f})"
                  f"  x{row['vs_same_plain']:.2f} same dtype/mode  x{row['vs_fastest_plain']:.2f} fastest plain"
                  f"  {'same tokens' if row['same_tokens_as_plain'] else 'tokens differ from plain'} ({dtype} eager)")
            if "k=auto" in name:
                row["draft_lengths"] = timed.results[name][-1].stats.draft_lengths
                print(f"  {'':>26} steps by draft length (last round): {row['draft_lengths']}")
    return rows


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(dtype: str, args) -> dict:
    # The runtime's own memory (the tokenizer and prompts, code pages of the kernels used,
    # allocator pools) is the baseline: the tiny pair decodes once in this dtype first, and is freed.
    stops = stop_ids(target_dir("smollm2"))
    prompts = requests("chat", args.prompts)
    tiny_target, tiny_drafter = load_pair("tiny", drafter_dir("tiny"), dtype=dtype)
    SpeculativeDecoder(tiny_target, tiny_drafter, args.k[0]).generate([[1, 2, 3]], 8)
    generate_plain(tiny_target, [[1, 2, 3]], 8)
    del tiny_target, tiny_drafter
    gc.collect()
    trim_heap()
    baseline = resident_bytes()
    target, drafter = load_pair("smollm2", drafter_dir("smollm2", parallel=args.drafting[0] == "parallel"), dtype=dtype)
    decoder = SpeculativeDecoder(target, drafter, args.k[0])
    passes, steps = [], 0
    for _ in range(3):
        for batch in args.batch:
            speculative = in_batches(lambda p: decoder.generate(p, args.max_new_tokens, eos_token_id=stops), prompts,
                                     batch)
            plain = in_batches(lambda p: generate_plain(target, p, args.max_new_tokens, eos_token_id=stops), prompts,
                               batch)
            steps += speculative.stats.num_drafts + plain.stats.num_generated_tokens  # decode steps (about)
        passes.append(resident_bytes() - baseline)
    parameters = {id(p): p for m in (target, drafter) for p in m.parameters()}  # tied / borrowed: once
    weights = sum(p.numel() * p.element_size() for p in parameters.values())
    caches = sum(t.numel() * t.element_size() for m in (target, drafter) for pair in m.caches for t in pair)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    return dict(dtype=dtype, weights=weights, caches=caches, peak=peak, after_first_pass=passes[0],
                after_third_pass=passes[2], steps_after_first_pass=steps * 2 // 3, baseline=baseline)


def memory(args) -> list[dict]:
    rows = []
    mb = 1 << 20
    print(f"SmolLM2-135M-Instruct + {args.drafting[0]} drafter k={args.k[0]}, {args.prompts} chat prompts x "
          f"{args.max_new_tokens} tokens at batch {' and '.join(map(str, args.batch))}, 3 passes, one process per dtype")
    for dtype in args.dtypes:
        command = [sys.executable, __file__, "memory", "--child", dtype, "--drafting", args.drafting[0], "-k",
                   str(args.k[0]), "--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens),
                   "--batch", *map(str, args.batch)]
        row = run_child(command, f"bench_smollm2 memory: the {dtype} child")
        row["peak_over_weights_and_caches"] = row["peak"] / (row["weights"] + row["caches"])
        rows.append(row)
        print(f"  {dtype}: weights {row['weights'] / mb:.0f} MiB + caches {row['caches'] / mb:.0f} MiB; peak resident "
              f"{row['peak'] / mb:.0f} MiB above the runtime's {row['baseline'] / mb:.0f} MiB = "
              f"{row['peak_over_weights_and_caches']:.2f}x; resident after pass 1 / 3: {row['after_first_pass'] / mb:.0f}"
              f" / {row['after_third_pass'] / mb:.0f} MiB over {row['steps_after_first_pass']} more decode steps")
    return rows


def main():
    args = parse_args()
    if args.child:
        print_child_result(memory_child(args.child, args))
        return
    start = time.perf_counter()
    rows = {"acceptance": acceptance, "speed": speed, "memory": memory}[args.what](args)
    print(f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["acceptance", "speed", "memory"])
    parser.add_argument("-k", type=int, nargs="+", default=None)
    parser.add_argument("--drafting", nargs="+", choices=["chain", "parallel", "tree", "lookup", "lookup-tree"],
                        default=["chain"], help="tree: EAGLE-2 trees of depth k from the chain drafter, --topk "
                        "children; lookup: prompt lookup, the chain where nothing matches; lookup-tree: the tree "
                        "with a copied branch")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="acceptance: decode with this repetition penalty (the demo's and chat's: 1.1)")
    parser.add_argument("--topk", type=int, default=2, help="tree drafting: children per node")
    parser.add_argument("--adaptive", action="store_true",
                        help="speed: also each chain / parallel drafting with adaptive draft lengths (0..5 per step)")
    parser.add_argument("--per-category", type=int, default=21)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    parser.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager"],
                        help="speed: the speculative configurations' modes (plain decoding runs both)")
    parser.add_argument("--drafters", type=Path, nargs="+", default=[], metavar="DIR",
                        help="acceptance: the drafters in these directories (draft/ and draft-parallel/, as "
                             "scripts/train_smollm2.py --out writes them), one after another in this process; "
                             "default: the shipped ones")
    parser.add_argument("--greedy-only", action="store_true", help="acceptance: skip the sampled rows")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # memory: the measuring process of one dtype
    args = parser.parse_args()
    if args.what != "acceptance" and max(args.batch) > args.prompts:
        parser.error(f"--batch {max(args.batch)} needs at least that many prompts (--prompts {args.prompts}): "
                     f"a batch is that many requests at once")
    args.k = args.k or ([1, 3, 5, 7] if args.what == "acceptance" else [3] if args.what == "memory" else [3, 5])
    return args


if __name__ == "__main__":
    main()
