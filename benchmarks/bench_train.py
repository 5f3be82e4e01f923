"""Drafter training step time: fp32 vs bf16 autocast vs bf16 + compiled TTT loss, in one run.

    python benchmarks/bench_train.py [--steps 4] [--rounds 3] [--device cpu] [--json PATH]

One step = the drafter's loss (forward), backward and AdamW step on a fixed batch of 8 x 256
tokens of held-out standard-library code (the teacher's features and logits computed once, untimed: they are
the same in every mode). The drafters are the shipped ones (python/qspec_ext/demo_pair):
the chain drafter with 7 TTT steps, the P-EAGLE drafter with COD depth 8. Modes take turns
in each round; each mode's best round is reported, with its speed-up over fp32 in the same
run. The compiled mode's first call (compilation) is untimed and reported on its own.
"""

import argparse
import json
from functools import partial

import torch
from common import device_name

from qspec_ext import Eagle3Drafter, NativeTarget
from qspec_ext.bench import interleaved_calls
from qspec_ext.demo import DEMO_DIR, stdlib_files
from qspec_ext.rope import rope_cos_sin_cache
from qspec_ext.train import TrainConfig, draft_labels, parallel_loss, ttt_loss

SEQ, BATCH, TTT, DEPTH = 256, 8, 7, 8


def teacher_batch(device: str):
    from qspec_ext.text import load_tokenizer
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(DEMO_DIR / "target")
    stream = [t for path in stdlib_files("heldout")[:40] for t in tokenizer.encode(path.read_text(errors="replace")).ids]
    ids = torch.tensor(stream[: BATCH * SEQ], device=device).view(BATCH, SEQ)
    target = AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return ids, out


def drafter(name: str, device: str) -> Eagle3Drafter:
    target = NativeTarget.from_pretrained(DEMO_DIR / "target", dtype=torch.float32, device=device)
    model = Eagle3Drafter.from_pretrained(DEMO_DIR / name, dtype=torch.float32, device=device, target=target,
                                          use_custom_ops=False)
    model.embed_tokens.weight.requires_grad_(model.config.parallel_drafting)
    return model.train()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    device = args.device
    ids, out = teacher_batch(device)
    rows = {}
    for kind, name in (("chain", "draft"), ("parallel", "draft-parallel")):
        model = drafter(name, device)
        c = model.config
        cos_sin = rope_cos_sin_cache(SEQ + DEPTH + 1, c.head_dim, c.rope_theta, device=device, scaling=c.rope_scaling)
        aux = model.config.aux_layer_ids
        features = torch.cat([out.hidden_states[i] for i in aux], dim=-1)
        draft_ids = model.t2d.nonzero().flatten() if model.t2d is not None else torch.arange(c.vocab_size, device=device)
        labels = draft_labels(out.logits, draft_ids)  # what the trainer stores per token
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-5)
        if kind == "chain":
            loss_fn = partial(ttt_loss, ttt_steps=TTT, cos_sin=cos_sin)
            modes = {"fp32": (loss_fn, False), "bf16": (loss_fn, True), "bf16 compiled": (torch.compile(loss_fn), True)}
        else:
            loss_fn = partial(parallel_loss, config=TrainConfig(parallel=True, parallel_depth=DEPTH), cos_sin=cos_sin,
                              generator=torch.Generator().manual_seed(0))
            modes = {"fp32": (loss_fn, False), "bf16": (loss_fn, True)}

        def step(fn, bf16):
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
                loss, _ = fn(model, ids, features, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if device.startswith("cuda"):
                torch.cuda.synchronize()

        calls = {mode: partial(step, fn, bf16) for mode, (fn, bf16) in modes.items()}
        first = {mode: times[0] for mode, times in interleaved_calls(calls, rounds=1).items()}  # compiles
        timed = interleaved_calls(calls, rounds=args.rounds, repeat=args.steps)
        best = {mode: min(times) for mode, times in timed.items()}
        for mode in modes:
            rows[f"{kind} {mode}"] = {"s_per_step": best[mode], "speedup_vs_fp32": best["fp32"] / best[mode],
                                      "first_step_s": first[mode]}
            print(f"{kind:8s} {mode:14s} {best[mode]:.3f} s/step  {best['fp32'] / best[mode]:.2f}x fp32  "
                  f"(first step {first[mode]:.1f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name(device), "batch": BATCH, "seq_len": SEQ, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
