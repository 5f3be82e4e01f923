"""The one timing harness of ``qspec bench``, ``qspec demo`` and benchmarks/: every configuration
runs once per round, the rounds interleaved (A B C ... A B C ...), so that a shared machine's drift
falls on all of them alike; a figure is the median over the rounds (with its spread), a speed-up
the median of each round's ratio to the round's fastest baseline (plain decoding).
:func:`interleaved_rounds` times decoding (each run's own clock, GenerateResult.stats);
:func:`interleaved_calls` times any callables (a forward, a training step)."""

import statistics
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

from .decode import GenerateResult, DecodeStats

Generate = Callable[..., GenerateResult]  # generate(prompts, **kwargs)


def in_batches(generate: Generate, prompts: list[list[int]], batch_size: int, warmup: bool = False,
               **kwargs) -> GenerateResult:
    """Runs generate(prompts_chunk, **kwargs) over chunks of batch_size prompts; one result
    with the tokens in order and the stats summed (tokens/s over the total wall time).
    ``warmup``: everything runs once untimed first (compiled steps: that builds every graph
    the timed run uses), and stats.compile_time is how much longer that run took."""
    if warmup:
        first = in_batches(generate, prompts, batch_size, **kwargs)
        result = in_batches(generate, prompts, batch_size, **kwargs)
        result.stats.compile_time = max(first.stats.wall_time - result.stats.wall_time, 0.0)
        return result
    tokens: list[list[int]] = []
    total = DecodeStats()
    for start in range(0, len(prompts), batch_size):
        result = generate(prompts[start : start + batch_size], **kwargs)
        tokens += result.tokens
        s = result.stats
        total.num_drafts += s.num_drafts
        total.num_draft_tokens += s.num_draft_tokens
        total.num_accepted_tokens += s.num_accepted_tokens
        total.num_generated_tokens += s.num_generated_tokens
        total.num_requests += s.num_requests
        total.wall_time += s.wall_time
        total.first_token_time += s.first_token_time
        per = total.accepted_per_position or [0] * len(s.accepted_per_position)
        total.accepted_per_position = [a + b for a, b in zip(per, s.accepted_per_position)]
        for k, steps in s.draft_lengths.items():
            total.draft_lengths[k] = total.draft_lengths.get(k, 0) + steps
    return GenerateResult(tokens, total)


@dataclass
class Rounds:
    """Each configuration's results, one per round, and its compile time (the untimed warm-up's
    extra wall time; 0 for configurations that need none)."""

    results: dict[Hashable, list[GenerateResult]] = field(default_factory=dict)
    compile_time: dict[Hashable, float] = field(default_factory=dict)

    def rates(self, name, decode: bool = False) -> list[float]:
        """tokens/s per round; ``decode``: of the decode phase (after each request's first token)."""
        return [r.stats.decode_tokens_per_second if decode else r.stats.tokens_per_second
                for r in self.results[name]]

    def median(self, name, decode: bool = False) -> float:
        return statistics.median(self.rates(name, decode))

    def spread(self, name, decode: bool = False) -> tuple[float, float]:
        rates = self.rates(name, decode)
        return min(rates), max(rates)

    def speedup(self, name, baselines: Iterable, decode: bool = False) -> float:
        """The median over rounds of ``name``'s rate over the fastest of ``baselines`` that round."""
        baselines = list(baselines)
        fastest = [max(rates) for rates in zip(*(self.rates(b, decode) for b in baselines))]
        return statistics.median(a / b for a, b in zip(self.rates(name, decode), fastest))


def interleaved_rounds(configs: dict[Hashable, Generate], prompts: list[list[int]], batch_size: int, rounds: int,
                       warmup: Callable[[Hashable], bool] = lambda name: False,
                       on_run: Callable[[Hashable, int], None] | None = None, **kwargs) -> Rounds:
    """Times every configuration (``generate(prompts_chunk, **kwargs)``) over ``prompts`` in
    chunks of ``batch_size``, once per round. ``warmup(name)``: the configuration first runs
    untimed (compiled steps build their graphs there); ``on_run(name, round)``: after each run."""
    timed = Rounds({name: [] for name in configs}, {name: 0.0 for name in configs})
    for round_ in range(rounds):
        for name, generate in configs.items():
            result = in_batches(generate, prompts, batch_size, warmup=round_ == 0 and warmup(name), **kwargs)
            timed.compile_time[name] = max(timed.compile_time[name], result.stats.compile_time)
            timed.results[name].append(result)
            if on_run is not None:
                on_run(name, round_)
    return timed


def interleaved_calls(calls: dict[Hashable, Callable[[], object]], rounds: int, repeat: int = 1,
                      sync: Callable[[], None] = lambda: None) -> dict[Hashable, list[float]]:
    """Seconds per call of each of ``calls``, one figure per round, the rounds interleaved: a round
    runs each callable ``repeat`` times in a row, timed from ``sync()`` to ``sync()`` (which waits
    for the device's queued work: ``torch.cuda.synchronize`` on a GPU). Warm-ups are the caller's."""
    seconds: dict[Hashable, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            sync()
            start = time.perf_counter()
            for _ in range(repeat):
                call()
            sync()
            seconds[name].append((time.perf_counter() - start) / repeat)
    return seconds
