"""What each pool learns online, and the feedback that holds admitted work to its deadlines.

Everything here is state fed by what the gateway sees (admissions, the end of each admitted
request's stream, the engines' output-length histogram) and read by the admission step
(``extproc.decision.step``). No I/O and no clock reads: callers pass ``now``. The gateway and the
simulator hold one ``PoolLearning`` per pool and feed it the same way.

**The promise (closed-loop attainment control).** ``decide`` admits a request if its
*promised* output length, the ``q``-quantile of the pool's output lengths, would still finish
within its deadline. A fixed high ``q`` holds every request to a worst case, which is far
stricter than the target, 99% of *admitted requests* within their deadline: it keeps batches
small and turns away work the fleet could have done in time. So ``q`` is not a constant:
``Promise`` holds it where attainment meets the target, per pool and class, in two loops:

- *predicted* (fast): each admitted request comes with the chance its decision predicts that
  it misses its deadline (its answer longer than what the deadline leaves after its predicted
  first token at its predicted step, from the learned lengths:
  ``extproc.decision.step.miss_chance``).
  With ``x = log((1 - q) / q)``, at each admission::

      x  <-  x + gain x (expected - chance) / m
      expected = m + (1 - m) x unavoidable,   m = target_miss x calibration

  a stochastic-approximation (Robbins-Monro) tracker that stands still exactly when admitted
  requests' predicted chances average ``expected``. A prediction is known at once and is a
  probability, not a rare event, so it can move ``q`` fast (``gain`` 0.01: from 0.99 to 0.95
  in about 165 admissions that were sure to make it) without the noise of counting misses;
- *measured* (slow): each admitted request is resolved when its deadline comes, a miss if it
  is still running or ended late, a hit if it completed in time (a stream cancelled in time
  says nothing). ``calibration`` is predicted misses over measured ones, both decayed like the
  lengths, with ``CALIBRATION_PRIOR`` requests' worth of agreement (ten misses at the target)
  so a handful of misses does not swing it: where the model is optimistic (misses come twice
  as often as predicted), the predicted loop aims at half the target, and measured attainment
  lands on it. A model can also be blind to what makes requests miss (it predicts none at all,
  say, while long prompts' prefill stalls every decode): so while measured misses run over
  what the target allows by more than a Poisson deviation (``over``), the promise never
  loosens, and each measured miss tightens it at once by ``MEASURED_GAIN x (1 - expected) /
  target_miss`` (0.2 in log-odds). Resolving at the deadline, not when a stream ends,
  matters: the short answers of a burst end first, and counted then they would vouch for the
  long ones still running.

``q`` is bounded to [0.5, 0.995] and starts at the strict end (0.99). ``unavoidable`` is the
chance, from the learned lengths, that the request's answer is too long to finish within its
deadline even alone on an idle replica: such misses are not load's doing, and no promise could
prevent them, so they raise the expected miss rate instead of tightening the promise (a
workload where one answer in five is unboundedly long would otherwise drive the promise to
where nothing is admitted at all). The gateway measures a stream's duration, not its first
token, so time-to-first-token misses reach the promise only through the decision's own TTFT
check.
Across gateway replicas each one holds its own promise from its own admissions: each sees a
fair sample of the traffic, so each converges to the same quantile, and each one's admitted
requests meet the target, hence all of them together do.

**Demand (class isolation).** ``Demand`` measures the interactive classes' arrival rate ``λ``
(every request, admitted or not: the demand, not what was let in) and mean time in flight
``T`` (from their streams' ends), both decayed over ``DEMAND_MEMORY_S``. By Little's law they
keep ``λ T`` requests in flight; the batch classes may use only what is left beyond ``λ T +
2 sqrt(λ T)`` (two standard deviations of a Poisson count) slots: headroom that follows the
interactive load instead of a fixed split.

**Lengths per class.** The pool's output lengths (``extproc.decision.lengths``) come from the
engines' histogram (the simulator: from each completion), exact but for the whole pool. When a pool
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

**Answers nobody waited for.** The engines' histogram counts the answers that finished; an
answer whose client gave up first (past its deadline) never enters it, so where the long ones
are mostly such, the histogram reads them as rare, and a request's chance of missing even
alone (``unavoidable``) reads low: on an output tail where 31 % of the admitted answers could
not finish in time alone it read 9 %, and the level took the misses for load's doing. So the
pool also keeps ``begun``: every answer the engines began, those that finished at their length
and each cancelled stream (a streaming one: a non-streaming answer may be finished and thrown
away, and then the engines count it themselves) as a censored observation, at least the
tokens it had when its client left: ``(d - ttft) / itl`` for a stream that lasted ``d``, at
the first-token time and inter-token
latency the engines *measured* over their last scrape round (``engine_speed``; vLLM's
``vllm:time_to_first_token_seconds`` and ``vllm:inter_token_latency_seconds``). Measured, not
the decision's prediction: under overload every answer is slower than predicted, and a
predicted step would read each late stream as a long answer, so the misses of overload
would look unavoidable and never tighten anything (``docs/admission.md``, "Answers nobody
waited for", measures both). Without a fresh measurement
(``SPEED_MAX_AGE_S``: TGI, no engine metrics configured) a cancelled stream counts nothing.
``begun`` prices only ``unavoidable`` (the level's baseline, the promise's expected misses),
never the promise itself: an answer that cannot finish says nothing about which requests will
be long. A pool serving several classes keeps each class's own lengths for both.

**The mix.** The mean prompt of the requests that ask (decayed) and the mean output: the
context a decode reads and the prefill that joins a busy batch (``extproc.decision.admission.Mix``).

**The prefill backlog** (``Backlog``): the prompt tokens this gateway admitted that the engines have
not prefilled yet, a fluid estimate (each admission adds its prompt; the level drains at the fleet's
prefill rate, the token budget a step beside the running batch's decodes,
``Capacity.batch_tokens_per_ms``, and a request whose stream has ended takes its own prompt out at
once: an engine faster than its model must not leave a phantom backlog), so a request admitted in a
burst is told it waits for the prompts ahead of it. Each gateway replica sees only its own
admissions: behind several gateways it scales its backlog by the share of the ledger's requests in
flight that it holds (``extproc.decision.step.admit``), so two gateways sharing a ledger see the
burst one gateway would.

Length: past the house's ~400 lines because a sixth is this docstring; the code is small state
objects (``Promise``, ``Spread``, ``Backlog``, ``Demand``) and the ``PoolLearning`` that composes
them and keeps each admitted request's record (``extproc.decision.running``) until its deadline.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from extproc.decision.admission import Mix
from extproc.decision.lengths import Lengths, Prior
from extproc.decision.level import Level, waits_for_compute
from extproc.decision.retries import Shown

if TYPE_CHECKING:
    from collections.abc import Iterable

    from extproc.config import Pool
    from extproc.decision.rules import Rules
    from extproc.decision.running import Running
    from extproc.fleet.engine import EngineModel
    from extproc.fleet.enginestats import EngineSample

TARGET_ATTAINMENT = 0.99
Q_LOW, Q_HIGH, Q_START = 0.5, 0.995, 0.99
GAIN = 0.01
MEASURED_GAIN = 0.002  # a measured miss's tightening while misses run over (0.2 log-odds)
CALIBRATION_PRIOR = 1000.0  # requests at the target miss rate: ten misses, predicted and seen
DEMAND_MEMORY_S = 60.0
FLOW_MEMORY_S = 30.0  # a group's arrivals and durations (extproc.decision.share)
FLOW_FORGOTTEN = 0.01  # a group whose decayed arrivals fall below this is dropped
SPREAD_WEIGHT = 0.02  # the admission limit's spread: about the last 50 decisions
MIX_WEIGHT = 0.02  # the prompt mean's weight of each new admission
CLASS_SHARE = 0.05  # a class counts as served from this share of recent requests
CENSOR_REFRESH_S = 1.0  # the answers in flight are folded into the lengths this often
SPEED_MAX_AGE_S = 30.0  # the engines' measured speed counts this long after it was read


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
    _predicted: float = 0.0  # resolved requests' predicted miss chances, decayed
    _expected: float = 0.0  # ... the misses the target allows them
    _missed: float = 0.0  # ... and their misses

    @property
    def quantile(self) -> float:
        return 1.0 / (1.0 + math.exp(self.x))

    @property
    def calibration(self) -> float:
        """Predicted misses per measured miss (1 until measured: ``CALIBRATION_PRIOR``)."""
        prior = CALIBRATION_PRIOR * (1.0 - self.target)
        return (self._predicted + prior) / (self._missed + prior)

    @property
    def over(self) -> bool:
        """Measured misses above what the target allows, by more than a Poisson deviation."""
        return self._missed > self._expected + math.sqrt(self._expected) + 1.0

    def _expected_miss(self, miss: float, unavoidable: float) -> float:
        return miss + (1.0 - miss) * min(1.0, max(0.0, unavoidable))

    def _move(self, step: float) -> None:
        self.x = min(_logit_tail(Q_LOW), max(_logit_tail(Q_HIGH), self.x + step))

    def admitted(self, chance: float, unavoidable: float = 0.0) -> None:
        """A request was admitted with a predicted ``chance`` of missing its deadline, of
        which ``unavoidable`` it would miss even alone on an idle replica."""
        miss = min(0.5, (1.0 - self.target) * self.calibration)
        step = self.gain * (self._expected_miss(miss, unavoidable)
                            - min(1.0, max(0.0, chance))) / miss
        if step < 0 or not self.over:  # never looser while measured misses run over
            self._move(step)

    def settled(self, missed: bool, chance: float = 0.0, unavoidable: float = 0.0) -> None:
        """An admitted request was resolved: ``missed`` its deadline or not, against the
        ``chance`` its admission predicted. While measured misses run over the target, each
        one tightens the promise at once, whatever was predicted."""
        miss = 1.0 - self.target
        expected = self._expected_miss(miss, unavoidable)
        self._predicted += chance
        self._expected += expected
        self._missed += 1.0 if missed else 0.0
        if missed:
            self.misses += 1
            if self.over:
                self._move(-MEASURED_GAIN * (1.0 - expected) / miss)
        else:
            self.hits += 1

    def decay(self, factor: float) -> None:
        self._predicted *= factor
        self._expected *= factor
        self._missed *= factor


@dataclass
class Spread:
    """A decaying mean of a quantity sampled at decisions, and how much it moves from one
    sample to the next (each sample weighs ``weight``): how much the admission limit a request
    meets varies from one arrival to the next (``extproc.decision.step``). The deviation is
    the successive differences' (half their mean square), not the samples' around their
    mean: a learning pool's limit climbs, and a mean that lags the climb would count the
    climb as swing (measured: 14-19 places of a limit of 28-30 on four 16-slot replicas while
    the pool learned, where it moved by 1-4 from one decision to the next)."""

    weight: float = SPREAD_WEIGHT
    mean: float | None = None
    variance: float = 0.0
    last: float = 0.0

    def add(self, value: float) -> float:
        """Record ``value``; returns the standard deviation so far."""
        if self.mean is None:
            self.mean = self.last = value
            return 0.0
        self.mean += self.weight * (value - self.mean)
        step, self.last = value - self.last, value
        self.variance = (1.0 - self.weight) * self.variance + self.weight * step * step / 2.0
        return self.std

    @property
    def std(self) -> float:
        return math.sqrt(self.variance)


@dataclass
class Backlog:
    """Prompt tokens admitted and not prefilled yet (module docstring)."""

    tokens: float = 0.0
    at: float = 0.0

    def level(self, now: float, tokens_per_s: float) -> float:
        """The backlog at ``now``, drained at ``tokens_per_s`` since the last admission (a
        read: deciding changes nothing)."""
        return max(0.0, self.tokens - max(0.0, now - self.at) * tokens_per_s)

    def add(self, tokens: float, now: float, tokens_per_s: float) -> None:
        self.tokens = self.level(now, tokens_per_s) + tokens
        self.at = max(self.at, now)


@dataclass
class Demand:
    """Interactive demand: arrivals per second and mean seconds in flight, decayed."""

    memory_s: float = DEMAND_MEMORY_S
    _arrivals: float = 0.0
    _at: float | None = None
    _duration_s: float = 0.0
    _durations: float = 0.0
    _first: float | None = None  # the first arrival: a young stream's rate is not diluted

    def _factor(self, now: float) -> float:
        """How much of what was counted up to the last record is left at ``now``."""
        if self._at is not None and now > self._at:
            return math.exp(-(now - self._at) / self.memory_s)
        return 1.0

    def _decay(self, now: float) -> None:
        f = self._factor(now)
        self._arrivals *= f
        self._durations *= f
        self._duration_s *= f
        self._at = now if self._at is None else max(self._at, now)

    def arrived(self, now: float) -> None:
        self._decay(now)
        self._arrivals += 1.0
        if self._first is None:
            self._first = now

    def served(self, seconds: float, now: float) -> None:
        self._decay(now)
        self._durations += 1.0
        self._duration_s += seconds

    @property
    def measured(self) -> bool:
        return self._durations > 0

    def rate(self, now: float, z: float = 0.0) -> float:
        """Arrivals a second: the decayed count over the decayed time it was counted in (a
        stream younger than its memory is not averaged with the time before it began). With
        ``z``, the count less ``z`` Poisson standard deviations: a rate there is evidence
        for (one arrival in a second is no stream of one a second). A read."""
        if self._first is None:
            return 0.0
        age = max(1.0, now - self._first)
        arrivals = self._arrivals * self._factor(now)
        seen = max(0.0, arrivals - z * math.sqrt(arrivals))
        return seen / (self.memory_s * -math.expm1(-age / self.memory_s))

    @property
    def duration_s(self) -> float:
        """Mean seconds in flight (0 until one has ended)."""
        return self._duration_s / self._durations if self._durations else 0.0

    def needed(self, now: float) -> float:
        """Slots the interactive classes need: ``λ T + 2 sqrt(λ T)``. A read."""
        if not self._durations:
            return 0.0
        load = self._arrivals * self._factor(now) / self.memory_s * self.duration_s
        return load + 2.0 * math.sqrt(load)


@dataclass(frozen=True)
class Speed:
    """What the engines measured over a scrape round: mean time to first token and mean
    inter-token latency, ms, read at ``at``."""

    ttft_ms: float
    itl_ms: float
    at: float


class PoolLearning:
    """One pool's learned state: output lengths, promises per class, demand, the mix."""

    def __init__(self, prior: Prior | None = None) -> None:
        self.lengths = Lengths(prior)
        self.begun = Lengths(prior)  # ... and the cancelled ones, censored (docstring)
        self._begun_view: Lengths | None = None  # ... with the answers in flight
        self._abandoned_seen = False  # ``begun`` differs from ``lengths`` (else it is a copy)
        self._speed: Speed | None = None  # the engines' last measured speed
        self._queued_at = -math.inf  # the last scrape round that found a compute queue
        self.class_lengths: dict[str, Lengths] = {}  # inferred from durations (docstring)
        self._asked: dict[str, float] = {}  # requests per class, decayed like the lengths
        self.promises: dict[str, Promise] = {}
        self.demand = Demand()
        self.flows: dict[str, Demand] = {}  # per priority and tenant group (extproc.decision.share)
        self._prompt = self.lengths.prior.mean * 4.0  # until the first request
        self._prompts = 0
        self.inflight: dict[str, int] = {}  # this gateway's requests per class, running now
        # Its running requests, and the lengths with their answers so far folded in as
        # censored observations (docstring), by class ("" for the pool's), rebuilt by
        # ``refresh`` every CENSOR_REFRESH_S.
        self._running: dict[str, Running] = {}
        self._views: dict[str, Lengths] = {}
        self._viewed_at = -math.inf
        # Each request is resolved at its deadline (docstring): (deadline, key), and the
        # outcomes of those that ended first: key -> (what it ran as, missed, the share of its
        # deadline a hit used).
        self._due: list[tuple[float, str]] = []
        self._ended: dict[str, tuple[Running, bool, float | None]] = {}
        self.level = Level(target=TARGET_ATTAINMENT)  # what the pool was seen to serve in time
        self._cut_at = -math.inf  # when the level last backed off (``completed``'s evidence)
        # The pool's work per replica at each decision, (when, work), kept only as suffix
        # minima (each entry's work below every later one's): the least work the pool held
        # at any decision after a moment is the first entry after it (``_completed``).
        self._loads: list[tuple[float, float]] = []
        self.backlog = Backlog()
        self.limit = Spread()  # the admission limit demoted requests meet (extproc.decision.step)
        self.shown = Shown()  # what cancelled requests' answers had at least, for their retries

    def promise(self, service_class: str) -> Promise:
        promise = self.promises.get(service_class)
        if promise is None:
            promise = self.promises[service_class] = Promise()
        return promise

    def interactive_classes(self, rules: Rules) -> list[str]:
        """The classes without ``batch`` that the pool serves (``CLASS_SHARE`` of recent
        requests or more)."""
        total = sum(self._asked.values())
        return [c for c, n in self._asked.items()
                if n >= CLASS_SHARE * total and rules.interactive(c)]

    def headroom(self, rules: Rules, now: float) -> float:
        """Slots a batch request must leave free beyond those it takes: what the interactive
        classes need (``Demand.needed``) less what their requests hold now, which the pool's
        in-flight count already has. A read."""
        held = sum(n for c, n in self.inflight.items() if rules.interactive(c))
        return max(0.0, self.demand.needed(now) - held)

    def _several(self) -> bool:
        """The pool serves more than one class (each ``CLASS_SHARE`` of recent requests)."""
        total = sum(self._asked.values())
        return sum(1 for n in self._asked.values() if n >= CLASS_SHARE * total) >= 2

    def lengths_for(self, service_class: str) -> Lengths:
        """The lengths a class's requests are priced by (module docstring)."""
        if not self._several():
            return self._views.get("", self.lengths)
        return self._views.get(service_class) or self._own(service_class)

    def unavoidable_lengths(self, service_class: str) -> Lengths:
        """The lengths a class's chance of missing even alone is read from: the answers the
        engines began, the cancelled ones included (module docstring)."""
        if self._several() or not self._abandoned_seen:
            return self.lengths_for(service_class)
        return self._begun_view or self.begun

    def finished(self, tokens: float, *, cut: bool = False) -> None:
        """An answer the engines finished, of ``tokens`` (``cut``: by ``max_tokens``)."""
        self.lengths.observe(tokens, cut=cut)
        self.begun.observe(tokens, cut=cut)

    def finished_bucket(self, low: float, high: float, count: float) -> None:
        """``count`` answers the engines finished, each of ``(low, high]`` tokens."""
        self.lengths.observe_bucket(low, high, count)
        self.begun.observe_bucket(low, high, count)

    def engine_speed(self, ttft_ms: float, itl_ms: float, now: float) -> None:
        """The engines' mean first-token time and inter-token latency over their last scrape
        round (module docstring, "Answers nobody waited for")."""
        if itl_ms > 0 and ttft_ms >= 0:
            self._speed = Speed(ttft_ms, itl_ms, now)

    def engines_round(self, samples: Iterable[EngineSample], engine: EngineModel,
                      now: float) -> None:
        """One scrape round of the pool's engines (``samples``, one a replica): whether one of
        them holds requests waiting for compute, with a slot and KV room for a typical request
        of the traffic (``waits_for_compute``); the measured level climbs by one request at a
        time until a round finds none (``Level.completed``)."""
        mix = self.mix()
        need = mix.prompt_tokens + mix.output_tokens
        queued = any(waits_for_compute(s, engine.max_num_seqs, engine.kv_tokens, need)
                     for s in samples)
        self._queued_at = now if queued else -math.inf

    def queued(self, now: float) -> bool:
        """The last round found a compute queue, recently enough to count (a scraper that
        stopped says nothing)."""
        return now - self._queued_at <= SPEED_MAX_AGE_S

    def abandoned(self, running: Running, seconds: float, now: float) -> None:
        """A stream of this gateway's, running for ``seconds``, was cancelled: its answer had
        at least the tokens the engines' measured speed gives it by then. A streaming one
        stands for the pool's cancelled streams as this gateway's requests stand for the
        pool's (one in ``1 / share``): the engines' finished answers are every gateway's, its
        cancelled streams only its own. And its retry is judged by it (``decision.retries``:
        counted from the later of the engines' mean first token and its own predicted one)."""
        speed = self._speed
        if speed is None or now - speed.at > SPEED_MAX_AGE_S:
            return
        shown = (seconds * 1000.0 - max(speed.ttft_ms, running.ttft_ms)) / speed.itl_ms
        if running.fingerprint is not None and shown >= 1.0:
            self.shown.keep(running.fingerprint, shown, now)
        tokens = (seconds * 1000.0 - speed.ttft_ms) / speed.itl_ms
        if running.streaming and tokens >= 1.0:
            self.begun.observe(tokens, 1.0 / max(running.share, 1e-3), cut=True)
            self._abandoned_seen = True

    def refresh(self, now: float) -> None:
        """Resolve the requests whose deadline has come (module docstring); and at most every
        ``CENSOR_REFRESH_S``, fold the answers in flight into the lengths (``Lengths.censored``:
        a request running for ``a`` after a decision that predicted its first token at ``t``
        and decode steps of ``s`` has generated about ``(a - t) / s`` tokens so far, and its
        answer is at least that long)."""
        self.resolve(now)
        if now - self._viewed_at < CENSOR_REFRESH_S:
            return
        self._viewed_at = now
        self.shown.forget(now)
        oldest = min((r.started for r in self._running.values()), default=now)
        self._loads = self._loads[bisect.bisect_right(self._loads, (oldest, math.inf)):]
        for group in [g for g, f in self.flows.items() if f.rate(now) * f.memory_s
                      < FLOW_FORGOTTEN]:
            del self.flows[group]
        pool: list[float] = []
        by_class: dict[str, list[float]] = {}
        for r in self._running.values():
            if r.step_ms <= 0:
                continue
            tokens = ((now - r.started) * 1000.0 - r.ttft_ms) / r.step_ms
            if tokens > 1.0:
                pool.append(tokens)
                by_class.setdefault(r.service_class, []).append(tokens)
        self._views = {c: self._own(c).censored(b) for c, b in by_class.items()}
        self._begun_view = (self.begun.censored(pool) if pool and self._abandoned_seen
                            else None)  # (until one is abandoned, ``_views[""]`` is the same)
        if pool:
            self._views[""] = self.lengths.censored(pool)

    def resolve(self, now: float) -> None:
        """Each admitted request counts for its promise when its deadline comes: a miss if it
        is still running or ended late, a hit if it completed in time (a stream cancelled in
        time says nothing). Counting hits when they end and misses when they are known would
        count the short answers first, and the promise would loosen on them before the long
        ones it admitted with them could miss."""
        while self._due and self._due[0][0] <= now:
            _, key = heapq.heappop(self._due)
            running = self._running.get(key)
            if running is not None:
                running.missed = True
                self._resolved(running, True, now)
                continue
            ended = self._ended.pop(key, None)
            if ended is not None:
                running, missed, used = ended
                self._resolved(running, missed, now, used=used)

    def _resolved(self, running: Running, missed: bool, now: float,
                  used: float | None = None) -> None:
        """One admitted request's outcome, for its class's promise (unless the measured level
        admitted it against the model: ``extproc.decision.level``) and for the measured level."""
        if not running.measured:
            self.promise(running.service_class).settled(missed, _chance(running),
                                                        running.unavoidable)
        if running.level_ms >= 0:
            before = self.level.level_ms
            self.level.settled(missed, running.at_ms, running.level_ms,
                               alone=running.alone, unavoidable=running.unavoidable,
                               used=used, measured=running.measured)
            if self.level.level_ms < before:
                self._cut_at = now

    def _completed(self, running: Running, now: float) -> None:
        """An admitted request completed within its deadline: the measured level may rise at
        once (``Level.completed``: the way up is clocked by completions, as TCP's slow start
        is by acknowledgements, not by deadlines), unless it was admitted before the level's
        last back-off (evidence the back-off has already weighed). It ran at the work it was
        admitted at, or at the least work the pool held at any decision after it, whichever
        is more: behind several gateways the pool runs at what all of them admit, and a gateway
        whose own level is lower learns from its requests that ran there in time throughout
        (it would otherwise see its requests only at its own level, and keep it)."""
        if running.level_ms < 0 or running.started < self._cut_at:
            return
        i = bisect.bisect_right(self._loads, (running.started, math.inf))  # decided after it
        at_ms = max(running.at_ms, self._loads[i][1]) if i < len(self._loads) else running.at_ms
        self.level.completed(at_ms, running.level_ms, running.own_ms,
                             measured=running.measured, queued=self.queued(now))

    def _own(self, service_class: str) -> Lengths:
        own = self.class_lengths.get(service_class)
        if own is None:
            own = self.class_lengths[service_class] = Lengths(self.lengths.prior)
        return own

    def decay(self, factor: float) -> None:
        """Forget a round's worth of every length histogram and of the classes' requests."""
        self.lengths.decay(factor)
        self.begun.decay(factor)
        for own in self.class_lengths.values():
            own.decay(factor)
        self._asked = {c: n * factor for c, n in self._asked.items()}
        for promise in self.promises.values():
            promise.decay(factor)
        self.level.decay(factor)

    def mix(self) -> Mix:
        lengths = self._views.get("", self.lengths)
        return Mix(prompt_tokens=self._prompt, output_tokens=max(1.0, lengths.mean()))

    def flow(self, group: str) -> Demand:
        flow = self.flows.get(group)
        if flow is None:
            flow = self.flows[group] = Demand(FLOW_MEMORY_S)
        return flow

    def arrived(self, service_class: str, batch: bool, now: float,
                prompt_tokens: int | None = None, groups: tuple[str, ...] = ()) -> None:
        """A request asked (admitted or not): it is demand, for the headroom batch work leaves if
        its class is interactive, and for its groups' (priority, tenant:
        ``extproc.decision.share``); it counts its class as served; its prompt is the traffic's (the
        mix is what asks, not what was let in: a mix of what was let in would follow the decisions
        it feeds). The requests whose deadline has come are resolved first (``refresh``): the
        decision that follows (``extproc.decision.step.admit``) only reads."""
        self.refresh(now)
        self._asked[service_class] = self._asked.get(service_class, 0.0) + 1.0
        if not batch:
            self.demand.arrived(now)
        for group in groups:
            self.flow(group).arrived(now)
        if prompt_tokens is not None:
            self._prompts += 1
            w = max(MIX_WEIGHT, 1.0 / self._prompts)
            self._prompt += w * (prompt_tokens - self._prompt)

    def decided(self, limit: int, load_ms: float | None, now: float) -> None:
        """A request was decided, once (not each time the gateway asked again): the admission
        limit its contention check met (0: none was), a sample of ``limit``'s spread; and the
        pool's outstanding work per replica it saw (every gateway's, from the ledger; None:
        it was refused before the pool was looked at), the load the requests running now are
        running at (``_completed``)."""
        if limit:
            self.limit.add(limit)
        if load_ms is None:
            return
        while self._loads and self._loads[-1][1] >= load_ms:
            self._loads.pop()
        self._loads.append((now, load_ms))

    def admitted(self, running: Running, key: str | None = None) -> None:
        """A request runs (``running``, its record): its prompt joins the prefill backlog
        (drained at its ``prefill_rate``); its predicted time in flight stands for the
        interactive classes' measured time until one of their requests has ended; with its
        ``key``, the pool keeps its record: its answer so far counts in the lengths while it
        runs, it is resolved at its deadline, and its predicted chance of missing moves its
        class's promise (``refresh``, ``Promise``)."""
        now, expected_s = running.started, running.expected_s
        if key is not None:
            self._running[key] = running
            if math.isfinite(running.deadline_s):
                heapq.heappush(self._due, (running.started + running.deadline_s, key))
            if running.chance is not None and not running.measured:
                self.promise(running.service_class).admitted(running.chance,
                                                             running.unavoidable)
        if not running.batch and expected_s > 0 and not self.demand.measured:
            self.demand.served(expected_s, now)
        for group in running.groups:
            if expected_s > 0 and not self.flow(group).measured:
                self.flow(group).served(expected_s, now)
        self.inflight[running.service_class] = self.inflight.get(running.service_class, 0) + 1
        self.backlog.add(running.prompt_tokens, now, running.prefill_rate)

    def settled(self, running: Running, *, completed: bool, now: float,
                key: str | None = None) -> None:
        """A request's stream ended at ``now``: ``completed`` normally, or cancelled. Past
        its deadline it is a miss; a completion within it a hit; a stream cancelled in time
        says nothing about the promise. A request this pool keeps (its ``key``) is resolved
        at its deadline (``resolve``), any other at once. Its record's predicted first token
        and step teach its class's lengths (0: nothing to learn)."""
        service_class = running.service_class
        seconds = now - running.started
        self.inflight[service_class] = max(0, self.inflight.get(service_class, 0) - 1)
        missed = seconds > running.deadline_s
        kept = key is not None and self._running.pop(key, None) is not None  # (``admitted``)
        if kept:  # whatever the estimate says, its prompt is prefilled
            self.backlog.tokens = max(0.0, self.backlog.tokens - running.prompt_tokens)
        if kept and completed and not missed:
            self._completed(running, now)
        if kept and not completed:
            self.abandoned(running, seconds, now)
        if kept and key is not None and math.isfinite(running.deadline_s):
            if not running.missed and (missed or completed):
                self._ended[key] = (running, missed,
                                    seconds / running.deadline_s
                                    if completed and not missed else None)
        elif missed or completed:
            if not kept:
                self.promise(service_class).settled(missed, running.unavoidable,
                                                    running.unavoidable)
            else:
                self._resolved(running, missed, now)
        if not running.batch:
            self.demand.served(seconds, now)
        for group in running.groups:
            self.flow(group).served(seconds, now)
        if running.step_ms > 0:
            tokens = max(1.0, (seconds * 1000.0 - running.ttft_ms) / running.step_ms)
            self._own(service_class).observe(tokens, cut=not completed)


def _chance(r: Running) -> float:
    return r.unavoidable if r.chance is None else r.chance


def learning_for(pool: Pool) -> PoolLearning:
    """A fresh pool's state: its configured prior (``expected_output_tokens``: the mean,
    ``long_output_tokens``: the 99th percentile; each defaults to ``Prior``'s)."""
    return PoolLearning(Prior(pool.expected_output_tokens or Prior.mean,
                              pool.long_output_tokens or Prior.p99))
