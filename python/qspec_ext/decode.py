"""The decode loop (:func:`_decode`, one for plain and speculative decoding): speculative steps
draft k tokens, verify them in one target forward, keep the accepted prefix and the target's own
next token, repeat; plain decoding is the same loop with one target forward per token.

Each speculative step: the drafting strategy proposes drafts from the drafter's state (a chain,
P-EAGLE's parallel drafts or a tree: see drafting/) -> target.forward([last, drafts]) -> the
strategy verifies them and commits the accepted path -> the drafter's input from the features the
forward returned (gather_aux_hidden of the accepted rows) -> drafter.prefill_last of those pairs
(which also rewinds the drafter's cache) gives the next state; the target's cache is rewound the
same way, by the next step's positions. All of that is one
device-side function (:meth:`SpeculativeDecoder._step`); the only host synchronization per step
reads the tokens and accepted counts, which stopping needs. ``compile=True`` runs that step as one static-shape graph
(compiled.py); the prompt prefill, once per batch, runs eagerly: its tokens packed, without the
padding of shorter prompts, which a static-shape graph would compute.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .adaptive import DraftLengthPolicy, candidate_lengths
from .arguments import check_float, check_int, check_pair, check_prompts, check_sampling
from .compiled import bucketed, check_compilable, compiled_method, compiled_step, compiling
from .drafting import Drafting, make_drafting
from .drafting.tree import TreeDrafting
from .models.eagle3 import DraftState
from .sampling import apply_repetition_penalty, apply_top_k_top_p


@dataclass
class DecodeStats:
    """What a generate call did, plain or speculative (the draft counters stay 0 for plain decoding)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_generated_tokens: int = 0
    num_requests: int = 0
    wall_time: float = 0.0
    first_token_time: float = 0.0  # of wall_time: until every request's first token (the target's prefill)
    compile_time: float = 0.0  # in_batches(warmup=True): the warm-up run's extra wall time
    draft_lengths: dict[int, int] = field(default_factory=dict)  # drafts per step -> steps (0: plain steps)

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens per target forward, counting the target's own token."""
        return 1.0 + self.num_accepted_tokens / max(self.num_drafts, 1)

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Unconditional acceptance at draft position i: accepted_at_i / drafts."""
        return [n / max(self.num_drafts, 1) for n in self.accepted_per_position]

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """The tokens after each request's first, over the time after it: the decode phase alone
        (what speculative decoding speeds up; the prompt prefill is the same for both)."""
        decode_time = self.wall_time - self.first_token_time
        return (self.num_generated_tokens - self.num_requests) / decode_time if decode_time > 0 else 0.0

    def as_dict(self) -> dict:
        return dict(
            num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens, mean_acceptance_length=self.mean_acceptance_length,
            acceptance_rate_per_position=self.acceptance_rate_per_position,
            num_generated_tokens=self.num_generated_tokens, num_requests=self.num_requests,
            wall_time=self.wall_time, first_token_time=self.first_token_time,
            tokens_per_second=self.tokens_per_second, decode_tokens_per_second=self.decode_tokens_per_second,
            compile_time=self.compile_time, draft_lengths=dict(sorted(self.draft_lengths.items())),
        )


SpecDecodeStats = DecodeStats  # the name before plain decoding shared it


@dataclass
class GenerateResult:
    tokens: list[list[int]]  # generated ids per prompt, prompt excluded
    stats: DecodeStats


class _Sampler:
    """Picks the target's own tokens outside verification (the first token, plain decoding), and
    processes the target's logits: the repetition penalty (which needs the tokens each request has
    seen: ``observe``), then temperature, top-k and top-p."""

    def __init__(self, batch: int, temperature: float, top_k: int | None, top_p: float | None, seed: int, device,
                 repetition_penalty: float = 1.0, prompts: list[list[int]] | None = None, vocab_size: int = 0):
        self.repetition_penalty = repetition_penalty
        self.seen = None
        if repetition_penalty != 1.0:
            self.seen = torch.zeros(batch, vocab_size, dtype=torch.bool, device=device)
            for b, p in enumerate(prompts):
                self.seen[b, torch.tensor(p, dtype=torch.long, device=device)] = True
        self.temperature = temperature
        self.max_top_k = top_k if top_k is not None and top_k > 0 else None
        self.top_k = None if top_k is None else torch.full((batch,), top_k, device=device)
        self.top_p = None if top_p is None else torch.full((batch,), top_p, device=device)
        self.generators = [torch.Generator(device=device).manual_seed(seed * 1_000_003 + b) for b in range(batch)]

    def keep_requests(self, rows: list[int]) -> None:
        """Follows the batch to its rows ``rows`` (see :func:`_kept_rows`)."""
        index = torch.tensor(rows, device=self.generators[0].device)
        self.top_k = None if self.top_k is None else self.top_k[index]
        self.top_p = None if self.top_p is None else self.top_p[index]
        self.seen = None if self.seen is None else self.seen[index]
        self.generators = [self.generators[i] for i in rows]

    def observe(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Adds ``tokens [B, W]`` (where ``valid [B, W]``) to what each request has seen."""
        if self.seen is None:
            return
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid
        counts = torch.zeros(self.seen.shape, dtype=torch.int32, device=self.seen.device)
        counts.scatter_add_(1, tokens.clamp(min=0), valid.to(torch.int32))
        self.seen |= counts > 0

    def draft_penalty(self) -> tuple[float, torch.Tensor]:
        """What a drafter needs to penalize its drafts as the target's rows will be."""
        return self.repetition_penalty, self.seen

    def penalize(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """The repetition penalty (:func:`~qspec_ext.sampling.apply_repetition_penalty`)."""
        if self.seen is None:
            return logits
        return apply_repetition_penalty(logits, self.seen, self.repetition_penalty, drafts)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """logits / temperature, filtered; verify_sampling then runs at temperature 1."""
        return apply_top_k_top_p(logits.float() / self.temperature, self.top_k, self.top_p, self.max_top_k)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B]
        logits = self.penalize(logits)
        if self.temperature == 0.0:
            return logits.float().argmax(dim=-1)  # the same ids; torch's fp32 argmax is 2-4x its bf16 one on CPU
        probs = torch.softmax(self.process(logits), dim=-1)
        return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.generators)])


def _check_call(where: str, target, prompts, max_new_tokens: int, extra: int, max_length: int | None,
                temperature, top_k, top_p, eos_token_id, seed) -> tuple[list[list[int]], int, list[int]]:
    """The arguments of one generate call, checked before any work: the prompts as lists, the
    cache length (just enough when max_length is None) and the stop ids."""
    vocab = target.config.vocab_size
    prompts = check_prompts(where, prompts, vocab)
    stop_ids = check_sampling(where, vocab, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed)
    longest = max(len(p) for p in prompts)
    max_length = max_length or longest + max_new_tokens + extra
    if longest + max_new_tokens + extra > max_length:
        raise ValueError(
            f"{where}: a prompt of {longest} tokens + max_new_tokens={max_new_tokens} (+{extra} for drafts) "
            f"does not fit the cache of {max_length} positions"
        )
    return prompts, max_length, stop_ids


def check_repetition_penalty(where: str, penalty, compile: bool, tree: bool = False) -> None:
    check_float(where, "repetition_penalty", penalty, 0.0, low_open=True)
    if penalty != 1.0 and compile:
        raise ValueError(f"{where}: repetition_penalty={penalty} does not run compiled (compile=True); "
                         f"use eager decoding or repetition_penalty=1.0")
    if penalty != 1.0 and tree:
        raise ValueError(f"{where}: repetition_penalty={penalty} runs with chain and parallel drafting, "
                         f"not trees (topk > 1)")


def _nothing_to_generate(prompts: list[list[int]]) -> "GenerateResult":
    return GenerateResult([[] for _ in prompts], DecodeStats())


def _prefill_inputs(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    positions = torch.full_like(tokens, -1)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p, device=device)
        positions[b, : len(p)] = torch.arange(len(p), device=device)
    return tokens, positions


class _StopIds:
    """Finds stop ids on the device: the host reads the answer with the tokens, in one transfer."""

    def __init__(self, ids: list[int], device):
        self.ids = torch.tensor(ids, dtype=torch.long, device=device) if ids else None

    def first(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[B]``: the column of the first stop id in each row of ``tokens [B, W]``, W if none."""
        width = tokens.shape[1]
        if self.ids is None:
            return torch.full(tokens.shape[:1], width, dtype=torch.long, device=tokens.device)
        columns = torch.arange(width, device=tokens.device)
        return torch.where(torch.isin(tokens, self.ids), columns, width).min(dim=1).values


# on_tokens(request index, the tokens it just gained): called as each step's tokens are kept
# (streaming), in order; the concatenation per request is its GenerateResult.tokens entry.
TokenCallback = Callable[[int, list[int]], None]


def _finish(generated: list[int], new: list[int], max_new_tokens: int, stop: int,
            on_tokens: TokenCallback | None = None, request: int = 0) -> bool:
    """Appends ``new[: stop + 1]`` (``stop``: the index of a stop id in ``new``, or len(new) if
    none) up to max_new_tokens; True when the request is done."""
    kept = new[: min(stop + 1, max_new_tokens - len(generated))]
    generated.extend(kept)
    if on_tokens is not None and kept:
        on_tokens(request, kept)
    return stop < len(new) or len(generated) >= max_new_tokens


def _kept_rows(live: list[int], done: list[bool], compiled: bool) -> list[int] | None:
    """When requests have finished: the batch rows to keep (the models' ``keep_requests``), so that
    a step computes only the requests still running (as a server's batch drops finished ones).
    ``live[i]``: the request in row i. The running rows below the new size stay where they are,
    the others fill the gaps of the finished ones (rows[i] >= i); compiled, the size is a power of
    two (finished rows left in place as padding), so that few graphs are built. None: no change."""
    running = [i for i, r in enumerate(live) if not done[r]]
    size = min(len(live), 1 << max(len(running) - 1, 0).bit_length()) if compiled else len(running)
    if not running or size >= len(live):
        return None
    rows = list(range(size))
    holes = [i for i in rows if done[live[i]]]
    for hole, row in zip(holes, [i for i in running if i >= size]):
        rows[hole] = row
    return rows


def _read_tokens(rows: torch.Tensor, stops: _StopIds, skip: int = 0) -> tuple[list[list[int]], list[int]]:
    """rows ``[B, W]`` and the first stop column of each row's ``rows[:, skip:]`` (the columns
    before are counts, not tokens), in one device-to-host transfer."""
    both = torch.cat([rows, stops.first(rows[:, skip:])[:, None]], dim=1).tolist()
    return [row[:-1] for row in both], [row[-1] for row in both]


@torch.no_grad()
def generate_plain(target, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                   top_k: int | None = None, top_p: float | None = None,
                   eos_token_id: int | Sequence[int] | None = None, seed: int = 0, max_length: int | None = None,
                   compile: bool = False, on_tokens: TokenCallback | None = None,
                   repetition_penalty: float = 1.0) -> GenerateResult:
    """Ordinary decoding with the target alone (one forward per token): the baseline. Each
    request stops at max_new_tokens or after any of the ``eos_token_id`` ids; ``on_tokens``
    streams each request's tokens as they come. ``repetition_penalty`` (HF / vLLM semantics, over
    the prompt and the output; 1: none) applies before temperature, top-k and top-p.
    ``compile``: the decode steps' target forward runs as static-shape graphs (compiled.py); the
    prompt prefill runs eagerly, packed."""
    if compile:
        check_compilable("generate_plain", target)
    prompts, max_length, stop_ids = _check_call("generate_plain", target, prompts, max_new_tokens, 1, max_length,
                                                temperature, top_k, top_p, eos_token_id, seed)
    check_repetition_penalty("generate_plain", repetition_penalty, compile)
    if max_new_tokens == 0:
        return _nothing_to_generate(prompts)
    sampling = _Sampling(temperature, top_k, top_p, seed, repetition_penalty)
    with compiling(compile):
        return _decode(target, _PlainSteps(target, compile), prompts, max_new_tokens, sampling, stop_ids,
                       bucketed(max_length, compile), compile, on_tokens)


@dataclass
class _Sampling:
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int
    repetition_penalty: float


def _decode(target, steps, prompts: list[list[int]], max_new_tokens: int, sampling: _Sampling, stop_ids: list[int],
            cache_length: int, compiled: bool, on_tokens: TokenCallback | None) -> GenerateResult:
    """The decode loop, plain or speculative (``steps``: :class:`_PlainSteps` or
    :class:`_SpeculativeSteps`): the prompts' prefill and first token, then steps of 1 to k + 1
    tokens per request until each stops; the batch bookkeeping (stop ids, streaming, finished
    requests leaving the batch, the stats) in this one place."""
    device = target.device
    start = time.perf_counter()
    batch = len(prompts)
    target.setup(batch, cache_length)
    steps.setup(batch, cache_length)
    sampler = _Sampler(batch, sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed, device,
                       sampling.repetition_penalty, prompts, target.config.vocab_size)
    stops = _StopIds(stop_ids, device)
    stats = DecodeStats(accepted_per_position=[0] * steps.max_depth, num_requests=batch)

    # Prefill: the target reads the prompts and picks the first token.
    tokens, positions = _prefill_inputs(prompts, device)
    prefill = target(tokens, positions, last_only=True)
    first = sampler.pick(prefill.logits)
    sampler.observe(first[:, None])
    generated: list[list[int]] = [[] for _ in prompts]
    new, stop = _read_tokens(first[:, None], stops)
    done = [_finish(g, n, max_new_tokens, s, on_tokens, b) for b, (g, n, s) in enumerate(zip(generated, new, stop))]
    stats.first_token_time = time.perf_counter() - start
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    steps.start(tokens, positions, lengths, first, prefill.features)  # (the drafter's prefill counts as decode time)

    last, position = first, lengths  # the newest token and its position (not yet in the target's cache)
    position_host = [len(p) for p in prompts]  # per request
    live = list(range(batch))  # the request in each row of the batch
    while not all(done):
        rows = _kept_rows(live, done, compiled)
        if rows is not None:
            kept = [min(position_host[live[i]] + steps.cache_margin, cache_length) for i in rows]
            target.keep_requests(rows, kept)
            index = torch.tensor(rows, device=device)
            steps.keep_requests(rows, kept, index)
            last, position = last[index], position[index]
            sampler.keep_requests(rows)
            live = [live[i] for i in rows]
        active = ~torch.tensor([done[r] for r in live], device=device)
        out, accepted, last, position = steps.step(last, position, active, sampler)
        stats.draft_lengths[steps.num_draft_tokens] = stats.draft_lengths.get(steps.num_draft_tokens, 0) + 1
        # The one sync per step (stopping needs it): tokens, accepted counts and stop columns.
        if accepted is None:  # plain decoding: one token, nothing drafted
            out_host, stop = _read_tokens(out, stops)
            accepted_host = [0] * len(out_host)
        else:
            out_host, stop = _read_tokens(torch.cat([accepted[:, None], out], dim=1), stops, skip=1)
            accepted_host = [row.pop(0) for row in out_host]

        for i, r in enumerate(live):
            if done[r]:
                continue
            n = accepted_host[i]
            position_host[r] += n + 1
            if steps.num_draft_tokens:
                stats.num_drafts += 1
                stats.num_draft_tokens += steps.num_draft_tokens
                stats.num_accepted_tokens += n
                for j in range(n):
                    stats.accepted_per_position[j] += 1
            done[r] = _finish(generated[r], out_host[i][: n + 1], max_new_tokens, stop[i], on_tokens, r)
    stats.num_generated_tokens = sum(map(len, generated))
    stats.wall_time = time.perf_counter() - start
    return GenerateResult(generated, stats)


def drafter_input(drafter, features, rows: torch.Tensor) -> torch.Tensor:
    """The drafter's fc input ``[*rows.shape, n*H]``: the target's features (:class:`AuxFeatures` of
    one forward) at its rows ``rows`` (-1: none), normalized as the drafter's fc expects."""
    norm_mode, norm_weight = drafter.fc_norm_mode()
    fc_input = features.gather(rows.reshape(-1), norm_mode, norm_weight, drafter.config.rms_norm_eps)
    return fc_input.view(*rows.shape, -1)


class _PlainSteps:
    """The loop's steps without a drafter: one target forward and one pick per token."""

    max_depth = num_draft_tokens = 0
    cache_margin = 1

    def __init__(self, target, compiled: bool):
        self.forward = compiled_method(target, "forward") if compiled else target

    def setup(self, batch: int, cache_length: int) -> None:
        pass

    def start(self, tokens, positions, lengths, first, features) -> None:
        pass

    def keep_requests(self, rows: list[int], lengths: list[int], index: torch.Tensor) -> None:
        pass

    def step(self, last, position, active, sampler) -> tuple:
        """(the new token [B, 1], no accepted drafts (None), the new token, its position)."""
        logits = self.forward(last[:, None], torch.where(active, position, -1)[:, None]).logits[:, 0]
        token = sampler.pick(logits)
        sampler.observe(token[:, None])
        return token[:, None], None, token, position + 1


class SpeculativeDecoder:
    """EAGLE-3 speculative decoding of a target (any :class:`~qspec_ext.targets.Target`) with an Eagle3Drafter.

    ``topk = 1`` drafts a chain of ``num_speculative_tokens`` (one forward each, or one forward
    for all with a P-EAGLE drafter); ``topk > 1`` drafts an EAGLE-2 tree of that depth and
    verifies its ``num_draft_tokens`` best nodes (SGLang's steps / eagle topk / draft tokens).
    ``drafting``: a strategy of your own (the :class:`~qspec_ext.drafting.Drafting` protocol) in
    place of the one ``num_speculative_tokens`` / ``topk`` / ``num_draft_tokens`` choose, built
    with ``check_bounds=False`` (the decoder sizes the cache once per call).
    ``compile``: each decode step runs as one static-shape graph (compiled.py), the prompt
    prefill eagerly, packed; the models themselves stay eager for other callers.
    ``adaptive``: each step drafts 0 to ``num_speculative_tokens`` tokens (of
    :func:`~qspec_ext.adaptive.candidate_lengths`), the length with the most expected tokens per
    second by the running acceptance and the step times measured on this machine (adaptive.py;
    0: a plain step); chain or P-EAGLE drafting, the drafter's kind. The decoder keeps what it
    measured across generate calls."""

    def __init__(self, target, drafter, num_speculative_tokens: int = 3, max_length: int | None = None,
                 topk: int = 1, num_draft_tokens: int | None = None, compile: bool = False,
                 drafting: Drafting | None = None, adaptive: bool = False):
        check_int("SpeculativeDecoder", "num_speculative_tokens", num_speculative_tokens, 1, 32)
        check_int("SpeculativeDecoder", "topk", topk, 1, 64)
        if max_length is not None:
            check_int("SpeculativeDecoder", "max_length", max_length, 2)
        check_pair(target, drafter)
        self.target, self.drafter, self.k = target, drafter, num_speculative_tokens
        # The cache is sized for every step once per generate call: no per-step bounds checks.
        self.drafting = drafting or make_drafting(target, drafter, num_speculative_tokens, topk, num_draft_tokens,
                                                  check_bounds=False)
        self.policy = None
        if adaptive:
            if topk != 1 or drafting is not None:
                raise ValueError("SpeculativeDecoder: adaptive=True chooses among chain (or P-EAGLE) draft lengths; "
                                 f"it takes no tree (topk={topk}) and no drafting of your own")
            self.draftings = {k: make_drafting(target, drafter, k, check_bounds=False)
                              for k in candidate_lengths(num_speculative_tokens) if k > 0}
            self.policy = DraftLengthPolicy(candidate_lengths(num_speculative_tokens))
        self.max_length = max_length or target.config.max_position_embeddings
        self.compiled = compile
        self.step = self._step
        if compile:
            check_compilable("SpeculativeDecoder", target)
            self.step = compiled_step(self._step, drafter.device)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None,
                 eos_token_id: int | Sequence[int] | None = None, seed: int = 0,
                 on_tokens: TokenCallback | None = None, repetition_penalty: float = 1.0) -> GenerateResult:
        """Tokens for each prompt, up to max_new_tokens or through the first of the
        ``eos_token_id`` ids (one, or several: an instruct model's list); a stop id inside an
        accepted run ends the request there. ``on_tokens(request, tokens)`` streams what each
        step accepts. ``repetition_penalty``: as :func:`generate_plain`'s (each verified row
        counts the drafts before it: still exactly plain decoding's output, or its law when sampling)."""
        margin = self.drafting.cache_margin  # positions past the new tokens that drafts may use
        prompts, _, stop_ids = _check_call("SpeculativeDecoder.generate", self.target, prompts, max_new_tokens,
                                           margin, self.max_length, temperature, top_k, top_p, eos_token_id, seed)
        check_repetition_penalty("SpeculativeDecoder.generate", repetition_penalty, self.compiled,
                                 tree=isinstance(self.drafting, TreeDrafting))
        if max_new_tokens == 0:
            return _nothing_to_generate(prompts)
        needed = max(len(p) for p in prompts) + max_new_tokens + margin
        cache_length = max(needed, min(bucketed(needed, self.compiled), self.max_length))
        sampling = _Sampling(temperature, top_k, top_p, seed, repetition_penalty)
        with compiling(self.compiled):
            steps = (_AdaptiveSteps if self.policy else _SpeculativeSteps)(self, seed if temperature > 0 else None)
            return _decode(self.target, steps, prompts, max_new_tokens, sampling, stop_ids, cache_length,
                           self.compiled, on_tokens)

    def _step(self, drafting: Drafting, last: torch.Tensor, position: torch.Tensor, active: torch.Tensor,
              seeds: torch.Tensor | None, sampler: "_Sampler", state: DraftState,
              context: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """One step on the device, no host synchronization (compile=True: one graph per
        ``drafting``): draft from the drafter's ``state``, verify in one target forward, commit the
        accepted path, prefill the drafter with it. ``context``: each request's tokens by position,
        for a drafting that ``needs_context``. Returns (out_ids, num_accepted, the new last token,
        its position, the drafter's next state)."""
        target, drafter = self.target, self.drafter
        root = torch.where(active, position, -1)
        penalty = None if sampler.seen is None else sampler.draft_penalty()
        proposal = drafting.propose(root, state, penalty, context)
        tokens = torch.cat([last[:, None], proposal.draft_ids], dim=1)
        verified = target(tokens, torch.where(active[:, None], position[:, None] + proposal.depths, -1), tree=proposal.tree)
        logits = sampler.penalize(verified.logits, proposal.draft_ids)
        if seeds is not None:
            logits = sampler.process(logits)
        out, accepted, path = drafting.verify(proposal, logits, seeds, position + 1)
        sampler.observe(out, torch.arange(out.shape[1], device=out.device) <= accepted[:, None])
        drafting.commit(proposal, path)
        # The drafter's next pairs: features of the accepted path [last, drafts...] with the
        # tokens after them, at consecutive positions (a fixed width: one shape per step).
        batch, width = tokens.shape[0], drafting.max_depth + 1
        on_path = (path[:, :width] >= 0) & active[:, None]
        rows = torch.where(on_path, torch.arange(batch, device=last.device)[:, None] * tokens.shape[1] + path[:, :width], -1)
        pair_positions = torch.where(on_path, position[:, None] + torch.arange(width, device=last.device), -1)
        state = drafter.prefill_last(drafter_input(drafter, verified.features, rows), out[:, :width].clamp(min=0),
                                     pair_positions, packed=not self.compiled)
        return out, accepted, out.gather(1, accepted[:, None])[:, 0], position + accepted + 1, state


class _SpeculativeSteps:
    """The loop's steps with a drafter: the drafter's prefill of the prompts, then
    :meth:`SpeculativeDecoder._step` (draft, verify, commit), carrying the drafter's state and
    each request's sampling seed from step to step."""

    def __init__(self, decoder: SpeculativeDecoder, seed: int | None):
        self.decoder, self.seed = decoder, seed
        drafting = decoder.drafting
        self.max_depth, self.num_draft_tokens = drafting.max_depth, drafting.num_draft_tokens
        self.cache_margin = drafting.cache_margin  # positions past the new tokens that drafts may use
        self.state: DraftState | None = None
        self.seeds: torch.Tensor | None = None
        self.context: torch.Tensor | None = None  # [B, cache length + 1] tokens by position (needs_context)

    def setup(self, batch: int, cache_length: int) -> None:
        self.decoder.drafter.setup(batch, cache_length)
        if self.decoder.drafting.needs_context:  # the last column takes the writes of tokens not kept
            self.context = torch.zeros(batch, cache_length + 1, dtype=torch.long, device=self.decoder.drafter.device)

    def start(self, tokens, positions, lengths, first, features) -> None:
        """The drafter reads the pairs (feature of prompt token t, prompt token t+1 or the first
        new token); ``features``: the target's prefill's."""
        drafter = self.decoder.drafter
        batch, device = tokens.shape[0], tokens.device
        pair_tokens = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
        pair_tokens[torch.arange(batch, device=device), lengths - 1] = first
        rows = torch.where(positions >= 0, torch.arange(tokens.numel(), device=device).view_as(tokens), -1)
        self.state = drafter.prefill_last(drafter_input(drafter, features, rows), pair_tokens, positions, packed=True)
        if self.seed is not None:
            self.seeds = torch.tensor([self.seed * 1_000_003 + b for b in range(batch)], device=device)
        if self.context is not None:
            self.context[:, : tokens.shape[1]] = torch.where(positions >= 0, tokens, 0)
            self.context[torch.arange(batch, device=device), lengths] = first

    def keep_requests(self, rows: list[int], lengths: list[int], index: torch.Tensor) -> None:
        self.decoder.drafter.keep_requests(rows, lengths)
        self.state = self.state.select(index)
        self.seeds = None if self.seeds is None else self.seeds[index]
        self.context = None if self.context is None else self.context[index]

    def step(self, last, position, active, sampler) -> tuple[torch.Tensor, ...]:
        out, accepted, new_last, new_position, self.state = self.decoder.step(
            self.decoder.drafting, last, position, active, self.seeds, sampler, self.state, self.context)
        if self.context is not None:  # the kept tokens at their positions, the rest to the spare column
            columns = position[:, None] + 1 + torch.arange(out.shape[1], device=out.device)
            kept = (torch.arange(out.shape[1], device=out.device) <= accepted[:, None]) & active[:, None]
            self.context.scatter_(1, torch.where(kept, columns, self.context.shape[1] - 1), out.clamp(min=0))
        return out, accepted, new_last, new_position


class _AdaptiveSteps(_SpeculativeSteps):
    """The steps of an adaptive decoder: each step's draft length from the decoder's
    :class:`~qspec_ext.adaptive.DraftLengthPolicy`, which learns from each step's wall time (from
    its start to the next step's) and accepted counts. A step of 0 drafts is a plain step: one
    target forward and a pick; its (feature, token) pair waits, and the next drafting step first
    prefills the drafter with the pairs that waited (a plain step costs what plain decoding's does)."""

    def __init__(self, decoder: SpeculativeDecoder, seed: int | None):
        super().__init__(decoder, seed)
        self.num_draft_tokens = 0
        self.forward = compiled_method(decoder.target, "forward") if decoder.compiled else decoder.target
        self.waiting: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (fc input, token, position)
        self.last_step: tuple | None = None  # (rows, k, start time, accepted counts)

    def keep_requests(self, rows: list[int], lengths: list[int], index: torch.Tensor) -> None:
        super().keep_requests(rows, lengths, index)
        self.waiting = [tuple(t[index] for t in pair) for pair in self.waiting]

    def step(self, last, position, active, sampler) -> tuple[torch.Tensor, ...]:
        policy, start = self.decoder.policy, time.perf_counter()
        if self.last_step is not None:
            rows, k, began, accepted = self.last_step
            policy.record(rows, k, start - began, accepted)
        rows = last.shape[0]
        k = self.num_draft_tokens = policy.choose(rows)
        if k == 0:
            out, accepted, last, position = self._plain_step(last, position, active, sampler)
        else:
            if self.waiting:
                self._prefill_waiting()
            out, accepted, last, position, self.state = self.decoder.step(
                self.decoder.draftings[k], last, position, active, self.seeds, sampler, self.state)
        self.last_step = (rows, k, start, accepted[active].tolist())
        return out, accepted, last, position

    def _plain_step(self, last, position, active, sampler) -> tuple[torch.Tensor, ...]:
        pair_position = torch.where(active, position, -1)
        output = self.forward(last[:, None], pair_position[:, None])
        token = sampler.pick(output.logits[:, 0])
        sampler.observe(token[:, None])
        rows = torch.where(active, torch.arange(last.shape[0], device=last.device), -1)[:, None]
        self.waiting.append((drafter_input(self.decoder.drafter, output.features, rows), token[:, None],
                             pair_position[:, None]))
        return token[:, None], torch.zeros_like(position), token, position + 1

    def _prefill_waiting(self) -> None:
        fc_input, tokens, positions = (torch.cat(parts, dim=1) for parts in zip(*self.waiting))
        self.waiting = []
        self.state = self.decoder.drafter.prefill_last(fc_input, tokens, positions, packed=True)
