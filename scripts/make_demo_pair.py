"""Reproduces the demo pair shipped in python/qspec_ext/demo_pair/ (deterministic: fixed seeds).

    python scripts/make_demo_pair.py [--out python/qspec_ext/demo_pair]

1. corpus: the standard library's .py files, 1 in 10 held out (qspec_ext.demo.stdlib_files);
2. a byte-level BPE tokenizer (vocab 512) trained with `tokenizers`;
3. a small Qwen3 target (8 layers, hidden 192, GQA 3/1 heads of 64, q/k norm) trained from
   scratch on 512-token windows, its held-out cross-entropy measured every 250 steps;
4. two Qwen3-architecture EAGLE-3 drafters for it (draft vocab 384), trained with
   `qspec_ext.train.train_drafter` on the target's own greedy continuations of corpus windows
   (`regenerate`): `draft` a chain drafter with 7 TTT steps (MLP 1024 wide, 2000 steps),
   `draft-parallel` a P-EAGLE drafter (parallel drafting, COD depth 8, 1200 steps);
weights saved in bf16, and the loss curves in loss_curves.json / loss_curves.png.
The target trains under bf16 autocast, compiled; the drafters with bf16 autocast, the chain's TTT
loss compiled. On the 2-core CPU of the dev machine this took 97 minutes (see the README).
"""

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from qspec_ext.demo import heldout_cross_entropy, stdlib_files
from qspec_ext.train import TrainConfig, Windows, train_drafter

EOS = "<|endoftext|>"
VOCAB = 512


def train_tokenizer(files, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([str(f) for f in files], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS).save_pretrained(out_dir)
    return tokenizer


def train_target(tokenizer, files, out_dir: Path, steps: int, curves: dict):
    from tqdm import tqdm
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    eos = tokenizer.token_to_id(EOS)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=192, intermediate_size=384, num_hidden_layers=8,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                         rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=eos, bos_token_id=eos)
    model = Qwen3ForCausalLM(config)
    stream = []
    for f in files:
        stream += tokenizer.encode(f.read_text(errors="replace")).ids + [eos]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 100) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s / steps, 1.0)))))
    data = Windows(stream, 513, 8, random.Random(0))
    curve = curves["target"] = {"step": [], "train_loss": [], "eval_step": [], "heldout_nats_per_token": []}
    compiled = torch.compile(model)  # the training forward and backward; the evaluation runs eager, fp32
    bar = tqdm(range(steps), desc="train-target", mininterval=30)
    for step in bar:
        ids = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 matmuls (AMX where the CPU has it), fp32 weights
            loss = compiled(ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        curve["step"].append(step)
        curve["train_loss"].append(loss.item())
        if (step + 1) % 250 == 0 or step + 1 == steps:
            model.eval()
            ce, _ = heldout_cross_entropy(model, tokenizer)
            model.train()
            curve["eval_step"].append(step + 1)
            curve["heldout_nats_per_token"].append(ce)
            print(f"step {step + 1}: held-out cross-entropy {ce:.3f} nats/token", flush=True)
        bar.set_postfix(loss=f"{float(loss):.3f}")
    model.to(torch.bfloat16).save_pretrained(out_dir)
    GenerationConfig(eos_token_id=eos, bos_token_id=eos).save_pretrained(out_dir)


def train_shipped_drafter(out: Path, name: str, files, config: TrainConfig, curves: dict):
    from qspec_ext import Eagle3Drafter, NativeTarget

    _, history = train_drafter(out / "target", files, out / name, config)
    curves[name] = {"loss": [h[0] for h in history], "accuracy_per_step": [h[1] for h in history]}
    # Ship bf16 weights, like the target.
    target = NativeTarget.from_pretrained(out / "target")
    Eagle3Drafter.from_pretrained(out / name, dtype=torch.bfloat16, target=target).save_pretrained(out / name)


def plot_curves(curves: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    if "target" in curves:
        t = curves["target"]
        axes[0].plot(t["step"], t["train_loss"], lw=0.5, alpha=0.6, label="train (one batch)")
        axes[0].plot(t["eval_step"], t["heldout_nats_per_token"], "o-", label="held out")
        axes[0].set(title="target: cross-entropy", xlabel="step", ylabel="nats/token")
        axes[0].legend()
    for ax, name in zip(axes[1:], ("draft", "draft-parallel")):
        if name not in curves:
            continue
        accuracy = list(zip(*curves[name]["accuracy_per_step"]))
        for i, acc in enumerate(accuracy):
            ax.plot(acc, lw=0.5, label=f"{'step' if name == 'draft' else 'depth'} {i + 1}")
        ax.set(title=f"{name}: top-1 agreement with the target", xlabel="step", ylim=(0, 1))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "python/qspec_ext/demo_pair"))
    parser.add_argument("--target-steps", type=int, default=2000)
    parser.add_argument("--drafter-steps", type=int, default=None,
                        help="training steps of each drafter (default: 2000 chain, 1200 parallel)")
    parser.add_argument("--skip-target", action="store_true", help="reuse the target already in --out")
    parser.add_argument("--only", choices=["draft", "draft-parallel"], help="train only this drafter")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curves_path = out / "loss_curves.json"
    curves = {}
    train_files = stdlib_files("train")
    start = time.time()
    if not args.skip_target:
        tokenizer = train_tokenizer(train_files, out / "target")
        train_target(tokenizer, train_files, out / "target", args.target_steps, curves)
        curves_path.write_text(json.dumps(curves))
        curves["seconds"] = {"target": round(time.time() - start)}
        print(f"target trained in {time.time() - start:.0f} s", flush=True)
    # Both drafters learn from the target's own greedy continuations (regenerate): the text they will draft.
    common = dict(draft_vocab=384, arch="qwen3", seq_len=256, batch_size=8, lr=2e-3, seed=0, regenerate=True,
                  bf16=True, compile=True)
    # The chain drafter: a wider MLP (1024, the target's is 384) and a longer schedule bought
    # acceptance at every draft position (13% more time per training step).
    drafters = {"draft": TrainConfig(ttt_steps=7, steps=args.drafter_steps or 2000, intermediate_size=1024, **common),
                "draft-parallel": TrainConfig(parallel=True, parallel_depth=8, steps=args.drafter_steps or 1200, **common)}
    for name, config in drafters.items():
        if args.only in (None, name):
            began = time.time()
            train_shipped_drafter(out, name, train_files, config, curves)
            curves.setdefault("seconds", {})[name] = round(time.time() - began)
            print(f"{name} trained in {time.time() - began:.0f} s", flush=True)
    # Merged with what is there now: the drafters may be trained by separate --only runs.
    before = json.loads(curves_path.read_text()) if curves_path.is_file() else {}
    seconds = {**before.get("seconds", {}), **curves.get("seconds", {})}
    curves = {**before, **curves, "seconds": seconds}
    curves_path.write_text(json.dumps(curves))
    plot_curves(curves, out / "loss_curves.png")
    print(f"demo pair written to {out} in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
