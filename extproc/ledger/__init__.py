"""The in-flight ledger: what admitted requests still owe the GPUs, per pool.

Contract (every implementation passes the same tests, ``tests/test_ledger_contract.py``):

- ``reserve(entry, ceiling_ms, max_inflight, caps)`` records an admitted request, atomically
  refusing it when the pool's outstanding work plus ``entry.charge_ms`` would exceed
  ``ceiling_ms``, or its in-flight count with this entry would exceed ``max_inflight``
  (``None``: no check), or a group's count or work would pass its ``Cap``. The request id is
  the key: reserving an id already present changes nothing and returns True, so a retried
  reserve never counts twice.
- ``release(request_id, pool)`` removes it exactly once: True the first time, False for a
  double, late or unknown release, which never touch another entry.
- ``renew(request_id, pool, lease_ms)`` extends the lease of a live entry.
- ``heartbeat(pool, request_ids, lease_ms)`` renews many live entries at once (a replica's
  heartbeat: one call per pool, whatever its load) and returns the ids it did not find, never
  re-creating one.
- ``adjust(request_id, pool, charge_ms, kv_tokens)`` changes the cost (and, when given, the
  KV footprint) of a live entry (its exact count arrived after it was admitted on an
  estimate); False, touching nothing, when it is gone.
- ``expire()`` drops entries whose lease ended (their gateway died or lost the stream); a
  backstop, never the normal path.
- ``snapshot(pool)`` is the decision's input: in-flight count, outstanding work and the KV
  tokens the entries will hold (each entry's ``kv_tokens``, its prompt and typical output),
  and per group with entries, its count and work.
- Groups (``entry.groups``: its priority and tenant, ``extproc.decision.share``) are counted with
  the totals, in the same atomic steps; a group whose last entry goes leaves nothing behind.
- ``wait(pool, gateway, level, lease_ms)`` publishes the highest priority level a gateway holds
  requests of (``extproc.decision.defer``; None: it holds none), replacing what it published before,
  for ``lease_ms``. ``reserve`` of an entry with a ceiling answers ``YIELDED`` (refused,
  nothing recorded) while another gateway's live level is higher than ``entry.priority``:
  one strict priority order across the gateways of a shared ledger. A gateway's own held
  requests never make its entries yield here (its queue orders them); a gateway whose lease
  lapsed (it died) is ignored, and ``expire`` removes it.

A shared ledger may also offer ``recent(pool)`` (``Recent``; the Redis ledger does): the
pool's newest snapshot that came back with any of its answers, and its age. The gate may
decide on it instead of calling ``snapshot`` (``extproc.gateway.gate``); what it decides and records
is the same contract.

Leases are measured by the ledger's own clock, never the caller's. The gateway gives each
entry a short lease (``ledger.liveness_ms``) and renews its live entries by heartbeat, so the
entries of a replica that died lapse within seconds (``extproc.gateway.leases``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from extproc.decision.admission import Snapshot


@dataclass(frozen=True, slots=True)
class Entry:
    request_id: str
    pool: str
    charge_ms: float  # the request's estimated service time, its share of outstanding work
    lease_ms: float  # how long the entry lives without a renewal or release
    kv_tokens: int = 0  # the KV cache it will hold: prompt + typical output
    groups: tuple[str, ...] = ()  # the groups it counts in (names without spaces)
    priority: int = 0  # its priority level: it yields to other gateways' held higher ones
    gateway: str = ""  # the gateway recording it: its own held requests never make it yield


class Reserved(enum.IntEnum):
    """What ``reserve`` did; true only when it recorded the entry."""

    FULL = 0  # refused: past the ceiling, the count or a cap
    RECORDED = 1  # recorded, now or by an earlier reserve of the same id
    YIELDED = 2  # refused: another gateway holds a higher priority (``wait``)

    def __bool__(self) -> bool:
        return self is Reserved.RECORDED


@dataclass(frozen=True, slots=True)
class Cap:
    """A group's hard limit, checked by ``reserve`` with the entry counted."""

    group: str
    max_inflight: int | None = None
    max_ms: float | None = None


class Ledger(Protocol):
    async def reserve(self, entry: Entry, ceiling_ms: float | None = None,
                      max_inflight: int | None = None,
                      caps: Sequence[Cap] = ()) -> Reserved: ...

    async def release(self, request_id: str, pool: str) -> bool: ...

    async def renew(self, request_id: str, pool: str, lease_ms: float) -> bool: ...

    async def heartbeat(self, pool: str, request_ids: Sequence[str],
                        lease_ms: float) -> list[str]: ...

    async def adjust(self, request_id: str, pool: str, charge_ms: float,
                     kv_tokens: int | None = None) -> bool: ...

    async def expire(self) -> int: ...

    async def snapshot(self, pool: str) -> Snapshot: ...

    async def wait(self, pool: str, gateway: str, level: int | None,
                   lease_ms: float) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class Recent(Protocol):
    def recent(self, pool: str) -> tuple[Snapshot, float] | None:
        """The pool's newest snapshot from any answer and its age in seconds (every change
        committed more than that long ago is in it); None when there is none."""
        ...

    def newest(self, pool: str) -> tuple[Snapshot, float] | None:
        """As ``recent``, but also the snapshot from before the ledger last failed."""
        ...


__all__ = ["Cap", "Entry", "Ledger", "Recent", "Reserved", "Snapshot"]
