"""Training data for SmolLM2-135M-Instruct's drafters, the seed recipe's way: prompts, and the
target's own regenerated answers to them (greedy, and at the card's sampling settings:
temperature 0.6, top-p 0.95, top-k 20).

    python scripts/make_smollm2_data.py [--out data/smollm2] [--magpie 600] [--batch 32]

Prompts (prompts.jsonl), deduplicated, filtered, and disjoint from the held-out evaluation set
(qspec_ext.prompts: heldout.jsonl, written by hand):
- Magpie: user turns the target writes itself, sampled after its chat template's user header;
- coding: "write a function" requests from the Python standard library's documented functions;
- math: arithmetic word problems from templates with random numbers;
- summarization: requests to summarize paragraphs of the standard library's module docstrings.
Magpie prompts (magpie.jsonl) and answers (answers.jsonl: prompt id, mode, the conversation's
token ids) are appended as they come; a rerun skips what is there, so the run can stop
(--limit-seconds) and resume, across sessions too.
"""

import argparse
import ast
import json
import random
import re
import sys
import sysconfig
import time
from pathlib import Path

import torch

from qspec_ext import generate_plain, load_target
from qspec_ext.prompts import HeldoutFilter, words
from qspec_ext.shipped import target_dir
from qspec_ext.text import chat_ids, load_tokenizer, stop_ids

REPO = Path(__file__).resolve().parents[1]
SAMPLING = dict(temperature=0.6, top_p=0.95, top_k=20)


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.glob("*.py")) if not p.name.startswith(("_", "test"))]


def coding_prompts(rng: random.Random, count: int) -> list[str]:
    found = []
    for path in stdlib_sources():
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = (ast.get_docstring(node) or "").strip().split("\n\n")[0].replace("\n", " ")
                if 20 <= len(doc) <= 200:
                    args = ", ".join(a.arg for a in node.args.args)
                    found.append(f"Write a Python function {node.name}({args}). {doc}")
    rng.shuffle(found)
    return found[:count]


def math_prompts(rng: random.Random, count: int) -> list[str]:
    templates = [
        "A box holds {a} pens. How many pens are in {b} boxes?",
        "{name} has {a} marbles and buys {b} more. Then {name} gives away {c}. How many marbles are left?",
        "A bus carries {a} people on each trip. How many trips are needed to carry {p} people?",
        "What is {a} percent of {p}? Show your work.",
        "A garden is {a} meters long and {b} meters wide. What is its area?",
        "{name} reads {a} pages a day. How many days does it take to read a book of {p} pages?",
        "Solve for x: {a}x - {b} = {c}.",
        "A ticket costs {a} dollars. How much do {b} tickets cost with a {c} dollar discount in total?",
        "The temperature was {a} degrees in the morning and rose by {b} degrees by noon, then fell by {c}. "
        "What was it in the evening?",
        "If {a} notebooks cost {p} cents, how much does one notebook cost?",
    ]
    names = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas"]
    out = set()
    while len(out) < count:
        t = rng.choice(templates)
        out.add(t.format(a=rng.randint(2, 40), b=rng.randint(2, 30), c=rng.randint(1, 20), p=rng.randint(50, 900),
                         name=rng.choice(names)))
    return sorted(out)


def summarization_prompts(rng: random.Random, count: int) -> list[str]:
    paragraphs = []
    for path in stdlib_sources():
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(errors="replace"))) or ""
        except SyntaxError:
            continue
        for para in doc.split("\n\n"):
            text = " ".join(para.split())
            if 200 <= len(text) <= 900 and not re.search(r"[>]{3}|\$ |::", text):
                paragraphs.append(text)
    asks = ["Summarize the following text in one sentence:", "Give a short summary of this passage:",
            "What is the main idea of this text?", "Summarize this in two sentences:"]
    rng.shuffle(paragraphs)
    return [f"{rng.choice(asks)}\n\n{p}" for p in paragraphs[:count]]


def magpie_prompts(target, directory: Path, out: Path, count: int, batch: int, seed: int,
                   deadline: float | None) -> list[str] | None:
    """User turns the target writes after its template's user header (Magpie), sampled; kept
    when they look like a request (10-300 characters, mostly letters, no template tokens).
    Appended to magpie.jsonl round by round (round r samples with seed + r): a rerun resumes.
    None when the deadline came first."""
    marker = "\u2063"
    full = chat_ids(directory, [{"role": "user", "content": marker}])
    tokenizer = load_tokenizer(directory)
    text = tokenizer.decode(full, skip_special_tokens=False)
    header = tokenizer.encode(text[: text.index(marker)], add_special_tokens=False).ids
    stops = stop_ids(directory)
    path = out / "magpie.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    round_ = max((r["round"] for r in rows), default=-1) + 1
    while len(rows) < count:
        if deadline is not None and time.time() > deadline:
            return None
        if round_ > 20 * count // batch + 20:
            raise RuntimeError(f"magpie: {len(rows)} prompts after {round_} rounds: the filter keeps almost nothing")
        result = generate_plain(target, [header] * batch, 64, temperature=1.0, top_p=0.98, eos_token_id=stops,
                                seed=seed + round_)
        kept = []
        for ids in result.tokens:
            if not ids or ids[-1] not in stops:
                continue  # unfinished: no end of turn within 64 tokens
            turn = tokenizer.decode(ids[:-1]).strip()
            letters = sum(ch.isalpha() or ch.isspace() for ch in turn)
            if 10 <= len(turn) <= 300 and letters >= 0.8 * len(turn) and "<|" not in turn:
                kept.append({"round": round_, "prompt": turn})
        with path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in kept))
        rows += kept
        round_ += 1
        print(f"magpie: {len(rows)} / {count}", file=sys.stderr, flush=True)
    return [r["prompt"] for r in rows[:count]]


def make_prompts(target, directory: Path, out: Path, args, deadline: float | None) -> list[dict] | None:
    path = out / "prompts.jsonl"
    if path.is_file():
        return [json.loads(line) for line in path.read_text().splitlines()]
    out.mkdir(parents=True, exist_ok=True)
    magpie = magpie_prompts(target, directory, out, args.magpie, args.batch, args.seed, deadline)
    if magpie is None:
        return None
    heldout = HeldoutFilter()
    rng = random.Random(args.seed)
    candidates = [("chat", p) for p in magpie]
    candidates += [("coding", p) for p in coding_prompts(rng, args.templated)]
    candidates += [("math", p) for p in math_prompts(rng, args.templated)]
    candidates += [("summarization", p) for p in summarization_prompts(rng, args.templated)]
    seen, rows = set(), []
    for category, prompt in candidates:
        key = " ".join(words(prompt))
        if key in seen or heldout.overlaps(prompt):
            continue
        seen.add(key)
        rows.append({"id": len(rows), "category": category, "prompt": prompt})
    out.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "data" / "smollm2"))
    parser.add_argument("--magpie", type=int, default=600, help="Magpie prompts to sample")
    parser.add_argument("--templated", type=int, default=250, help="templated prompts per category")
    parser.add_argument("--batch", type=int, default=32, help="batch 32: 192 tokens/s eager fp32, 16: 140; "
                                                                     "compiled 32: 168 (2 cores, 64 new tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit-seconds", type=float, default=None, help="stop (resumable) after this long")
    args = parser.parse_args()
    out = Path(args.out)
    start = time.time()
    directory = target_dir("smollm2")
    target = load_target("smollm2", dtype=torch.float32)
    deadline = None if args.limit_seconds is None else start + args.limit_seconds
    prompts = make_prompts(target, directory, out, args, deadline)
    if prompts is None:
        print("time limit reached while sampling Magpie prompts: rerun to resume", file=sys.stderr)
        return
    answers = out / "answers.jsonl"
    done = set()
    if answers.is_file():
        text = answers.read_text()
        if text and not text.endswith("\n"):  # a run killed mid-write: drop its unfinished line
            text = text[: text.rfind("\n") + 1]
            answers.write_text(text)
        done = {(r["id"], r["mode"]) for r in map(json.loads, text.splitlines())}
    stops = stop_ids(directory)
    print(f"{len(prompts)} prompts, {len(done)} of {2 * len(prompts)} answers done", file=sys.stderr)
    # Fixed batches (similar lengths together: less padding), each written whole and seeded by its
    # index: a resumed run writes what an uninterrupted one would.
    rows = sorted(prompts, key=lambda p: (len(p["prompt"]), p["id"]))
    for mode in ("greedy", "sampled"):
        for i in range(0, len(rows), args.batch):
            chunk = rows[i : i + args.batch]
            if all((p["id"], mode) in done for p in chunk):
                continue
            if deadline is not None and time.time() > deadline:
                print("time limit reached: rerun to resume", file=sys.stderr)
                return
            ids = [chat_ids(directory, [{"role": "user", "content": p["prompt"]}]) for p in chunk]
            sampling = SAMPLING if mode == "sampled" else {}
            result = generate_plain(target, ids, args.max_new_tokens, eos_token_id=stops, seed=args.seed + i,
                                    **sampling)
            with answers.open("a") as f:  # the batch in one write
                f.write("".join(json.dumps({"id": p["id"], "mode": mode, "prompt_length": len(prompt_ids),
                                            "ids": prompt_ids + answer}) + "\n"
                                for p, prompt_ids, answer in zip(chunk, ids, result.tokens)))
            print(f"{mode}: {i + len(chunk)} / {len(rows)} ({result.stats.tokens_per_second:.0f} tokens/s)",
                  file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
