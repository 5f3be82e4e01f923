"""Trains SmolLM2-135M-Instruct's shipped drafters on the target's regenerated answers
(scripts/make_smollm2_data.py): an EAGLE-3 chain drafter (Qwen3 architecture, TTT over 7 steps)
and a P-EAGLE drafter, both with an 8192-token draft vocabulary from the data's token counts,
stored in bf16 (both drafters together within ~40 MB: the embeddings are the target's).

    python scripts/train_smollm2.py [--steps 600] [--parallel-steps 400] [--only chain|parallel]
    python scripts/train_smollm2.py --smoke DIR      # 2 steps per part, on 16 records, into DIR: does it run

First the target (the native one, fp32) reads every record once (its aux features and top-32
draft-vocabulary labels, about 1.7 GB, kept in build/smollm2-train/features.pt and shared by both
parts); then each part trains the drafter alone on windows inside one record, its loss on the
answer tokens. Reproducible (fixed seeds) and resumable: each part checkpoints every 10 steps
under build/smollm2-train/ (not committed: about 110 MB per part) and a rerun on the same machine
continues where the last one stopped; a finished part is not trained again. fp32 throughout: on a
CPU without AVX-512 bf16 autocast ran a chain step 35x slower (71 s against 2.1 s). The shipped
drafters' run (an AVX2-only 2-core machine, 2026-12-03): the target's pass about 40 minutes (2152
records, 488k tokens), 600 chain steps (TTT over 7 steps, batch 4 x 256, compiled) at 3.0-3.4 s
about 34 minutes, 400 P-EAGLE steps about 16 minutes: about 92 minutes in all. Writes --out
(default python/qspec_ext/smollm2_pair/): {draft,draft-parallel} and loss_curves.json / .png (loss and accuracy per step, seconds per part).
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from qspec_ext.shipped import SMOLLM2_DIR, target_dir
from qspec_ext.train import TrainConfig, train_drafter

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "smollm2"
WORK = REPO / "build" / "smollm2-train"

COMMON = dict(draft_vocab=8192, arch="qwen3", seq_len=256, batch_size=4, lr=1e-3, seed=0, intermediate_size=1024,
              bf16=False, checkpoint_every=10, own_embeddings=False)
SMOKE_RECORDS = 16


def data_complete() -> bool:
    prompts = (DATA / "prompts.jsonl").read_text().splitlines() if (DATA / "prompts.jsonl").is_file() else []
    answers = (DATA / "answers.jsonl").read_text().splitlines() if (DATA / "answers.jsonl").is_file() else []
    done = {(r["id"], r["mode"]) for r in map(json.loads, answers)}  # a rerun batch may repeat rows
    return bool(prompts) and len(done) == 2 * len(prompts)


def train_part(name: str, config: TrainConfig, curves: dict, shipped: Path, data: Path) -> None:
    out = shipped / name
    if (out / "config.json").is_file() and name in curves:
        print(f"{name}: already trained ({out})", file=sys.stderr)
        return
    work = WORK / name
    drafter, history = train_drafter(target_dir("smollm2"), [data], work, config, features_file=WORK / "features.pt")
    seconds = json.loads((work / "history.json").read_text())["seconds"]  # every session's share
    drafter.to(torch.bfloat16).save_pretrained(out)  # without embeddings: the target lends its own
    curves[name] = {"loss": [h[0] for h in history], "accuracy": [h[1] for h in history], "seconds": seconds,
                    "config": dict(vars(config))}
    (shipped / "loss_curves.json").write_text(json.dumps(curves) + "\n")
    shutil.rmtree(work, ignore_errors=True)


def plot(curves: dict, shipped: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for name in ("draft", "draft-parallel"):
        if name in curves:
            axes[0].plot(curves[name]["loss"], label=name)
            axes[1].plot([a[0] for a in curves[name]["accuracy"]], label=f"{name}: first draft")
    axes[0].set(xlabel="step", ylabel="KL to the target", title="training loss")
    axes[1].set(xlabel="step", ylabel="top-1 agreement", title="accuracy")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(shipped / "loss_curves.png", dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="chain drafter steps")
    parser.add_argument("--parallel-steps", type=int, default=400, help="P-EAGLE drafter steps")
    parser.add_argument("--only", choices=["chain", "parallel"])
    parser.add_argument("--out", type=Path, default=SMOLLM2_DIR,
                        help="where the drafters go (default: the shipped ones' directory; a part already there is kept)")
    parser.add_argument("--smoke", metavar="DIR", help=f"2 steps per part on the first {SMOKE_RECORDS} records, written to DIR")
    args = parser.parse_args()
    shipped, data = args.out, DATA / "answers.jsonl"
    if args.smoke:
        shipped, args.steps, args.parallel_steps = Path(args.smoke), 2, 2
        global WORK
        WORK = shipped / "work"
        WORK.mkdir(parents=True, exist_ok=True)
        data = WORK / "answers.jsonl"
        data.write_text("".join((DATA / "answers.jsonl").read_text().splitlines(keepends=True)[:SMOKE_RECORDS]))
    elif not data_complete():
        sys.exit(f"train_smollm2: the data in {DATA} is incomplete: run scripts/make_smollm2_data.py until it is done")
    shipped.mkdir(parents=True, exist_ok=True)
    curves_path = shipped / "loss_curves.json"
    curves = json.loads(curves_path.read_text()) if curves_path.is_file() else {}
    if args.only in (None, "chain"):
        train_part("draft", TrainConfig(steps=args.steps, ttt_steps=7, compile=True, **COMMON), curves, shipped, data)
    if args.only in (None, "parallel"):
        train_part("draft-parallel", TrainConfig(steps=args.parallel_steps, parallel=True, parallel_depth=8,
                                                 **COMMON), curves, shipped, data)
    if all(name in curves for name in ("draft", "draft-parallel")):
        (WORK / "features.pt").unlink(missing_ok=True)
    plot(curves, shipped)


if __name__ == "__main__":
    main()
