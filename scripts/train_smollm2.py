"""Trains SmolLM2-135M-Instruct's shipped drafters on the target's own answers
(scripts/make_smollm2_data.py: data/smollm2/answers.npz, and answers-v1.npz, the first data set),
speculators' EAGLE 3.1 way: a Qwen3
chain drafter with fc_norm (per-chunk norms of the aux features before fc), TTT over 3 steps, and
a P-EAGLE drafter, both with a draft vocabulary of the answers' most frequent tokens.

    python scripts/train_smollm2.py [--steps 1500] [--only chain|parallel]   # trains, or resumes
    python scripts/train_smollm2.py --export [--only chain|parallel]  # a running part's latest checkpoint, shipped
    python scripts/train_smollm2.py --curve [--per-category 8] [--curve-steps 100 200]   # the snapshots' acceptance
    python scripts/train_smollm2.py --smoke DIR      # 2 steps per part on 64 records, into DIR: does it run

The target's features and labels come from its transformers model (bf16: AMX / AVX512-BF16 run it
several times faster than fp32) in one batched pass over the data, kept under the user cache
(~/.cache/qspec_ext/train-features/, about 3.5 KB a token, with a manifest beside each file) and
rebuilt when missing. The chain trains on windows of 1024 rows packed with whole records, its loss
(KL to the target over the draft vocabulary) and draft logits on the answer rows only; bf16
autocast where the CPU has AMX or AVX512-BF16 (without them bf16 is many times slower: fp32).
At steps 0, 25, 50, 100, 200, ... the drafter's teacher-forced accuracy on the held-out prompts' answers
(heldout_answers.npz; never trained on) is logged, and a copy of the drafter is kept under
build/smollm2-train/<part>/curve/ for the acceptance side of the learning curve.

--curve decodes the held-out prompts (chat template, greedy, k = 3, 128 new tokens, bf16) with each
kept snapshot and writes learning_curve.json / .png beside the shipped drafters: teacher-forced
accuracy and decode acceptance against the answer tokens trained on.

Resuming: on the same machine from build/smollm2-train/<part>/checkpoint.pt (every 25 steps,
exact); on a new one from the shipped drafter and its training.json (a warm start: its weights,
the step it reached, the learning rate where the cosine schedule was; a fresh optimizer). --export
writes the shipped drafter and training.json from the latest checkpoint while a run goes on (what a
session commits before it stops); --steps may grow between runs.
"""

import argparse
import hashlib
import json
import math
import shutil
import sys
from pathlib import Path

import torch

from qspec_ext.shipped import SMOLLM2_DIR, cache_root, target_dir
from qspec_ext.train import (TrainConfig, batched_capture, cached_target_features, draft_vocabulary, evaluate_ttt,
                             npz_records, train_drafter)

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "smollm2"
# The first data set (2026-12-03: Magpie chat, stdlib coding, templated math, docstring summaries) and
# the second (balanced over the held-out categories, target-written passages to summarize).
ANSWERS, HELDOUT = [DATA / "answers-v1.npz", DATA / "answers.npz"], DATA / "heldout_answers.npz"
WORK = REPO / "build" / "smollm2-train"
PARTS = {"chain": "draft", "parallel": "draft-parallel"}


def cpu_has_fast_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return " amx_bf16" in flags or " avx512_bf16" in flags


def configs(steps: int, bf16: bool) -> dict[str, TrainConfig]:
    common = dict(draft_vocab=8192, arch="qwen3", fc_norm=True, intermediate_size=1024, seed=0, bf16=bf16,
                  capture_bf16=True, checkpoint_every=25, own_embeddings=False)
    return {"chain": TrainConfig(steps=steps, ttt_steps=3, seq_len=1024, batch_size=4, lr=1e-3, pack=True, **common),
            "parallel": TrainConfig(steps=steps, parallel=True, parallel_depth=8, seq_len=256, batch_size=8, lr=1e-3,
                                    **common)}


def file_hash(paths) -> str:
    digest = hashlib.sha256()
    for path in [paths] if isinstance(paths, Path) else paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def features_file(data: list[Path], config: TrainConfig) -> Path:
    """Under the user cache, named by the data and what the features hold."""
    key = hashlib.sha256(f"{file_hash(data)} {config.draft_vocab} {config.aux_layer_ids} bf16-hf v1".encode()).hexdigest()
    return cache_root() / "train-features" / f"smollm2-{key[:16]}.pt"


def heldout_evaluator(config: TrainConfig, data: list[Path]):
    """evaluate(drafter) -> held-out teacher-forced KL and accuracy per TTT step (3 steps)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(target_dir("smollm2")).vocab_size
    _, draft_ids = draft_vocabulary([r for path in data for r in npz_records(path)], vocab, config.draft_vocab)
    records = npz_records(HELDOUT)
    key = hashlib.sha256(f"{file_hash(HELDOUT)} {draft_ids.tolist()}".encode()).hexdigest()[:16]
    store = cached_target_features(None, records, draft_ids, cache_root() / "train-features" / f"heldout-{key}.pt", False,
                             batched_capture(target_dir("smollm2"), [2, 15, 27], "cpu", False))

    def evaluate(drafter) -> dict:
        return evaluate_ttt(drafter, store, 3, bf16=config.bf16)

    return evaluate


def training_record(work: Path, config: TrainConfig, data: list[Path]) -> dict:
    """What the shipped drafter's training.json keeps: enough to plot it and to resume from it."""
    state = torch.load(work / "checkpoint.pt", weights_only=False) if (work / "checkpoint.pt").is_file() else None
    history = json.loads((work / "history.json").read_text()) if state is None else dict(
        history=state["history"], seconds=state["seconds"], rows_seen=state["rows_seen"],
        evaluations=state["evaluations"])
    return dict(config=dict(vars(config)), data=dict(files=[p.name for p in data], sha256_16=file_hash(data)),
                steps_done=len(history["history"]), **history)


def export(part: str, config: TrainConfig, data: list[Path], shipped: Path, before: dict | None) -> None:
    """The part's drafter (bf16, embeddings borrowed) and training.json into the shipped directory,
    from its finished run or its latest checkpoint; ``before``: an earlier session's record this run
    continued (warm start), whose history comes first."""
    from qspec_ext import load_target
    from qspec_ext.models import Eagle3Config, Eagle3Drafter

    work = WORK / part
    record = training_record(work, config, data)
    if before is not None:
        offset = before["steps_done"]
        record["history"] = before["history"] + record["history"]
        record["evaluations"] = before["evaluations"] + [
            dict(e, step=e["step"] + offset, rows_seen=e["rows_seen"] + before["rows_seen"]) for e in record["evaluations"]]
        record["rows_seen"] += before["rows_seen"]
        record["seconds"] += before["seconds"]
        record["steps_done"] += offset
        record["warm_started_at"] = before.get("warm_started_at", []) + [offset]
    if (work / "checkpoint.pt").is_file():
        state = torch.load(work / "checkpoint.pt", weights_only=False)
        drafter = Eagle3Drafter(Eagle3Config(**state["drafter_config"]), use_custom_ops=False)
        drafter.load_state_dict(state["drafter"])
        drafter.embeddings_borrowed = state["embeddings_borrowed"]
    else:
        drafter = Eagle3Drafter.from_pretrained(work, dtype=torch.float32, target=load_target("smollm2"))
    out = shipped / PARTS[part]
    drafter.to(torch.bfloat16).save_pretrained(out)
    (out / "training.json").write_text(json.dumps(record) + "\n")
    print(f"{part}: step {record['steps_done']} exported to {out}", file=sys.stderr)


def train_part(part: str, config: TrainConfig, data: list[Path], shipped: Path, evaluate) -> None:
    work = WORK / part
    out = shipped / PARTS[part]
    record = json.loads((out / "training.json").read_text()) if (out / "training.json").is_file() else None
    if record is not None and record["data"]["sha256_16"] != file_hash(data):
        record = None  # a drafter of other data: start afresh
    before, init = None, None
    if record is not None and not (work / "checkpoint.pt").is_file():
        if record["steps_done"] >= config.steps:
            return print(f"{part}: trained ({record['steps_done']} steps, {out})", file=sys.stderr)
        # A warm start from the shipped drafter: the rest of the steps, from the learning rate reached.
        before, init = record, out
        done = record["steps_done"]
        config = TrainConfig(**dict(vars(config), steps=config.steps - done,
                                    lr=config.lr * 0.5 * (1 + math.cos(math.pi * done / config.steps))))
        (work / "before.json").parent.mkdir(parents=True, exist_ok=True)
        (work / "before.json").write_text(json.dumps(record) + "\n")
    elif (work / "before.json").is_file():
        before = json.loads((work / "before.json").read_text())
        # The warm start's learning rate stays what it was when this run began (the checkpoint's),
        # whatever the new total: the cosine from there is recomputed for the remaining steps.
        lr = config.lr * 0.5 * (1 + math.cos(math.pi * before["steps_done"] / config.steps))
        if (work / "checkpoint.pt").is_file():
            lr = torch.load(work / "checkpoint.pt", weights_only=False, map_location="cpu")["config"].lr
        config = TrainConfig(**dict(vars(config), steps=config.steps - before["steps_done"], lr=lr))

    def evaluate_and_keep(drafter, step: int) -> dict:
        result = evaluate(drafter) if evaluate is not None else {}
        overall = step + (before["steps_done"] if before is not None else 0)
        drafter.save_pretrained(snapshot_dir(part, overall))  # a copy for the acceptance curve
        print(f"{part}: held-out {json.dumps(result)}", file=sys.stderr, flush=True)
        return result

    train_drafter(target_dir("smollm2"), data, work, config, features_file=features_file(data, config),
                  init_from=init, evaluate=evaluate_and_keep if part == "chain" else None, eval_steps=eval_steps(config.steps))
    export(part, config, data, shipped, before)
    for name in ("checkpoint.pt", "before.json"):
        (work / name).unlink(missing_ok=True)


def snapshot_dir(part: str, step: int) -> Path:
    return WORK / part / "curve" / f"step-{step:05d}"


def eval_steps(steps: int) -> set[int]:
    """Log-spaced: 0, 25, 50, 100, 200, ... (and the end: the trainer's)."""
    return {0} | {25 * 2**i for i in range(20) if 25 * 2**i < steps}


def plot(shipped: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for part, name in PARTS.items():
        path = shipped / name / "training.json"
        if not path.is_file():
            continue
        record = json.loads(path.read_text())
        losses = [h[0] for h in record["history"]]
        window = 25
        smooth = [sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
                  for i in range(len(losses))]
        axes[0].plot(smooth, label=f"{name} (mean of {window} steps)")
        evals = record.get("evaluations", [])
        for j in range(len(evals[0]["accuracy"]) if evals else 0):
            axes[1].plot([e["rows_seen"] for e in evals], [e["accuracy"][j] for e in evals], "o-",
                         label=f"{name}: draft position {j + 1}")
    axes[0].set(xlabel="step", ylabel="KL to the target (training batches)", title="training loss")
    axes[1].set(xscale="log", xlabel="answer tokens trained on (token-passes)", ylabel="top-1 agreement",
                title="held-out teacher-forced accuracy")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(shipped / "loss_curves.png", dpi=110)


def learning_curve(shipped: Path, per_category: int, steps: list[int] | None = None) -> None:
    """Decode acceptance (k = 3, greedy) of each snapshot beside its held-out teacher-forced accuracy."""
    from qspec_ext import SpeculativeDecoder, load_target
    from qspec_ext.models import Eagle3Drafter
    from qspec_ext.prompts import CATEGORIES, heldout_prompts
    from qspec_ext.text import chat_ids, stop_ids

    directory = target_dir("smollm2")
    record = json.loads((shipped / "draft" / "training.json").read_text())
    target = load_target("smollm2", dtype=torch.bfloat16)
    stops = stop_ids(directory)
    prompts = {c: [chat_ids(directory, [{"role": "user", "content": r["prompt"]}])
                   for r in heldout_prompts(c)[:per_category]] for c in CATEGORIES}
    rows, done = [], set()
    for evaluation in record["evaluations"]:
        snapshot = snapshot_dir("chain", evaluation["step"])
        if (steps and evaluation["step"] not in steps) or not snapshot.is_dir() or evaluation["step"] in done:
            continue
        done.add(evaluation["step"])
        drafter = Eagle3Drafter.from_pretrained(snapshot, dtype=torch.bfloat16, target=target)
        decoder = SpeculativeDecoder(target, drafter, 3)
        per = {}
        for category, ids in prompts.items():
            stats = decoder.generate(ids, 128, eos_token_id=stops).stats
            per[category] = (stats.num_generated_tokens, stats.num_drafts, stats.num_accepted_tokens)
        generated, drafts, accepted = (sum(v[i] for v in per.values()) for i in range(3))
        rows.append(dict(step=evaluation["step"], rows_seen=evaluation["rows_seen"], accuracy=evaluation["accuracy"],
                         kl=evaluation["kl"], acceptance_k3=1 + accepted / max(drafts, 1),
                         per_category={c: 1 + v[2] / max(v[1], 1) for c, v in per.items()}))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    path = shipped / "learning_curve.json"  # the rows measured before stay unless measured again
    kept = {r["step"]: r for r in (json.loads(path.read_text()) if path.is_file() else [])}
    rows = sorted({**kept, **{r["step"]: r for r in rows}}.values(), key=lambda r: r["step"])
    path.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"| step | answer tokens trained on | held-out accuracy, positions 1 / 2 / 3 | acceptance length, k = 3 "
          f"| {' | '.join(CATEGORIES)} |\n|---|---|---|---|{'---|' * len(CATEGORIES)}")
    for r in rows:
        print(f"| {r['step']} | {r['rows_seen']:,} | {' / '.join(f'{a:.3f}' for a in r['accuracy'])} | "
              f"{r['acceptance_k3']:.2f} | " + " | ".join(f"{r['per_category'][c]:.2f}" for c in CATEGORIES) + " |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    seen = [max(r["rows_seen"], 1) for r in rows]
    for j in range(3):
        ax.plot(seen, [r["accuracy"][j] for r in rows], "o-", label=f"teacher-forced accuracy, position {j + 1}")
    ax.set(xscale="log", xlabel="answer tokens trained on (token-passes)", ylabel="accuracy")
    right = ax.twinx()
    right.plot(seen, [r["acceptance_k3"] for r in rows], "s--k", label="acceptance length, k = 3 (right)")
    right.set_ylabel("tokens per target forward")
    fig.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.1, 0.95))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(shipped / "learning_curve.png", dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500, help="steps per part (may grow between runs)")
    parser.add_argument("--only", choices=list(PARTS))
    parser.add_argument("--out", type=Path, default=SMOLLM2_DIR, help="where the drafters go")
    parser.add_argument("--export", action="store_true", help="write the shipped drafters from the latest checkpoints")
    parser.add_argument("--curve", action="store_true", help="decode acceptance of the chain's snapshots")
    parser.add_argument("--per-category", type=int, default=8, help="--curve: held-out prompts per category")
    parser.add_argument("--curve-steps", type=int, nargs="+", help="--curve: only the snapshots of these steps")
    parser.add_argument("--smoke", metavar="DIR", help="2 steps per part on 64 records, written to DIR")
    args = parser.parse_args()
    global WORK
    shipped, data, steps = args.out, ANSWERS, args.steps
    if args.smoke:
        import numpy as np

        shipped, steps = Path(args.smoke), 2
        WORK = shipped / "work"
        WORK.mkdir(parents=True, exist_ok=True)
        with np.load(ANSWERS[-1]) as z:
            n = int(z["starts"][64])
            data = [WORK / "answers.npz"]
            np.savez(data[0], ids=z["ids"][:n], starts=z["starts"][:65], prompt_length=z["prompt_length"][:64])
    elif not all(path.is_file() for path in ANSWERS):
        sys.exit(f"train_smollm2: {ANSWERS} not all found: run scripts/make_smollm2_data.py")
    parts = [args.only] if args.only else list(PARTS)
    all_configs = configs(steps, cpu_has_fast_bf16())
    if args.curve:
        return learning_curve(shipped, args.per_category, args.curve_steps)
    if args.export:
        for part in parts:
            before = WORK / part / "before.json"
            export(part, all_configs[part], data, shipped, json.loads(before.read_text()) if before.is_file() else None)
        return plot(shipped)
    shipped.mkdir(parents=True, exist_ok=True)
    for part in parts:
        evaluate = heldout_evaluator(all_configs[part], data) if part == "chain" else None
        train_part(part, all_configs[part], data, shipped, evaluate)
        plot(shipped)
    if args.smoke:
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
