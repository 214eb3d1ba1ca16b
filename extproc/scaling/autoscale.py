"""The replica recommender: how many replicas a pool should have, and why.

A pure function, ``recommend(window, state, policy) -> (Recommendation, State)``, fed one
``Window`` per control period (counts over the window plus gauges at its end, and ``now``; it
reads no clock) and a small ``State`` carried between windows. ``Recommender`` holds the state
for one pool. Two rules are combined, the larger ask wins:

(a) Rejections (scale up fast). Over a window with at least ``min_decisions`` decisions,
    ``r = rejected / (admitted + rejected)`` counts attempts, and a gateway cannot tell a
    client's retry of a 429 from a first attempt, so it reads ``r`` through the clients'
    retry budget (``client_retries``, k; the OpenAI SDK retries twice): a request is lost only
    when all k + 1 of its attempts are, so the share of requests lost is

        lost = min(r, 1/2) ^ (k + 1)              k = 0 is the article's reading: lost = r

    (a ratio over one half is read as one half: beyond it the count is mostly the same
    requests coming back). ``q = queue_depth / ready``, the engines' queue (not what the
    gateway holds: see (b)). When ``lost`` exceeds ``reject_ratio_high``, or ``q`` exceeds
    ``queue_per_replica_high`` while requests are lost or the oldest is older than
    ``age_threshold_s`` (or its age is not known):

        demand_ratio = 1 / (1 - lost)              admission sheds the excess, so offered
                                                   requests over served ones are 1 / (1 - lost)
        queue_ratio  = q / queue_per_replica_target    (0 unless q is over its high mark)
        want_a       = clamp(ceil(ready x max(demand_ratio, queue_ratio)),
                             ready + 1, ceil(ready x max_up_factor))       at most 2x by default

    A deep queue that loses nothing and does not age is admission's plan: under enforced
    admission the engines hold what finishes within its deadline, and on the simulated
    incident's plateau 8 and more a replica, each within it, read as demand asked 4 -> 6
    replicas where 4 carry it (274.8 replica-minutes against the HPA's 257.7; 251.7 so).

    Read as ``1 / (1 - r)``, retries overstated demand: in the simulated incident 64 % of the
    attempts were rejected where 1.25x the capacity was offered, and the rule asked 3 -> 6
    where 4 carry it. With k = 2 the rejection step is at most 8/7 of ``ready`` (at least one
    replica); a larger surge is met step by step as each step turns ready and still sheds, and
    by the queue rules. A window in which replicas turned ready (``ready`` above the last
    window's) is not judged: its rejections were counted against the smaller fleet.

(b) Queue age (scale out by the backlog). When the oldest eligible request is older than
    ``age_threshold_s`` while arrivals exceed successful departures, for ``confirm_windows``
    consecutive windows:

        need   = ceil(backlog / (drain_s x rate))          rate: successful requests per second
        want_b = ready + need                              per ready replica, measured

    The note's example: 360 waiting, drained in 60 s at 2.5 req/s per replica: 360 / 60 / 2.5
    = 2.4, three more replicas. The backlog is the engines' queue plus the requests the
    gateway holds (``held``, ``extproc.decision.defer``): demand that waits rather than being
    refused. Counted in (a)'s per-replica queue instead, a held queue that drains within its
    deadlines read as a shortage (simulated, the recommender with defer on: 368 replica-minutes
    where without a hold it spends 257, for 1 % more goodput; 269 now). ``rate`` is an
    exponentially weighted mean of ``departures / duration / ready`` over windows where the
    replicas were saturated: rule (a) sheds (``lost`` over ``reject_ratio_high``) or ``q``
    is at least ``queue_per_replica_target``, and the utilization, when known, is at least
    ``utilization_high`` (work waiting at idle engines is a dispatch problem, not their
    capacity); a window in which replicas turned ready is skipped. Only then do departures
    measure capacity rather than demand; elsewhere the estimate is kept (a rate learnt at
    moderate load drifts down to the demand per replica, and the scale-down's headroom check
    below then never passes). It is seeded by ``service_rate_hint``; unknown, the step is one
    replica (never a large step on a guess).
    The step assumes arrivals fall back to what the fleet serves; a sustained excess keeps
    the backlog growing and the next window asks for the difference, while (a) answers a
    sustained excess through the rejections it causes.

Requested capacity counts before asking for more: the ask is absolute and compared with
``requested = max(ready + starting, previous recommendation)`` (the previous ask covers pods
not yet visible), so replicas still warming are never asked for twice; an ask they already
cover is held with reason ``PENDING``.

Scale down slowly: one replica, only after ``down_quiet_s`` of windows that were all quiet
(``lost`` under ``reject_ratio_quiet``: with k = 2, under 10 % of the attempts rejected;
waiting per replica under ``queue_per_replica_quiet``, nothing held, oldest age under
``quiet_age_fraction`` of its threshold, a known utilization under ``utilization_high``)
and only when the remaining replicas would carry the arrival rate at ``down_headroom`` of
their measured rate. The quiet clock restarts after each step.

Guardrails (each conservative rule is also a comment where the code applies it):
a stale or missing input holds the last recommendation (no scaling on a missing metric).
Departures near zero while old work waits to start, for ``confirm_windows`` windows, is a
failure state (``STALLED``), never a reason to add GPUs: "near zero" is under
``stall_fraction`` of what the measured rate expects in the window, judged only when it
expects at least ``stall_min_expected`` (one slow replica finishing nothing in 15 s proves
nothing). Replicas stuck starting longer than ``readiness_timeout_s`` pause scale-out
(``NOT_READY``). A reversal of direction within ``cooldown_s`` of the last change is held
(``COOLDOWN``), so the direction changes at most once per cooldown on any input. The result
is clamped to ``[min_replicas, max_replicas]``; what is cut off above the maximum is reported
as ``unmet`` (an alert: the controller is reporting demand, not solving it).

Every recommendation carries a low-cardinality ``Reason`` and the three-way ``Reading`` of
queue age against utilization (KV-cache usage when the GPU figure is not known): high/high is
capacity pressure, high/low a dispatch or dependency problem (more GPUs may not help), low/high
efficient operation. The reading explains; it does not gate, except that efficient operation
blocks a scale-down.

Length: past the house's ~400 lines because a fifth is this docstring, the policy's
reasoning kept next to the code; the recommender itself is one function, ``recommend``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import StrEnum

from extproc.errors import ConfigError


class Direction(StrEnum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


class Reason(StrEnum):
    """Why the recommendation is what it is: a metric label, so a closed set."""

    STEADY = "steady"  # nothing to do
    REJECTIONS = "rejections"  # up: reject ratio over its threshold
    QUEUE_DEPTH = "queue_depth"  # up: waiting requests per replica over its threshold
    QUEUE_AGE = "queue_age"  # up: old work and a growing backlog, sized by the backlog
    ACTIVATE = "activate"  # up: traffic and no replica at all
    PENDING = "pending"  # wants more, but replicas already requested cover it
    QUIET = "quiet"  # down: one replica after a long quiet period
    COOLDOWN = "cooldown"  # a reversal held back until the cooldown has passed
    STALLED = "stalled"  # failure state: old work waits and almost nothing completes
    NOT_READY = "not_ready"  # requested replicas do not become ready: scale-out paused
    STALE = "stale"  # an input is stale or missing: hold
    BOUNDS = "bounds"  # moved only to respect min_replicas / max_replicas


class Reading(StrEnum):
    """The three-way reading of queue age against utilization (and its two leftovers)."""

    CAPACITY_PRESSURE = "capacity_pressure"  # age high, utilization high
    DISPATCH_PROBLEM = "dispatch_problem"  # age high, utilization low
    EFFICIENT = "efficient"  # age low, utilization high
    NORMAL = "normal"  # age low, utilization low
    UNKNOWN = "unknown"  # age or utilization not known


@dataclass(frozen=True)
class ScalingPolicy:
    """Thresholds of the recommender. Defaults follow the source documents' planning values."""

    min_replicas: int = 1
    max_replicas: int = 64
    # rule (a): rejections and queue depth
    # both compared with the share of requests lost, ``lost_share`` (k = 0: of attempts)
    reject_ratio_high: float = 0.02  # the article: scale up over 2 % rejected
    reject_ratio_quiet: float = 0.001  # and down only under 0.1 %
    min_decisions: int = 20  # fewer decisions in a window make the ratio noise: ignored
    queue_per_replica_high: float = 8.0  # the article's trigger
    queue_per_replica_target: float = 4.0  # the article's goal
    queue_per_replica_quiet: float = 2.0
    max_up_factor: float = 2.0  # scale up by at most 2x in one step
    client_retries: int = 2  # retries a client makes after a 429 (the OpenAI SDK's default)
    # rule (b): queue age
    age_threshold_s: float = 20.0  # oldest eligible age objective (about the latency budget)
    confirm_windows: int = 2  # consecutive breaching windows before acting
    drain_s: float = 60.0  # drain the backlog within this long
    service_rate_hint: float | None = None  # req/s per ready replica until one is measured
    rate_smoothing: float = 0.3  # weight of a new window in the measured service rate
    stall_fraction: float = 0.05  # departures under this share of expected: stalled
    stall_min_expected: float = 5.0  # fewer expected departures per window prove nothing
    # scale down
    down_quiet_s: float = 300.0  # quiet this long before removing one replica (HPA's 5 min)
    quiet_age_fraction: float = 0.2  # quiet: oldest age under 20 % of its threshold
    utilization_high: float = 0.75  # utilization (or KV usage) counted as high
    down_headroom: float = 0.8  # remaining replicas must carry arrivals at <= 80 % of rate
    # guards
    cooldown_s: float = 300.0  # at least this long between two changes of direction
    readiness_timeout_s: float = 900.0  # replicas starting longer than this: pause scale-out

    def __post_init__(self) -> None:
        if problems := self.problems():
            raise ConfigError(problems)

    def problems(self) -> list[str]:
        """Every invalid field, naming the bound and the bad value."""
        out: list[str] = []

        def need(ok: bool, name: str, bound: str) -> None:
            if not ok:
                out.append(f"autoscale.{name}: must be {bound} (got {getattr(self, name)!r})")

        need(self.min_replicas >= 0, "min_replicas", ">= 0")
        need(self.max_replicas >= max(1, self.min_replicas), "max_replicas",
             f">= max(1, min_replicas={self.min_replicas})")
        for name in ("reject_ratio_high", "reject_ratio_quiet", "stall_fraction",
                     "quiet_age_fraction", "utilization_high"):
            need(0 <= getattr(self, name) <= 1, name, "in [0, 1]")
        need(0 < self.rate_smoothing <= 1, "rate_smoothing", "in (0, 1]")
        need(0 < self.down_headroom <= 1, "down_headroom", "in (0, 1]")
        need(self.reject_ratio_quiet <= self.reject_ratio_high, "reject_ratio_quiet",
             f"<= reject_ratio_high ({self.reject_ratio_high})")
        need(self.min_decisions >= 1, "min_decisions", ">= 1")
        need(self.client_retries >= 0, "client_retries", ">= 0")
        need(self.confirm_windows >= 1, "confirm_windows", ">= 1")
        for name in ("queue_per_replica_high", "queue_per_replica_target", "age_threshold_s",
                     "drain_s"):
            need(getattr(self, name) > 0, name, "> 0")
        for name in ("queue_per_replica_quiet", "down_quiet_s", "cooldown_s",
                     "readiness_timeout_s", "stall_min_expected"):
            need(getattr(self, name) >= 0, name, ">= 0")
        need(self.max_up_factor > 1, "max_up_factor", "> 1")
        need(self.service_rate_hint is None or self.service_rate_hint > 0, "service_rate_hint",
             "> 0 or unset")
        return out


@dataclass(frozen=True)
class Window:
    """What one control window saw for one pool: counts over ``duration_s`` ending at ``now``,
    gauges at ``now``. ``None`` means not known (never guessed as zero)."""

    now: float  # seconds on a monotonic clock; never decreases between windows
    duration_s: float
    arrivals: int  # requests offered to admission (admitted, rejected or passed)
    admitted: int
    rejected: int  # 429s for overload
    departures: int  # admitted requests that completed successfully
    oldest_age_s: float | None  # oldest eligible admitted-but-unfinished request; 0 when none
    queue_depth: int  # eligible requests waiting (admitted, not yet running): the backlog
    ready: int
    held: int = 0  # requests the gateway holds until they fit (``extproc.decision.defer``): backlog
    starting: int = 0  # requested, not yet ready (never capacity)
    draining: int = 0  # leaving (never capacity)
    utilization: float | None = None  # 0..1: GPU utilization or KV-cache usage, if known
    stale: bool = False  # an input behind this window is stale or missing


@dataclass(frozen=True)
class Recommendation:
    desired: int  # replicas the pool should have, within [min_replicas, max_replicas]
    previous: int  # the previous recommendation (or, the first time, what existed)
    direction: Direction
    reason: Reason
    reading: Reading
    unmet: int = 0  # replicas wanted above max_replicas
    active: bool = True  # any demand at all (KEDA's IsActive)
    reject_ratio: float | None = None
    service_rate: float | None = None  # measured (or hinted) req/s per ready replica


@dataclass(frozen=True)
class State:
    """What the recommender carries from one window to the next."""

    desired: int | None = None
    now: float | None = None  # the last window's end
    last_move_at: float | None = None
    last_move: Direction = Direction.HOLD
    breach_windows: int = 0  # consecutive windows: age high and arrivals > departures
    stall_windows: int = 0  # consecutive windows: age high and departures near zero
    quiet_since: float | None = None
    starting_since: float | None = None  # start of the current wait for replicas to be ready
    last_ready: int = 0
    rate: float | None = None  # measured successful req/s per ready replica


RATIO_CAP = 0.5  # reject ratios above this are read as this much (see lost_share)


def _ceil(x: float) -> int:
    """``ceil`` that does not round 11.000000000000002 (a float artefact) up to 12."""
    return math.ceil(x - 1e-9)


def drain_step(backlog: int, drain_s: float, rate_per_replica: float) -> int:
    """Extra ready replicas that drain ``backlog`` requests within ``drain_s`` seconds."""
    return _ceil(backlog / (drain_s * rate_per_replica)) if backlog > 0 else 0


def lost_share(reject_ratio: float, retries: int) -> float:
    """The share of requests (not attempts) turned away for good when ``reject_ratio`` of the
    attempts are rejected and each client retries a 429 up to ``retries`` times: a request is
    lost only when all ``retries + 1`` of its attempts are, so ``r^(retries + 1)``, with ``r``
    read as at most ``RATIO_CAP``."""
    return min(reject_ratio, RATIO_CAP) ** (retries + 1)


def classify(age_high: bool | None, utilization: float | None, high: float) -> Reading:
    if age_high is None or utilization is None:
        return Reading.UNKNOWN
    util_high = utilization >= high
    if age_high:
        return Reading.CAPACITY_PRESSURE if util_high else Reading.DISPATCH_PROBLEM
    return Reading.EFFICIENT if util_high else Reading.NORMAL


def recommend(w: Window, s: State, p: ScalingPolicy) -> tuple[Recommendation, State]:
    """One control step; see the module docstring for the rules and their order."""
    if s.now is not None and w.now < s.now:
        raise ValueError(f"window.now went backwards ({w.now} < {s.now})")

    def clamp(n: int) -> int:
        return max(p.min_replicas, min(p.max_replicas, n))

    current = w.ready + w.starting
    previous = s.desired if s.desired is not None else clamp(current)
    decided = w.admitted + w.rejected
    ratio = w.rejected / decided if decided >= p.min_decisions else None
    lost = None if ratio is None else lost_share(ratio, p.client_retries)
    per_replica_q = w.queue_depth / w.ready if w.ready > 0 else 0.0
    age_high = None if w.oldest_age_s is None else w.oldest_age_s > p.age_threshold_s
    reading = classify(age_high, w.utilization, p.utilization_high)
    # Held requests are backlog, sized against the measured drain (rule b), and never quiet;
    # the per-replica queue of rule (a) is the engines' alone: a gateway's queue that drains
    # within its requests' deadlines is what the hold is for, not a shortage.
    backlog = w.queue_depth + w.held
    has_demand = w.arrivals > 0 or backlog > 0
    duration = max(w.duration_s, 1e-9)
    arrival_rate, departure_rate = w.arrivals / duration, w.departures / duration

    def hold(reason: Reason, state: State, desired: int = previous,
             unmet: int = 0) -> tuple[Recommendation, State]:
        rec = Recommendation(desired, previous, Direction.HOLD, reason, reading, unmet,
                             has_demand or desired > 0, ratio, state.rate or p.service_rate_hint)
        return rec, dataclasses.replace(state, desired=desired, last_ready=w.ready, now=w.now)

    def move(desired: int, reason: Reason, state: State,
             unmet: int = 0) -> tuple[Recommendation, State]:
        if desired == previous:
            return hold(reason, state, desired, unmet)
        direction = Direction.UP if desired > previous else Direction.DOWN
        # The promotion rule: at most one change of direction per cooldown period.
        if (state.last_move not in (direction, Direction.HOLD) and state.last_move_at is not None
                and w.now - state.last_move_at < p.cooldown_s):
            return hold(Reason.COOLDOWN, state, previous, unmet)
        rec = Recommendation(desired, previous, direction, reason, reading, unmet,
                             has_demand or desired > 0, ratio, state.rate or p.service_rate_hint)
        return rec, dataclasses.replace(state, desired=desired, last_ready=w.ready, now=w.now,
                                        last_move=direction, last_move_at=w.now)

    # A stale or missing input proves neither pressure nor quiet: hold, and let nothing in
    # this window count towards a confirmation or the quiet period.
    if w.stale:
        return hold(Reason.STALE, dataclasses.replace(s, quiet_since=None, breach_windows=0,
                                                      stall_windows=0))

    rate = s.rate
    # Stalled: old work waits to start and (almost) nothing completes. Zero departures prove
    # something only when the measured rate expects several in the window.
    expected = w.ready * (rate or p.service_rate_hint or 0.0) * w.duration_s
    stalled_now = bool(age_high) and w.ready > 0 and backlog > 0 and (
        expected >= p.stall_min_expected and w.departures <= p.stall_fraction * expected
        if expected > 0 else w.departures == 0)
    # Departures measure capacity only while work waits or is turned away; a stalled window
    # measures a failure, not the service rate.
    # Departures measure capacity only while the replicas are saturated: work turned away,
    # a queue at its per-replica target, or a high utilization. Below that they measure the
    # demand, and a rate learnt there would drift down to it (and block every scale-down).
    # A window in which replicas turned ready was served partly by the smaller fleet: its
    # counts measure neither fleet, and its rejections predate the new capacity.
    grew = s.now is not None and w.ready > s.last_ready
    shedding = lost is not None and lost > p.reject_ratio_high and not grew
    saturated = ((shedding or per_replica_q >= p.queue_per_replica_target)
                 and (w.utilization is None or w.utilization >= p.utilization_high))
    if saturated and not grew and w.ready > 0 and w.departures > 0 and not stalled_now:
        observed = departure_rate / w.ready
        rate = observed if rate is None else rate + p.rate_smoothing * (observed - rate)
    starting_since = s.starting_since
    if w.starting == 0 or w.ready > s.last_ready:
        starting_since = None if w.starting == 0 else w.now
    elif starting_since is None:
        starting_since = w.now
    s = dataclasses.replace(
        s, rate=rate, starting_since=starting_since,
        breach_windows=s.breach_windows + 1 if age_high and w.arrivals > w.departures else 0,
        stall_windows=s.stall_windows + 1 if stalled_now else 0)
    rate_now = rate or p.service_rate_hint

    # Failure path: old work and (almost) nothing completing is not a capacity shortage that
    # more GPUs fix; hold in both directions and let the reason raise the alarm.
    if s.stall_windows >= p.confirm_windows:
        return hold(Reason.STALLED, dataclasses.replace(s, quiet_since=None))

    wants: list[tuple[int, Reason]] = []
    if w.ready == 0 and has_demand:
        wants.append((1, Reason.ACTIVATE))  # held as PENDING while one is starting
    # Rejections count by the requests they cost: ``lost`` is the estimated share of requests
    # (not attempts) turned away for good once the clients' retries are spent. A window in
    # which replicas turned ready is not judged: its rejections predate the new capacity.
    # A deep queue that loses nothing and does not age is admission's plan (it admits what
    # finishes within its deadline), not demand the replicas cannot meet.
    deep = per_replica_q > p.queue_per_replica_high and (shedding or age_high is not False)
    if w.ready > 0 and (shedding or deep):
        demand_ratio = 1.0 / (1.0 - lost) if shedding and lost is not None else 1.0
        queue_ratio = per_replica_q / p.queue_per_replica_target if deep else 0.0
        cap = _ceil(w.ready * p.max_up_factor)
        want = max(w.ready + 1, min(cap, _ceil(w.ready * max(demand_ratio, queue_ratio))))
        wants.append((want, Reason.QUEUE_DEPTH if queue_ratio > demand_ratio
                       else Reason.REJECTIONS))
    if s.breach_windows >= p.confirm_windows:
        need = drain_step(backlog, p.drain_s, rate_now) if rate_now else 1
        wants.append((w.ready + max(1, need), Reason.QUEUE_AGE))

    if wants:
        s = dataclasses.replace(s, quiet_since=None)
        want, reason = max(wants, key=lambda x: x[0])
        requested = max(current, previous)
        unmet = max(0, want - p.max_replicas)
        if want <= requested:
            return hold(Reason.PENDING, s, previous, unmet)
        # Requested replicas that never become ready: another wave would only deepen the
        # contention (image pulls, quota, model store), so pause scale-out.
        if s.starting_since is not None and w.now - s.starting_since > p.readiness_timeout_s:
            return hold(Reason.NOT_READY, s, previous, unmet)
        desired = clamp(want)
        if desired <= previous:
            return hold(Reason.BOUNDS if unmet else Reason.PENDING, s, previous, unmet)
        return move(desired, reason, s, unmet)

    quiet = (
        (lost is None or lost < p.reject_ratio_quiet)
        and per_replica_q < p.queue_per_replica_quiet and w.held == 0
        and w.oldest_age_s is not None  # an unknown age cannot prove quiet
        and w.oldest_age_s < p.quiet_age_fraction * p.age_threshold_s
        and (w.utilization is None or w.utilization < p.utilization_high)
    )
    if not quiet:
        s = dataclasses.replace(s, quiet_since=None)
    elif s.quiet_since is None:
        s = dataclasses.replace(s, quiet_since=w.now - w.duration_s)
    if s.quiet_since is not None and w.now - s.quiet_since >= p.down_quiet_s \
            and previous > p.min_replicas:
        remaining = min(w.ready, previous) - 1
        fits = rate_now is None or arrival_rate <= remaining * rate_now * p.down_headroom
        if fits:
            rec, after = move(previous - 1, Reason.QUIET, s)
            if rec.direction is Direction.DOWN:
                after = dataclasses.replace(after, quiet_since=w.now)  # restart the clock
            return rec, after
    return hold(Reason.STEADY, s)


class Recommender:
    """The state of one pool's recommender; ``observe`` once per control window."""

    def __init__(self, policy: ScalingPolicy | None = None) -> None:
        self.policy = policy or ScalingPolicy()
        self.state = State()
        self.last: Recommendation | None = None

    def observe(self, window: Window) -> Recommendation:
        self.last, self.state = recommend(window, self.state, self.policy)
        return self.last
