"""Defer, the third verb: the requests a pool holds until they fit, and the order they go in.

A request the step refuses (``extproc.decision.step.admit``) is *held* instead of refused when
waiting can make it fit and it would still finish in time after the wait:

- the refusal is one waiting can undo (``DEFERRABLE``: the pool is busy, its KV cache is full,
  the room is kept for others; not a hard tenant cap, a missing ledger or an infeasible ask);
- its hold ends (``until``) when even alone on an idle replica it could no longer finish
  within its deadline (or start within its time-to-first-token objective): its deadline
  counts from its arrival, so every moment held is taken from it;
- the wait predicted now fits before that end: the time the model says room comes back
  (``Decision.retry_after_ms``) plus the work held ahead of it, drained at the fleet's rate
  (``ahead_ms / replicas``, the ledger's unit: GPU milliseconds a replica works off each
  millisecond);
- the pool holds fewer than ``max_waiting`` requests, and its tenant fewer than
  ``max_waiting_per_tenant``; else it takes the place of the worst-ranked held request of a
  lower band (its tenant's, when its tenant's bound is the one reached), which gets the 429
  ``queue_full``; with none lower, it gets it (a flood of sheddable requests held to the bound
  must not turn critical ones away: it did, 15,686 of 35,749 critical attempts on 8b-vllm).

What cannot fit even after the predicted wait is refused at once, as before, with Retry-After
from the same prediction.

**One order.** Held requests go strictly by priority (a higher band first, whatever waits
below), then between tenants by fair share of GPU time in the unit the ledger charges, then by
earliest deadline within a tenant. The fair share is start-time fair queueing: each tenant's
next request carries the tag ``max(V, F_tenant)``, the tenant with the least tag goes first,
its finish ``F_tenant`` moves on by ``charge / weight`` and ``V`` is the tag of the request
last sent. A tenant that held nothing for a while gets no credit for it (``V`` has moved on).

**Strict between bands.** Nothing of a lower band is sent while a higher band holds anything
(``blocks``), neither a held request nor a new arrival the step admits (it is held in turn): the
room a release frees goes to the highest band held, and a higher request that needs more room
than one release gives gets it as the pool drains, within its hold. (When a lower request that
fit could go past a higher one that did not, the lower bands kept refilling the room it waited
for: on the 1024-sequence fleet at 1.5x, 30 % of critical attempts were served in time, 72 %
with this rule; ``docs/defer.md``.) So the bands are not work-conserving between each other,
as in the Gateway API Inference Extension's flow control and Dynamo's tiers; no replica idles
for it, since a replica with nothing to do admits any feasible request (``extproc.decision.level``).

**Dispatch.** Whatever frees capacity (a release, an expiry, a new replica) and every arrival
that finds a queue runs a *pass*: the highest band's held requests are decided again in that
order, each on the pool as it is now, with what it has waited taken from its deadline. The
first that fits goes; one that does not fit is passed over for the next (a smaller one may fit
where it does not); a pass decides the first ``PASSED_OVER`` of them (each costs a decision),
so what it sends is among the best-ranked. A new arrival is decided after the pass: it goes if
it fits then and no higher band is held (what was held before it had its turn), else it is
held or refused.

This module is the queue's state and order, pure (no clock reads, no I/O); the gate
(``extproc.gateway.gate``) and the simulator (``extproc.sim.run``) hold one per pool and run the
passes, each with its own way to wait.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from extproc.decision.admission import Policy, Reason

if TYPE_CHECKING:
    from extproc.decision.step import Admission

# The refusals waiting can undo: the pool is busy now, or its room is kept for others.
DEFERRABLE = frozenset({Reason.DEADLINE, Reason.TTFT, Reason.KV_CACHE, Reason.NO_CAPACITY,
                        Reason.PRIORITY, Reason.FAIR_SHARE})
PASSED_OVER = 4  # held requests a pass decides again, the best-ranked first


@dataclass(eq=False, slots=True)
class Waiter:
    """One held request. Times in seconds on the caller's clock."""

    key: str
    priority: int
    tenant: str | None
    weight: float  # its tenant's weight in the fair share (1 without tenants)
    charge_ms: float  # its ledger charge: the fair share's unit, and the queue's drain
    arrived: float  # when it reached the gateway: its deadline counts from here
    due: float  # its deadline (arrived + the class's or the client's deadline)
    until: float  # the hold's end: past it, it could not finish in time even alone
    payload: Any = None  # the caller's (the gate's future, the simulator's attempt)
    seq: int = 0


@dataclass
class Queue:
    """The requests one pool holds (module docstring)."""

    max_waiting: int = 256
    max_waiting_per_tenant: int = 64
    # hears of each held request a higher band took the place of, with its 429 (``enter``)
    displaced: Callable[[Waiter, Refused], None] | None = None
    _bands: dict[int, dict[str | None, list[tuple[float, int, Waiter]]]] = field(
        default_factory=dict)
    _finish: dict[str | None, float] = field(default_factory=dict)  # F per tenant
    _virtual: float = 0.0  # V: the tag of the request last sent
    _count: int = 0
    _per_tenant: dict[str | None, int] = field(default_factory=dict)
    _held_ms: float = 0.0  # the charges held, in all
    _seq: Iterator[int] = field(default_factory=itertools.count)

    def __len__(self) -> int:
        return self._count

    @property
    def held_ms(self) -> float:
        return self._held_ms

    def full(self, tenant: str | None) -> bool:
        """No room for one more of ``tenant``'s (``queue_full``); without tenants (None) only
        the pool's bound counts."""
        return self._count >= self.max_waiting or self._tenant_full(tenant)

    def _tenant_full(self, tenant: str | None) -> bool:
        return (tenant is not None
                and self._per_tenant.get(tenant, 0) >= self.max_waiting_per_tenant)

    def ahead_ms(self, priority: int, due: float) -> float:
        """The work held that would go before a request of ``priority`` due at ``due``: every
        higher band's, and its own band's due no later (its tenants' shares interleave, so
        this counts them all: the prediction errs long)."""
        total = 0.0
        for level, tenants in self._bands.items():
            for queued in tenants.values():
                if level > priority:
                    total += sum(w.charge_ms for _, _, w in queued)
                elif level == priority:
                    total += sum(w.charge_ms for d, _, w in queued if d <= due)
        return total

    def push(self, waiter: Waiter) -> None:
        waiter.seq = next(self._seq)
        tenants = self._bands.setdefault(waiter.priority, {})
        bisect.insort(tenants.setdefault(waiter.tenant, []), (waiter.due, waiter.seq, waiter))
        self._count += 1
        self._per_tenant[waiter.tenant] = self._per_tenant.get(waiter.tenant, 0) + 1
        self._held_ms += waiter.charge_ms

    def remove(self, waiter: Waiter) -> bool:
        """Take ``waiter`` out (sent, refused or gone); False if it was not held."""
        tenants = self._bands.get(waiter.priority)
        queued = tenants.get(waiter.tenant) if tenants is not None else None
        if tenants is None or not queued:
            return False
        i = bisect.bisect_left(queued, (waiter.due, waiter.seq))
        if i >= len(queued) or queued[i][2] is not waiter:
            return False
        del queued[i]
        if not queued:
            del tenants[waiter.tenant]
            if not tenants:
                del self._bands[waiter.priority]
        self._count -= 1
        left = self._per_tenant[waiter.tenant] - 1
        if left:
            self._per_tenant[waiter.tenant] = left
        else:
            del self._per_tenant[waiter.tenant]
        self._held_ms = max(0.0, self._held_ms - waiter.charge_ms) if self._count else 0.0
        return True

    def sent(self, waiter: Waiter) -> None:
        """``waiter`` goes to the engines: out of the queue, and its tenant's share moves on."""
        if self.remove(waiter):
            tag = max(self._virtual, self._finish.get(waiter.tenant, 0.0))
            self._finish[waiter.tenant] = tag + waiter.charge_ms / max(waiter.weight, 1e-9)
            self._virtual = tag
            if not self._count:  # idle: nobody's past counts any more
                self._finish.clear()

    def order(self) -> Iterator[Waiter]:
        """The held requests in dispatch order (module docstring), generated lazily; the
        queue must not change while it is read."""
        for level in sorted(self._bands, reverse=True):
            tenants = self._bands[level]
            heap = [(max(self._virtual, self._finish.get(t, 0.0)), i, t, 0)
                    for i, t in enumerate(tenants)]
            heapq.heapify(heap)
            while heap:
                tag, i, tenant, at = heapq.heappop(heap)
                queued = tenants[tenant]
                waiter = queued[at][2]
                yield waiter
                if at + 1 < len(queued):
                    heapq.heappush(heap, (tag + waiter.charge_ms / max(waiter.weight, 1e-9),
                                          i, tenant, at + 1))

    def pass_order(self) -> list[Waiter]:
        """The held requests one pass decides again, in order: the first ``PASSED_OVER`` of
        the highest band (module docstring). A list: the pass changes the queue as it goes."""
        top = self.highest()
        band = itertools.takewhile(lambda w: w.priority == top, self.order())
        return list(itertools.islice(band, PASSED_OVER))

    def highest(self) -> int | None:
        """The highest priority band held (None: nothing held)."""
        return max(self._bands, default=None)

    def blocks(self, priority: int) -> bool:
        """A higher band than ``priority`` is held: nothing of it is sent (module docstring)."""
        top = self.highest()
        return top is not None and top > priority

    def displaceable(self, priority: int, tenant: str | None) -> Waiter | None:
        """When ``full(tenant)``: the held request a new one of ``priority`` takes the place
        of (module docstring), the last in order of the lowest band below ``priority`` (of
        ``tenant``'s when its own bound is reached); None: there is none."""
        mine = self._tenant_full(tenant)
        for level in sorted(self._bands):
            if level >= priority:
                return None
            tenants = self._bands[level]
            queued = [q[-1][2] for t, q in tenants.items() if not mine or t == tenant]
            if queued:
                return max(queued, key=lambda w: (w.due, w.seq))
        return None

    def oldest(self) -> float | None:
        """When the longest-held request arrived (None: none held)."""
        return min((w.arrived for tenants in self._bands.values() for queued in
                    tenants.values() for _, _, w in queued), default=None)

    def depth(self, levels: Iterable[int] = ()) -> dict[int, int]:
        """Held requests per priority level: those holding any, and ``levels`` (0 if none)."""
        depth = dict.fromkeys(levels, 0)
        for level, tenants in self._bands.items():
            depth[level] = sum(len(q) for q in tenants.values())
        return depth


def predicted_wait_ms(retry_after_ms: float | None, ahead_ms: float, replicas: int) -> float:
    """When a refused request would fit (module docstring): the model's time until room comes
    back, plus the work held ahead of it at the fleet's rate."""
    return (retry_after_ms or 0.0) + ahead_ms / max(replicas, 1)


def hold_s(policy: Policy, alone_ms: float, first_alone_ms: float) -> float:
    """How long after its arrival a request may be held: until even alone on an idle replica
    it could no longer finish within its budget, or start within its first-token one."""
    left = policy.budget_ms - alone_ms
    ttft = policy.ttft_budget_ms
    if ttft is not None:
        left = min(left, ttft - first_alone_ms)
    return max(0.0, left) / 1000.0


@dataclass(frozen=True, slots=True)
class Refused:
    """A request that is not held after all: its 429's reason (None: the step's stands) and
    Retry-After (ms, the queue's predicted drain)."""

    reason: Reason | None
    retry_ms: float


def enter(queue: Queue, adm: Admission, tenant: str | None, weight: float, *, arrived: float,
          now: float, replicas: int, payload: Any) -> Waiter | Refused:
    """Hold a request the step refused (``adm``, its reason ``DEFERRABLE``) if it would still
    finish in time after the predicted wait and the queue has room, or a lower band's place
    (module docstring): the waiter pushed, or why not. A held request whose place it took
    is out of the queue and handed to the queue's ``displaced`` with its 429. The gate and the
    simulator both call it."""
    assert adm.decision is not None
    full = Refused(Reason.QUEUE_FULL,
                   predicted_wait_ms(adm.retry_after_ms, queue.held_ms, replicas))
    victim = None
    if queue.full(tenant):
        victim = queue.displaceable(adm.priority, tenant)
        if victim is None:
            return full
    until = arrived + hold_s(adm.policy, adm.alone_ms, adm.first_alone_ms)
    due = arrived + adm.policy.deadline_ms / 1000.0
    wait_ms = predicted_wait_ms(None, queue.ahead_ms(adm.priority, due), replicas)
    if now + wait_ms / 1000.0 >= until:
        return Refused(None, max(wait_ms, adm.retry_after_ms or 0.0))
    if victim is not None:
        queue.remove(victim)
        if queue.displaced is not None:
            queue.displaced(victim, full)
    waiter = Waiter(str(next(queue._seq)), adm.priority, tenant, weight,
                    adm.decision.charge_ms, arrived, due, until, payload)
    queue.push(waiter)
    return waiter
