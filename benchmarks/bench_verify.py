"""Microbenchmark of verify_greedy / verify_sampling and the tree ops on the Qwen3 vocabulary.

    python benchmarks/bench_verify.py [--batch 1 8 64] [--k 3 7] [--nodes 16 64] [--check] [--json PATH]

V = 151936 target logits per row, a 32000-token draft vocabulary (d2t) with draft
probabilities for sampling. Baselines, timed in the same run: the eager PyTorch
composition of a rejection sampler (softmax, gather, cumprod, multinomial) and its
torch.compile. The bytes counted are the least the op must read: the logits [B, K+1, V]
once, and for sampling also, per request, the draft probabilities [Vd] of the one row
that may be rejected (accepted rows need only q(x)) and d2t [Vd] once, to map them.

Tree modes: a breadth-first tree of N nodes, 4 children per node, whose first child holds
the parent row's argmax (so walks go deep); the baseline is the eager composition (argmax or
multinomial of every row, then a walk vectorized over the batch, one step per tree level)
and its torch.compile. Bytes: the logits rows the op must read: every row [B, N+1, V] on CUDA
(all nodes' tokens at once), the walked path's rows on CPU (it computes them lazily).
"""

import argparse
import sys

import torch
from common import Row, add_common_args, compiled, finish, time_fn

import qspec_ext
from qspec_ext import reference as ref

VOCAB, DRAFT_VOCAB = 151936, 32000
# check_against: --check compares sampling on CUDA with the CPU kernel, which makes the same
# decisions bit for bit (qspec_ext/verify.h: one exp, one summation order); the reference works in
# float64, so a draw landing within fp32 rounding of a token boundary may pick the neighbour there
# (seen once on an H200: tree sampling, B=64 N=16). The CPU kernel is checked against the reference
# on CPU runs and in the tests.
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


def eager_tree(draft_ids, parents, logits, temperature, max_depth: int):
    batch, nodes = draft_ids.shape
    if temperature is None:
        tokens = logits.argmax(-1)
    else:
        p = torch.softmax(logits.float() / temperature[:, None, None], dim=-1)
        tokens = torch.multinomial(p.view(-1, p.shape[-1]), 1).view(batch, nodes + 1)
    is_child = parents[:, None, :] == torch.arange(nodes + 1, device=logits.device)[None, :, None]
    rows = torch.arange(batch, device=logits.device)
    current = torch.zeros(batch, dtype=torch.long, device=logits.device)
    alive = torch.ones(batch, dtype=torch.bool, device=logits.device)
    out = torch.full((batch, nodes + 1), -1, dtype=torch.long, device=logits.device)
    path, accepted = out.clone(), torch.zeros_like(current)
    for depth in range(max_depth + 1):
        token = tokens.gather(1, current[:, None])[:, 0]
        out[:, depth] = torch.where(alive, token, -1)
        path[:, depth] = torch.where(alive, current, -1)
        match = is_child[rows, current] & (draft_ids == token[:, None])
        alive = alive & match.any(-1)
        accepted += alive
        current = torch.where(alive, match.int().argmax(-1) + 1, current)
    return out, accepted, path


def tree_inputs(batch: int, nodes: int, logits: torch.Tensor, branching: int = 4):
    """parents [B, N] of a breadth-first tree, draft_ids whose first children hold the argmax."""
    parents = [(i // branching) for i in range(nodes)]  # node i+1's parent: breadth-first, `branching` each
    depth = [0]
    for parent in parents:
        depth.append(depth[parent] + 1)
    parents = torch.tensor(parents, device=logits.device).expand(batch, nodes).contiguous()
    draft_ids = torch.randint(0, logits.shape[-1], (batch, nodes), device=logits.device)
    first = torch.arange(nodes, device=logits.device) % branching == 0
    argmax_of_parent = logits.argmax(-1).gather(1, parents)
    return torch.where(first, argmax_of_parent, draft_ids), parents, max(depth)


def timed_row(op: str, shape: str, moved: int, ours, baseline_fn, baseline_args, target_rows: int, args) -> Row:
    """ours timed against the eager baseline and (unless --no-compile) its torch.compile."""
    min_samples = 3 if target_rows >= 256 else 10
    row = Row(op, args.dtype, shape, moved, time_fn(ours, args.device, args.min_time))
    row.baselines["eager"] = time_fn(lambda: baseline_fn(*baseline_args), args.device, args.min_time,
                                     min_samples=min_samples)
    if not args.no_compile:
        fn = compiled(baseline_fn)
        row.baselines["compile"] = time_fn(lambda: fn(*baseline_args), args.device, args.min_time,
                                           min_samples=min_samples)
    print(f"  {op} {shape}: {row.ours.median_us:.1f} us", file=sys.stderr, flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--k", type=int, nargs="+", default=[3, 7])
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 64], help="tree nodes N (tree modes)")
    modes = ["greedy", "sampling", "tree_greedy", "tree_sampling"]
    parser.add_argument("--modes", nargs="+", default=modes, choices=modes)
    add_common_args(parser)
    args = parser.parse_args()
    dtype, dev = DTYPES[args.dtype], args.device
    rows, failures = [], 0
    for mode in args.modes:
        if mode.startswith("tree"):
            failures += bench_tree(mode, args, dtype, rows)
            continue
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
                    expected_fn = ref.verify_sampling if dev == "cpu" else qspec_ext.verify_sampling  # see check_against
                    check = lambda: (  # noqa: E731
                        qspec_ext.verify_sampling(draft_ids, draft_probs, logits, temperature, seed, offset, d2t),
                        expected_fn(draft_ids.cpu(), draft_probs.cpu(), logits.cpu(), temperature.cpu(),
                                    seed.cpu(), offset.cpu(), d2t.cpu()),
                    )
                if args.check:
                    (a_out, a_acc), (b_out, b_acc) = check()
                    if not (torch.equal(a_out.cpu(), b_out) and torch.equal(a_acc.cpu(), b_acc)):
                        failures += 1
                        print(f"CHECK FAILED: {mode} B={batch} K={k}")
                moved = logits.nbytes
                if mode == "sampling":
                    moved += batch * DRAFT_VOCAB * draft_probs.element_size() + d2t.nbytes
                rows.append(timed_row(f"verify_{mode}", f"B={batch} K={k}", moved, ours, baseline_fn, baseline_args,
                                      batch * (k + 1), args))
    title = f"qspec_ext draft verification (V {VOCAB}, draft vocab {DRAFT_VOCAB}, temperature 0.8)"
    return finish(title, rows, args, failures)


def bench_tree(mode: str, args, dtype, rows: list) -> int:
    dev, failures = args.device, 0
    for batch in args.batch:
        for nodes in args.nodes:
            g = torch.Generator(device=dev).manual_seed(batch * 100 + nodes)
            logits = (torch.randn(batch, nodes + 1, VOCAB, generator=g, device=dev) * 3).to(dtype)
            draft_ids, parents, max_depth = tree_inputs(batch, nodes, logits)
            temperature = torch.full((batch,), 0.8, device=dev)
            seed = torch.arange(batch, device=dev)
            offset = torch.zeros(batch, dtype=torch.long, device=dev)
            out = [torch.empty(batch, nodes + 1, dtype=torch.long, device=dev), torch.empty(batch, dtype=torch.long, device=dev),
                   torch.empty(batch, nodes + 1, dtype=torch.long, device=dev)]
            sampling = mode == "tree_sampling"
            if sampling:
                ours = lambda: qspec_ext.verify_tree_sampling_out(draft_ids, parents, logits, temperature, seed, offset, *out)  # noqa: E731
                reference_args = (temperature.cpu(), seed.cpu(), offset.cpu())
                expected_fn = ref.verify_tree if dev == "cpu" else qspec_ext.verify_tree_sampling  # see check_against
            else:
                ours = lambda: qspec_ext.verify_tree_greedy_out(draft_ids, parents, logits, *out)  # noqa: E731
                reference_args = ()
                expected_fn = ref.verify_tree
            if args.check:
                ours()
                expected = expected_fn(draft_ids.cpu(), parents.cpu(), logits.cpu(), *reference_args)
                if not all(torch.equal(a.cpu(), b) for a, b in zip(out, expected)):
                    failures += 1
                    print(f"CHECK FAILED: {mode} B={batch} N={nodes}")
            baseline_args = (draft_ids, parents, logits, temperature if sampling else None, max_depth)
            ours()
            read_rows = batch * (nodes + 1) if logits.is_cuda else int(out[1].sum()) + batch
            rows.append(timed_row(f"verify_{mode}", f"B={batch} N={nodes}", read_rows * VOCAB * logits.element_size(),
                                  ours, eager_tree, baseline_args, batch * (nodes + 1), args))
    return failures


if __name__ == "__main__":
    sys.exit(main())
