"""Adaptive speculation: how many tokens to draft, chosen step by step (docs/adaptive.md).

A step that drafts k tokens yields E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens per request, where
a_j is the acceptance of draft j given drafts 1..j-1 were accepted, and costs C(B, k) seconds at
batch B. :class:`DraftLengthPolicy` picks the k of its candidates (0 = a plain step) with the most
tokens per second E(k) / C(B, k), from a running estimate of each a_j (counts over the batch's
requests, decayed so that the estimate follows the text) and a cost table measured online: the
wall time of each step, from one step's start to the next one's, kept per (batch rows, k).
"""

import math
import statistics
from collections import deque

CANDIDATES = (0, 1, 2, 3, 5)  # few lengths: a compiled decoder builds one graph per length


def candidate_lengths(max_length: int) -> tuple[int, ...]:
    """The draft lengths an adaptive decoder with at most ``max_length`` drafts chooses from."""
    return tuple(sorted({k for k in CANDIDATES if k <= max_length} | {max_length}))


def expected_tokens(acceptance: list[float], k: int) -> float:
    """E(k): tokens per request per step, the target's own token included."""
    total, reached = 1.0, 1.0
    for a in acceptance[:k]:
        reached *= a
        total += reached
    return total


def rows_bucket(rows: int) -> int:
    """The cost table's key for a batch of ``rows`` requests: the power of two at or above it
    (a shrinking batch reuses what it measured instead of timing every size anew)."""
    return 1 << max(rows - 1, 0).bit_length()


class DraftLengthPolicy:
    """Chooses each step's draft length and learns from what the step gave.

    ``lengths``: the candidates (0 first). Acceptance: per draft position, decayed counts of drafts
    that reached the position and were accepted there; a position with less than one draft counted
    takes the estimate of the one before (the first: ``prior``). Costs: the median of the last
    ``window`` step times per (batch bucket, k); each k is timed ``samples`` times at a bucket
    before the first choice there. While k = 0 wins, every ``probe_every``-th step drafts the best
    k > 0 anyway (more rarely where that k is far behind: probes cost at most ``probe_budget`` of the
    throughput), so that the acceptance estimate can recover when the text gets easier."""

    def __init__(self, lengths: tuple[int, ...], prior: float = 0.5, decay: float = 0.98, window: int = 9,
                 samples: int = 3, probe_every: int = 16, probe_budget: float = 0.01):
        if lengths[0] != 0:
            lengths = (0, *lengths)
        self.lengths, self.decay, self.samples = lengths, decay, samples
        self.probe_every, self.probe_budget = probe_every, probe_budget
        self.window, self.prior = window, prior
        self.reached = [0.0] * max(lengths)
        self.accepted = [0.0] * max(lengths)
        self.times: dict[tuple[int, int], deque] = {}
        self.plain_streak = 0

    def acceptance(self) -> list[float]:
        """The conditional acceptance a_j per draft position (j = 1..max length)."""
        out, previous = [], self.prior
        for reached, accepted in zip(self.reached, self.accepted):
            previous = accepted / reached if reached >= 1.0 else previous
            out.append(min(max(previous, 0.0), 1.0))
        return out

    def cost(self, rows: int, k: int) -> float | None:
        """The measured seconds of a step of k drafts at this batch size (None: not timed yet)."""
        times = self.times.get((rows_bucket(rows), k))
        return statistics.median(times) if times and len(times) >= self.samples else None

    def rates(self, rows: int) -> dict[int, float]:
        """Expected tokens per second and request for each timed candidate k at this batch size."""
        acceptance = self.acceptance()
        return {k: expected_tokens(acceptance, k) / c for k in self.lengths if (c := self.cost(rows, k))}

    def choose(self, rows: int) -> int:
        counts = {k: len(self.times.get((rows_bucket(rows), k), ())) for k in self.lengths}
        if min(counts.values()) < self.samples:
            k = min(self.lengths, key=counts.get)
        else:
            rates = self.rates(rows)
            k = max(rates, key=rates.get)
            self.plain_streak = self.plain_streak + 1 if k == 0 else 0
            drafting = max((k for k in rates if k > 0), key=rates.get)
            # A probe loses (1 - its rate / plain's) of a step: spaced so that probes cost at most
            # probe_budget of the throughput.
            every = max(self.probe_every, math.ceil((1 - rates[drafting] / rates[0]) / self.probe_budget))
            if k == 0 and self.plain_streak >= every:
                k, self.plain_streak = drafting, 0
        return k

    def record(self, rows: int, k: int, seconds: float, accepted: list[int]) -> None:
        """What a step of k drafts at ``rows`` rows gave: its wall time and, for each request that
        ran in it, the number of drafts accepted."""
        self.times.setdefault((rows_bucket(rows), k), deque(maxlen=self.window)).append(seconds)
        if k == 0 or not accepted:
            return
        for j in range(k):
            self.reached[j] *= self.decay
            self.accepted[j] *= self.decay
        for n in accepted:
            for j in range(min(n + 1, k)):
                self.reached[j] += 1.0
                self.accepted[j] += 1.0 if n > j else 0.0
