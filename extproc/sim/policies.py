"""The admission policies compared side by side, each answering with an ``admission.Decision``.

- ``none``: no admission control; the engines' FIFO queues take everything. It is the default
  policy in *shadow mode*: decisions are computed (so a replay can count what enforcing would
  have refused) but every request continues.
- ``naive``: naive capacity, "N free slots": admit while the gateway's in-flight count is below
  ``replicas x max_running``.
- ``article``: the formula of the source article, taken literally: every replica is serial,
  ``max_tokens`` is charged in full at the single-sequence decode rate, and
  ``outstanding_ms / replicas + own_ms <= deadline x safety`` admits (no infeasible case, no
  TTFT check).
- ``default``: the product: ``extproc.admission.decide`` itself, fed what the gateway knows.
- ``oracle``: clairvoyant about lengths: the same ``decide`` told each request's true output
  length as its long length (what it promises) instead of a prediction. Its goodput bounds
  what a better output-length predictor could buy the default; the default's gap to it is
  what not knowing lengths costs.

``none``, ``default`` and ``oracle`` run the production ``decide``; ``naive`` and ``article``
are baselines that exist only here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from extproc.admission import Capacity, Cost, Decision, Outcome, Policy, Reason, Snapshot, decide


class AdmissionPolicy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def enforce(self) -> bool:
        """False: shadow mode, the request continues whatever the decision."""
        ...

    def decide(self, cost: Cost, true_output: int, snapshot: Snapshot, capacity: Capacity,
               policy: Policy, now: float) -> Decision: ...


@dataclass(frozen=True)
class Default:
    name: str = "default"
    enforce: bool = True

    def decide(self, cost: Cost, true_output: int, snapshot: Snapshot, capacity: Capacity,
               policy: Policy, now: float) -> Decision:
        return decide(cost, snapshot, capacity, policy, now)


def NoAdmission() -> Default:
    return Default(name="none", enforce=False)


@dataclass(frozen=True)
class Oracle:
    """``decide`` told each request's true output length as its long length, the length its
    own completion is promised on: what the default would do with a perfect output-length
    predictor. Its ledger charge stays the pool's mean output, like the default's (the sum
    over the fleet is the same either way, and the fleet's prefill share is read from the
    mean), so the two differ only in what they promise. The gap to it is what predicting
    lengths costs."""

    name: str = "oracle"
    enforce: bool = True

    def decide(self, cost: Cost, true_output: int, snapshot: Snapshot, capacity: Capacity,
               policy: Policy, now: float) -> Decision:
        told = Cost(cost.prompt_tokens, cost.output_tokens,
                    expected_output_tokens=cost.expected_output_tokens,
                    long_output_tokens=true_output)
        return decide(told, snapshot, capacity, policy, now)


@dataclass(frozen=True)
class NaiveSlots:
    name: str = "naive"
    enforce: bool = True

    def decide(self, cost: Cost, true_output: int, snapshot: Snapshot, capacity: Capacity,
               policy: Policy, now: float) -> Decision:
        own = cost.prompt_tokens * capacity.prefill_ms_per_token \
            + cost.output_tokens * capacity.itl_ms(capacity.max_running)
        budget = policy.budget_ms
        if snapshot.inflight < capacity.slots:
            return Decision(Outcome.ADMIT, Reason.FITS, own, 0.0, 0.0, own, budget,
                            now + own / 1000.0)
        return Decision(Outcome.REJECT, Reason.NO_CAPACITY, own, 0.0, 0.0, own, budget,
                        now + own / 1000.0, retry_after_ms=None)


@dataclass(frozen=True)
class ArticleFormula:
    name: str = "article"
    enforce: bool = True

    def decide(self, cost: Cost, true_output: int, snapshot: Snapshot, capacity: Capacity,
               policy: Policy, now: float) -> Decision:
        own = cost.prompt_tokens * capacity.prefill_ms_per_token \
            + cost.output_tokens * capacity.itl_ms_at_1
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
    "article": ArticleFormula,
    "default": Default,
    "oracle": Oracle,
}


def make(name: str) -> AdmissionPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    return factory()
