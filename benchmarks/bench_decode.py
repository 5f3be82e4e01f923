"""End-to-end decoding: speculative vs plain, with the custom ops on and off, in one run.

    python benchmarks/bench_decode.py [--target DIR --draft DIR] [-k 3] [--batch 1 4] [--json PATH]

The pair defaults to the shipped demo pair (python/qspec_ext/demo_pair); prompts are
held-out standard-library code, tokenized with the target's tokenizer.json. Reports
tokens/s of plain and speculative decoding, the speed-up and the mean acceptance length;
--check fails when the greedy outputs differ.
"""

import argparse
import json
import sys

import torch
from common import device_name

import qspec_ext
from qspec_ext import Eagle3Drafter, Qwen3Target, SpeculativeDecoder, generate_plain
from qspec_ext.demo import DEMO_DIR, demo_prompts


def load_pair(target_dir: str, draft_dir: str, device: str, use_custom_ops: bool):
    config = json.loads(open(f"{draft_dir}/config.json").read())
    target = Qwen3Target.from_pretrained(target_dir, dtype=torch.float32, device=device, use_custom_ops=use_custom_ops,
                                         aux_layer_ids=config.get("eagle_aux_hidden_state_layer_ids"))
    drafter = Eagle3Drafter.from_pretrained(draft_dir, dtype=torch.float32, device=device, target=target,
                                            use_custom_ops=use_custom_ops)
    return target, drafter


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--check", action="store_true", help="fail if greedy speculative output differs from plain")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--min-time", type=float, default=0.0, help="accepted for gpu_check.sh; unused")
    parser.add_argument("--no-compile", action="store_true", help="accepted for gpu_check.sh; unused")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    target_dir, draft_dir = args.target or str(DEMO_DIR / "target"), args.draft or str(DEMO_DIR / "draft")
    tokenizer = Tokenizer.from_file(f"{target_dir}/tokenizer.json")
    texts = demo_prompts(max(args.batch))
    rows, failures = [], 0
    for use_custom_ops in (True, False):
        target, drafter = load_pair(target_dir, draft_dir, args.device, use_custom_ops)
        for batch in args.batch:
            prompts = [tokenizer.encode(t).ids for t in texts[:batch]]
            generate_plain(target, prompts, 4)  # warm-up
            plain = generate_plain(target, prompts, args.max_new_tokens)
            spec = SpeculativeDecoder(target, drafter, args.k).generate(prompts, args.max_new_tokens)
            if spec.tokens != plain.tokens:
                failures += 1
                print(f"CHECK FAILED: custom_ops={use_custom_ops} batch={batch}: speculative output differs")
            rows.append(dict(custom_ops=use_custom_ops, batch=batch, k=args.k,
                             plain_tokens_per_s=plain.stats.tokens_per_second,
                             spec_tokens_per_s=spec.stats.tokens_per_second,
                             speedup=spec.stats.tokens_per_second / plain.stats.tokens_per_second,
                             mean_acceptance_length=spec.stats.mean_acceptance_length))
    print(f"\nqspec_ext decoding on {device_name(args.device)} (qspec_ext {qspec_ext.__version__}, "
          f"{target_dir}, k={args.k}, {args.max_new_tokens} new tokens)")
    print(f"{'custom ops':>10}  {'batch':>5}  {'plain tok/s':>11}  {'spec tok/s':>10}  {'speed-up':>8}  {'accept len':>10}")
    for r in rows:
        print(f"{str(r['custom_ops']):>10}  {r['batch']:>5}  {r['plain_tokens_per_s']:>11.1f}  {r['spec_tokens_per_s']:>10.1f}"
              f"  {r['speedup']:>7.2f}x  {r['mean_acceptance_length']:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name(args.device), "rows": rows}, f, indent=1)
    if args.check:
        print("check: speculative output equals plain decoding" if failures == 0 else f"check: {failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
