"""The shipped demo pair (a small Qwen3 target, its EAGLE-3 chain drafter and its P-EAGLE
drafter, trained on the Python standard library's own source) and ``qspec demo``."""

import sysconfig
import zlib
from pathlib import Path

import torch

from .shipped import DEMO_DIR

# The real pair's default repetition penalty in the demo and chat: greedy SmolLM2-135M loops without
# one ("mushrooms, mushrooms, eggplant, ..."); it applies to plain and speculative decoding alike.
# 1.1 reads as well as 1.2 and keeps more of the acceptance (the drafter learned unpenalized
# answers): k = 3 on the demo's prompts 1.88 at 1.0 (looping), 1.64 at 1.1, 1.36 at 1.2.
DEMO_PENALTY = 1.1


def stdlib_files(split: str) -> list[Path]:
    """The standard library's .py files (tests and site-packages left out), split by a hash of
    the relative path: 1 file in 10 is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("test", "site-packages", "idlelib/idle_test", "lib2to3/tests")) or "/test" in rel:
            continue
        held_out = zlib.crc32(rel.encode()) % 10 == 0
        if held_out == (split == "heldout"):
            files.append(path)
    return files


def heldout_cross_entropy(model, tokenizer, files: int = 40, tokens: int = 512) -> tuple[float, float]:
    """The shipped target's quality measure: mean next-token cross-entropy (nats/token) over
    the first `tokens` tokens of the first `files` held-out files, and the same in nats/byte
    (the per-token number depends on the tokenizer, the per-byte one does not).
    `model` is a transformers causal LM, `tokenizer` a `tokenizers.Tokenizer`."""
    import torch.nn.functional as F

    total, count, nbytes = 0.0, 0, 0
    with torch.no_grad():
        for path in stdlib_files("heldout")[:files]:
            ids = tokenizer.encode(path.read_text(errors="replace")).ids[:tokens]
            if len(ids) < 2:
                continue
            batch = torch.tensor([ids])
            logits = model(batch).logits[0, :-1].float()
            total += float(F.cross_entropy(logits, batch[0, 1:], reduction="sum"))
            count += len(ids) - 1
            nbytes += len(tokenizer.decode(ids[1:]).encode())
    return total / count, total / nbytes


def demo_prompts(count: int, max_chars: int = 600) -> list[str]:
    """Held-out code prompts: the start of a held-out file up to its first function header."""
    prompts = []
    for path in stdlib_files("heldout"):
        text = path.read_text(errors="replace")
        at = text.find("\ndef ")
        if at < 0 or at > 4000:
            continue
        end = text.find("\n", at + 1)
        prompts.append(text[max(0, end + 1 - max_chars) : end + 1])
        if len(prompts) == count:
            break
    return prompts


def demo_requests(pair: str, count: int) -> tuple[list[str], list[list[int]], list[int] | None]:
    """What ``qspec demo`` asks a named pair: (the prompts as shown, their token ids, the stop ids).
    The tiny pair continues held-out code (no stop: it writes a fixed length); SmolLM2 answers
    held-out chat prompts through its chat template and stops at the end of its turn."""
    from .prompts import heldout_prompts
    from .shipped import target_dir
    from .text import chat_ids, load_tokenizer, stop_ids

    directory = target_dir(pair)
    if pair == "tiny":
        texts = demo_prompts(count)
        tokenizer = load_tokenizer(directory)
        return texts, [tokenizer.encode(t).ids for t in texts], None
    texts = [r["prompt"] for r in heldout_prompts("chat")[:count]]
    return texts, [chat_ids(directory, [{"role": "user", "content": t}]) for t in texts], stop_ids(directory)


def run_demo(pair: str = "smollm2", quick: bool = False, device: str = "cpu", max_new_tokens: int | None = None,
             ks: list[int] | None = None, compile: bool = False, rounds: int | None = None,
             repetition_penalty: float | None = None, parallel: bool = False) -> int:
    """Loads a named pair (target, chain drafter; with ``parallel`` its P-EAGLE drafter too), decodes
    its demo requests one at a time with and without speculation, checks the greedy outputs are
    identical, prints the text, then acceptance and speed by k for each drafting kind and for the
    adaptive chain (k chosen per step), each configuration timed in ``rounds`` interleaved rounds (plain, then every
    configuration, again; default 3, 1 with ``quick``): the median tokens/s and the median of the
    rounds' speed-ups, so that one slow run does not decide a row. ``compile``: compiled decode
    steps, each configuration timed after an untimed run that compiles it. ``repetition_penalty``
    (default :data:`DEMO_PENALTY` for the real pair decoded eagerly, else 1) applies to every
    configuration: the outputs must still be identical."""
    from functools import partial

    from .bench import interleaved_rounds
    from .decode import SpeculativeDecoder, generate_plain
    from .models import Eagle3Drafter
    from .models.checkpoint import CheckpointError
    from .pair import load_pair
    from .shipped import drafter_dir, target_dir
    from .text import load_tokenizer

    try:
        chain_dir = drafter_dir(pair)
        target, chain = load_pair(pair, chain_dir, device, "fp32")
    except CheckpointError as error:
        print(f"qspec demo: {error}")
        return 1
    drafters = {"chain": chain}
    if parallel:  # not by default: the shipped P-EAGLE drafters are slower than the chain wherever measured
        try:
            drafters["parallel"] = Eagle3Drafter.from_pretrained(drafter_dir(pair, parallel=True), dtype=torch.float32,
                                                                 device=device, target=target)
        except CheckpointError:
            print(f"qspec demo: no P-EAGLE drafter shipped for {pair}")
    tokenizer = load_tokenizer(target_dir(pair))
    texts, prompts, stops = demo_requests(pair, 2 if quick else 4 if pair == "tiny" else 3)
    new_tokens = max_new_tokens or (24 if quick else 96 if pair == "tiny" else 160)
    ks = ks or ([1, 3] if quick else [1, 2, 3, 4, 5])
    generate_plain(target, prompts[:1], 4)  # warm-up
    configs = {("plain", 0): partial(generate_plain, target, compile=compile)}
    configs |= {(kind, k): SpeculativeDecoder(target, drafter, k, compile=compile).generate
                for kind, drafter in drafters.items() for k in ks}
    # Adaptive: each step's draft length (0..5) chosen by expected tokens per second.
    configs[("chain", "auto")] = SpeculativeDecoder(target, chain, 5, compile=compile, adaptive=True).generate
    rounds = rounds or (1 if quick else 3)
    # One request at a time: the single-stream latency speculative decoding is for.
    if repetition_penalty is None:
        repetition_penalty = DEMO_PENALTY if pair == "smollm2" and not compile else 1.0
    timed = interleaved_rounds(configs, prompts, 1, rounds, warmup=lambda _: compile, max_new_tokens=new_tokens,
                               eos_token_id=stops, repetition_penalty=repetition_penalty)
    runs = {name: results[-1] for name, results in timed.results.items()}
    plain = runs.pop(("plain", 0))
    speed = {name: timed.median(name) for name in configs}
    speedup = {name: timed.speedup(name, [("plain", 0)]) for name in configs}
    for text, ids in zip(texts, plain.tokens):
        print("=" * 72)
        if stops is None:
            print(text.rstrip("\n")[-300:], end="")
            print(" \u2190 prompt | generated \u2192")
        else:
            print(f"user: {text}\nassistant:")
        print(tokenizer.decode(ids, skip_special_tokens=True))
    print("=" * 72)
    identical = all(run.tokens == plain.tokens for run in runs.values())
    penalty = f" (repetition penalty {repetition_penalty:g})" if repetition_penalty != 1.0 else ""
    print(f"greedy speculative output identical to plain decoding{penalty}: {'yes' if identical else 'NO'}")
    print(f"plain decoding: {speed['plain', 0]:.1f} tokens/s (one request at a time; medians of {rounds} "
          f"interleaved round{'s' if rounds > 1 else ''})"
          + (f"; compiled steps (compile time {sum(timed.compile_time.values()):.0f} s, "
             f"untimed)"
             if compile else ""))
    header = "".join(f"  {kind + ': accept len':>20}  {'tokens/s':>8}  {'speed-up':>8}" for kind in drafters)
    print(f"{'k':>2}{header}")
    for k in ks:
        cells = "".join(f"  {runs[kind, k].stats.mean_acceptance_length:>20.2f}  {speed[kind, k]:>8.1f}  "
                        f"{speedup[kind, k]:>7.2f}x" for kind in drafters)
        print(f"{k:>2}{cells}")
    auto = runs["chain", "auto"].stats
    chosen = ", ".join(f"{k}: {n}" for k, n in sorted(auto.draft_lengths.items()))
    print(f"chain, adaptive k (0..5 per step): accept len {auto.mean_acceptance_length:.2f}, "
          f"{speed['chain', 'auto']:.1f} tokens/s, {speedup['chain', 'auto']:.2f}x plain; steps by draft length: {chosen}")
    best_name = max(runs, key=lambda name: speedup[name])
    print(f"best: {best_name[0]} drafting at k = {best_name[1]}, {speedup[best_name]:.2f}x plain decoding")
    for kind in drafters:
        best = max(ks, key=lambda k: speedup[kind, k])  # the fixed lengths
        per = " ".join(f"{a:.2f}" for a in runs[kind, best].stats.acceptance_rate_per_position)
        print(f"{kind} drafting, best k = {best}: acceptance at draft position 1..{best}: {per}")
    return 0 if identical else 1
