"""The admission policies compared side by side, each answering with an ``admission.Decision``.

- ``none``: no admission control; the engines' FIFO queues take everything. It is the default
  policy in *shadow mode*: decisions are computed (so a replay can count what enforcing would
  have refused) but every request continues.
- ``naive``: naive capacity, "N free slots": admit while the gateway's in-flight count is below
  ``replicas x max_num_seqs`` (the engines' true slot count).
- ``limit-N``: a static concurrency limit of ``N`` per ready replica, what llm-d's flow-control
  guide asks operators to tune by hand; ``tuned`` in an evaluation is the best ``N`` for that
  very workload, found by a sweep in hindsight (``extproc.sim.evaluate``).
- ``saturation``: the Gateway API Inference Extension's saturation detector with its documented
  defaults: the pool is saturated when no ready replica has fresh metrics (at most 200 ms old)
  with at most 5 requests waiting and at most 80% of its KV cache in use; a saturated pool
  refuses. Metrics are scraped every 50 ms (GIE's refresh interval): the simulator refreshes
  its view at a decision when the last scrape is 50 ms old or more.
- ``article``: the formula of the source article, taken literally: every replica is serial,
  ``max_tokens`` is charged in full at the single-sequence decode rate, and
  ``outstanding_ms / replicas + own_ms <= deadline x safety`` admits (no infeasible case, no
  TTFT check).
- ``default``: the product: the admission step (``extproc.decision.step.admit``) the gateway runs,
  fed what the gateway knows (holding what fits after a wait if the scenario's configuration turns
  ``defer`` on; it is off by default).
- ``defer``: the same, holding what fits after a wait (``extproc.decision.defer``) whatever
  configured.
- ``oracle``: clairvoyant about lengths: the same step told each request's true output length as its
  promise instead of the learned quantile. Its goodput bounds what a better output-length predictor
  could buy the default; the default's gap to it is what not knowing lengths costs.

``none``, ``default``, ``defer`` and ``oracle`` run the production step; the others are
baselines that exist only here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from extproc.decision.admission import Capacity, Cost, Decision, Outcome, Policy, Reason, Snapshot


class AdmissionPolicy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def enforce(self) -> bool:
        """False: shadow mode, the request continues whatever the decision."""
        ...

    @property
    def uses_step(self) -> bool:
        """True: the simulator runs the product's admission step (``extproc.decision.step.admit``);
        False: it calls ``decide`` below (a baseline)."""
        ...

    @property
    def clairvoyant(self) -> bool:
        """True: the step is told each answer's true length (the oracle)."""
        ...

    @property
    def defers(self) -> bool | None:
        """The step holds what fits after a wait (``extproc.decision.defer``); None: as
        configured."""
        ...

    def decide(self, cost: Cost, true_output: int, snapshot: Snapshot, capacity: Capacity,
               policy: Policy, now: float, view: EngineView) -> Decision: ...


@dataclass(frozen=True)
class EngineView:
    """What the engines' metrics said at their last scrape, per ready replica."""

    waiting: tuple[int, ...] = ()
    kv_usage: tuple[float, ...] = ()
    running: tuple[int, ...] = ()
    age_s: float = 0.0


@dataclass(frozen=True)
class Product:
    """The product's admission step: ``default`` (enforcing), ``none`` (shadow mode: decided
    and counted, never enforced), ``oracle`` (told each answer's length)."""

    name: str = "default"
    enforce: bool = True
    clairvoyant: bool = False
    uses_step: bool = True
    defers: bool | None = None  # hold what fits after a wait (None: as configured, ``defer``)

    def decide(self, cost: Cost, true_output: int, snapshot: Snapshot, capacity: Capacity,
               policy: Policy, now: float, view: EngineView) -> Decision:
        raise TypeError("the product's policies run the admission step, not decide")


def Default() -> Product:
    return Product()


def NoAdmission() -> Product:
    return Product(name="none", enforce=False)


def Defer() -> Product:
    """The product holding what fits after a wait (``defer: enabled: true``, whatever the
    scenario configures: ``extproc.decision.defer``)."""
    return Product(name="defer", defers=True)


def Oracle() -> Product:
    """The product told each request's true output length as its promise (its ledger charge
    stays the pool's mean, like the default's): what the default would do with a perfect
    output-length predictor. The gap to it is what not knowing lengths costs."""
    return Product(name="oracle", clairvoyant=True)


def _admit(cost: Cost, capacity: Capacity, policy: Policy, now: float) -> Decision:
    own = capacity.charge_ms(cost)
    return Decision(Outcome.ADMIT, Reason.FITS, own, 0.0, 0.0, own, policy.budget_ms,
                    now + own / 1000.0)


def _refuse(admission: Decision, reason: Reason) -> Decision:
    return dataclasses.replace(admission, outcome=Outcome.REJECT, reason=reason,
                               retry_after_ms=None)


@dataclass(frozen=True)
class NaiveSlots:
    """Admit while in flight < ``per_replica`` x ready replicas (default: the engines' slot
    count, ``max_num_seqs``)."""

    per_replica: int | None = None
    name: str = "naive"
    enforce: bool = True
    uses_step: bool = False
    clairvoyant: bool = False
    defers: bool | None = False

    def decide(self, cost: Cost, true_output: int, snapshot: Snapshot, capacity: Capacity,
               policy: Policy, now: float, view: EngineView) -> Decision:
        admit = _admit(cost, capacity, policy, now)
        limit = capacity.replicas * (self.per_replica or capacity.engine.max_num_seqs)
        return admit if snapshot.inflight < limit else _refuse(admit, Reason.NO_CAPACITY)


def Limit(per_replica: int) -> NaiveSlots:
    return NaiveSlots(per_replica=per_replica, name=f"limit-{per_replica}")


@dataclass(frozen=True)
class Saturation:
    """GIE's saturation detector (module docstring): thresholds and staleness as documented."""

    queue_depth: int = 5
    kv_util: float = 0.8
    staleness_s: float = 0.2
    name: str = "saturation"
    enforce: bool = True
    uses_step: bool = False
    clairvoyant: bool = False
    defers: bool | None = False

    def decide(self, cost: Cost, true_output: int, snapshot: Snapshot, capacity: Capacity,
               policy: Policy, now: float, view: EngineView) -> Decision:
        admit = _admit(cost, capacity, policy, now)
        fresh = view.age_s <= self.staleness_s
        if fresh and any(w <= self.queue_depth and k <= self.kv_util
                         for w, k in zip(view.waiting, view.kv_usage, strict=True)):
            return admit
        return _refuse(admit, Reason.NO_CAPACITY)


@dataclass(frozen=True)
class ArticleFormula:
    name: str = "article"
    enforce: bool = True
    uses_step: bool = False
    clairvoyant: bool = False
    defers: bool | None = False

    def decide(self, cost: Cost, true_output: int, snapshot: Snapshot, capacity: Capacity,
               policy: Policy, now: float, view: EngineView) -> Decision:
        e = capacity.engine
        own = cost.prompt_tokens * e.ms_per_token + cost.max_output_tokens * e.itl_ms(1)
        wait = snapshot.outstanding_ms / max(capacity.replicas, 1)
        completion = wait + own
        budget = policy.budget_ms
        if completion <= budget:
            return Decision(Outcome.ADMIT, Reason.FITS, own, wait, wait, completion, budget,
                            now + completion / 1000.0)
        return Decision(Outcome.REJECT, Reason.DEADLINE, own, wait, wait, completion, budget,
                        now + completion / 1000.0, retry_after_ms=completion - budget)


POLICIES: dict[str, Callable[[], AdmissionPolicy]] = {
    "none": NoAdmission,
    "naive": NaiveSlots,
    "saturation": Saturation,
    "article": ArticleFormula,
    "default": Default,
    "defer": Defer,
    "oracle": Oracle,
}


def make(name: str) -> AdmissionPolicy:
    """A policy by name: one of ``POLICIES``, or ``limit-N``."""
    if name.startswith("limit-") and name[6:].isdigit() and int(name[6:]) > 0:
        return Limit(int(name[6:]))
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}"
                         " or limit-N") from None
    return factory()
