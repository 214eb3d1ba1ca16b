"""What each pool learns online, and the feedback that holds admitted work to its deadlines.

Everything here is state fed by what the gateway sees (admissions, the end of each admitted
request's stream, the engines' output-length histogram) and read by the admission step
(``extproc.step``). No I/O and no clock reads: callers pass ``now``. The gateway and the
simulator hold one ``PoolLearning`` per pool and feed it the same way.

**The promise (closed-loop attainment control).** ``decide`` admits a request if its
*promised* output length, the ``q``-quantile of the pool's output lengths, would still finish
within its deadline. A fixed high ``q`` holds every request to a worst case, which is far
stricter than the target, 99% of *admitted requests* within their deadline: it keeps batches
small and turns away work the fleet could have done in time. So ``q`` is not a constant:
``Promise`` holds it where the measured attainment meets the target, per pool and class. Each
admitted request, when its stream ends, is a miss (it ended after its deadline) or a hit (it
completed within it; a stream the client cancelled early says nothing). With ``x =
log((1 - q) / q)``:

    x  <-  x + gain x (expected - miss) / target_miss
    expected = target_miss + (1 - target_miss) x unavoidable

a stochastic-approximation (Robbins-Monro) quantile tracker: each miss makes the promise
stricter by ``gain x (1 - expected) / target_miss``, each hit looser by ``gain x expected /
target_miss``, so ``x`` stands still exactly when misses come at the ``expected`` rate. It is
bounded, ``q`` in [0.5, 0.995], starts at the strict end (0.99), and one step is small
(``gain`` 0.002: a hundred hits undo one miss's tightening), so a burst of misses tightens it
at once while loosening takes sustained evidence: stable under bursts, with no oscillation
faster than the traffic's own. ``unavoidable`` is the chance, from the learned lengths, that
the request's answer is too long to finish within its deadline even alone on an idle replica:
such misses are not load's doing, and no promise could prevent them, so they raise the
expected miss rate instead of tightening the promise (a workload where one answer in five is
unboundedly long would otherwise drive the promise to where nothing is admitted at all).
Across gateway replicas each one holds its own promise from its own completions: each sees a
fair sample of the traffic, so each converges to the same quantile, and each one's admitted
requests meet the target, hence all of them together do.

**Demand (class isolation).** ``Demand`` measures the interactive classes' arrival rate ``λ``
(every request, admitted or not: the demand, not what was let in) and mean time in flight
``T`` (from their streams' ends), both decayed over ``DEMAND_MEMORY_S``. By Little's law they
keep ``λ T`` requests in flight; the batch classes may use only what is left beyond ``λ T +
2 sqrt(λ T)`` (two standard deviations of a Poisson count) slots: a reserve that follows the
interactive load instead of a fixed split.

**Lengths per class.** The pool's output lengths (``extproc.lengths``) come from the engines'
histogram (the simulator: from each completion), exact but for the whole pool. When a pool
serves several classes their answers differ (chat turns and batch summaries), and a chat
request promised the pool's 99th percentile would be promised a summary's length. So each
class also learns its own lengths, from what the gateway sees of its requests: a stream that
lasted ``d`` after a decision that predicted a first token at ``t`` and decode steps of ``s``
generated about ``(d - t) / s`` tokens (a stream its client cancelled, at least that many: a
censored observation). Those are estimates (the batch changes after the decision), so a class
uses its own lengths only while the pool serves more than one class (each at least
``CLASS_SHARE`` of the recent requests); a pool serving one class keeps the engines' exact
histogram. A class's own lengths start from the pool's configured prior, not from the pool's
mixed histogram (which would promise a chat request a summary's length, refuse it, and never
learn otherwise). The promise's feedback corrects whatever bias the estimate keeps.

**The mix.** The mean prompt of the requests that ask (decayed) and the mean output: the
context a decode reads and the prefill that joins a busy batch (``extproc.admission.Mix``).

**The prefill backlog** (``Backlog``): the prompt tokens this gateway admitted that the
engines have not prefilled yet, a fluid estimate (each admission adds its prompt; the level
drains at the fleet's prefill rate, the token budget a step, ``Capacity.backlog_ms``), so a
request admitted in a burst is told it waits for the prompts ahead of it. Each gateway
replica sees only its own admissions: behind several gateways the backlog is the fraction
that one admitted, and a burst's first tokens are predicted that much too early.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from extproc.admission import Mix
from extproc.config import Config, Pool
from extproc.lengths import Lengths, Prior

TARGET_ATTAINMENT = 0.99
Q_LOW, Q_HIGH, Q_START = 0.5, 0.995, 0.99
GAIN = 0.002
DEMAND_MEMORY_S = 60.0
MIX_WEIGHT = 0.02  # the prompt mean's weight of each new admission
CLASS_SHARE = 0.05  # a class counts as served from this share of recent requests
CENSOR_REFRESH_S = 1.0  # the answers in flight are folded into the lengths this often


def _logit_tail(q: float) -> float:
    return math.log((1.0 - q) / q)


@dataclass
class Promise:
    """The promise quantile of one pool and class, held by feedback (module docstring)."""

    target: float = TARGET_ATTAINMENT
    gain: float = GAIN
    x: float = field(default=_logit_tail(Q_START))
    hits: int = 0
    misses: int = 0

    @property
    def quantile(self) -> float:
        return 1.0 / (1.0 + math.exp(self.x))

    def settled(self, missed: bool, unavoidable: float = 0.0) -> None:
        """One admitted request ended: ``missed`` its deadline or not. ``unavoidable``: the
        chance it would have missed even alone on an idle replica."""
        miss = 1.0 - self.target
        expected = miss + (1.0 - miss) * min(1.0, max(0.0, unavoidable))
        self.x += self.gain * ((expected - (1.0 if missed else 0.0)) / miss)
        self.x = min(_logit_tail(Q_LOW), max(_logit_tail(Q_HIGH), self.x))
        if missed:
            self.misses += 1
        else:
            self.hits += 1


@dataclass
class Backlog:
    """Prompt tokens admitted and not prefilled yet (module docstring)."""

    tokens: float = 0.0
    at: float = 0.0

    def level(self, now: float, tokens_per_s: float) -> float:
        """The backlog now, drained at ``tokens_per_s`` since the last call."""
        if now > self.at:
            self.tokens = max(0.0, self.tokens - (now - self.at) * tokens_per_s)
            self.at = now
        return self.tokens

    def add(self, tokens: float, now: float, tokens_per_s: float) -> None:
        self.level(now, tokens_per_s)
        self.tokens += tokens


@dataclass
class Demand:
    """Interactive demand: arrivals per second and mean seconds in flight, decayed."""

    memory_s: float = DEMAND_MEMORY_S
    _arrivals: float = 0.0
    _at: float | None = None
    _duration_s: float = 0.0
    _durations: float = 0.0

    def _decay(self, now: float) -> None:
        if self._at is not None and now > self._at:
            f = math.exp(-(now - self._at) / self.memory_s)
            self._arrivals *= f
            self._durations *= f
            self._duration_s *= f
        self._at = now if self._at is None else max(self._at, now)

    def arrived(self, now: float) -> None:
        self._decay(now)
        self._arrivals += 1.0

    def served(self, seconds: float, now: float) -> None:
        self._decay(now)
        self._durations += 1.0
        self._duration_s += seconds

    @property
    def measured(self) -> bool:
        return self._durations > 0

    def reserve(self, now: float) -> float:
        """Slots the interactive classes need: ``λ T + 2 sqrt(λ T)``."""
        self._decay(now)
        if not self._durations:
            return 0.0
        load = self._arrivals / self.memory_s * self._duration_s / self._durations
        return load + 2.0 * math.sqrt(load)


class PoolLearning:
    """One pool's learned state: output lengths, promises per class, demand, the mix."""

    def __init__(self, prior: Prior | None = None) -> None:
        self.lengths = Lengths(prior)
        self.class_lengths: dict[str, Lengths] = {}  # inferred from durations (docstring)
        self._asked: dict[str, float] = {}  # requests per class, decayed like the lengths
        self.promises: dict[str, Promise] = {}
        self.demand = Demand()
        self._prompt = self.lengths.prior.mean * 4.0  # until the first request
        self._prompts = 0
        self.inflight: dict[str, int] = {}  # this gateway's requests per class, running now
        # Its running requests (key -> class, start, predicted TTFT and step) and the lengths
        # with their answers so far folded in as censored observations (docstring), by class
        # ("" for the pool's), rebuilt by ``refresh`` every CENSOR_REFRESH_S.
        self._running: dict[str, tuple[str, float, float, float]] = {}
        self._views: dict[str, Lengths] = {}
        self._viewed_at = -math.inf
        self.backlog = Backlog()

    def promise(self, service_class: str) -> Promise:
        promise = self.promises.get(service_class)
        if promise is None:
            promise = self.promises[service_class] = Promise()
        return promise

    def interactive_classes(self, config: Config) -> list[str]:
        """The classes without ``batch`` that the pool serves (``CLASS_SHARE`` of recent
        requests or more)."""
        total = sum(self._asked.values())
        return [c for c, n in self._asked.items()
                if n >= CLASS_SHARE * total and c in config.classes
                and not config.classes[c].batch]

    def lengths_for(self, service_class: str) -> Lengths:
        """The lengths a class's requests are priced by (module docstring)."""
        total = sum(self._asked.values())
        served = sum(1 for n in self._asked.values() if n >= CLASS_SHARE * total)
        if served < 2:
            return self._views.get("", self.lengths)
        return self._views.get(service_class) or self._own(service_class)

    def refresh(self, now: float) -> None:
        """Fold the answers in flight into the lengths (``Lengths.censored``), at most every
        ``CENSOR_REFRESH_S``: a request running for ``a`` after a decision that predicted its
        first token at ``t`` and decode steps of ``s`` has generated about ``(a - t) / s``
        tokens so far, and its answer is at least that long."""
        if now - self._viewed_at < CENSOR_REFRESH_S:
            return
        self._viewed_at = now
        pool: list[float] = []
        by_class: dict[str, list[float]] = {}
        for cls, started, ttft_ms, step_ms in self._running.values():
            tokens = ((now - started) * 1000.0 - ttft_ms) / step_ms
            if tokens > 1.0:
                pool.append(tokens)
                by_class.setdefault(cls, []).append(tokens)
        self._views = {cls: self._own(cls).censored(b) for cls, b in by_class.items()}
        if pool:
            self._views[""] = self.lengths.censored(pool)

    def _own(self, service_class: str) -> Lengths:
        own = self.class_lengths.get(service_class)
        if own is None:
            own = self.class_lengths[service_class] = Lengths(self.lengths.prior)
        return own

    def decay(self, factor: float) -> None:
        """Forget a round's worth of every length histogram and of the classes' requests."""
        self.lengths.decay(factor)
        for own in self.class_lengths.values():
            own.decay(factor)
        self._asked = {c: n * factor for c, n in self._asked.items()}

    def mix(self) -> Mix:
        lengths = self._views.get("", self.lengths)
        return Mix(prompt_tokens=self._prompt, output_tokens=max(1.0, lengths.mean()))

    def arrived(self, service_class: str, batch: bool, now: float,
                prompt_tokens: int | None = None) -> None:
        """A request asked (admitted or not): it is demand, for the batch classes' reserve if
        its class is interactive; it counts its class as served; its prompt is the traffic's
        (the mix is what asks, not what was let in: a mix of what was let in would follow
        the decisions it feeds)."""
        self._asked[service_class] = self._asked.get(service_class, 0.0) + 1.0
        if not batch:
            self.demand.arrived(now)
        if prompt_tokens is not None:
            self._prompts += 1
            w = max(MIX_WEIGHT, 1.0 / self._prompts)
            self._prompt += w * (prompt_tokens - self._prompt)

    def admitted(self, service_class: str, prompt_tokens: int, *, batch: bool = False,
                 expected_s: float = 0.0, now: float = 0.0, prefill_rate: float = 0.0,
                 key: str | None = None, ttft_ms: float = 0.0, step_ms: float = 0.0) -> None:
        """A request runs: its prompt joins the prefill backlog (drained at ``prefill_rate``
        tokens a second); ``expected_s``, its predicted time in flight, stands for the
        interactive classes' measured time until one of their requests has ended; with its
        ``key`` and its decision's predicted ``ttft_ms`` and ``step_ms``, its answer so far
        counts in the lengths while it runs (``refresh``)."""
        if key is not None and step_ms > 0:
            self._running[key] = (service_class, now, ttft_ms, step_ms)
        if not batch and expected_s > 0 and not self.demand.measured:
            self.demand.served(expected_s, now)
        self.inflight[service_class] = self.inflight.get(service_class, 0) + 1
        self.backlog.add(prompt_tokens, now, prefill_rate)

    def settled(self, service_class: str, *, batch: bool, seconds: float, deadline_s: float,
                completed: bool, unavoidable: float, now: float, ttft_ms: float = 0.0,
                step_ms: float = 0.0, key: str | None = None) -> None:
        """An admitted request's stream ended after ``seconds``: ``completed`` normally, or
        cancelled. Past its deadline it is a miss; a completion within it a hit; a stream
        cancelled in time says nothing about the promise. ``ttft_ms`` and ``step_ms``: what
        its decision predicted (its class's lengths learn from them; 0: nothing to learn)."""
        self.inflight[service_class] = max(0, self.inflight.get(service_class, 0) - 1)
        if key is not None:
            self._running.pop(key, None)
        missed = seconds > deadline_s
        if missed or completed:
            self.promise(service_class).settled(missed, unavoidable)
        if not batch:
            self.demand.served(seconds, now)
        if step_ms > 0:
            tokens = max(1.0, (seconds * 1000.0 - ttft_ms) / step_ms)
            self._own(service_class).observe(tokens, cut=not completed)


def learning_for(pool: Pool) -> PoolLearning:
    """A fresh pool's state: its configured prior (``expected_output_tokens``: the mean,
    ``long_output_tokens``: the 99th percentile; each defaults to ``Prior``'s)."""
    return PoolLearning(Prior(pool.expected_output_tokens or Prior.mean,
                              pool.long_output_tokens or Prior.p99))
