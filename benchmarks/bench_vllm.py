"""qspec_ext and vLLM side by side on the same pair, prompts, k, dtype and core count: greedy
tokens equal, acceptance per position, tokens/s for plain decoding, chain EAGLE-3 and P-EAGLE at
each batch size. Run it in the vLLM venv (scripts/make_vllm_venv.sh):

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--pair tiny] [--cores 1 2] [--batch 1 4 8] [-k 3]
        [--rounds 3] [--prompts 8] [--max-new-tokens 96] [--kinds plain chain parallel]
        [--engines qspec_ext vllm] [--mode eager] [--sampling greedy t1 seeded mixed] [--json PATH]

Engines: qspec_ext (its own loop), vllm (stock: the qspec_ext plugin off), vllm+plugin (every
seam of qspec_ext.integrations.vllm on), vllm+SEAM (that seam alone, e.g. vllm+rms_norm).
Ratios are against the second engine listed (default: qspec_ext / vLLM). An engine name may end in
:eager or :compiled, its mode in place of --mode (the fastest mode of each engine side by side:
--engines qspec_ext:eager vllm:compiled).

Each measurement is a child process pinned to the first N cores (qspec_ext: torch threads = N;
vLLM: VLLM_CPU_OMP_THREADS_BIND=0-(N-1), no reserved core), in-process engine; --mode eager
(vLLM's enforce_eager) or compiled (qspec_ext's compile=True; vLLM's default CPU compilation, whose
start-up takes minutes per configuration, untimed like qspec_ext's compile warm-up); the children
alternate (qspec_ext, vLLM, qspec_ext, ...) for --rounds rounds, and each figure is the median
over the rounds with the spread; a speed ratio is the median of each round's ratio.
Batch B: the prompts B at a time (qspec_ext's in_batches; vLLM with max_num_seqs = B).

--sampling: greedy (temperature 0), t1 (temperature 1.0), seeded (1.0 with a seed per request),
mixed (1.0; of every 4 requests one seeded, one asking 5 logprobs, one with repetition penalty
1.1, one plain). qspec_ext's own loop samples every setting but greedy at 1.0 with one seed per
batch (its acceptance is the reference for vLLM's). Acceptance length: 1 + the accepted drafts per
step summed over positions.

The table of the vLLM issue (SmolLM2, fp32, 8 chat prompts, batch 1 and 8):
    bench_vllm.py --pair smollm2 --cores 2 --batch 1 8 --kinds plain chain --rounds 2 \
        --engines vllm vllm+plugin qspec_ext --sampling greedy t1 seeded mixed
"""

import argparse
import json
import os
import statistics
import sys
import time

from common import print_child_result, run_child

KINDS = ("plain", "chain", "parallel")
SAMPLING = ("greedy", "t1", "seeded", "mixed")


def vllm_params(setting: str, count: int, max_tokens: int) -> list:
    """One SamplingParams per request for a --sampling setting."""
    from vllm import SamplingParams

    common = dict(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    if setting == "greedy":
        return [SamplingParams(temperature=0, **common)] * count
    if setting == "t1":
        return [SamplingParams(temperature=1.0, **common)] * count
    if setting == "seeded":
        return [SamplingParams(temperature=1.0, seed=1000 + i, **common) for i in range(count)]
    extras = [dict(seed=1000), dict(logprobs=5), dict(repetition_penalty=1.1), {}]
    return [SamplingParams(temperature=1.0, **common, **extras[i % 4]) for i in range(count)]


def prompts_of(pair: str, count: int) -> list[list[int]]:
    from qspec_ext.demo import demo_prompts
    from qspec_ext.prompts import heldout_prompts
    from qspec_ext.shipped import target_dir
    from qspec_ext.text import chat_ids, load_tokenizer

    if pair == "tiny":
        tokenizer = load_tokenizer(target_dir("tiny"))
        return [tokenizer.encode(text).ids for text in demo_prompts(count)]
    directory = target_dir(pair)
    return [chat_ids(directory, [{"role": "user", "content": r["prompt"]}]) for r in heldout_prompts()[:count]]


def child_qspec(job: dict) -> dict:
    import torch

    from qspec_ext import SpeculativeDecoder, generate_plain, load_pair
    from qspec_ext.bench import in_batches
    from qspec_ext.shipped import drafter_dir

    torch.set_num_threads(job["cores"])
    prompts, out = job["prompts"], {}
    target, chain = load_pair(job["pair"], drafter_dir(job["pair"]), dtype=job["dtype"])
    compiled = job["mode"] == "compiled"
    runners = {"plain": lambda **kw: generate_plain(target, compile=compiled, **kw),
               "chain": SpeculativeDecoder(target, chain, job["k"], compile=compiled).generate}
    if "parallel" in job["kinds"]:
        _, parallel = load_pair(job["pair"], drafter_dir(job["pair"], parallel=True), dtype=job["dtype"])
        runners["parallel"] = SpeculativeDecoder(target, parallel, job["k"], compile=compiled).generate
    for kind in job["kinds"]:
        for batch in job["batch"]:
            def run(setting, prompts=prompts):
                temperature = 0.0 if setting == "greedy" else 1.0
                return in_batches(lambda p, **kw: runners[kind](prompts=p, **kw), prompts, batch,
                                  max_new_tokens=job["max_new_tokens"], temperature=temperature)
            for setting in job["sampling"]:  # warm-up (compiled: builds every graph the timed run uses)
                run(setting, prompts[:batch])
            for setting in job["sampling"]:
                result = run(setting)
                s = result.stats
                out[f"{kind}/{batch}/{setting}"] = dict(
                    tokens_per_second=s.tokens_per_second, tokens=result.tokens,
                    acceptance=None if kind == "plain" else s.acceptance_rate_per_position)
    return out


def child_vllm(job: dict) -> dict:
    from vllm import LLM

    from qspec_ext.shipped import drafter_dir, target_dir

    prompts, out = job["prompts"], {}
    for kind in job["kinds"]:
        # P-EAGLE: vLLM drafts in parallel only when asked (else it runs the drafter as a chain).
        spec = None if kind == "plain" else {"method": "eagle3", "num_speculative_tokens": job["k"],
                                             "model": str(drafter_dir(job["pair"], parallel=kind == "parallel")),
                                             "parallel_drafting": kind == "parallel"}
        for batch in job["batch"]:
            llm = LLM(model=str(target_dir(job["pair"])), skip_tokenizer_init=True,
                      enforce_eager=job["mode"] == "eager",
                      dtype={"fp32": "float32", "bf16": "bfloat16"}[job["dtype"]], max_num_seqs=batch,
                      max_model_len=2048, disable_log_stats=False, seed=0, speculative_config=spec)

            def counters():
                m = {x.name: x for x in llm.get_metrics()}
                drafts = getattr(m.get("vllm:spec_decode_num_drafts"), "value", 0)
                per = getattr(m.get("vllm:spec_decode_num_accepted_tokens_per_pos"), "values", [])
                return drafts, list(per)

            def run(setting, prompts=prompts):
                params = vllm_params(setting, len(prompts), job["max_new_tokens"])
                tokens, start = [], time.perf_counter()
                for i in range(0, len(prompts), batch):
                    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[i : i + batch]],
                                        params[i : i + batch], use_tqdm=False)
                    tokens += [list(o.outputs[0].token_ids) for o in outs]
                return tokens, time.perf_counter() - start

            for setting in job["sampling"]:  # warm-up: each setting's first batch
                run(setting, prompts[:batch])
            for setting in job["sampling"]:
                before = counters()
                tokens, seconds = run(setting)
                after = counters()
                drafts = after[0] - before[0]
                acceptance = None if kind == "plain" or not drafts else [
                    (a - b) / drafts for a, b in zip(after[1], before[1] or [0] * len(after[1]))]
                out[f"{kind}/{batch}/{setting}"] = dict(tokens_per_second=sum(map(len, tokens)) / seconds,
                                                        tokens=tokens, acceptance=acceptance)
            del llm
    return out


def plugin_disabled(engine: str) -> str:
    """QSPEC_VLLM_DISABLE for an engine name: vllm (all seams off), vllm+plugin (none), vllm+SEAM."""
    from qspec_ext.integrations.vllm import SEAMS

    if engine in ("vllm", "qspec_ext"):
        return "all"
    seam = engine.removeprefix("vllm+")
    if seam == "plugin":
        return ""
    if seam not in SEAMS:
        sys.exit(f"bench_vllm: --engines: unknown engine {engine!r}; expected qspec_ext, vllm, vllm+plugin or "
                 f"vllm+SEAM with SEAM one of {', '.join(SEAMS)}")
    return ",".join(s for s in SEAMS if s != seam)


def engine_mode(engine: str, default: str) -> tuple[str, str]:
    """(engine, mode) of an --engines entry: NAME or NAME:eager / NAME:compiled."""
    name, _, mode = engine.partition(":")
    if mode not in ("", "eager", "compiled"):
        sys.exit(f"bench_vllm: --engines: {engine!r}: the mode after ':' must be eager or compiled, got {mode!r}")
    return name, mode or default


def run_engine(engine: str, job: dict) -> dict:
    engine, mode = engine_mode(engine, job["mode"])
    job = dict(job, mode=mode)
    cores = job["cores"]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}" if cores > 1 else "0", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               OMP_NUM_THREADS=str(cores), QSPEC_VLLM_DISABLE=plugin_disabled(engine))
    child = "qspec_ext" if engine == "qspec_ext" else "vllm"
    command = ["taskset", "-c", f"0-{cores - 1}", sys.executable, __file__, "--child", child, json.dumps(job)]
    return run_child(command, f"bench_vllm: the {engine} child", env)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        job = json.loads(sys.argv[3])
        print_child_result(child_qspec(job) if sys.argv[2] == "qspec_ext" else child_vllm(job))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="tiny")
    parser.add_argument("--cores", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--engines", nargs="+", default=["qspec_ext", "vllm"])
    parser.add_argument("--mode", default="eager", choices=["eager", "compiled"])
    parser.add_argument("--sampling", nargs="+", default=["greedy"], choices=SAMPLING)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if len(args.engines) < 2:
        parser.error("--engines: at least two (ratios are against the second)")
    if max(args.batch) > args.prompts:
        parser.error(f"--batch {max(args.batch)} needs at least that many prompts (--prompts {args.prompts}): "
                     f"a batch is that many requests at once")
    for engine in args.engines:
        plugin_disabled(engine_mode(engine, args.mode)[0])  # an unknown name fails before any child runs
    base = dict(pair=args.pair, prompts=prompts_of(args.pair, args.prompts), k=args.k, batch=args.batch,
                max_new_tokens=args.max_new_tokens, dtype=args.dtype, kinds=args.kinds, mode=args.mode,
                sampling=args.sampling)
    runs = {}  # (engine, cores) -> [round results]
    for round_ in range(args.rounds):
        for cores in args.cores:
            for engine in args.engines:
                runs.setdefault((engine, cores), []).append(run_engine(engine, dict(base, cores=cores)))
                print(f"round {round_ + 1}/{args.rounds}: {engine} on {cores} core(s) done", file=sys.stderr)
    reference = args.engines[1]
    rows = []
    for cores in args.cores:
        for kind in args.kinds:
            for batch in args.batch:
                for setting in args.sampling:
                    key = f"{kind}/{batch}/{setting}"
                    row = dict(cores=cores, kind=kind, batch=batch, sampling=setting, engines={})
                    theirs = [r[key] for r in runs[reference, cores]]
                    for engine in args.engines:
                        mine = [r[key] for r in runs[engine, cores]]
                        rates = [r["tokens_per_second"] for r in mine]
                        acceptance = mine[0]["acceptance"]
                        row["engines"][engine] = dict(
                            tokens_per_second=statistics.median(rates), spread=[min(rates), max(rates)],
                            rounds=rates, ratio=statistics.median(a["tokens_per_second"] / b["tokens_per_second"]
                                                                  for a, b in zip(mine, theirs)),
                            same_tokens=mine[0]["tokens"] == theirs[0]["tokens"] if setting == "greedy" else None,
                            acceptance=acceptance,
                            acceptance_lengths=None if acceptance is None else [1 + sum(r["acceptance"]) for r in mine])
                    rows.append(row)
    print(f"pair {args.pair}, {args.prompts} prompts x {args.max_new_tokens} tokens, {args.dtype}, {args.mode}, k = {args.k}; "
          f"medians over {args.rounds} alternating rounds (spread min-max); ratio: the median of each round's "
          f"engine / {reference}; same: greedy tokens equal {reference}'s; AL: acceptance length per round")
    for r in rows:
        print(f"{r['cores']} core(s), {r['kind']}, batch {r['batch']}, {r['sampling']}:")
        for engine, e in r["engines"].items():
            acc = "" if e["acceptance"] is None else "  AL " + " ".join(f"{a:.2f}" for a in e["acceptance_lengths"])
            same = "" if e["same_tokens"] is None else f"  same {'yes' if e['same_tokens'] else 'NO'}"
            print(f"  {engine:>24} {e['tokens_per_second']:7.0f} tok/s ({e['spread'][0]:.0f}-{e['spread'][1]:.0f}) "
                  f"{e['ratio']:5.2f}x{same}{acc}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
