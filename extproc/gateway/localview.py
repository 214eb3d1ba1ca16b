"""One pool's local view of the ledger, kept by ``extproc.gateway.leases``: the ledger's newest
snapshot plus this process's own changes that snapshot cannot hold (``View``). Pure: no clock of its
own, no I/O; the times it is given are ``time.monotonic`` readings of when calls were sent.
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from dataclasses import dataclass, field

from extproc.decision.admission import Snapshot

Totals = tuple[int, float, int]  # in flight, outstanding ms, KV tokens
ZERO: Totals = (0, 0.0, 0)
Change = tuple[float, Totals, tuple[str, ...]]  # when, what, the groups it counts in


def _when(change: Change) -> float:
    return change[0]


@dataclass
class Sum:
    """Own changes added up: in all, and per group (a priority or a tenant: in flight,
    outstanding ms), as the ledger's snapshot counts them."""

    totals: Totals = ZERO
    groups: dict[str, tuple[int, float]] = field(default_factory=dict)

    def add(self, delta: Totals, groups: tuple[str, ...], sign: int = 1) -> None:
        held, work, kv = self.totals
        self.totals = (held + sign * delta[0], work + sign * delta[1], kv + sign * delta[2])
        for group in groups:
            n, group_work = self.groups.get(group, (0, 0.0))
            n, group_work = n + sign * delta[0], group_work + sign * delta[1]
            if n == 0 and abs(group_work) < 1e-6:
                self.groups.pop(group, None)
            else:
                self.groups[group] = (n, group_work)


@dataclass
class View:
    """One pool's local view: the ledger's newest snapshot (newest by when its call was sent:
    answers come back out of order), plus this process's own changes that snapshot cannot
    hold, in all and per group (so a tenant's caps and shares hold in an outage too). The
    decision's input while the ledger is away.

    A change counts from when it reached the ledger's queue: an admission from when its
    reserve was sent, a completion or a recharge from when it happens (before its call is
    sent). A snapshot whose call was sent later holds it; one sent earlier does not, and the
    change is added. Admissions the ledger has not recorded (``unrecorded``: fail-open, in the
    outage) are in no snapshot until they are recorded. (Resetting to each snapshot instead
    lost the admissions of decisions running concurrently: ``tests/test_recovery.py``.)"""

    base: Snapshot = field(default_factory=lambda: Snapshot(inflight=0, outstanding_ms=0.0))
    sent: float = -math.inf  # when ``base``'s call was sent (time.monotonic)
    changes: list[Change] = field(default_factory=list)  # after ``sent``, sorted by time
    # ``changes`` summed, kept as they come: in an outage ``changes`` grows with every
    # completion, and each fail-open decision would sum it again
    since: Sum = field(default_factory=Sum)
    unrecorded: Sum = field(default_factory=Sum)

    def change(self, delta: Totals, groups: tuple[str, ...], at: float) -> None:
        if at <= self.sent:  # the base holds it already
            return
        insort(self.changes, (at, delta, groups), key=_when)
        self.since.add(delta, groups)

    def saw(self, snapshot: Snapshot, sent: float) -> None:
        if sent < self.sent:  # an older call's answer, come back late
            return
        self.base, self.sent = snapshot, sent
        held = bisect_right(self.changes, sent, key=_when)
        for _, delta, groups in self.changes[:held]:
            self.since.add(delta, groups, -1)
        del self.changes[:held]

    def snapshot(self) -> Snapshot:
        base = self.base
        (held, work, kv), (held2, work2, kv2) = self.since.totals, self.unrecorded.totals
        groups = dict(base.groups)
        for own in (self.since, self.unrecorded):
            for group, (n, group_work) in own.groups.items():
                n0, work0 = groups.get(group, (0, 0.0))
                groups[group] = (n0 + n, work0 + group_work)
        return Snapshot(inflight=max(0, base.inflight + held + held2),
                        outstanding_ms=max(0.0, base.outstanding_ms + work + work2),
                        kv_tokens=max(0, base.kv_tokens + kv + kv2),
                        prefill_tokens=base.prefill_tokens,
                        groups={group: (n, max(0.0, group_work))
                                for group, (n, group_work) in groups.items() if n > 0})
