"""The shipped pair's quality numbers (issue: a shipped pair worth showing), measured:

    python scripts/model_quality.py [--pair python/qspec_ext/demo_pair] [--files 40] [--tokens 512]

- the target's held-out cross-entropy: the first 512 tokens of the first 40 held-out stdlib
  files, in nats/token and nats/byte;
- the chain drafter on the 8 demo prompts, 96 new tokens, greedy, one request at a time:
  mean acceptance length at k = 3 and acceptance at draft position 3 at k = 4 (what
  `qspec bench --demo 8 --max-new-tokens 96` reports);
- the same for the P-EAGLE drafter, if the pair has one.
Prints one JSON object.
"""

import argparse
import json
from pathlib import Path

import torch

from qspec_ext import Eagle3Drafter, NativeTarget, SpeculativeDecoder
from qspec_ext.bench import in_batches
from qspec_ext.demo import DEMO_DIR, demo_prompts, heldout_cross_entropy


def acceptance(target, drafter, prompts, k: int, new_tokens: int) -> dict:
    s = in_batches(SpeculativeDecoder(target, drafter, k).generate, prompts, 1, max_new_tokens=new_tokens).stats
    return dict(k=k, mean_acceptance_length=s.mean_acceptance_length,
                acceptance_per_position=s.acceptance_rate_per_position)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default=str(DEMO_DIR))
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    from qspec_ext.text import load_tokenizer
    from transformers import AutoModelForCausalLM

    pair = Path(args.pair)
    tokenizer = load_tokenizer(pair / "target")
    model = AutoModelForCausalLM.from_pretrained(pair / "target", dtype=torch.float32).eval()
    per_token, per_byte = heldout_cross_entropy(model, tokenizer, args.files, args.tokens)
    report = {"heldout_nats_per_token": per_token, "heldout_nats_per_byte": per_byte,
              "size_mb": sum(f.stat().st_size for f in pair.rglob("*.safetensors")) / 1e6}
    target = NativeTarget.from_pretrained(pair / "target", dtype=torch.float32)
    prompts = [tokenizer.encode(t).ids for t in demo_prompts(args.prompts)]
    for name in ("draft", "draft-parallel"):
        if (pair / name).is_dir():
            drafter = Eagle3Drafter.from_pretrained(pair / name, dtype=torch.float32, target=target)
            report[name] = [acceptance(target, drafter, prompts, k, args.max_new_tokens) for k in (3, 4)]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
