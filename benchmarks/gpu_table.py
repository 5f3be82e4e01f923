"""The one table a GPU run settles (benchmarks/gpu_check.sh runs it last; CUDA only).

    python benchmarks/gpu_table.py [--decode-json OUT_DIR/decode.json] [--json PATH] [--min-time 0.2]

Rows, each as % of a device-to-device copy's bandwidth timed in the same run:
- verification (V = 151936, K = 3, B = 1 and 8, bf16 logits; greedy, and sampling at T = 1 with a
  32000-token draft vocabulary): the default kernels (one block per row) vs split-V
  (QSPEC_VERIFY_SPLIT=always), and whether both give the CPU kernel's tokens bit for bit;
- decode attention at B = 1 and 8, 8192 tokens of context (Qwen3-8B heads, bf16): ours vs
  F.scaled_dot_product_attention over exactly the used keys (flash where torch has it for GQA);
- compiled chain vs compiled plain decoding on the shipped tiny pair, bf16, read from
  bench_decode.py's JSON (gpu_check.sh's decode step), when given.
Bytes: what each op must read (the logits once; for sampling also one draft-probability row and
d2t per request; the used K/V and the queries).
"""

import argparse
import json
import os
import sys
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from common import copy_bandwidth, device_name, time_fn

import qspec_ext

VOCAB, DRAFT_VOCAB, K = 151936, 32000, 3


@contextmanager
def split_mode(value: str):
    before = os.environ.get("QSPEC_VERIFY_SPLIT")
    os.environ["QSPEC_VERIFY_SPLIT"] = value
    try:
        yield
    finally:
        os.environ.pop("QSPEC_VERIFY_SPLIT") if before is None else os.environ.__setitem__("QSPEC_VERIFY_SPLIT", before)


def verify_case(batch: int, sampling: bool, device: str) -> tuple[dict, int]:
    g = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, K + 1, VOCAB, generator=g) * 2).to(torch.bfloat16)
    if not sampling:
        drafts = logits[:, :K].float().argmax(-1)
        drafts[:, -1] = 0  # one rejection per request: the emitted token comes from a drafted row
        case = dict(draft_ids=drafts, target_logits=logits)
        return {k: v.to(device) for k, v in case.items()}, logits.numel() * 2
    targets = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    probs = torch.softmax(torch.randn(batch, K, DRAFT_VOCAB, generator=g) * 2, -1)
    drafts = targets[torch.multinomial(probs.view(-1, DRAFT_VOCAB), 1, generator=g).view(batch, K)]
    case = dict(draft_ids=drafts, draft_probs=probs, target_logits=logits, temperature=torch.ones(batch),
                seed=torch.arange(batch) + 7, offset=torch.zeros(batch, dtype=torch.long),
                d2t=targets - torch.arange(DRAFT_VOCAB))
    moved = logits.numel() * 2 + batch * DRAFT_VOCAB * 4 + DRAFT_VOCAB * 8
    return {k: v.to(device) for k, v in case.items()}, moved


def verify_rows(device: str, min_time: float, copy_bw: float) -> list[dict]:
    rows = []
    for sampling in (False, True):
        op = qspec_ext.verify_sampling if sampling else qspec_ext.verify_greedy
        for batch in (1, 8):
            case, moved = verify_case(batch, sampling, device)
            cpu = op(**{k: v.cpu() for k, v in case.items()})
            row = dict(kernel=f"verify_{'sampling' if sampling else 'greedy'}", shape=f"B={batch} K={K} V={VOCAB}")
            for name, mode in (("old", "0"), ("new", "always")):
                with split_mode(mode):
                    got = op(**case)
                    same = all(torch.equal(a.cpu(), b) for a, b in zip(got, cpu))
                    us = time_fn(lambda: op(**case), device, min_time).median_us
                row[name] = dict(us=us, copy_fraction=moved / (us * 1e-6) / copy_bw, equals_cpu=same)
            rows.append(row)
    return rows


def flash_sdpa(query, keys, values, scale):
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True), "flash"
    except RuntimeError:  # no flash kernel for this case in this torch: its own dispatch
        return F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True), "sdpa"


def attention_rows(device: str, min_time: float, copy_bw: float, context: int = 8192) -> list[dict]:
    heads_q, heads_kv, head_dim = 32, 8, 128
    rows = []
    for batch in (1, 8):
        g = torch.Generator(device=device).manual_seed(batch)
        randn = lambda *s: torch.randn(*s, generator=g, device=device).to(torch.bfloat16)  # noqa: E731
        query = randn(batch, 1, heads_q, head_dim)
        k_cache, v_cache = randn(batch * context, heads_kv, head_dim), randn(batch * context, heads_kv, head_dim)
        positions = torch.full((batch, 1), context - 1, device=device)
        scale = head_dim**-0.5
        keys = k_cache.view(batch, context, heads_kv, head_dim).transpose(1, 2).contiguous()
        values = v_cache.view(batch, context, heads_kv, head_dim).transpose(1, 2).contiguous()
        q = query.transpose(1, 2).contiguous()
        ours = qspec_ext.ops.cached_attention(query, k_cache, v_cache, positions, scale)
        theirs, backend = flash_sdpa(q, keys, values, scale)
        close = torch.allclose(ours.float(), theirs.transpose(1, 2).float(), atol=2e-2, rtol=2e-2)
        moved = (2 * batch * context * heads_kv * head_dim + 2 * query.numel()) * 2
        t_ours = time_fn(lambda: qspec_ext.ops.cached_attention(query, k_cache, v_cache, positions, scale), device,
                         min_time).median_us
        t_theirs = time_fn(lambda: flash_sdpa(q, keys, values, scale), device, min_time).median_us
        rows.append(dict(kernel="cached_attention", shape=f"B={batch} ctx={context} (32q/8kv x 128)",
                         old=dict(us=t_theirs, copy_fraction=moved / (t_theirs * 1e-6) / copy_bw, backend=backend),
                         new=dict(us=t_ours, copy_fraction=moved / (t_ours * 1e-6) / copy_bw, equals_cpu=close)))
    return rows


def print_table(verify: list[dict], attention: list[dict], decode: list[dict], device: str, copy_bw: float) -> str:
    lines = [f"qspec_ext GPU table on {device} (copy {copy_bw / 1e9:.0f} GB/s, torch {torch.__version__})", "",
             "| kernel | shape | old / baseline | new / ours | identical |", "|---|---|---|---|---|"]
    for r in verify:
        same = "yes" if r["old"]["equals_cpu"] and r["new"]["equals_cpu"] else "NO"
        lines.append(f"| {r['kernel']} (one block per row vs split-V) | {r['shape']} | {r['old']['us']:.1f} us, "
                     f"{100 * r['old']['copy_fraction']:.0f}% | {r['new']['us']:.1f} us, "
                     f"{100 * r['new']['copy_fraction']:.0f}% | {same} (== CPU kernel) |")
    for r in attention:
        lines.append(f"| {r['kernel']} ({r['old']['backend']} SDPA vs ours) | {r['shape']} | {r['old']['us']:.1f} us, "
                     f"{100 * r['old']['copy_fraction']:.0f}% | {r['new']['us']:.1f} us, "
                     f"{100 * r['new']['copy_fraction']:.0f}% | {'yes' if r['new']['equals_cpu'] else 'NO'} (bf16 tol) |")
    for r in decode:
        lines.append(f"| compiled decode, tiny pair bf16 (plain vs {r['drafting']} k={r['k']}) | batch {r['batch']} | "
                     f"{r['plain_tokens_per_s']:.0f} tok/s | {r['spec_tokens_per_s']:.0f} tok/s, "
                     f"**{r['speedup']:.2f}x** | accept len {r['mean_acceptance_length']:.2f} |")
    text = "\n".join(lines)
    print(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-json", help="bench_decode.py --json output to read the compiled rows from")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--min-time", type=float, default=0.2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_table: needs a CUDA device", file=sys.stderr)
        return 2
    device = "cuda"
    copy_bw = copy_bandwidth(device, args.min_time)
    verify = verify_rows(device, args.min_time, copy_bw)
    attention = attention_rows(device, args.min_time, copy_bw)
    decode = []
    if args.decode_json and os.path.exists(args.decode_json):
        decode = [r for r in json.load(open(args.decode_json))["rows"] if r["mode"] == "compiled" and r["drafting"] == "chain"]
    text = print_table(verify, attention, decode, device_name(device), copy_bw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device_name(device), copy_bandwidth=copy_bw, verify=verify, attention=attention,
                           decode=decode, table=text), f, indent=1)
    return 0 if all(r["old"]["equals_cpu"] and r["new"]["equals_cpu"] for r in verify) else 1


if __name__ == "__main__":
    sys.exit(main())
