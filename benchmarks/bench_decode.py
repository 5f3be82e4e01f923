"""End-to-end decoding: speculative vs plain, with the custom ops on and off, in one run.

    python benchmarks/bench_decode.py [--target DIR --draft DIR] [-k 3] [--batch 1 4] [--json PATH]

Without --target/--draft it builds a small random Qwen3 target and a random drafter:
almost nothing is accepted, so the numbers then show the cost of a draft-verify step
over a plain step, not a speed-up. Pass a trained pair for real acceptance. Reports
tokens/s, mean acceptance length and the speed-up of speculative over plain decoding;
--check fails when the greedy outputs differ.
"""

import argparse
import json
import sys

import torch
from common import device_name

import qspec_ext
from qspec_ext import Eagle3Config, Eagle3Drafter, Qwen3Target, SpeculativeDecoder, generate_plain
from qspec_ext.models.qwen3 import Qwen3Config


def random_pair(device: str, use_custom_ops: bool):
    torch.manual_seed(0)
    tc = Qwen3Config(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                     intermediate_size=768, vocab_size=4096, rope_theta=10000.0, max_position_embeddings=1024)
    target = Qwen3Target(tc, aux_layer_ids=[1, 3, 5], use_custom_ops=use_custom_ops)
    dc = Eagle3Config(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32, intermediate_size=768,
                      vocab_size=4096, draft_vocab_size=4096, num_aux=3, aux_layer_ids=[1, 3, 5], rope_theta=10000.0)
    drafter = Eagle3Drafter(dc, use_custom_ops=use_custom_ops)
    with torch.no_grad():
        for module in (target, drafter):
            for name, p in module.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0, 0.05)
    return target.to(device).eval(), drafter.to(device).eval()


def load_pair(args, use_custom_ops: bool):
    if args.target is None:
        return random_pair(args.device, use_custom_ops)
    config = json.loads(open(f"{args.draft}/config.json").read())
    target = Qwen3Target.from_pretrained(args.target, device=args.device, use_custom_ops=use_custom_ops,
                                         aux_layer_ids=config.get("eagle_aux_hidden_state_layer_ids"))
    drafter = Eagle3Drafter.from_pretrained(args.draft, device=args.device, target=target, use_custom_ops=use_custom_ops)
    return target, drafter


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--check", action="store_true", help="fail if greedy speculative output differs from plain")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--min-time", type=float, default=0.0, help="accepted for gpu_check.sh; unused")
    parser.add_argument("--no-compile", action="store_true", help="accepted for gpu_check.sh; unused")
    args = parser.parse_args()
    rows, failures = [], 0
    for use_custom_ops in (True, False):
        target, drafter = load_pair(args, use_custom_ops)
        vocab = target.config.vocab_size
        for batch in args.batch:
            g = torch.Generator().manual_seed(batch)
            prompts = [torch.randint(0, vocab, (args.prompt_length + 3 * b,), generator=g).tolist() for b in range(batch)]
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
          f"{'random pair' if args.target is None else args.target}, k={args.k}, {args.max_new_tokens} new tokens)")
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
