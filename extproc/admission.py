"""The admission decision: a pure function of cost, ledger snapshot, capacity, policy and now.

No I/O, no clock reads, no logging: the server, the simulator and replay call the very same
``decide``, so what the simulator proves is what production does.

The model, per pool of ``R`` ready replicas that each decode up to ``B`` sequences at once
(continuous batching), with ``S = R x B`` slots:

    batch      b = min(B, (inflight + 1) / R)              mean running sequences per replica
    itl(b)       = itl_at_1 + itl_per_running x (b - 1)    inter-token latency grows with batch
    own          = prompt x prefill_per_token + output x itl(b)
    wait         = 0                   if inflight + 1 <= S  (a slot is free: it starts now)
                 = outstanding / S     otherwise             (work ahead drains over S slots)
    ttft         = wait + prompt x prefill_per_token
    completion   = wait + own

It admits when ``completion <= deadline x safety`` and, for classes with a time-to-first-token
objective, ``ttft <= ttft_objective x safety``. ``outstanding`` is the ledger's sum of the
``own`` estimates of requests in flight. With B = 1 this is the article's baseline
(outstanding / replicas + own vs SLO x 0.8); B > 1 stops treating a batching replica as serial.

A request that would miss its deadline even on an idle fleet (wait 0, b = 1) is not overload:
a 429 would invite retries that can never succeed, so the decision is ``INFEASIBLE`` and the
caller passes or refuses it by configuration.

A rejection says when the request would fit: the wait shrinks by one millisecond per
millisecond while nothing new is admitted, so ``retry_after = completion - budget`` (or the
TTFT excess, whichever is larger); when the wait is already zero the excess comes from the
batch being full, and the hint is the mean time for a slot to free, ``outstanding / S``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


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


@dataclass(frozen=True, slots=True)
class Cost:
    """What one request asks of the GPU, in tokens (times are the model's business)."""

    prompt_tokens: int
    output_tokens: int  # output charged: max_tokens (or the default) x choices


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
    service_ms: float  # this request's own estimated service time: its ledger charge
    wait_ms: float
    ttft_ms: float
    completion_ms: float
    budget_ms: float
    finish_at: float  # now + completion: when the request is expected to end
    retry_after_ms: float | None = None  # set on REJECT: when it would fit

    @property
    def admitted(self) -> bool:
        return self.outcome is Outcome.ADMIT


def decide(cost: Cost, snapshot: Snapshot, capacity: Capacity, policy: Policy,
           now: float) -> Decision:
    """Admit, reject (429) or declare infeasible one request; see the module docstring."""
    prefill_ms = cost.prompt_tokens * capacity.prefill_ms_per_token
    idle_ms = prefill_ms + cost.output_tokens * capacity.itl_ms(1.0)
    ttft_budget = policy.ttft_budget_ms
    if idle_ms > policy.budget_ms or (ttft_budget is not None and prefill_ms > ttft_budget):
        return Decision(Outcome.PASS, Reason.INFEASIBLE, idle_ms, 0.0, prefill_ms, idle_ms,
                        policy.budget_ms, now + idle_ms / 1000.0)

    if capacity.replicas <= 0:
        return Decision(Outcome.REJECT, Reason.NO_CAPACITY, idle_ms, 0.0, prefill_ms, idle_ms,
                        policy.budget_ms, now + idle_ms / 1000.0,
                        retry_after_ms=policy.budget_ms)

    slots = capacity.slots
    batch = min(float(capacity.max_running), (snapshot.inflight + 1) / capacity.replicas)
    own_ms = prefill_ms + cost.output_tokens * capacity.itl_ms(batch)
    wait_ms = snapshot.outstanding_ms / slots if snapshot.inflight + 1 > slots else 0.0
    ttft_ms = wait_ms + prefill_ms
    completion_ms = wait_ms + own_ms
    finish_at = now + completion_ms / 1000.0

    deadline_excess = completion_ms - policy.budget_ms
    ttft_excess = ttft_ms - ttft_budget if ttft_budget is not None else float("-inf")
    if deadline_excess <= 0 and ttft_excess <= 0:
        return Decision(Outcome.ADMIT, Reason.FITS, own_ms, wait_ms, ttft_ms, completion_ms,
                        policy.budget_ms, finish_at)

    reason = Reason.DEADLINE if deadline_excess >= ttft_excess else Reason.TTFT
    excess = max(deadline_excess, ttft_excess)
    retry_ms = excess if wait_ms > 0 else max(excess, snapshot.outstanding_ms / slots)
    return Decision(Outcome.REJECT, reason, own_ms, wait_ms, ttft_ms, completion_ms,
                    policy.budget_ms, finish_at, retry_after_ms=retry_ms)
