"""What a pool knows about output lengths: a prior, then what it sees, forgotten slowly.

The gateway never knows how long an answer will be; admission charges each request the mean
and promises it a quantile (``extproc.decision.admission``). Both come from one ``Lengths`` per
pool:

- a histogram of output lengths on a log grid (ten cells a decade from 1 to 100,000 tokens),
  holding what completed requests produced, decayed by ``decay(f)`` (the gateway and the
  simulator both forget with a ~16.6-minute memory in seconds, ``decay_factor``);
- a **prior**: a log-normal with the pool's configured mean and 99th percentile (``Prior``; by
  default mean 256 and p99 1,536 tokens, a chat mix) weighing ``w = P^2 / (P + n)``
  pseudo-observations, with ``P = PRIOR_SAMPLES`` and ``n`` the outputs remembered: ``P``
  for a fresh pool, 1.8 after 200 outputs, back to ``P`` when everything seen is forgotten. A
  fresh gateway therefore prices requests like a chat service from its first request instead
  of charging ``max_tokens`` in full (which, with a long ``max_tokens``, makes every request
  look infeasible: a fresh gateway refusing them would never learn), and what it then sees
  soon outweighs what it assumed;
- **censoring**: an output cut at ``max_tokens`` says only that the answer would have been at
  least that long. ``observe(tokens, cut=True)`` spreads its count over the cells above
  ``tokens`` in proportion to what the histogram holds there (Efron's redistribute-to-the-
  right, the Kaplan-Meier estimate on a grid), so a mix of requests with small ``max_tokens``
  does not teach the pool that answers are short. The answers still being generated are
  censored the same way (``censored``: a stream in flight for a while has produced at least
  so many tokens): without them the first outputs a pool sees are its short ones, since they
  end first, and a fresh pool (or a pool whose traffic just changed) believes answers are
  short exactly while it fills its engines with long ones. What rejection hides needs no
  correction: the gateway rejects by prompt, class and load, never by the answer's length
  (which it does not know), so the outputs it sees are a fair sample of those it would have
  seen.

Queries (each O(cells)): ``mean(cap)``, the mean of ``min(output, cap)``; ``quantile(q)``;
``survival(x)``, the share of outputs longer than ``x``. Quantiles interpolate linearly within
a cell (bounds 26% apart). The gateway feeds the histogram from the engines' own histogram
(``observe_bucket``: a coarse vLLM bucket spread log-uniformly over the grid cells inside it);
the simulator feeds each completion.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import NormalDist

# Upper bounds of the histogram's cells: ten per decade from 1 to 100,000 tokens; cell i holds
# (GRID[i - 1], GRID[i]], the last one everything above GRID[-1].
GRID = tuple(round(10 ** (i / 10), 3) for i in range(51))
CELLS = len(GRID) + 1
PRIOR_SAMPLES = 20.0  # the prior's weight, in outputs
OUTPUT_MEMORY_S = 10.0 / -math.log(0.99)  # e-folding time of the memory: 1% forgotten per 10 s
_Z99 = NormalDist().inv_cdf(0.99)


def decay_factor(interval_s: float) -> float:
    """The ``decay`` factor per round of ``interval_s``: ``exp(-interval_s / memory)``."""
    return math.exp(-interval_s / OUTPUT_MEMORY_S)


def _low(i: int) -> float:
    return GRID[i - 1] if i > 0 else 0.0


def _high(i: int) -> float:
    return GRID[i] if i < len(GRID) else GRID[-1] * 10 ** 0.1


def _mid(i: int) -> float:
    """A cell's representative length: the log-uniform mean of its bounds."""
    a, b = max(_low(i), 0.5), _high(i)
    return (b - a) / math.log(b / a)


@dataclass(frozen=True)
class Prior:
    """A log-normal belief about output lengths, from its mean and 99th percentile."""

    mean: float = 256.0
    p99: float = 1536.0

    def sigma(self) -> float:
        """``p99 / mean = exp(z99 sigma - sigma^2 / 2)``, the smaller root (0.1 at least)."""
        ratio = max(self.p99 / self.mean, 1.0001)
        disc = _Z99 * _Z99 - 2.0 * math.log(ratio)
        if disc <= 0:
            return _Z99  # the ratio is beyond what a log-normal reaches; the widest one
        return max(0.1, _Z99 - math.sqrt(disc))

    def cells(self, weight: float) -> list[float]:
        """``weight`` observations spread over the grid by the log-normal's probabilities."""
        sigma = self.sigma()
        mu = math.log(self.mean) - sigma * sigma / 2.0
        dist = NormalDist(mu, sigma)
        out, below = [], 0.0
        for i in range(CELLS):
            upto = dist.cdf(math.log(GRID[i])) if i < len(GRID) else 1.0
            out.append(weight * (upto - below))
            below = upto
        return out


class Lengths:
    """Output lengths of one pool: a decaying histogram over a fixed prior (docstring)."""

    def __init__(self, prior: Prior | None = None) -> None:
        self.prior = prior or Prior()
        self._prior = self.prior.cells(PRIOR_SAMPLES)
        self._prior_sums = [c * _mid(i) for i, c in enumerate(self._prior)]
        self._counts = [0.0] * CELLS
        self._sums = [0.0] * CELLS
        self._seen = 0.0
        self._cumulative: list[float] | None = None  # running totals, recomputed lazily
        self._memo: dict[tuple[str, float], float] = {}  # mean / held by cap, until a change

    # ---- learning ----
    def observe(self, tokens: float, count: float = 1.0, *, cut: bool = False) -> None:
        """``count`` outputs of ``tokens``; ``cut``: stopped by ``max_tokens``, so at least
        that long (redistributed to the right, module docstring)."""
        if count <= 0:
            return
        cell = bisect.bisect_left(GRID, tokens)
        if not cut:
            self._add(cell, count, count * tokens)
            return
        k = self._prior_weight
        weights = [self._counts[i] + k * self._prior[i] for i in range(cell + 1, CELLS)]
        total = sum(weights)
        if total <= 0:
            self._add(cell, count, count * tokens)
            return
        for offset, w in enumerate(weights):
            if w > 0:
                i = cell + 1 + offset
                share = count * w / total
                self._add(i, share, share * max(tokens, _mid(i)))

    def censored(self, bounds: Iterable[float]) -> Lengths:
        """A copy that also counts one output longer than each of ``bounds`` (the answers in
        flight, each at least that long), redistributed to the right from the shortest bound
        up (Efron's order). Bounds are grouped by grid cell, so this is O(bounds + cells^2)."""
        view = Lengths.__new__(Lengths)
        view.prior, view._prior, view._prior_sums = self.prior, self._prior, self._prior_sums
        view._counts, view._sums = list(self._counts), list(self._sums)
        view._seen, view._cumulative, view._memo = self._seen, None, {}
        groups: dict[int, tuple[int, float]] = {}
        for b in bounds:
            cell = bisect.bisect_left(GRID, b)
            n, low = groups.get(cell, (0, b))
            groups[cell] = (n + 1, min(low, b))
        for cell in sorted(groups):
            n, low = groups[cell]
            view.observe(low, n, cut=True)
        return view

    def observe_bucket(self, low: float, high: float, count: float) -> None:
        """``count`` outputs somewhere in ``(low, high]`` (a bucket of an engine's histogram),
        spread over the grid cells inside in proportion to their overlap in log space: within
        a coarse bucket (vLLM's 20-50) the quantile interpolates log-uniformly instead of
        finding every output at one point. No output is shorter than one token, so a bucket
        from 0 starts at 1; ``high`` infinite (the +Inf bucket) goes to the top cell."""
        if count <= 0:
            return
        if math.isinf(high):
            self._add(CELLS - 1, count, count * max(low, GRID[-1]))
            return
        low = max(low, min(high, 1.0))
        if high <= low or high <= GRID[0]:
            self._add(bisect.bisect_left(GRID, high), count, count * high)
            return
        span = math.log(high / low)
        first, last = bisect.bisect_left(GRID, low), bisect.bisect_left(GRID, high)
        for i in range(first, last + 1):
            a, b = max(low, _low(i)), min(high, _high(i))
            if b <= a:
                continue
            share = count * math.log(b / a) / span
            self._add(i, share, share * (b - a) / math.log(b / a))

    def _add(self, cell: int, count: float, tokens: float) -> None:
        self._counts[cell] += count
        self._sums[cell] += tokens
        self._seen += count
        self._cumulative = None
        self._memo.clear()

    def decay(self, factor: float) -> None:
        """Forget: every observed count times ``factor`` (the prior stays)."""
        self._counts = [c * factor for c in self._counts]
        self._sums = [s * factor for s in self._sums]
        self._seen *= factor
        self._cumulative = None
        self._memo.clear()

    @property
    def seen(self) -> float:
        """Observed outputs still remembered (the decayed count)."""
        return self._seen

    # ---- queries ----
    @property
    def _prior_weight(self) -> float:
        """The prior's share of a pseudo-observation: ``w / P`` (module docstring)."""
        return PRIOR_SAMPLES / (PRIOR_SAMPLES + self._seen)

    def _totals(self) -> list[float]:
        if self._cumulative is None:
            k = self._prior_weight
            running, out = 0.0, []
            for c, p in zip(self._counts, self._prior, strict=True):
                running += c + k * p
                out.append(running)
            self._cumulative = out
        return self._cumulative

    def mean(self, cap: float = math.inf) -> float:
        """The mean of ``min(output, cap)``."""
        known = self._memo.get(("mean", cap))
        if known is not None:
            return known
        total = self._totals()[-1]
        k = self._prior_weight
        acc = 0.0
        for i in range(CELLS):
            n = self._counts[i] + k * self._prior[i]
            if n <= 0:
                continue
            if _high(i) <= cap:
                acc += self._sums[i] + k * self._prior_sums[i]
            elif _low(i) >= cap:
                acc += n * cap
            else:  # the cell holding the cap: its outputs below the cap, the rest at it
                acc += min(self._sums[i] + k * self._prior_sums[i], n * cap)
        self._memo[("mean", cap)] = acc / total
        return acc / total

    def held(self, cap: float = math.inf) -> float:
        """The mean output a request *in flight* has generated so far: ``E[o^2] / (2 E[o])``
        of ``o = min(output, cap)`` (each cell's outputs at their mean). A request in flight
        is more likely a long one (it stays longer: the inspection paradox), so with a heavy
        tail this exceeds the mean itself: what the engines' KV caches hold."""
        known = self._memo.get(("held", cap))
        if known is not None:
            return known
        k = self._prior_weight
        first = second = 0.0
        for i in range(CELLS):
            n = self._counts[i] + k * self._prior[i]
            if n <= 0:
                continue
            o = min((self._sums[i] + k * self._prior_sums[i]) / n, cap)
            first += n * o
            second += n * o * o
        self._memo[("held", cap)] = second / (2.0 * first) if first > 0 else 0.0
        return self._memo[("held", cap)]

    def quantile(self, q: float) -> float:
        """The length a share ``q`` of outputs stays within."""
        totals = self._totals()
        target = q * totals[-1]
        i = bisect.bisect_left(totals, target)
        i = min(i, CELLS - 1)
        before = totals[i - 1] if i > 0 else 0.0
        inside = totals[i] - before
        lo, hi = _low(i), _high(i)
        return lo + (hi - lo) * ((target - before) / inside if inside > 0 else 1.0)

    def survival(self, x: float) -> float:
        """The share of outputs longer than ``x`` tokens."""
        totals = self._totals()
        if x <= 0:
            return 1.0
        i = min(bisect.bisect_left(GRID, x), CELLS - 1)
        before = totals[i - 1] if i > 0 else 0.0
        inside = totals[i] - before
        lo, hi = _low(i), _high(i)
        within = inside * min(1.0, max(0.0, (x - lo) / (hi - lo)))
        return max(0.0, 1.0 - (before + within) / totals[-1])
