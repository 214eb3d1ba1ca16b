"""The admission decision: a pure function of cost, ledger snapshot, capacity, policy and now.

No I/O, no clock reads, no logging: the server, the simulator and replay call the very same
``decide``, so what the simulator proves is what production does.

The model, per pool of ``R`` ready replicas that each decode up to ``B`` sequences at once
(continuous batching), with ``S = R x B`` slots. A request charges ``output`` tokens (its
``max_tokens``: the most it can generate); most stop far earlier, so when the cost carries an
output-length prediction (``extproc.estimate``) the model tells two lengths apart:

    typical    o = min(output, expected_output)       what it will probably generate (mean)
    long       O = min(output, long_output)           what it may generate (a high quantile)
    prefill      = prompt x prefill_per_token
    gpu          = prefill + o x itl(B) / B           its GPU time in a full batch: ledger charge
    mean       g = outstanding / inflight             (gpu itself when nothing is in flight)
    fleet      f = expected_output (output if none)   the pool's mean output, not clipped by
                                                      this request's own max_tokens
    share        = 1 - f x itl(B) / (B x g)           prefill's share of a busy replica's time,
                                                      kept in [0, 0.9]
    batch      b = min(B, (inflight + 1) / R)         mean running sequences per replica
    step(b)      = itl(b) / (1 - share x b / B)       a decode step, stretched by the prefills
                                                      of sequences joining the batch
    position   p = inflight + 1 - S                   its place in the engines' queues
    wait         = 0                       if p <= 0  (a slot is free: it starts now)
                 = q(ceil(p / R)) x g      otherwise
    ttft         = wait + prefill
    completion   = wait + prefill + O x step(b)

``itl(b) = itl_at_1 + itl_per_running x (b - 1)``. It admits when ``completion <= deadline x
safety`` and, for classes with a time-to-first-token objective, ``ttft <= ttft_objective x
safety``.

Why it looks like this. A full replica finishes one request per ``g`` of GPU time (a decode
step is shared by its ``B`` sequences; a prefill runs alone), so slots free one every ``g`` per
replica, and a request ``k``-th in its replica's queue (queues are kept even) starts with the
``k``-th release. Releases are irregular, so the wait is not ``k x g`` but ``q(k) x g``, the
``wait_quantile`` of the time to the ``k``-th event of a Poisson stream (``release_quantile``):
the mean would be met only half the time. (Releases of many sequences sharing a replica are
close to Poisson; for a serial replica, ``B = 1``, the estimate is pessimistic.) The work in
flight is charged at its expected size, so the wait depends on when slots free, not on
``max_tokens`` summed over the backlog. And while sequences join, every step also runs their
prefill: ``share`` of a busy replica's time goes to prefill (the ledger's mean charge less its
decode part), which stretches every decode step by ``1 / (1 - share)`` at a full batch, less
at a smaller one. The share is the fleet's, so its decode part is the pool's mean output
``f``, never this request's own length: a request told it will be long (or one with a small
``max_tokens``) would otherwise read the busy fleet's prefill share as none (or as most).

Why two lengths: the *fleet* is charged what requests will probably cost (charging
``max_tokens`` in full makes a busy fleet look several times busier than it is and turns
requests away while slots sit idle), but a request is *promised* only what it may cost: its
own completion uses the long length, so an admitted request still meets its deadline when its
output runs long. Without a prediction ``o = O = output``: the conservative model that charges
``max_tokens`` in full.

A request that would miss its deadline even on an idle fleet (wait 0, b = 1) is not overload:
a 429 would invite retries that can never succeed, so the decision is ``INFEASIBLE`` and the
caller passes or refuses it by configuration.

An admission carries ``ceiling_ms``, the threshold for the ledger's atomic check-and-record
(a shared ledger may have changed since the snapshot): the most outstanding work, this request
included, under which it still fits. Requests admitted ahead of it meanwhile add about their
charge ``g`` each to ``outstanding`` and ``g / R`` each to its wait, so with
``slack = min(budget - completion, ttft_budget - ttft)``

    ceiling    = outstanding + gpu + R x slack

which an unchanged ledger always satisfies (admissions that only took free slots add no wait,
so the ceiling is conservative there).

A rejection says when the request would fit: the wait shrinks by one millisecond per
millisecond while nothing new is admitted, so ``retry_after = completion - budget`` (or the
TTFT excess, whichever is larger); when the wait is already zero the excess comes from the
batch being full, and the hint is at least the time a replica takes to free a slot, ``g``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from statistics import NormalDist


class Outcome(StrEnum):
    """Low-cardinality result of one request's admission: a metric label and span attribute."""

    ADMIT = "admit"
    REJECT = "reject"  # 429: overload, retry later
    PASS = "pass"  # not decided on: infeasible-but-passed, unmanaged model, fail-open
    INVALID = "invalid"  # 4xx: the request itself is unusable
    ERROR = "error"  # 5xx-class: our own failure (fail-closed)


class Reason(StrEnum):
    FITS = "fits"
    DEADLINE = "deadline"  # predicted completion past the deadline budget
    TTFT = "ttft"  # predicted first token past the TTFT budget
    NO_CAPACITY = "no_capacity"  # no ready replica
    INFEASIBLE = "infeasible"  # would miss even on an idle fleet
    UNMANAGED = "unmanaged"  # no pool serves this model
    BAD_REQUEST = "bad_request"
    BODY_TOO_LARGE = "body_too_large"
    UNSUPPORTED_MEDIA = "unsupported_media"
    LEDGER_UNAVAILABLE = "ledger_unavailable"
    PROCESSOR_OVERLOADED = "processor_overloaded"  # shed before deciding (extproc.loadshed)


@dataclass(frozen=True, slots=True)
class Cost:
    """What one request asks of the GPU, in tokens (times are the model's business)."""

    prompt_tokens: int
    output_tokens: int  # output charged: max_tokens (or the default) x choices
    expected_output_tokens: float | None = None  # predicted mean output; None: output_tokens
    long_output_tokens: float | None = None  # predicted long output (~p99); None: output_tokens

    @property
    def typical_tokens(self) -> float:
        """``o``: what it will probably generate, never above the charge."""
        expected = self.expected_output_tokens
        return self.output_tokens if expected is None else min(self.output_tokens, expected)

    @property
    def fleet_tokens(self) -> float:
        """What a request of the pool generates on average (the prediction, unclipped by this
        request's own ``max_tokens``): the decode part of the fleet's mean charge."""
        expected = self.expected_output_tokens
        return self.output_tokens if expected is None else expected

    @property
    def long_tokens(self) -> float:
        """``O``: what it generates at worst, bar the predictor's tail, never above the charge."""
        long = self.long_output_tokens
        return self.output_tokens if long is None else min(self.output_tokens, long)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The ledger's view of one pool: admitted requests not yet finished."""

    inflight: int
    outstanding_ms: float


@dataclass(frozen=True, slots=True)
class Capacity:
    """Ready replicas of a pool and the cost model of one replica."""

    replicas: int
    max_running: int
    prefill_ms_per_token: float
    itl_ms_at_1: float
    itl_ms_per_running: float
    wait_quantile: float = 0.97  # how sure the predicted wait must be (see the docstring)
    wait_z: float = field(init=False, repr=False, compare=False)  # its normal quantile

    def __post_init__(self) -> None:
        object.__setattr__(self, "wait_z", NormalDist().inv_cdf(self.wait_quantile))

    @property
    def slots(self) -> int:
        return self.replicas * self.max_running

    def itl_ms(self, running: float) -> float:
        return self.itl_ms_at_1 + self.itl_ms_per_running * max(0.0, running - 1.0)


@dataclass(frozen=True, slots=True)
class Policy:
    """The budget a request is held to: its class's deadline (possibly tightened by the
    client) and TTFT objective, each scaled by the class's safety factor."""

    deadline_ms: float
    safety_factor: float
    ttft_ms: float | None = None

    @property
    def budget_ms(self) -> float:
        return self.deadline_ms * self.safety_factor

    @property
    def ttft_budget_ms(self) -> float | None:
        return None if self.ttft_ms is None else self.ttft_ms * self.safety_factor


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: Outcome
    reason: Reason
    service_ms: float  # this request's GPU time in a full batch: its ledger charge
    wait_ms: float
    ttft_ms: float
    completion_ms: float
    budget_ms: float
    finish_at: float  # now + completion: when the request is expected to end
    retry_after_ms: float | None = None  # set on REJECT: when it would fit
    ceiling_ms: float | None = None  # set on ADMIT: the ledger's atomic check (docstring)

    @property
    def admitted(self) -> bool:
        return self.outcome is Outcome.ADMIT


MAX_PREFILL_SHARE = 0.9  # beyond this a replica barely decodes: the estimate is not trusted


def release_quantile(k: int, z: float) -> float:
    """The time until the ``k``-th release of a Poisson stream, in mean gaps, at the normal
    quantile ``z`` (Wilson-Hilferty's approximation of the gamma distribution: within 1% for
    the quantiles used here, exact in the mean as ``k`` grows)."""
    return k * max(0.0, 1.0 - 1.0 / (9.0 * k) + z / (3.0 * math.sqrt(k))) ** 3


def charge_ms(cost: Cost, capacity: Capacity) -> float:
    """``gpu``: a request's GPU time in a full batch, its ledger charge (module docstring)."""
    full = capacity.max_running
    return (cost.prompt_tokens * capacity.prefill_ms_per_token
            + cost.typical_tokens * capacity.itl_ms(full) / full)


def decide(cost: Cost, snapshot: Snapshot, capacity: Capacity, policy: Policy,
           now: float) -> Decision:
    """Admit, reject (429) or declare infeasible one request; see the module docstring."""
    long = cost.long_tokens
    prefill_ms = cost.prompt_tokens * capacity.prefill_ms_per_token
    idle_ms = prefill_ms + long * capacity.itl_ms(1.0)
    ttft_budget = policy.ttft_budget_ms
    full = capacity.max_running
    gpu_ms = charge_ms(cost, capacity)  # prefill + typical decode
    if idle_ms > policy.budget_ms or (ttft_budget is not None and prefill_ms > ttft_budget):
        return Decision(Outcome.PASS, Reason.INFEASIBLE, gpu_ms, 0.0, prefill_ms, idle_ms,
                        policy.budget_ms, now + idle_ms / 1000.0)

    if capacity.replicas <= 0:
        return Decision(Outcome.REJECT, Reason.NO_CAPACITY, gpu_ms, 0.0, prefill_ms, idle_ms,
                        policy.budget_ms, now + idle_ms / 1000.0,
                        retry_after_ms=policy.budget_ms)

    mean_ms = snapshot.outstanding_ms / snapshot.inflight if snapshot.inflight else gpu_ms
    fleet_decode_ms = cost.fleet_tokens * capacity.itl_ms(full) / full
    share = (min(MAX_PREFILL_SHARE, max(0.0, 1.0 - fleet_decode_ms / mean_ms))
             if mean_ms > 0 else 0.0)
    batch = min(float(full), (snapshot.inflight + 1) / capacity.replicas)
    step_ms = capacity.itl_ms(batch) / (1.0 - share * batch / full)
    position = snapshot.inflight + 1 - capacity.slots
    if position > 0:
        ahead = math.ceil(position / capacity.replicas)
        wait_ms = release_quantile(ahead, capacity.wait_z) * mean_ms
    else:
        wait_ms = 0.0
    ttft_ms = wait_ms + prefill_ms
    completion_ms = wait_ms + prefill_ms + long * step_ms
    finish_at = now + completion_ms / 1000.0

    deadline_excess = completion_ms - policy.budget_ms
    ttft_excess = ttft_ms - ttft_budget if ttft_budget is not None else float("-inf")
    if deadline_excess <= 0 and ttft_excess <= 0:
        slack_ms = -max(deadline_excess, ttft_excess)
        ceiling_ms = snapshot.outstanding_ms + gpu_ms + capacity.replicas * slack_ms
        return Decision(Outcome.ADMIT, Reason.FITS, gpu_ms, wait_ms, ttft_ms, completion_ms,
                        policy.budget_ms, finish_at, ceiling_ms=ceiling_ms)

    reason = Reason.DEADLINE if deadline_excess >= ttft_excess else Reason.TTFT
    excess = max(deadline_excess, ttft_excess)
    retry_ms = excess if wait_ms > 0 else max(excess, mean_ms)
    return Decision(Outcome.REJECT, reason, gpu_ms, wait_ms, ttft_ms, completion_ms,
                    policy.budget_ms, finish_at, retry_after_ms=retry_ms)
