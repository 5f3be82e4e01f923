"""The ``qspec`` command line: generate text with EAGLE-3 speculative decoding, or benchmark
it against plain decoding."""

import argparse
import json
import sys
from pathlib import Path

from functools import partial

import torch

from . import shipped
from .bench import interleaved_rounds
from .decode import SpeculativeDecoder, generate_plain
from .demo import DEMO_PENALTY
from .models.checkpoint import CheckpointError, read_config, resolve_checkpoint
from .pair import DTYPES, load_pair
from .text import chat_ids, load_tokenizer, stop_ids

# What a user can fix: printed as one line (`qspec <command>: error: ...`, exit 2), with the
# traceback only under --debug. Anything else (a TypeError included) is a bug and keeps its traceback.
EXPECTED_ERRORS = (CheckpointError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                   PermissionError)


DEFAULT_PAIR = "smollm2"  # the real pair; "tiny" is the fast test fixture


def resolve_models(args) -> None:
    """--target / --draft as directories (hub ids resolved). A named target (tiny, smollm2) brings
    its shipped drafter (the P-EAGLE one with --parallel) unless --draft is given; no --target:
    the default pair."""
    if args.target is None:
        if args.draft is not None:
            raise ValueError("--draft needs its --target")
        args.target = DEFAULT_PAIR
    named = args.target in shipped.NAMES and not Path(args.target).exists()  # as resolve_source decides
    args.pair = args.target if named else None
    if args.draft is None:
        if not named:
            raise ValueError(f"--target {args.target} needs a --draft (a named target, {' or '.join(shipped.NAMES)}, "
                             f"brings its own)")
        args.draft = str(shipped.drafter_dir(args.target, args.parallel))
    args.target, args.draft = str(shipped.resolve_source(args.target)), str(resolve_checkpoint(args.draft))
    if args.parallel:
        config = read_config(Path(args.draft))
        if config.get("speculators_model_type") != "peagle" and not config.get("parallel_drafting"):
            raise ValueError(f"--parallel: {args.draft} is a chain EAGLE-3 drafter, not a P-EAGLE (parallel drafting) one")
    if args.parallel and args.topk > 1:
        raise ValueError("--parallel and --topk > 1 do not go together: trees are drafted by chain drafters")


def read_prompts(args) -> list[str]:
    """--demo N held-out prompts (a named pair's demo requests: chat prompts for smollm2, as user
    turns; code otherwise), --prompt, or --prompts FILE: text lines, or JSONL lines with
    {"prompt": ...} or MT-bench style {"turns": [...]} (the first turn)."""
    if args.demo is not None:
        from .demo import demo_prompts
        from .prompts import heldout_prompts

        if getattr(args, "pair", None) == "smollm2":
            args.chat = True
            return [r["prompt"] for r in heldout_prompts("chat")[: args.demo]]
        return demo_prompts(args.demo)
    if args.prompt is not None:
        return [args.prompt]
    path = Path(args.prompts)
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path} holds no prompts (text lines, or JSONL with \"prompt\" or \"turns\")")
    if not lines[0].lstrip().startswith("{"):
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not a JSON object ({e.msg})") from e
        turns = record.get("turns") if isinstance(record, dict) else None
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if prompt is None and isinstance(turns, list) and turns:
            prompt = turns[0]
        if not isinstance(prompt, str):
            raise ValueError(f"{path}:{number}: a JSONL prompt needs a \"prompt\" string or a non-empty \"turns\" list")
        prompts.append(prompt)
    return prompts


def encode_prompts(args, tokenizer, texts: list[str]) -> tuple[list[list[int]], list[int]]:
    """Token ids of the prompts and the ids to stop at. --chat wraps each prompt as one user turn
    in the target's chat template."""
    if not args.chat:
        return [tokenizer.encode(t).ids for t in texts], stop_ids(args.target)
    return [chat_ids(args.target, [{"role": "user", "content": t}]) for t in texts], stop_ids(args.target)


def stats_table(stats) -> str:
    lines = [
        f"Mean acceptance length: {stats.mean_acceptance_length:.2f}",
        f"Drafts: {stats.num_drafts}, draft tokens: {stats.num_draft_tokens}, accepted: {stats.num_accepted_tokens}",
    ]
    lines += [f"Acceptance at token {i}: {rate:.2f}" for i, rate in enumerate(stats.acceptance_rate_per_position)]
    if len(stats.draft_lengths) > 1:  # adaptive: the draft length each step chose
        lines.append("Steps by draft length: " + ", ".join(f"{k}: {n}" for k, n in sorted(stats.draft_lengths.items())))
    lines.append(f"Generated {stats.num_generated_tokens} tokens in {stats.wall_time:.2f} s "
                 f"({stats.tokens_per_second:.1f} tokens/s; after the first tokens at {stats.first_token_time:.2f} s: "
                 f"{stats.decode_tokens_per_second:.1f} tokens/s)")
    return "\n".join(lines)


def add_model_args(p: argparse.ArgumentParser, prompts: bool = True) -> None:
    p.add_argument("--target", help="HF causal LM checkpoint (directory or hub id, with tokenizer.json), or a named "
                                     f"model ({', '.join(shipped.NAMES)}: with its shipped drafters); default: "
                                     f"{DEFAULT_PAIR}")
    p.add_argument("--draft", help="EAGLE-3 drafter (directory or hub id; speculators or EAGLE format)")
    if prompts:
        source = p.add_mutually_exclusive_group(required=True)
        source.add_argument("--prompt", help="one prompt")
        source.add_argument("--prompts", help="a file: one prompt per line, or JSONL with \"prompt\" or \"turns\"")
        source.add_argument("--demo", type=int, metavar="N", help="N held-out prompts of the named pair (chat for smollm2, code for tiny)")
    p.add_argument("--chat", action="store_true",
                   help="format each prompt as a user turn in the target tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="HF / vLLM repetition penalty over the prompt and the output (1: none; eager, chains)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    p.add_argument("--backend", choices=["auto", "native", "transformers"], default="auto",
                   help="the target's implementation: native (qspec_ext ops; dense Qwen3 and Llama), transformers (any causal "
                        "LM, hybrid Qwen3-Next / Qwen3.5 included), auto: native where it runs the model type")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--parallel", action="store_true",
                   help="P-EAGLE parallel drafting (the shipped pair's draft-parallel drafter by default)")
    p.add_argument("--topk", type=int, default=1,
                   help="draft trees: children per node (EAGLE-2 dynamic tree of depth k); 1 = a chain")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="draft trees: nodes verified per step (default k * topk)")
    p.add_argument("--compile", action="store_true",
                   help="compiled static-shape decode steps (torch.compile; CUDA graphs on CUDA); native target only")


def sampling_args(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                repetition_penalty=args.repetition_penalty)


class TextStream:
    """``on_tokens`` for one request: prints its text as the tokens arrive (everything decoded so
    far, less what was printed; an unfinished UTF-8 sequence at the end waits for the next token)."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.ids: list[int] = []
        self.printed = ""

    def __call__(self, request: int, tokens: list[int]) -> None:
        self.ids += tokens
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self._show(text)

    def finish(self) -> str:
        text = self.tokenizer.decode(self.ids)
        self._show(text)
        return text

    def _show(self, text: str) -> None:
        self.out.write(text[len(self.printed):])
        self.out.flush()
        self.printed = text


AUTO_MAX_DRAFTS = 5  # -k auto: adaptive draft lengths 0..5


def draft_length(text: str) -> int | str:
    """-k: a number of draft tokens, or ``auto`` (adaptive, 0..AUTO_MAX_DRAFTS per step)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of draft tokens or 'auto', got {text!r}") from None


def make_decoder(args, target, drafter, k: int | str | None = None) -> SpeculativeDecoder:
    k = args.k if k is None else k
    if k == "auto":
        if args.topk > 1:
            raise ValueError(f"-k auto chooses chain (or P-EAGLE) draft lengths; it takes no --topk {args.topk}")
        return SpeculativeDecoder(target, drafter, AUTO_MAX_DRAFTS, compile=args.compile, adaptive=True)
    return SpeculativeDecoder(target, drafter, k, topk=args.topk, num_draft_tokens=args.num_draft_tokens,
                              compile=args.compile)


def cmd_generate(args) -> int:
    resolve_models(args)
    tokenizer = load_tokenizer(args.target)
    texts = read_prompts(args)
    if args.stream and (len(texts) != 1 or args.json):
        raise ValueError(f"--stream prints one prompt's text as it comes: got {len(texts)} prompts"
                         + (" and --json" if args.json else ""))
    prompts, eos = encode_prompts(args, tokenizer, texts)
    target, drafter = load_pair(args.target, args.draft, args.device, args.dtype, args.backend)
    decoder = make_decoder(args, target, drafter)
    if args.stream:
        stream = TextStream(tokenizer)
        result = decoder.generate(prompts, args.max_new_tokens, eos_token_id=eos, on_tokens=stream,
                                  **sampling_args(args))
        stream.finish()
        print()
        print(stats_table(result.stats), file=sys.stderr)
        return 0
    result = decoder.generate(prompts, args.max_new_tokens, eos_token_id=eos, **sampling_args(args))
    outputs = [tokenizer.decode(ids) for ids in result.tokens]
    if args.json:
        print(json.dumps({"outputs": [dict(prompt=p, text=o, token_ids=ids) for p, o, ids in
                                      zip(texts, outputs, result.tokens)], "k": args.k, "adaptive": bool(decoder.policy),
                          "drafting": decoder.drafting.kind, "topk": decoder.drafting.topk,
                          "num_draft_tokens": decoder.drafting.num_draft_tokens, "stats": result.stats.as_dict()},
                         indent=1))
    else:
        for prompt, output in zip(texts, outputs):
            print(f"--- prompt: {prompt!r}\n{output}")
        print(stats_table(result.stats))
    return 0


def cmd_chat(args) -> int:
    """A conversation in the target's chat template: each answer streamed as the steps accept
    it; /exit or Ctrl-D (end of input) leaves, Ctrl-C stops the answer being written (and at the
    prompt, leaves)."""
    resolve_models(args)
    if args.repetition_penalty is None:  # a small model loops in a conversation without one
        args.repetition_penalty = 1.0 if args.compile or args.topk > 1 else DEMO_PENALTY
    tokenizer, stops = load_tokenizer(args.target), stop_ids(args.target)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    chat_ids(args.target, messages + [{"role": "user", "content": "x"}])  # no template: an error before loading
    target, drafter = load_pair(args.target, args.draft, args.device, args.dtype, args.backend)
    decoder = make_decoder(args, target, drafter)
    print(f"qspec chat: {args.target} with {args.draft}, k = {args.k}. /exit or Ctrl-D leaves; Ctrl-C stops an "
          f"answer.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.strip() == "/exit":
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        stream = TextStream(tokenizer)
        try:
            result = decoder.generate([chat_ids(args.target, messages)], args.max_new_tokens, eos_token_id=stops,
                                      on_tokens=stream, **sampling_args(args))
            note = (f"[{result.stats.num_generated_tokens} tokens, {result.stats.tokens_per_second:.1f} tokens/s, "
                    f"acceptance length {result.stats.mean_acceptance_length:.2f}]")
        except KeyboardInterrupt:
            note = "[stopped]"
        messages.append({"role": "assistant", "content": stream.finish()})
        print()
        print(note, file=sys.stderr)


def cmd_bench(args) -> int:
    from tqdm import tqdm

    if args.repeat < 1:
        raise ValueError(f"qspec bench: --repeat must be >= 1, got {args.repeat}")
    if args.batch_size < 1:
        raise ValueError(f"qspec bench: --batch-size must be >= 1, got {args.batch_size}")
    resolve_models(args)
    prompts, eos = encode_prompts(args, load_tokenizer(args.target), read_prompts(args))
    target, drafter = load_pair(args.target, args.draft, args.device, args.dtype, args.backend)
    # Chains (or parallel drafts) at every k; with --topk > 1 also a tree of each depth k.
    decoders = [SpeculativeDecoder(target, drafter, AUTO_MAX_DRAFTS, compile=args.compile, adaptive=True) if k == "auto"
                else SpeculativeDecoder(target, drafter, k, compile=args.compile) for k in args.k]
    if args.topk > 1:
        decoders += [SpeculativeDecoder(target, drafter, k, topk=args.topk, num_draft_tokens=args.num_draft_tokens,
                                        compile=args.compile) for k in args.k if k != "auto"]
    # Compiled: each configuration is timed after an untimed run that builds its graphs. With
    # --repeat, interleaved rounds over all configurations (qspec_ext.bench).
    common = dict(max_new_tokens=args.max_new_tokens, eos_token_id=eos, **sampling_args(args))
    configs = {"plain": partial(generate_plain, target, compile=args.compile)}
    configs |= {i: d.generate for i, d in enumerate(decoders)}
    with tqdm(total=args.repeat * len(configs), desc="qspec bench", file=sys.stderr) as bar:
        timed = interleaved_rounds(configs, prompts, args.batch_size, args.repeat, warmup=lambda _: args.compile,
                                   on_run=lambda *_: bar.update(), **common)
    plain = timed.results["plain"]
    rows = []
    for i, decoder in enumerate(decoders):
        spec = timed.results[i]
        s = spec[0].stats
        rows.append(dict(k="auto" if decoder.policy else decoder.k, draft_lengths=s.draft_lengths,
                         drafting=decoder.drafting.kind, topk=decoder.drafting.topk,
                         num_draft_tokens=decoder.drafting.num_draft_tokens,
                         mean_acceptance_length=s.mean_acceptance_length,
                         acceptance_per_position=s.acceptance_rate_per_position,
                         tokens_per_second=timed.median(i), spread=timed.spread(i),
                         speedup=timed.speedup(i, ["plain"]),
                         decode_tokens_per_second=timed.median(i, decode=True),
                         decode_speedup=timed.speedup(i, ["plain"], decode=True),
                         compile_time=timed.compile_time[i],
                         identical_to_plain=all(r.tokens == plain[0].tokens for r in spec)
                         if args.temperature == 0.0 else None))
    plain_rate, plain_decode_rate = timed.median("plain"), timed.median("plain", decode=True)
    if args.json:
        print(json.dumps({"plain_tokens_per_second": plain_rate,
                          "plain_decode_tokens_per_second": plain_decode_rate, "compile": args.compile,
                          "repeat": args.repeat, "runs": rows}, indent=1))
    else:
        low, high = timed.spread("plain")
        print(f"plain decoding: {plain_rate:.1f} tokens/s ({low:.1f}-{high:.1f}), decode phase {plain_decode_rate:.1f} tokens/s"
              + (f" (compiled steps; compile time {timed.compile_time['plain']:.0f} s, untimed)" if args.compile else ""))
        print(f"medians over {args.repeat} round(s); tokens/s: all generated tokens over the whole run; decode: the "
              "tokens after each request's first, over the time after the prompt prefill; speed-up: each round's ratio "
              "to that round's plain run")
        print(f"{'drafting':>8}  {'k':>3}  {'nodes':>5}  {'accept len':>10}  {'tokens/s':>9}  {'spread':>13}  "
              f"{'speed-up':>8}  {'decode tok/s':>12}  {'speed-up':>8}  {'same as plain':>13}  acceptance per position")
        for r in rows:
            same = "-" if r["identical_to_plain"] is None else ("yes" if r["identical_to_plain"] else "NO")
            per = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
            spread = f"{r['spread'][0]:.1f}-{r['spread'][1]:.1f}"
            print(f"{r['drafting']:>8}  {r['k']:>3}  {r['num_draft_tokens']:>5}  {r['mean_acceptance_length']:>10.2f}  "
                  f"{r['tokens_per_second']:>9.1f}  {spread:>13}  {r['speedup']:>7.2f}x  {r['decode_tokens_per_second']:>12.1f}  "
                  f"{r['decode_speedup']:>7.2f}x  {same:>13}  {per}")
    if args.plot:
        plot_acceptance(rows, args.plot)
    return 0 if all(r["identical_to_plain"] in (True, None) for r in rows) else 1


def plot_acceptance(rows: list[dict], path: str) -> None:
    """Acceptance length and speed-up over plain decoding by k, one line per drafting kind."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from e
    fig, (accept, speed) = plt.subplots(1, 2, figsize=(9, 3.5))
    for kind in dict.fromkeys(r["drafting"] for r in rows):
        mine = [r for r in rows if r["drafting"] == kind]
        label = kind if kind != "tree" else f"tree (topk {mine[0]['topk']})"
        ks = [r["k"] for r in mine]
        accept.plot(ks, [r["mean_acceptance_length"] for r in mine], marker="o", label=label)
        speed.plot(ks, [r["speedup"] for r in mine], marker="o", label=label)
    ks = sorted({r["k"] for r in rows})
    accept.plot(ks, [k + 1 for k in ks], linestyle=":", color="gray", label="k + 1 (all accepted)")
    speed.axhline(1.0, linestyle=":", color="gray")
    accept.set(xlabel="draft depth per step (k)", ylabel="tokens per target forward", title="mean acceptance length")
    speed.set(xlabel="draft depth per step (k)", ylabel="x plain decoding", title="speed-up (tokens/s)")
    for ax in (accept, speed):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(pair=args.pair, quick=args.quick, device=args.device, max_new_tokens=args.max_new_tokens,
                    ks=args.k, compile=args.compile, rounds=args.rounds, repetition_penalty=args.repetition_penalty,
                    parallel=args.parallel)


def cmd_train_drafter(args) -> int:
    from .train import TrainConfig, train_drafter

    config = TrainConfig(steps=args.steps, ttt_steps=args.ttt_steps, draft_vocab=args.draft_vocab, arch=args.arch,
                         fc_norm=args.fc_norm, norm_output=args.norm_output, seq_len=args.seq_len,
                         batch_size=args.batch_size, lr=args.lr, seed=args.seed, parallel=args.parallel,
                         parallel_depth=args.depth, cod_ratio=args.cod_ratio, cod_floor=args.cod_floor,
                         regenerate=args.regenerate, aux_layer_ids=args.aux_layers, bf16=args.bf16,
                         compile=args.compile, pack=args.pack, capture_bf16=args.capture_bf16)
    _, history = train_drafter(args.target, args.data, args.out, config, device=args.device, init_from=args.init_from)
    first, last = history[0], history[-1]
    print(f"loss {first[0]:.3f} -> {last[0]:.3f}; accuracy per {'depth' if args.parallel else 'step'} "
          f"{' '.join(f'{a:.2f}' for a in last[1])}; wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qspec", description="EAGLE-3 speculative decoding with qspec_ext")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text with speculative decoding")
    add_model_args(gen)
    gen.add_argument("-k", type=draft_length, default=3,
                     help=f"draft tokens per step, or auto (each step chooses 0..{AUTO_MAX_DRAFTS})")
    gen.add_argument("--stream", action="store_true", help="print the text as each step accepts it (one prompt)")
    gen.set_defaults(run=cmd_generate)
    chat = commands.add_parser("chat", help="an interactive conversation in the target's chat template, streamed")
    add_model_args(chat, prompts=False)
    chat.add_argument("-k", type=draft_length, default=3,
                      help=f"draft tokens per step, or auto (each step chooses 0..{AUTO_MAX_DRAFTS})")
    chat.add_argument("--system", help="a system message to start the conversation with")
    chat.description = (f"Without --repetition-penalty, chat uses {DEMO_PENALTY} (a small model loops without one); "
                        f"1 with --compile or trees (--topk > 1), which run without one.")
    # repetition_penalty None: DEMO_PENALTY where it runs (eager chains), else 1 (see cmd_chat).
    chat.set_defaults(run=cmd_chat, chat=True, max_new_tokens=512, repetition_penalty=None)
    bench = commands.add_parser("bench", help="speculative vs plain decoding on the same prompts")
    add_model_args(bench)
    bench.add_argument("-k", type=draft_length, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, "auto"],
                       help="draft lengths to try (auto: adaptive, 0..5 per step)")
    bench.add_argument("--plot", metavar="PATH", help="write a PNG of acceptance length by k")
    bench.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (default 1: single stream)")
    bench.add_argument("--repeat", type=int, default=1,
                       help="timed rounds over all configurations: medians reported, speed-ups paired per round")
    bench.set_defaults(run=cmd_bench)
    demo = commands.add_parser("demo", help="speculative decoding with a named pair: a target and its shipped "
                                             "EAGLE-3 drafters")
    demo.add_argument("--pair", default=DEFAULT_PAIR, choices=shipped.NAMES,
                      help=f"smollm2: SmolLM2-135M-Instruct answering chat prompts; tiny: the small Qwen3 pair "
                           f"continuing code (default {DEFAULT_PAIR})")
    demo.add_argument("--quick", action="store_true", help="2 prompts, 24 tokens, k = 1 and 3")
    demo.add_argument("--max-new-tokens", type=int, default=None)
    demo.add_argument("-k", type=int, nargs="+", default=None, help="draft lengths (default 1..5)")
    demo.add_argument("--device", default="cpu")
    demo.add_argument("--compile", action="store_true", help="compiled static-shape decode steps")
    demo.add_argument("--parallel", action="store_true",
                      help="also the pair's P-EAGLE drafter (slower than the chain drafter wherever measured)")
    demo.add_argument("--rounds", type=int, default=None,
                      help="interleaved timing rounds, medians reported (default 3; 1 with --quick)")
    demo.add_argument("--repetition-penalty", type=float, default=None,
                      help=f"HF / vLLM repetition penalty, plain and speculative decoding alike (default "
                           f"{DEMO_PENALTY} for smollm2 eager, 1 for tiny or --compile)")
    demo.set_defaults(run=cmd_demo)
    train = commands.add_parser("train-drafter", help="train an EAGLE-3 drafter for a target on local text")
    train.add_argument("--target", required=True, help="transformers causal LM directory with tokenizer.json")
    train.add_argument("--data", nargs="+", required=True,
                       help="text files, .jsonl files of token ids (\"ids\", optional \"prompt_length\") or .npz "
                            "files (ids, starts, prompt_length: scripts/make_smollm2_data.py's) to train on")
    train.add_argument("--out", required=True)
    train.add_argument("--steps", type=int, default=300)
    train.add_argument("--ttt-steps", type=int, default=3)
    train.add_argument("--draft-vocab", type=int, default=2048)
    train.add_argument("--arch", choices=["qwen3", "llama"], default="qwen3")
    train.add_argument("--fc-norm", action="store_true")
    train.add_argument("--norm-output", action="store_true")
    train.add_argument("--seq-len", type=int, default=256)
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--lr", type=float, default=2e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--aux-layers", type=int, nargs="+", default=None, metavar="ID",
                       help="target layers whose input residual the drafter reads (default: EAGLE-3's 2, N/2, N-3)")
    train.add_argument("--parallel", action="store_true", help="train a P-EAGLE (parallel drafting) drafter")
    train.add_argument("--depth", type=int, default=8, help="P-EAGLE: mask-slot depths trained (k drafts need k)")
    train.add_argument("--cod-ratio", type=float, default=0.7, help="P-EAGLE: COD sampling decay per depth")
    train.add_argument("--cod-floor", type=float, default=0.2, help="P-EAGLE: COD sampling floor")
    train.add_argument("--regenerate", action="store_true",
                       help="train on the target's own greedy continuations of the data (self-distillation)")
    train.add_argument("--bf16", action="store_true",
                       help="the drafter's forward and backward in bf16 autocast (fp32 weights and optimizer); "
                            "on a CPU without AVX-512 bf16 far slower than fp32")
    train.add_argument("--compile", action="store_true", help="the chain drafter's TTT loss as one compiled graph")
    train.add_argument("--pack", action="store_true",
                       help="chain: windows packed with whole records, each from position 0 (little padding)")
    train.add_argument("--capture-bf16", action="store_true",
                       help="the target's features from its transformers model in bf16, many records a forward")
    train.add_argument("--init-from", metavar="DIR", help="a drafter to start from (same shape and draft vocabulary)")
    train.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    train.set_defaults(run=cmd_train_drafter)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except EXPECTED_ERRORS as e:
        if args.debug:
            raise
        print(f"qspec {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
