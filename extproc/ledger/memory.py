"""The in-process ledger: the default, exact for a single gateway replica.

Two layers. ``LedgerCore`` is the ledger itself, synchronous: none of its methods ever waits on
anything, so the simulator calls it directly, in virtual time, and runs the very code the
gateway runs. ``MemoryLedger`` is the async face ``Gate`` uses (the ``Ledger`` protocol): each
method forwards to the core and returns, without suspending.

Per pool the core keeps a dict of live entries plus running totals, so ``snapshot`` is O(1) and
``reserve``/``release`` are O(1). Lease ends sit in a min-heap with lazy deletion (a renewal
pushes a new end; stale heap items are skipped), so ``expire`` costs O(log n) per entry it
looks at and never scans the whole ledger. Stale items would otherwise pile up until their old
lease ends pass (rate x lease of them): once they outnumber the live entries twice over the
heap is rebuilt from the live ones, O(n) every O(n) operations, so memory stays O(live).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from extproc.decision.admission import Snapshot
from extproc.ledger import Cap, Entry, Reserved

_EMPTY = Snapshot(inflight=0, outstanding_ms=0.0)


@dataclass
class _Pool:
    # id -> (cost, lease end, kv, groups)
    entries: dict[str, tuple[float, float, int, tuple[str, ...]]] = field(default_factory=dict)
    outstanding_ms: float = 0.0
    kv_tokens: int = 0
    leases: list[tuple[float, str]] = field(default_factory=list)
    groups: dict[str, tuple[int, float]] = field(default_factory=dict)  # -> (count, work)
    # gateway -> (lease end, the highest priority level it holds) (``Ledger.wait``)
    waiting: dict[str, tuple[float, int]] = field(default_factory=dict)

    def count(self, groups: tuple[str, ...], cost: float, sign: int) -> None:
        """Add (``sign`` 1) or remove (-1) one entry of ``cost`` from its groups; a group's
        work is summed as the pool's total is, and an emptied group is dropped."""
        for g in groups:
            n, work = self.groups.get(g, (0, 0.0))
            n += sign
            if n <= 0:
                self.groups.pop(g, None)
            else:
                self.groups[g] = (n, max(0.0, work + cost) if sign > 0
                                  else max(0.0, work - cost))


def _compact(p: _Pool) -> None:
    """Rebuild the lease heap from the live entries once stale items dominate it."""
    if len(p.leases) > 2 * len(p.entries) + 64:
        p.leases = [(end, rid) for rid, (_, end, _, _) in p.entries.items()]
        heapq.heapify(p.leases)


def _capped(p: _Pool, cost: float, caps: Sequence[Cap]) -> bool:
    for cap in caps:
        n, work = p.groups.get(cap.group, (0, 0.0))
        if cap.max_inflight is not None and n + 1 > cap.max_inflight:
            return True
        if cap.max_ms is not None and work + cost > cap.max_ms:
            return True
    return False


class LedgerCore:
    """The ledger's state and rules; same contract as ``Ledger``, without ``async``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pools: dict[str, _Pool] = {}

    def _pool(self, name: str) -> _Pool:
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = _Pool()
        return pool

    def reserve(self, entry: Entry, ceiling_ms: float | None = None,
                max_inflight: int | None = None, caps: Sequence[Cap] = ()) -> Reserved:
        pool = self._pool(entry.pool)
        if entry.request_id in pool.entries:
            return Reserved.RECORDED
        if ceiling_ms is not None and pool.outstanding_ms + entry.charge_ms > ceiling_ms:
            return Reserved.FULL
        if max_inflight is not None and len(pool.entries) + 1 > max_inflight:
            return Reserved.FULL
        if _capped(pool, entry.charge_ms, caps):
            return Reserved.FULL
        now = self._clock()
        if ceiling_ms is not None and self._behind(pool, entry, now):
            return Reserved.YIELDED
        end = now + entry.lease_ms / 1000.0
        pool.entries[entry.request_id] = (entry.charge_ms, end, entry.kv_tokens, entry.groups)
        pool.outstanding_ms += entry.charge_ms
        pool.kv_tokens += entry.kv_tokens
        pool.count(entry.groups, entry.charge_ms, +1)
        heapq.heappush(pool.leases, (end, entry.request_id))
        return Reserved.RECORDED

    @staticmethod
    def _behind(pool: _Pool, entry: Entry, now: float) -> bool:
        """Another gateway, alive, holds a higher priority than ``entry``'s."""
        return any(gateway != entry.gateway and end > now and level > entry.priority
                   for gateway, (end, level) in pool.waiting.items())

    def wait(self, pool: str, gateway: str, level: int | None, lease_ms: float) -> None:
        p = self._pool(pool)
        if level is not None:
            p.waiting[gateway] = (self._clock() + lease_ms / 1000.0, level)
        else:
            p.waiting.pop(gateway, None)

    def release(self, request_id: str, pool: str) -> bool:
        p = self._pools.get(pool)
        if p is None or request_id not in p.entries:
            return False
        cost, _, kv, groups = p.entries.pop(request_id)
        # Floating-point sums drift: an empty pool owes exactly nothing.
        p.outstanding_ms = max(0.0, p.outstanding_ms - cost) if p.entries else 0.0
        p.kv_tokens -= kv
        p.count(groups, cost, -1)
        if not p.entries:
            p.leases.clear()
        _compact(p)
        return True

    def renew(self, request_id: str, pool: str, lease_ms: float) -> bool:
        p = self._pools.get(pool)
        if p is None or request_id not in p.entries:
            return False
        cost, _, kv, groups = p.entries[request_id]
        end = self._clock() + lease_ms / 1000.0
        p.entries[request_id] = (cost, end, kv, groups)
        heapq.heappush(p.leases, (end, request_id))
        _compact(p)
        return True

    def heartbeat(self, pool: str, request_ids: Sequence[str], lease_ms: float) -> list[str]:
        return [rid for rid in request_ids if not self.renew(rid, pool, lease_ms)]

    def adjust(self, request_id: str, pool: str, charge_ms: float,
               kv_tokens: int | None = None) -> bool:
        p = self._pools.get(pool)
        if p is None or request_id not in p.entries:
            return False
        old, end, kv, groups = p.entries[request_id]
        new_kv = kv if kv_tokens is None else kv_tokens
        p.entries[request_id] = (charge_ms, end, new_kv, groups)
        p.outstanding_ms = max(0.0, p.outstanding_ms - old + charge_ms)
        p.kv_tokens += new_kv - kv
        for g in groups:
            n, work = p.groups[g]
            p.groups[g] = (n, max(0.0, work - old + charge_ms))
        return True

    def expire(self) -> int:
        now = self._clock()
        dropped = 0
        for name, p in self._pools.items():
            for gateway in [g for g, (end, _) in p.waiting.items() if end <= now]:
                del p.waiting[gateway]
            while p.leases and p.leases[0][0] <= now:
                end, request_id = heapq.heappop(p.leases)
                live = p.entries.get(request_id)
                if live is not None and live[1] == end:
                    self.release(request_id, name)
                    dropped += 1
        return dropped

    def snapshot(self, pool: str) -> Snapshot:
        p = self._pools.get(pool)
        if p is None:
            return _EMPTY
        return Snapshot(inflight=len(p.entries), outstanding_ms=p.outstanding_ms,
                        kv_tokens=p.kv_tokens, groups=dict(p.groups))

    def close(self) -> None:
        self._pools.clear()


class MemoryLedger:
    """The ``Ledger`` protocol over a ``LedgerCore``; no method ever suspends."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.core = LedgerCore(clock)

    async def reserve(self, entry: Entry, ceiling_ms: float | None = None,
                      max_inflight: int | None = None, caps: Sequence[Cap] = ()) -> Reserved:
        return self.core.reserve(entry, ceiling_ms, max_inflight, caps)

    async def release(self, request_id: str, pool: str) -> bool:
        return self.core.release(request_id, pool)

    async def renew(self, request_id: str, pool: str, lease_ms: float) -> bool:
        return self.core.renew(request_id, pool, lease_ms)

    async def heartbeat(self, pool: str, request_ids: Sequence[str],
                        lease_ms: float) -> list[str]:
        return self.core.heartbeat(pool, request_ids, lease_ms)

    async def adjust(self, request_id: str, pool: str, charge_ms: float,
                     kv_tokens: int | None = None) -> bool:
        return self.core.adjust(request_id, pool, charge_ms, kv_tokens)

    async def expire(self) -> int:
        return self.core.expire()

    async def snapshot(self, pool: str) -> Snapshot:
        return self.core.snapshot(pool)

    async def wait(self, pool: str, gateway: str, level: int | None,
                   lease_ms: float) -> None:
        self.core.wait(pool, gateway, level, lease_ms)

    async def close(self) -> None:
        self.core.close()
