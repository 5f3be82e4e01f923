"""transformers targets (hybrid, MoE, dense) through HFTarget: plain vs speculative decoding.

    python benchmarks/bench_hf_targets.py [--hf-target-config qwen3_next qwen3_5 qwen3] [-k 3]
                                          [--batch 1 4] [--max-new-tokens 32] [--hidden 256 --layers 8]
                                          [--device cuda] [--dtype bf16] [--json PATH]

Random models of the given size are built here (no downloads; hybrids use Qwen3-Next /
Qwen3.5's 3:1 linear:full layer pattern). Reports tokens/s of plain decoding and of
speculative decoding with an oracle drafter (drafts the target's own greedy continuation: every
draft accepted, no rollback) and with a random drafter (nearly every draft rejected: a rollback
every step), the latter with the replay inside the linear-attention mixers (default) and as
whole-model forwards (split_mixers=False). The verify-call times (fastest target forward of a
step, from a profiled run that synchronizes the device; tokens/s are the median of --repeat runs) give the rollback's share of a
rejecting step: 1 - all-accepted call / rejecting call (the calls score the same k+1 tokens).
Fails when a greedy speculative output differs from plain decoding.
"""

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import transformers
from common import device_name

from qspec_ext import Eagle3Config, Eagle3Drafter, HFTarget, SpeculativeDecoder, generate_plain
from qspec_ext.bench import interleaved_rounds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import OracleDrafter, oracle_decoder  # noqa: E402  (the tests' oracle: the continuation as drafts)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CLASSES = {"qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
           "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def build_target(kind: str, hidden: int, layers: int, vocab: int, device, dtype) -> torch.nn.Module:
    """A random model with Qwen3-Next / Qwen3.5's 3:1 linear:full layer pattern (dense MLPs)."""
    config_cls, model_cls = (getattr(transformers, n) for n in CLASSES[kind])
    heads = max(hidden // 64, 2)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), head_dim=64,
                  max_position_embeddings=4096, eos_token_id=None)
    if kind != "qwen3":
        common.update(layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
                      linear_num_key_heads=max(heads // 2, 1), linear_num_value_heads=heads, linear_key_head_dim=64,
                      linear_value_head_dim=64, linear_conv_kernel_dim=4)
    if kind == "qwen3_next":
        common.update(num_experts=0, mlp_only_layers=list(range(layers)))
    torch.manual_seed(0)
    return model_cls(config_cls(**common)).to(device=device, dtype=dtype).eval()


def build_drafter(target: HFTarget, device, dtype) -> Eagle3Drafter:
    H = target.hidden_size
    config = Eagle3Config(hidden_size=H, num_attention_heads=max(H // 64, 2), num_key_value_heads=1, head_dim=64,
                          intermediate_size=2 * H, vocab_size=target.vocab_size, draft_vocab_size=target.vocab_size,
                          num_aux=len(target.aux_layer_ids), aux_layer_ids=target.aux_layer_ids)
    torch.manual_seed(1)
    drafter = Eagle3Drafter(config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.05)
    return drafter.to(device=device, dtype=dtype).eval()


def median_run(generate, prompts, max_new_tokens: int, rounds: int):
    """The first run's result and the median tokens/s of ``rounds`` runs (each target wraps the
    model with its own hooks, so the targets run one after another, not interleaved)."""
    timed = interleaved_rounds({"run": generate}, prompts, len(prompts), rounds, max_new_tokens=max_new_tokens)
    return timed.results["run"][0], timed.median("run")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-target-config", nargs="+", choices=list(CLASSES), default=list(CLASSES))
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-new-tokens", type=int, help="default 32, 16 with --check")
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--repeat", type=int, help="timed runs per measurement (median); default 3, 1 with --check")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--check", action="store_true",
                        help="a quick run for gpu_check.sh (16 new tokens, one timed run); a greedy mismatch always fails")
    parser.add_argument("--min-time", type=float, default=0.0, help="accepted for gpu_check.sh; unused")
    parser.add_argument("--no-compile", action="store_true", help="accepted for gpu_check.sh; unused")
    args = parser.parse_args()
    if args.repeat is None:
        args.repeat = 1 if args.check else 3
    if args.max_new_tokens is None:
        args.max_new_tokens = 16 if args.check else 32
    device, dtype = args.device, DTYPES[args.dtype]
    print(f"# {device_name(device)}, {args.dtype}, hidden {args.hidden}, {args.layers} layers, k={args.k}, "
          f"{args.max_new_tokens} new tokens, prompts of ~{args.prompt_length}, transformers {transformers.__version__}")
    print("| target | batch | plain tok/s | oracle tok/s (x plain) | random tok/s (x plain) | random, replay as "
          "forwards tok/s | verify call ms: all accepted / rollback / rollback as forwards | rollback share of a "
          "rejecting step |")
    print("|---|---|---|---|---|---|---|---|")
    rows, failed = [], False
    for kind in args.hf_target_config:
        model = build_target(kind, args.hidden, args.layers, args.vocab, device, dtype)
        base = HFTarget(model)
        drafter = build_drafter(base, device, dtype)
        for batch in args.batch:
            g = torch.Generator().manual_seed(batch)
            prompts = [torch.randint(0, args.vocab, (args.prompt_length - 7 * b,), generator=g).tolist()
                       for b in range(batch)]  # ragged
            n = args.max_new_tokens
            generate_plain(base, prompts, 4)  # warm-up
            plain, plain_tps = median_run(partial(generate_plain, base), prompts, n, args.repeat)
            full = generate_plain(base, prompts, n + 2 * args.k).tokens
            oracle = OracleDrafter(drafter, full, [len(p) for p in prompts])
            runs = [("oracle", oracle, True), ("random", drafter, True)]
            if base._has_linear:
                runs.append(("random_forwards", drafter, False))
            result = {}
            for name, d, split in runs:
                target = HFTarget(model, split_mixers=split)
                decoder = oracle_decoder(target, d, args.k) if d is oracle else SpeculativeDecoder(target, d, args.k)
                spec, tps = median_run(decoder.generate, prompts, n, args.repeat)
                failed |= spec.tokens != plain.tokens
                target.profile = True
                decoder.generate(prompts, n)
                target._hooks.detach()
                stats = target.stats
                result[name] = dict(tokens_per_second=tps, mean_acceptance_length=spec.stats.mean_acceptance_length,
                                    identical_to_plain=spec.tokens == plain.tokens,
                                    verify_call_ms=1e3 * min(stats.per_call[1:]),
                                    replay_forwards=stats.replay_forwards, mixer_splits=stats.mixer_splits,
                                    replay_tokens=stats.replay_tokens, calls=stats.calls)
            o, r = result["oracle"], result["random"]
            f = result.get("random_forwards")
            share = 1 - o["verify_call_ms"] / r["verify_call_ms"]
            f_tps = f"{f['tokens_per_second']:.1f}" if f else "-"
            f_ms = f"{f['verify_call_ms']:.1f}" if f else "-"
            print(f"| {kind} | {batch} | {plain_tps:.1f} | {o['tokens_per_second']:.1f} "
                  f"({o['tokens_per_second'] / plain_tps:.2f}) | {r['tokens_per_second']:.1f} "
                  f"({r['tokens_per_second'] / plain_tps:.2f}) | {f_tps} | "
                  f"{o['verify_call_ms']:.1f} / {r['verify_call_ms']:.1f} / {f_ms} | {100 * share:.0f}% |", flush=True)
            rows.append(dict(target=kind, batch=batch, plain_tokens_per_second=plain_tps, **{
                f"{name}_{key}": value for name, res in result.items() for key, value in res.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device_name(device), args=vars(args), rows=rows), f, indent=1)
    if failed:
        print("FAIL: a greedy speculative output differs from plain decoding", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
