"""The Redis ledger: the in-flight ledger shared by every gateway replica of a fleet.

Exactly as correct as the in-process ledger while Redis answers (the same contract tests run
against both, and on any sequence of calls both compute bit-for-bit the same outstanding work).
Per pool, six keys that share the hash tag ``{pool}``, so a pool lives in one Cluster slot and
every script touches a single slot (never CROSSSLOT)::

    <prefix>:{<pool>}:leases   sorted set  request id -> lease end (ms of Redis server time)
    <prefix>:{<pool>}:costs    hash        request id -> "cost kv" (ms, KV tokens)
    <prefix>:{<pool>}:total    string      sum of the costs: the pool's outstanding work (ms)
    <prefix>:{<pool>}:kv       string      sum of the KV tokens the entries will hold
    <prefix>:{<pool>}:groups   hash        group -> "count work" (a priority or tenant's entries)
    <prefix>:{<pool>}:waiting  hash        gateway -> "lease-end level": the highest it holds

Every change is one Lua script (``*.lua`` beside this file, each with a KEYS/ARGV header, sent
with the helpers of ``entries.lua`` in front):
``reserve`` checks the ceiling and records in one atomic step, ``release`` removes exactly once,
``renew`` moves a lease end, ``heartbeat`` moves many (a replica's live entries, batched),
``adjust`` changes a live entry's cost, ``expire`` drops at most
``sweep_batch`` lapsed entries per call (and gateways whose held requests' lease lapsed),
``snapshot`` reads the count and the totals together, ``wait`` publishes the highest priority
a gateway holds, which ``reserve`` makes lower priorities yield to.
The totals are aggregates the scripts keep, never a sum over members, so each call costs
O(log n) whatever the load. Lease ends come from Redis's ``TIME``: gateway clocks never matter.
Python decides the ceiling; Lua only checks it.

One round trip per admission: ``reserve`` and ``release`` answer with the pool's snapshot as
it stands after them (the view ``snapshot`` reads), and the ledger keeps the newest per pool
with the time its call was sent (``recent``): every change Redis committed before that instant
is in it. The gate decides on it while it is young (``extproc.gateway.gate``) instead of calling
``snapshot`` first. Releases are queued and sent together (``_flush``): whatever was queued
while the previous batch was in flight goes in one script call per pool (``BATCH`` ids at
most), each id answered on its own, exactly once; a queued release is sent even if its caller
is cancelled, and ``close`` sends what is still queued.

Scripts are sent by SHA (EVALSHA); a server
that lost them (restart, failover, SCRIPT FLUSH) answers NOSCRIPT and gets the source once
(EVAL caches it again, on the node owning the keys).

Faults: every call has short explicit timeouts (connect and socket, ``timeout_ms``) and no
client retries (a retry would double the wait of a decision that has a deadline), with one
exception: a pooled connection the server closed (Redis restarted or failed over while it sat
idle) fails at once, so the idle pool is dropped and the script sent again, once, on a fresh
connection (``_fresh_connections``); without it the first decisions after a restart failed
with ``ledger_unavailable`` though Redis was back (11 of 48 in three restarts, 0 with it).
Any Redis or socket error becomes ``LedgerUnavailable`` here, at the edge; callers apply the
fault policy.
A circuit breaker (``breaker.py``) refuses calls at once while Redis is failing, then lets one
trial through per cool-down. Nothing is connected at construction: a gateway starts without
Redis and recovers when it appears.

No key has a TTL, so ``noeviction`` and every ``volatile-*`` policy keep the ledger intact;
an ``allkeys-*`` policy could evict it under memory pressure (forgetting in-flight work, so
over-admitting): ``check`` warns loudly when it finds one.

Length: at the house's ~400 lines with one method per script and the fault handling they
share (``_run``); the connection is already apart (``connect.py``), and the release queue
(``release``, ``_flush``) is the next to move if it grows.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from extproc.decision.admission import Snapshot
from extproc.errors import LedgerUnavailable
from extproc.ledger import Cap, Entry, Reserved
from extproc.ledger.breaker import Breaker, State
from extproc.ledger.connect import connect, describe

if TYPE_CHECKING:
    from extproc.config import LedgerConfig

log = logging.getLogger(__name__)

_FAILURES = (RedisError, RedisClusterException, OSError)  # OSError covers TimeoutError
SAFE_EVICTION = ("noeviction", "volatile-")


def _lua(name: str) -> str:
    return (resources.files("extproc.ledger") / f"{name}.lua").read_text("utf-8")


class _Script:
    """One Lua script, sent with the helpers of ``entries.lua`` in front: by SHA, its source
    only after a NOSCRIPT."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = _lua("entries") + _lua(name)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def run(self, client: Any, keys: Sequence[str], args: Sequence[str]) -> Any:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await client.eval(self.source, len(keys), *keys, *args)


_RESERVE, _RELEASE, _RENEW, _ADJUST, _EXPIRE, _SNAPSHOT, _HEARTBEAT, _WAIT = (
    _Script(n) for n in ("reserve", "release", "renew", "adjust", "expire", "snapshot",
                         "heartbeat", "wait"))
BATCH = 500  # ids per heartbeat or release script call: one call never holds Redis long
_Waiting = tuple[str, "asyncio.Future[bool]"]  # a queued release: its id, its caller's answer


@dataclass(slots=True)
class _Seen:
    """A pool's newest snapshot from a script's answer: ``sent`` (``time.monotonic``) is when
    its call went out, so every change committed before then is in it. Parsed when read."""

    sent: float
    raw: Any
    snapshot: Snapshot | None = None


def _group(name: str) -> str:
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"a ledger group is a name without spaces (got {name!r})")
    return name


def _num(value: float) -> str:
    """A float as the shortest decimal that reads back exactly (Lua's ``tonumber`` agrees)."""
    if not math.isfinite(value):
        raise ValueError(f"ledger quantities must be finite (got {value!r})")
    return repr(float(value))


class RedisLedger:
    def __init__(self, client: Any, *, key_prefix: str = "extproc", pools: Iterable[str] = (),
                 breaker: Breaker | None = None, sweep_batch: int = 100,
                 sweep_max: int = 1_000, where: str = "redis",
                 extra_clients: Sequence[Any] = ()) -> None:
        self._client = client
        self._extra = tuple(extra_clients)  # e.g. Sentinel connections, closed with the ledger
        self.prefix = key_prefix
        self.breaker = breaker or Breaker()
        self.sweep_batch = sweep_batch
        self.sweep_max = sweep_max
        self.where = where  # for messages: never holds a credential
        self._pools: dict[str, None] = dict.fromkeys(pools)  # ordered set
        self._inspected = False
        self.eviction_policy: str | None = None  # as found by ``check``; None if unknown
        self._seen: dict[str, _Seen] = {}  # pool -> its newest snapshot (``recent``)
        self._failed_at = -math.inf  # when a call last failed (time.monotonic)
        self._releases: dict[str, list[_Waiting]] = {}  # pool -> releases queued (``_flush``)
        self._flushing: asyncio.Task[None] | None = None

    @classmethod
    def from_config(cls, config: LedgerConfig, pools: Iterable[str], *,
                    environ: Mapping[str, str] = os.environ,
                    on_breaker: Callable[[State], None] | None = None) -> RedisLedger:
        """Build the client for ``config`` (no connection is made yet)."""
        client, extra = connect(config, environ)
        breaker = Breaker(config.breaker.failures, config.breaker.cooldown_ms / 1000.0,
                          on_change=on_breaker)
        return cls(client, key_prefix=config.key_prefix, pools=pools, breaker=breaker,
                   where=describe(config), extra_clients=extra)

    def keys(self, pool: str) -> tuple[str, str, str, str, str, str]:
        """The pool's leases, costs, total, kv, groups and waiting keys (one hash tag: one
        Cluster slot)."""
        base = f"{self.prefix}:{{{pool}}}"
        return (f"{base}:leases", f"{base}:costs", f"{base}:total", f"{base}:kv",
                f"{base}:groups", f"{base}:waiting")

    async def reserve(self, entry: Entry, ceiling_ms: float | None = None,
                      max_inflight: int | None = None, caps: Sequence[Cap] = ()) -> Reserved:
        self._pools.setdefault(entry.pool)
        args = [entry.request_id, _num(entry.charge_ms), _num(entry.lease_ms),
                "" if ceiling_ms is None else _num(ceiling_ms), str(int(entry.kv_tokens)),
                "" if max_inflight is None else str(int(max_inflight)),
                " ".join(_group(g) for g in entry.groups),
                "" if ceiling_ms is None else str(int(entry.priority)),
                _group(entry.gateway or "-")]
        for cap in caps:
            args += [_group(cap.group),
                     "" if cap.max_inflight is None else str(int(cap.max_inflight)),
                     "" if cap.max_ms is None else _num(cap.max_ms)]
        sent = time.monotonic()
        ok, raw = await self._run("reserve", _RESERVE, self.keys(entry.pool), args)
        self._saw(entry.pool, _Seen(sent, raw))
        return Reserved(int(ok))

    async def release(self, request_id: str, pool: str) -> bool:
        """Queued, and sent with the other releases queued meanwhile (``_flush``); the answer
        is this id's own. Cancelling the caller does not take it back out of the queue."""
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._releases.setdefault(pool, []).append((request_id, answer))
        if self._flushing is None:
            self._flushing = asyncio.create_task(self._flush())
        return await answer

    async def _flush(self) -> None:
        """Send the queued releases until none is left: one script call per pool and
        ``BATCH`` ids (calls for several pools or batches at once), one flush at a time. It
        starts on the loop's next turn, so every release queued this turn joins; those queued
        while it is in flight go in its next round."""
        try:
            while self._releases:
                queued, self._releases = self._releases, {}
                batches = [(pool, waiting[i:i + BATCH]) for pool, waiting in queued.items()
                           for i in range(0, len(waiting), BATCH)]
                if len(batches) == 1:  # the usual case: no task to gather
                    await self._release_batch(*batches[0])
                else:
                    await asyncio.gather(*(self._release_batch(*b) for b in batches))
        finally:
            self._flushing = None
            left, self._releases = self._releases, {}  # only when cancelled (closing)
            for waiting in left.values():
                _answer_all(waiting, LedgerUnavailable(
                    f"redis release: not sent, the ledger is closing ({self.where})"))

    async def _release_batch(self, pool: str, waiting: Sequence[_Waiting]) -> None:
        sent = time.monotonic()
        try:
            done, raw = await self._run("release", _RELEASE, self.keys(pool),
                                        [rid for rid, _ in waiting])
        except LedgerUnavailable as exc:
            _answer_all(waiting, exc)
            return
        except BaseException:
            _answer_all(waiting, LedgerUnavailable(
                f"redis release: cancelled before an answer ({self.where})"))
            raise
        self._saw(pool, _Seen(sent, raw))
        for (_, answer), ok in zip(waiting, done, strict=True):
            if not answer.done():
                answer.set_result(bool(ok))

    async def renew(self, request_id: str, pool: str, lease_ms: float) -> bool:
        leases = self.keys(pool)[0]
        return bool(await self._run("renew", _RENEW, (leases,), (request_id, _num(lease_ms))))

    async def heartbeat(self, pool: str, request_ids: Sequence[str],
                        lease_ms: float) -> list[str]:
        leases = self.keys(pool)[0]
        missing: list[str] = []
        for i in range(0, len(request_ids), BATCH):
            batch = request_ids[i:i + BATCH]
            gone = await self._run("heartbeat", _HEARTBEAT, (leases,), (_num(lease_ms), *batch))
            missing += [_text(g) for g in gone]
        return missing

    async def adjust(self, request_id: str, pool: str, charge_ms: float,
                     kv_tokens: int | None = None) -> bool:
        _, costs, total, kv, groups, _ = self.keys(pool)
        args = (request_id, _num(charge_ms), "" if kv_tokens is None else str(int(kv_tokens)))
        return bool(await self._run("adjust", _ADJUST, (costs, total, kv, groups), args))

    async def expire(self) -> int:
        """Drop lapsed entries of every known pool, ``sweep_batch`` per script call and at
        most ``sweep_max`` per pool per call (the rest wait for the next sweep)."""
        dropped = 0
        for pool in list(self._pools):
            done = 0
            while done < self.sweep_max:
                batch = min(self.sweep_batch, self.sweep_max - done)
                n = int(await self._run("expire", _EXPIRE, self.keys(pool), (str(batch),)))
                done += n
                if n < batch:
                    break
            dropped += done
        return dropped

    async def snapshot(self, pool: str) -> Snapshot:
        leases, _, total, kv, groups, _ = self.keys(pool)
        sent = time.monotonic()
        raw = await self._run("snapshot", _SNAPSHOT, (leases, total, kv, groups), ())
        seen = _Seen(sent, raw, _snapshot(raw))
        self._saw(pool, seen)
        assert seen.snapshot is not None
        return seen.snapshot

    async def wait(self, pool: str, gateway: str, level: int | None,
                   lease_ms: float) -> None:
        self._pools.setdefault(pool)
        args = [_group(gateway), _num(lease_ms), "" if level is None else str(int(level))]
        await self._run("wait", _WAIT, (self.keys(pool)[5],), args)

    def recent(self, pool: str) -> tuple[Snapshot, float] | None:
        """The pool's newest snapshot from any answer (``reserve``, ``release``, ``snapshot``)
        and its age in seconds: how long ago its call was sent. None when none was sent after
        the last failure."""
        seen = self._seen.get(pool)
        if seen is None or seen.sent < self._failed_at:
            return None
        return self.newest(pool)

    def newest(self, pool: str) -> tuple[Snapshot, float] | None:
        """The pool's newest snapshot from any answer, one from before a failure too, and its
        age in seconds (the local view's base while the ledger is away)."""
        seen = self._seen.get(pool)
        if seen is None:
            return None
        if seen.snapshot is None:
            seen.snapshot = _snapshot(seen.raw)
        return seen.snapshot, time.monotonic() - seen.sent

    def _saw(self, pool: str, seen: _Seen) -> None:
        """Keep the answer whose call was sent last: answers may come back out of order."""
        kept = self._seen.get(pool)
        if kept is None or seen.sent >= kept.sent:
            self._seen[pool] = seen

    async def check(self) -> None:
        """Probe every known pool (the health signal); the first success also inspects the
        server's eviction policy. Raises ``LedgerUnavailable`` like any call."""
        for pool in list(self._pools) or ["_probe"]:
            await self.snapshot(pool)
        if not self._inspected:
            self._inspected = True
            await self._inspect()

    async def close(self) -> None:
        """Send the releases still queued (bounded by ``timeout_ms``), then disconnect."""
        if self._flushing is not None:
            await asyncio.wait([self._flushing])
        for client in (self._client, *self._extra):
            try:
                await client.aclose()
            except _FAILURES as exc:  # closing a dead connection: nothing left to do
                log.debug("closing redis client: %s", exc)

    async def _run(self, op: str, script: _Script, keys: Sequence[str],
                   args: Sequence[str]) -> Any:
        if not self.breaker.allow():
            raise LedgerUnavailable(f"redis {op}: circuit open after repeated failures"
                                    f" ({self.where})")
        try:
            try:
                result = await script.run(self._client, keys, args)
            except RedisConnectionError as exc:
                if not await self._fresh_connections(exc):
                    raise
                result = await script.run(self._client, keys, args)
        except asyncio.CancelledError:
            # The caller gave up (its decision deadline): a Redis that never answers must
            # still open the breaker, so this counts as a failure.
            self.breaker.failure()
            raise
        except _FAILURES as exc:
            self.breaker.failure()
            self._failed_at = time.monotonic()  # a view from before it is never decided on
            _restore_cancellation(exc)
            raise LedgerUnavailable(f"redis {op} failed ({self.where}):"
                                    f" {type(exc).__name__}: {exc}") from exc
        self.breaker.success()
        _restore_cancellation(None)
        return result

    async def _fresh_connections(self, exc: RedisConnectionError) -> bool:
        """After a connection error, may the call be retried once, at once? Only when the
        error came on a pooled connection the server had closed (a restart, a failover, an
        idle timeout): every idle pooled connection is then as stale, so all are dropped and
        the retry connects afresh. Every script is safe to run twice (a reserve or release is
        keyed by request id; the others set, not add). A refused connection (Redis is down)
        is not retried: it would only double the decision's wait."""
        text = str(exc).lower()
        if "closed" not in text and "reset" not in text:
            return False
        pool = getattr(self._client, "connection_pool", None)  # a Cluster client has none
        if pool is not None:
            await pool.disconnect(inuse_connections=False)
        return True

    async def _inspect(self) -> None:
        """Warn loudly when Redis may evict ledger keys (they have no TTL, so only an
        ``allkeys-*`` policy can). A managed Redis may refuse CONFIG: then say so once."""
        try:
            raw = await self._client.config_get("maxmemory-policy")
        except _FAILURES as exc:
            log.warning("could not read Redis maxmemory-policy (%s: %s): make sure it is"
                        " noeviction or a volatile-* policy, or Redis may evict in-flight"
                        " ledger entries", type(exc).__name__, exc, extra={"redis": self.where})
            return
        found = sorted(set(_policies(raw)))
        self.eviction_policy = ",".join(found) or None
        unsafe = [p for p in found if not p.startswith(SAFE_EVICTION)]
        if unsafe:
            log.error("REDIS MAY EVICT LEDGER KEYS: maxmemory-policy is %s. Under memory"
                      " pressure Redis would silently forget in-flight requests and the"
                      " gateways would over-admit. Set maxmemory-policy to noeviction (or a"
                      " volatile-* policy: ledger keys have no TTL).", ",".join(unsafe),
                      extra={"redis": self.where})


def _restore_cancellation(cause: BaseException | None) -> None:
    """Raise ``CancelledError`` if our task was asked to stop during a Redis call.

    redis-py writes through ``asyncio.wait_for``, which on Python 3.11 can lose a cancellation
    that races with the write finishing or timing out (fixed in 3.12): the call then returns,
    or fails with a Redis error, and the task carries on, e.g. a renewal loop renewing a
    finished request forever. The task still counts the request (``cancelling()``), so the
    cancellation is given back here, at the seam.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError() from cause


def _snapshot(raw: Any) -> Snapshot:
    """A snapshot as the scripts send it: count, total, KV tokens, flat group counts."""
    count, outstanding, tokens, flat = raw
    counted: dict[str, tuple[int, float]] = {}
    for name, value in zip(flat[::2], flat[1::2], strict=True):
        n, work = _text(value).split(" ", 1)
        counted[_text(name)] = (int(n), float(work))
    return Snapshot(inflight=int(count), outstanding_ms=float(outstanding),
                    kv_tokens=int(tokens), groups=counted)


def _answer_all(waiting: Iterable[_Waiting], exc: Exception) -> None:
    for _, answer in waiting:
        if not answer.done():
            answer.set_exception(exc)


def _policies(raw: Any) -> Iterable[str]:
    """CONFIG GET's answer: ``{name: value}``, or per node ``{node: {name: value}}``."""
    if isinstance(raw, Mapping):
        for key, value in raw.items():
            if isinstance(value, Mapping):
                yield from _policies(value)
            elif _text(key) == "maxmemory-policy":
                yield _text(value)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


__all__ = ["RedisLedger", "State"]
