"""This gateway's entries in the ledger: kept alive while their requests run, released when
they end, given back to the ledger after it was away. Every ledger call goes through ``call``.

Leases follow the gateway's liveness, not the request's length. An entry's lease is short
(``ledger.liveness_ms``, 3 s) and the heartbeat (``heartbeat``, every third of it, one ledger
call per pool whatever the load) renews every entry whose request still runs here; a request
that overruns its prediction keeps its entry for as long as it runs. A replica that dies stops
beating, so its entries lapse within ``liveness_ms`` and the sweepers of the survivors remove
them: a crash costs the fleet its requests' capacity for seconds, where a lease of expected
finish + ``lease_grace_ms`` held it for half a minute. The price: a replica whose event loop
stalls longer than ``liveness_ms`` loses its entries until its next beat records them again.

The recent snapshot (``recent``): a ledger whose answers carry the pool's snapshot (Redis)
keeps the newest; a decision reuses it while it is at most ``FRESH_MS`` old instead of calling
``snapshot`` first (``extproc.gateway.gate`` says when that decision stands).

The local view (``local``): per pool, the ledger's newest snapshot plus this process's own
admissions and minus its own completions since its call was sent (``extproc.gateway.localview``);
the gate decides on it while the ledger is away (its fault policy, ``extproc.gateway.gate``).

Renewals and releases never fail a request: a heartbeat that finds an entry gone (its lease
lapsed during an outage, a failover lost it, it was never recorded) records it again, because
the request is demonstrably still running; a release the ledger did not take is retried
(release is idempotent by id), and the lease ends it anyway.

Recovery is reconciled before it is used (``reconcile``): the first decision that finds the
ledger answering again first applies the releases it missed and records the requests admitted
without it, then reads the snapshot it decides on. Deciding first would count the outage's
admissions nowhere and its completions still, and let a burst through on a ledger that shows
less than is running; reconciled, in-flight exceeds the slots by at most what the outage
admitted. An outage is logged once when it starts and once when it ends, never with request
content.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from extproc.errors import LedgerUnavailable
from extproc.gateway.localview import Totals, View
from extproc.ledger import Entry, Ledger, Recent

if TYPE_CHECKING:
    from extproc.config import LedgerConfig, OnUnavailable
    from extproc.decision.admission import Snapshot
    from extproc.gateway.verdict import Ticket
    from extproc.observability.metrics import Metrics

# The ledger's events log under the gate's logger (``extproc.gateway.gate``): one logger for a
# decision's path, which dashboards filter on.
log = logging.getLogger("extproc.gateway.gate")

HEARTBEATS_PER_LEASE = 3  # a lease survives two lost heartbeats
RECORD_BATCH = 32  # entries recorded again concurrently after the ledger lost them
MAX_DEFERRED_RELEASES = 100_000  # beyond this, a lost release is left to its lease
RELEASE_CHUNK = 1_000  # deferred releases sent at once by ``reconcile`` (the ledger batches them)
# The oldest snapshot a decision reuses from an earlier answer (``recent``), counted from when
# its call was sent; older, it calls ``snapshot``. 0 turns the reuse off. Why 20 ms and not 5:
# on a busy event loop an answer waits milliseconds before it is read (a snapshot call's answer
# as much), and 5 ms left 19-75 % of decisions calling ``snapshot`` where 20 ms left 0.1-10 %
# (benchmarks/ledger_calls.py --fresh-ms 5: 32 closed-loop clients, and 200/s Poisson; seven
# runs on a shared 2-core machine). A module constant, not a setting.
FRESH_MS = 20.0
T = TypeVar("T")


class Leases:
    """The tickets running here, the local view, and what the ledger still owes or is owed."""

    def __init__(self, ledger: Ledger, settings: LedgerConfig, metrics: Metrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ledger = ledger
        self.settings = settings
        self.metrics = metrics
        self._clock = clock
        self._views: dict[str, View] = {}
        self._recent = ledger.recent if isinstance(ledger, Recent) else None
        self._newest = ledger.newest if isinstance(ledger, Recent) else None
        self._deferred: dict[str, str] = {}  # request id -> pool: releases to retry
        self._live: dict[str, Ticket] = {}  # request id -> ticket: what the heartbeat renews
        self._unrecorded: set[str] = set()  # live tickets admitted while the ledger was away
        self._reconciling = asyncio.Lock()
        self._unreachable = False  # the last ledger call failed
        self._stale = False  # the ledger came back and our entries are not renewed yet
        self._back_at = -math.inf  # the gate's clock when the ledger last came back
        self._down_since: float | None = None  # the ledger has been unavailable since
        self._down_decisions = 0

    async def call(self, op: str, call: Awaitable[T]) -> T:
        """One ledger call, timed; a failure is counted and re-raised. The first success
        after a failure marks the ledger as back (``reconcile``, ``expire``)."""
        started = time.perf_counter()
        try:
            result = await call
        except LedgerUnavailable:
            self.metrics.ledger_errors.labels(op).inc()
            self._unreachable = True
            raise
        else:
            if self._unreachable:
                self._unreachable = False
                self._stale = True
                self._back_at = self._clock()
            return result
        finally:
            self.metrics.ledger_seconds.labels(op).observe(time.perf_counter() - started)

    def recent(self, pool: str) -> tuple[Snapshot, float] | None:
        """The pool's newest snapshot the ledger sent back with an answer, and its age in
        seconds, if it is at most ``FRESH_MS`` old (None otherwise, and for a ledger that keeps
        none)."""
        if self._recent is None or FRESH_MS <= 0:
            return None
        found = self._recent(pool)
        if found is None or found[1] > FRESH_MS / 1000.0:
            return None
        return found

    def local(self, pool: str) -> Snapshot:
        """The pool's local view (module docstring), on the newest snapshot the ledger sent
        with any answer (an admission's own reserve, a release)."""
        view = self._view(pool)
        if self._newest is not None and (found := self._newest(pool)) is not None:
            snapshot, age = found
            view.saw(snapshot, time.monotonic() - age)
        return view.snapshot()

    def _view(self, pool: str) -> View:
        view = self._views.get(pool)
        if view is None:
            view = self._views[pool] = View()
        return view

    def saw(self, pool: str, snapshot: Snapshot, sent: float) -> None:
        """The ledger answered with the pool's snapshot, its call sent at ``sent``
        (time.monotonic): the local view starts from it (``extproc.gateway.localview``)."""
        self._view(pool).saw(snapshot, sent)
        if self._down_since is not None:
            log.warning("ledger available again after %.1f s; %d decisions were made without"
                        " it", time.monotonic() - self._down_since, self._down_decisions)
            self._down_since = None
            self._down_decisions = 0

    def away(self, exc: Exception, on_unavailable: OnUnavailable) -> None:
        """A decision found the ledger unavailable (``exc``; a timeout when the decision's
        deadline cut a call short): logged once per outage, with how it decides meanwhile."""
        self._unreachable = True
        self._down_decisions += 1
        if self._down_since is None:
            self._down_since = time.monotonic()
            why = str(exc) or (f"no answer within decision_deadline_ms"
                               f" ({self.settings.decision_deadline_ms:g} ms)")
            log.warning("ledger unavailable: deciding %s until it answers again (%s)",
                        on_unavailable.value, why)

    def hold(self, ticket: Ticket, reserved_at: float | None = None) -> None:
        """A ticket that runs here from now on: renewed by the heartbeat, in the local view.
        ``reserved_at``: when its reserve was sent (time.monotonic), for a recorded one."""
        self._live[ticket.request_id] = ticket
        view = self._view(ticket.pool)
        charge = (1, ticket.charge_ms, ticket.kv_tokens)
        if ticket.recorded:
            at = time.monotonic() if reserved_at is None else reserved_at
            view.change(charge, ticket.groups, at)
        else:
            self._unrecorded.add(ticket.request_id)
            view.unrecorded.add(charge, ticket.groups)
        self.metrics.inflight(ticket.pool, +1)

    async def recharge(self, ticket: Ticket, charge_ms: float, kv_tokens: int) -> None:
        """Charge a running ticket's entry ``charge_ms`` and ``kv_tokens`` instead. One ledger
        call: if the ledger does not answer, the old charge stays on the entry (the heartbeat
        re-records a lost entry at the new one)."""
        self._charge(ticket, (0, charge_ms - ticket.charge_ms, kv_tokens - ticket.kv_tokens))
        ticket.charge_ms, ticket.kv_tokens = charge_ms, kv_tokens
        with contextlib.suppress(LedgerUnavailable):
            await self.call("adjust", self.ledger.adjust(ticket.request_id, ticket.pool,
                                                         charge_ms, kv_tokens))

    def drop(self, ticket: Ticket) -> None:
        """The ticket's request ended: the heartbeat stops renewing it, and it leaves the local
        view now (in the same step as the gate marks it settled, so a record of it finishing
        meanwhile knows it is gone: ``_recorded``). ``release`` then tells the ledger."""
        self._live.pop(ticket.request_id, None)
        self._unrecorded.discard(ticket.request_id)
        self.metrics.inflight(ticket.pool, -1)
        self._charge(ticket, (-1, -ticket.charge_ms, -ticket.kv_tokens))

    async def release(self, ticket: Ticket) -> None:
        """Release the ticket's entry; deferred to the next reconcile if the ledger does not
        take it."""
        try:
            await self.call("release", self.ledger.release(ticket.request_id, ticket.pool))
        except LedgerUnavailable:
            self.defer_release(ticket.request_id, ticket.pool)

    def _charge(self, ticket: Ticket, delta: Totals) -> None:
        """A running ticket's change in the local view, from now."""
        view = self._view(ticket.pool)
        if ticket.recorded:
            view.change(delta, ticket.groups, time.monotonic())
        else:
            view.unrecorded.add(delta, ticket.groups)

    def defer_release(self, request_id: str, pool: str) -> None:
        """Release the entry at the next reconcile (one that may have been recorded)."""
        if len(self._deferred) < MAX_DEFERRED_RELEASES:
            self._deferred[request_id] = pool

    async def heartbeat(self) -> None:
        """Renew the entries of every request running here, one ledger call per pool, and
        record again those the ledger lost (module docstring). Raises ``LedgerUnavailable``;
        the next beat retries."""
        pools: dict[str, list[str]] = {}
        for rid, ticket in self._live.items():
            pools.setdefault(ticket.pool, []).append(rid)
        lease_ms = self.settings.liveness_ms
        for pool, ids in pools.items():
            sent = time.monotonic()
            missing = set(await self.call("heartbeat",
                                          self.ledger.heartbeat(pool, ids, lease_ms)))
            lost = []
            for rid in ids:
                live = self._live.get(rid)
                if live is None:
                    continue
                if rid not in missing:
                    self._recorded(live, sent)
                else:
                    lost.append(live)
            await self._record_all(lost)

    async def _record_all(self, tickets: Sequence[Ticket]) -> None:
        """Record many at once, ``RECORD_BATCH`` calls in flight (after a Redis restart every
        running request is lost: one at a time would keep the first decisions waiting)."""
        for i in range(0, len(tickets), RECORD_BATCH):
            await asyncio.gather(*(self._record(t) for t in tickets[i:i + RECORD_BATCH]))

    async def _record(self, ticket: Ticket) -> None:
        """Record a running request's entry again (no ceiling: it runs whatever the ledger
        holds). A release that raced with it is applied again afterwards."""
        sent = time.monotonic()
        await self.call("reserve", self.ledger.reserve(Entry(
            ticket.request_id, ticket.pool, ticket.charge_ms, self.settings.liveness_ms,
            ticket.kv_tokens, ticket.groups)))
        self._recorded(ticket, sent)
        if ticket.settled:  # it ended while we recorded it: its release may have come first
            await self.call("release", self.ledger.release(ticket.request_id, ticket.pool))

    def _recorded(self, ticket: Ticket, sent: float) -> None:
        """The ledger holds the ticket's entry, from a call sent at ``sent``: in the local
        view, a fail-open admission moves from ``unrecorded`` to a change at ``sent``."""
        if not ticket.recorded and not ticket.settled:  # settled: its release took it out
            charge = (1, ticket.charge_ms, ticket.kv_tokens)
            view = self._view(ticket.pool)
            view.unrecorded.add(charge, ticket.groups, -1)
            view.change(charge, ticket.groups, sent)
        ticket.recorded = True
        self._unrecorded.discard(ticket.request_id)

    def owed(self) -> bool:
        """Releases the ledger missed, requests admitted without it, or (the ledger was
        away) entries whose leases may have lapsed meanwhile are waiting. O(1): every
        decision asks."""
        return self._stale or bool(self._deferred) or bool(self._unrecorded)

    async def reconcile(self) -> None:
        """Give the ledger what it missed while away: the releases first (they free room),
        then the requests admitted meanwhile. One caller at a time; the others wait for it
        and find nothing left to do. Raises ``LedgerUnavailable``; what was done stays done."""
        async with self._reconciling:
            deferred = list(self._deferred.items())
            for i in range(0, len(deferred), RELEASE_CHUNK):  # together: the ledger batches them
                chunk = deferred[i:i + RELEASE_CHUNK]
                answers = await asyncio.gather(
                    *(self.call("release", self.ledger.release(rid, pool)) for rid, pool in chunk),
                    return_exceptions=True)
                for (request_id, _), answer in zip(chunk, answers, strict=True):
                    if not isinstance(answer, BaseException):
                        self._deferred.pop(request_id, None)
                failed = next((a for a in answers if isinstance(a, BaseException)), None)
                if failed is not None:
                    raise failed
            if self._stale:  # an outage longer than a lease: every entry may have lapsed
                self._stale = False
                try:
                    await self.heartbeat()  # renews ours, records the lapsed and the unrecorded
                except BaseException:
                    self._stale = True
                    raise
            await self._record_all([self._live[rid] for rid in list(self._unrecorded)
                                    if rid in self._live])

    async def probe(self, check: Awaitable[object]) -> None:
        """The ledger's health probe: ``check`` answered and nothing is owed to the ledger
        (``reconcile``, run here when something is). ``extproc.ledger`` is SERVING only after
        both, so a gateway that reports SERVING has its entries in the ledger again (its
        running requests renewed or recorded, its missed releases applied). Raises
        ``LedgerUnavailable``."""
        await self.call("check", check)
        if self.owed():
            await self.reconcile()

    async def expire(self) -> int:
        """Retry releases the ledger did not take, then expire entries whose lease ended (the
        backstop for lost streams). Raises ``LedgerUnavailable``; the next sweep retries."""
        if self.owed():
            await self.reconcile()
        if self._clock() - self._back_at < self.settings.liveness_ms / 1000.0:
            # The ledger was away until moments ago: every gateway's leases ran on while none
            # could renew them. Expiring now would reclaim requests still running behind
            # gateways that have not beaten yet; one lease from now all living ones have.
            return 0
        return await self.call("expire", self.ledger.expire())
