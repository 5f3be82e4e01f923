"""Plain decoding tokens/s by the KV cache allocated: the cost of a step should follow the context
used, not the cache (cached_attention reads only the used slots).

    python benchmarks/bench_cache_length.py [--pair tiny smollm2] [--caches 512 8192 32768]
        [--prompt-tokens 64] [--max-new-tokens 256] [--batch 1] [--rounds 3] [--dtype fp32] [--compile]

One request (or --batch copies) of a --prompt-tokens prompt decodes --max-new-tokens tokens with
a cache of each length in turn, interleaved over --rounds rounds in this one process; reported:
the median tokens/s (spread) and the median of each round's ratio to the first cache length.
Greedy tokens must be identical for every cache.
"""

import argparse
import statistics
import sys
from functools import partial

import torch

from qspec_ext import generate_plain
from qspec_ext.bench import interleaved_rounds
from qspec_ext.demo import demo_requests
from qspec_ext.targets import load_target


def prompt_of(pair: str, length: int) -> list[int]:
    _, prompt_ids, _ = demo_requests(pair, 4)
    ids = [t for prompt in prompt_ids for t in prompt]
    while len(ids) < length:
        ids += ids
    return ids[:length]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--caches", type=int, nargs="+", default=[512, 8192, 32768])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--compile", action="store_true", help="compiled forwards (default eager)")
    args = parser.parse_args()
    failures = 0
    for pair in args.pair:
        target = load_target(pair, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype])
        caches = args.caches
        prompts = [prompt_of(pair, args.prompt_tokens)] * args.batch
        generate_plain(target, prompts, 8, max_length=caches[0], compile=args.compile)  # warm-up
        configs = {cache: partial(generate_plain, target, max_length=cache, compile=args.compile) for cache in caches}
        timed = interleaved_rounds(configs, prompts, len(prompts), args.rounds, max_new_tokens=args.max_new_tokens)
        speeds = {cache: timed.rates(cache) for cache in caches}
        tokens = {cache: timed.results[cache][0].tokens for cache in caches}
        first = caches[0]
        same = all(tokens[c] == tokens[first] for c in caches)
        failures += not same
        print(f"\n{pair}: plain decoding, {args.dtype}, {'compiled' if args.compile else 'eager'}, batch {args.batch}, "
              f"{args.prompt_tokens}-token prompt, {args.max_new_tokens} new tokens, {torch.get_num_threads()} threads, "
              f"{args.rounds} interleaved rounds; tokens identical: {'yes' if same else 'NO'}")
        for cache in caches:
            ratios = [s / f for s, f in zip(speeds[cache], speeds[first])]
            print(f"  cache {cache:>6}: {statistics.median(speeds[cache]):7.1f} tok/s "
                  f"({min(speeds[cache]):.1f}-{max(speeds[cache]):.1f})  {statistics.median(ratios):.2f}x cache {first}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
