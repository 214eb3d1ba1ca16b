"""One Redis round trip per admission, releases sent together (issue 19), against a real
``redis-server``: the reserve and release answers carry the pool's snapshot, the gate decides
on it while it is young, and only an admission the reserve checks again stands on it; releases
queued together go in one script call, each answered on its own, exactly once, even when their
caller is cancelled or the ledger closes. ``FRESH_MS`` is set far beyond any stall here, so no
assertion depends on timing."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from extproc import config
from extproc.decision.admission import Outcome, Reason
from extproc.errors import LedgerUnavailable
from extproc.fleet.capacity import StaticCapacity
from extproc.gateway import leases
from extproc.gateway.gate import Gate
from extproc.gateway.tenant import Tenant
from extproc.ledger import Entry
from extproc.ledger.redis import RedisLedger
from extproc.observability.metrics import Metrics
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis
_prefixes = itertools.count()
PATH = "/v1/chat/completions"
BODY = json.dumps({"model": "m", "max_tokens": 16,
                   "messages": [{"role": "user", "content": "hello"}]}).encode()


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s


def settings(url: str, prefix: str) -> config.Config:
    return config.from_mapping({
        "pools": [{"name": "p", "replicas": 4, "engine": {"max_num_seqs": 16}}],
        "tenant": {"source": "header", "tenants": {"acme": {"max_inflight": 1}}},
        "ledger": {"kind": "redis", "url": url, "timeout_ms": 2_000,
                   "decision_deadline_ms": 5_000, "key_prefix": prefix}})


def make(cfg: config.Config) -> RedisLedger:
    return RedisLedger.from_config(cfg.ledger, ["p"])


@pytest.fixture
async def cfg(server: RedisServer) -> config.Config:
    return settings(server.url, f"rt{next(_prefixes)}")


@pytest.fixture
async def ledger(cfg: config.Config) -> AsyncIterator[RedisLedger]:
    led = make(cfg)
    yield led
    await led.close()


def script_calls(server: RedisServer) -> int:
    stats: dict[str, Any] = server.client().info("commandstats")
    return sum(stats.get(k, {}).get("calls", 0) for k in ("cmdstat_evalsha", "cmdstat_eval"))


def snapshot_calls(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value(
        "extproc_ledger_call_duration_seconds_count", {"op": "snapshot"}) or 0.0


def entry(rid: str, groups: tuple[str, ...] = ()) -> Entry:
    return Entry(rid, "p", 100.0, 60_000.0, 10, groups)


# --- the ledger ------------------------------------------------------------------------------

async def test_releases_queued_together_go_in_one_script_call_each_answered_exactly_once(
        server: RedisServer, ledger: RedisLedger) -> None:
    for rid in "abcde":
        assert await ledger.reserve(entry(rid, ("t:acme",)))
    assert not await ledger.release("nobody", "p")  # the script is cached: EVALSHA alone
    server.client().config_resetstat()
    answers = await asyncio.gather(*(ledger.release(rid, "p")
                                     for rid in ["a", "b", "c", "a", "nobody", "d", "e"]))
    assert answers == [True, True, True, False, False, True, True]
    assert script_calls(server) == 1
    assert server.client().keys(f"{ledger.prefix}:*") == []  # an emptied pool leaves nothing
    recent = ledger.recent("p")  # the batch's answer carried the pool as it left it
    assert recent is not None
    assert (recent[0].inflight, recent[0].outstanding_ms, recent[0].groups) == (0, 0.0, {})


async def test_a_release_is_sent_though_its_caller_was_cancelled_and_close_sends_it(
        server: RedisServer, cfg: config.Config) -> None:
    ledger = make(cfg)
    assert await ledger.reserve(entry("a"))
    caller = asyncio.create_task(ledger.release("a", "p"))
    await asyncio.sleep(0)  # queued: the flush has not run yet
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await ledger.close()  # sends what is queued before disconnecting
    assert server.client().hget(ledger.keys("p")[1], "a") is None


async def test_every_answer_carries_the_pool_snapshot_and_a_failure_forgets_it(
        ledger: RedisLedger) -> None:
    assert ledger.recent("p") is None
    assert await ledger.reserve(entry("a", ("t:acme", "p:1")))
    assert not await ledger.reserve(entry("b"), ceiling_ms=150.0)  # a refusal carries it too
    recent = ledger.recent("p")
    assert recent is not None and recent[1] >= 0.0
    assert recent[0] == await ledger.snapshot("p")
    with RedisServer() as doomed:
        other = make(settings(doomed.url, "doomed"))
        await other.reserve(entry("a"))
        assert other.recent("p") is not None
        doomed.kill()
        with pytest.raises(LedgerUnavailable):
            await other.reserve(entry("b"))
        assert other.recent("p") is None  # a view from before a failure is never decided on
        await other.close()


# --- the gate --------------------------------------------------------------------------------

@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leases, "FRESH_MS", 3_600_000.0)  # no stall makes a view too old here


def gate(cfg: config.Config) -> tuple[Gate, Metrics]:
    metrics = Metrics()
    return Gate(cfg, make(cfg), StaticCapacity(cfg.pools), metrics), metrics


async def check(g: Gate, tenant: str) -> Any:
    route = g.config.route(PATH)
    assert route is not None
    return await g.check(route, PATH, {}, BODY, tenant=Tenant(tenant, tenant))


@pytest.mark.usefixtures("fresh")
async def test_an_admission_on_a_recent_view_is_one_script_call(
        server: RedisServer, cfg: config.Config) -> None:
    g, metrics = gate(cfg)
    try:
        first = await check(g, "beta")  # nothing seen yet: snapshot, then reserve
        assert snapshot_calls(metrics) == 1
        server.client().config_resetstat()
        second = await check(g, "beta")
        assert script_calls(server) == 1 and snapshot_calls(metrics) == 1
        assert first.outcome is second.outcome is Outcome.ADMIT
        assert first.ticket is not None and second.ticket is not None
        server.client().config_resetstat()
        await asyncio.gather(g.settle(first.ticket), g.settle(second.ticket))
        assert script_calls(server) == 1  # both releases in one call
        assert (await g.ledger.snapshot("p")).inflight == 0
    finally:
        await g.ledger.close()


@pytest.mark.usefixtures("fresh")
async def test_a_refusal_on_a_reused_view_is_decided_again_on_a_read(
        cfg: config.Config) -> None:
    """The view says acme is at its cap of 1; another gateway has released since: the request
    is not refused on the view but decided again on a snapshot read for it, and admitted."""
    g, metrics = gate(cfg)
    rival = make(cfg)
    try:
        assert await rival.reserve(entry("rival", ("t:acme",)))
        await check(g, "beta")  # the gate's view now holds acme's entry
        assert await rival.release("rival", "p")
        reads = snapshot_calls(metrics)
        verdict = await check(g, "acme")
        assert (verdict.outcome, verdict.reason) == (Outcome.ADMIT, Reason.FITS)
        assert snapshot_calls(metrics) == reads + 1
    finally:
        await rival.close()
        await g.ledger.close()


@pytest.mark.usefixtures("fresh")
async def test_an_admission_on_a_reused_view_the_reserve_refuses_is_decided_on_its_answer(
        server: RedisServer, cfg: config.Config) -> None:
    """The view says acme is free; another gateway has taken its only place since: the reserve
    refuses atomically and the request is decided again on the pool as the refusal found it
    (no snapshot call): refused at the cap, not contended."""
    g, metrics = gate(cfg)
    rival = make(cfg)
    try:
        await check(g, "beta")  # the gate's view: acme holds nothing
        assert await rival.reserve(entry("rival", ("t:acme",)))
        reads = snapshot_calls(metrics)
        server.client().config_resetstat()
        verdict = await check(g, "acme")
        assert (verdict.outcome, verdict.reason) == (Outcome.REJECT, Reason.TENANT_CAP)
        assert snapshot_calls(metrics) == reads and script_calls(server) == 1
        snap = await rival.snapshot("p")
        assert snap.groups["t:acme"] == (1, 100.0)  # the rival's, alone
    finally:
        await rival.close()
        await g.ledger.close()


async def test_without_reuse_every_decision_reads_the_snapshot(
        monkeypatch: pytest.MonkeyPatch, cfg: config.Config) -> None:
    monkeypatch.setattr(leases, "FRESH_MS", 0.0)
    g, metrics = gate(cfg)
    try:
        verdicts = [await check(g, "beta") for _ in range(3)]
        assert snapshot_calls(metrics) == 3
        for v in verdicts:
            assert v.ticket is not None
            await g.settle(v.ticket)
    finally:
        await g.ledger.close()
