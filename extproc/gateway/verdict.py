"""What the gate answers and what it hands out: the result types, and who hears of them.

- ``Verdict``: one request's answer (``Gate.check``), what the server maps to Envoy's
  (``extproc.gateway.responses``), metrics count and the autoscaling loop reads;
- ``Ticket``: a request that will reach the backend holds one for its ledger entry, settled
  exactly once when its stream ends (``Gate.settle``), the shape of a reserve-then-release;
- ``invalid``, ``contended``, ``refused_held``: the verdicts the gate makes past the step (a
  4xx before any decision; an admission the ledger or a held higher band refused after it);
- ``Listener``: what hears of every verdict and every settled ticket (``extproc.scaling.control``);
  the gate takes its listeners at construction, none by default.

A leaf: it imports only the domain's outcomes at run time (the step, the record and the rest
only for annotations), so the gate, the leases, metrics, the autoscaling loop and the server can
all name these without importing each other or the policy core.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from extproc.decision.admission import Outcome, Reason

if TYPE_CHECKING:  # names for annotations only: importing the step would put the whole policy
    # core under every module that hands out a ticket (the leases, the server)
    from extproc.decision.admission import Decision
    from extproc.decision.running import Running
    from extproc.decision.step import Admission
    from extproc.errors import RequestError
    from extproc.gateway.tenant import Tenant
    from extproc.observability.decisionlog import Pending


@dataclass
class Ticket:
    """A reserved ledger entry; ``Gate.settle`` must be called exactly once for it."""

    request_id: str
    pool: str
    lease_ms: float
    running: Running  # its record (``extproc.decision.running``): what the pool's learning reads
    charge_ms: float = 0.0  # its ledger charge
    kv_tokens: int = 0  # the KV tokens its ledger entry holds
    recorded: bool = True  # False when admitted while the ledger was unavailable
    settled: bool = False  # set by ``Gate.settle``: the heartbeat stops renewing it
    # its exact count, when it was admitted on an estimate (``Gate._recount``)
    correction: asyncio.Task[None] | None = field(default=None, repr=False)
    log: Pending | None = field(default=None, repr=False)  # its decision log line

    @property
    def service_class(self) -> str:
        return self.running.service_class

    @property
    def groups(self) -> tuple[str, ...]:
        """The ledger groups its entry counts in (priority, tenant)."""
        return self.running.groups


@dataclass(frozen=True)
class Answer:
    """What a verdict made without a decision says: a 4xx before one, an unmanaged model, a
    request shed while the processor is behind."""

    outcome: Outcome
    reason: Reason
    service_class: str | None = None
    error: RequestError | None = None


@dataclass(frozen=True)
class Verdict:
    """One request's answer: the step's ``Admission`` when it decided (what was decided, on what,
    and its tokens), else an ``Answer``; its ``outcome`` and ``reason`` (the metric labels), class
    and error are read from it, never copied. A verdict that refuses after the step (a fail-closed
    ledger outage, ``contended``, ``refused_held``) refuses the admission itself
    (``Admission.refused``). The ``ticket`` is that of a request that will reach the backend.

    ``enforced`` is False in shadow mode: a rejected request continues all the same, so only
    ``blocks`` says whether the server answers in the backend's place."""

    answer: Admission | Answer
    pool: str | None = None
    ticket: Ticket | None = None
    enforced: bool = True  # False in shadow mode: the request continues whatever the outcome
    trace: Mapping[str, Any] | None = None  # span attributes known only here (when tracing)
    tenant: Tenant | None = None  # who is charged (extproc.gateway.tenant); None: attribution off
    held_ms: float = 0.0  # how long the gateway held it before this answer (extproc.decision.defer)

    @property
    def outcome(self) -> Outcome:
        return self.answer.outcome

    @property
    def reason(self) -> Reason:
        return self.answer.reason

    @property
    def service_class(self) -> str | None:
        return self.answer.service_class

    @property
    def error(self) -> RequestError | None:
        return self.answer.error

    @property
    def admission(self) -> Admission | None:
        """The step's answer, when it decided."""
        return None if isinstance(self.answer, Answer) else self.answer

    @property
    def decision(self) -> Decision | None:
        return self.admission.decision if self.admission is not None else None

    @property
    def prompt_tokens(self) -> int:
        return self.admission.cost.prompt_tokens if self.admission is not None else 0

    @property
    def max_output_tokens(self) -> int:
        """The most output it may write (``Cost.max_output_tokens``)."""
        return self.admission.cost.max_output_tokens if self.admission is not None else 0

    @property
    def blocks(self) -> bool:
        """True when the request must be answered by us instead of reaching the backend."""
        return self.enforced and self.outcome in (Outcome.REJECT, Outcome.INVALID, Outcome.ERROR)


def invalid(error: RequestError, pool: str | None, service_class: str) -> Verdict:
    """A request refused for what it is (unparseable, too large, not JSON): a 4xx."""
    reason = {413: Reason.BODY_TOO_LARGE, 415: Reason.UNSUPPORTED_MEDIA}.get(
        error.status, Reason.BAD_REQUEST)
    return Verdict(Answer(Outcome.INVALID, reason, service_class, error), pool)


def refused_held(verdict: Verdict, reason: Reason, retry_ms: float) -> Verdict:
    """A request that was, or would have been, held is refused after all
    (``extproc.decision.defer``): a 429 with ``reason`` and a Retry-After of ``retry_ms`` (the
    queue's predicted drain)."""
    assert verdict.admission is not None
    refused = verdict.admission.refused(reason, retry_after_ms=max(1.0, retry_ms))
    return dataclasses.replace(verdict, answer=refused, ticket=None)


def contended(verdict: Verdict, reason: Reason = Reason.DEADLINE) -> Verdict:
    """An admission that does not run after all (a 429, or held): every reserve was refused,
    other gateways keep filling the room we saw; or (``reason`` ``PRIORITY``) a higher
    priority is held, here or by another gateway (``extproc.decision.defer``, ``Ledger.wait``)."""
    assert verdict.admission is not None
    return dataclasses.replace(verdict, answer=verdict.admission.refused(reason))


class Listener(Protocol):
    """Hears of every decision (after metrics counted it) and of every settled ticket (after
    the pool's learning heard of it). Called on the event loop: it must not block."""

    def decided(self, verdict: Verdict) -> None: ...

    def settled(self, ticket: Ticket, completed: bool) -> None: ...
