"""Microbenchmark of verify_greedy / verify_sampling on the Qwen3 vocabulary.

    python benchmarks/bench_verify.py [--batch 1 8 64] [--k 3 7] [--check] [--json PATH]

V = 151936 target logits per row, a 32000-token draft vocabulary (d2t) with draft
probabilities for sampling. Baselines, timed in the same run: the eager PyTorch
composition of a rejection sampler (softmax, gather, cumprod, multinomial) and its
torch.compile. The bytes counted are the least the op must read: the logits [B, K+1, V]
once, and for sampling also, per request, the draft probabilities [Vd] of the one row
that may be rejected (accepted rows need only q(x)) and d2t [Vd] once, to map them.
"""

import argparse
import sys

import torch
from common import Row, add_common_args, compiled, finish, time_fn

import qspec_ext
from qspec_ext import reference as ref

VOCAB, DRAFT_VOCAB = 151936, 32000
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def eager_greedy(draft_ids, logits):
    k = draft_ids.shape[1]
    argmax = logits.argmax(-1)
    accepted = (draft_ids == argmax[:, :k]).int().cumprod(-1).sum(-1)
    positions = torch.arange(k + 1, device=logits.device)
    emitted = argmax.gather(1, accepted[:, None])
    out = torch.where(positions < accepted[:, None], torch.cat([draft_ids, draft_ids[:, :1]], 1), -1)
    return torch.where(positions == accepted[:, None], emitted, out), accepted


def eager_sampling(draft_ids, draft_probs, logits, temperature, target_ids):
    batch, k = draft_ids.shape
    p = torch.softmax(logits.float() / temperature[:, None, None], dim=-1)
    q = torch.zeros(batch, k, logits.shape[-1], device=logits.device)
    q[..., target_ids] = draft_probs
    p_x = p[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)
    q_x = q.gather(-1, draft_ids[..., None]).squeeze(-1)
    u = torch.rand(batch, k, device=logits.device)
    accepted = ((q_x > 0) & (u * q_x < p_x)).int().cumprod(-1).sum(-1)
    residual = (p[:, :k] - q).clamp(min=0)
    dist = torch.cat([residual, p[:, k:]], dim=1)
    samples = torch.multinomial(dist.view(-1, dist.shape[-1]), 1).view(batch, k + 1)
    positions = torch.arange(k + 1, device=logits.device)
    out = torch.where(positions < accepted[:, None], torch.cat([draft_ids, draft_ids[:, :1]], 1), -1)
    return torch.where(positions == accepted[:, None], samples.gather(1, accepted[:, None]), out), accepted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--k", type=int, nargs="+", default=[3, 7])
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--modes", nargs="+", default=["greedy", "sampling"], choices=["greedy", "sampling"])
    add_common_args(parser)
    args = parser.parse_args()
    dtype, dev = DTYPES[args.dtype], args.device
    rows, failures = [], 0
    for mode in args.modes:
        for batch in args.batch:
            for k in args.k:
                g = torch.Generator(device=dev).manual_seed(batch * 10 + k)
                logits = (torch.randn(batch, k + 1, VOCAB, generator=g, device=dev) * 3).to(dtype)
                target_ids = torch.randperm(VOCAB, generator=g, device=dev)[:DRAFT_VOCAB].sort().values
                d2t = target_ids - torch.arange(DRAFT_VOCAB, device=dev)
                draft_probs = torch.softmax(torch.randn(batch, k, DRAFT_VOCAB, generator=g, device=dev) * 3, -1)
                draft_local = torch.multinomial(draft_probs.view(-1, DRAFT_VOCAB), 1, generator=g).view(batch, k)
                draft_ids = target_ids[draft_local]
                temperature = torch.full((batch,), 0.8, device=dev)
                seed = torch.arange(batch, device=dev)
                offset = torch.zeros(batch, dtype=torch.long, device=dev)
                out = torch.empty(batch, k + 1, dtype=torch.long, device=dev)
                accepted = torch.empty(batch, dtype=torch.long, device=dev)
                if mode == "greedy":
                    ours = lambda: qspec_ext.verify_greedy_out(draft_ids, logits, out, accepted)  # noqa: E731
                    baseline_fn, baseline_args = eager_greedy, (draft_ids, logits)
                    check = lambda: (qspec_ext.verify_greedy(draft_ids, logits), ref.verify_greedy(draft_ids.cpu(), logits.cpu()))  # noqa: E731
                else:
                    ours = lambda: qspec_ext.verify_sampling_out(  # noqa: E731
                        draft_ids, draft_probs, logits, temperature, seed, offset, out, accepted, d2t)
                    baseline_fn = eager_sampling
                    baseline_args = (draft_ids, draft_probs, logits, temperature, target_ids)
                    check = lambda: (  # noqa: E731
                        qspec_ext.verify_sampling(draft_ids, draft_probs, logits, temperature, seed, offset, d2t),
                        ref.verify_sampling(draft_ids.cpu(), draft_probs.cpu(), logits.cpu(), temperature.cpu(),
                                            seed.cpu(), offset.cpu(), d2t.cpu()),
                    )
                if args.check:
                    (a_out, a_acc), (b_out, b_acc) = check()
                    if not (torch.equal(a_out.cpu(), b_out) and torch.equal(a_acc.cpu(), b_acc)):
                        failures += 1
                        print(f"CHECK FAILED: {mode} B={batch} K={k}")
                min_samples = 3 if batch * (k + 1) >= 256 else 10
                moved = logits.nbytes
                if mode == "sampling":
                    moved += batch * DRAFT_VOCAB * draft_probs.element_size() + d2t.nbytes
                row = Row(f"verify_{mode}", args.dtype, f"B={batch} K={k}", moved, time_fn(ours, dev, args.min_time))
                row.baselines["eager"] = time_fn(lambda: baseline_fn(*baseline_args), dev, args.min_time,
                                                 min_samples=min_samples)
                if not args.no_compile:
                    fn = compiled(baseline_fn)
                    row.baselines["compile"] = time_fn(lambda: fn(*baseline_args), dev, args.min_time,
                                                       min_samples=min_samples)
                rows.append(row)
                print(f"  {mode} B={batch} K={k}: {row.ours.median_us:.1f} us", file=sys.stderr, flush=True)
    title = f"qspec_ext draft verification (V {VOCAB}, draft vocab {DRAFT_VOCAB}, temperature 0.8)"
    return finish(title, rows, args, failures)


if __name__ == "__main__":
    sys.exit(main())
