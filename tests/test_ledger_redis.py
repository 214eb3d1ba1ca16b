"""The Redis ledger beyond the shared contract, against real ``redis-server`` processes: key
layout, server time, script reloading, bounded sweeps, equivalence with the in-process ledger,
atomicity across OS processes, fast failure and recovery, and every deployment form."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from extproc import config
from extproc.errors import LedgerUnavailable
from extproc.ledger import Entry
from extproc.ledger.breaker import State
from extproc.ledger.memory import MemoryLedger
from extproc.ledger.redis import RedisLedger
from tests.ledger_hammer import CAP, CEILING_MS, hammer, hammer_cap, race_for_slots
from tests.redis_server import Certs, RedisSentinel, RedisServer, poll

pytestmark = pytest.mark.redis

T = TypeVar("T")
SCRIPTS = Path(__file__).parent.parent / "extproc" / "ledger"
_prefixes = itertools.count()


def make(url: str | None = None, pools: tuple[str, ...] = ("p",), **section: Any) -> RedisLedger:
    settings_ = {"kind": "redis", "timeout_ms": 2_000,
                 "key_prefix": f"t{next(_prefixes)}", **section}
    if url is not None:
        settings_["url"] = url
    return RedisLedger.from_config(config.from_mapping({"ledger": settings_}).ledger, pools)


def entry(rid: str, cost: float = 100.0, pool: str = "p", lease_ms: float = 60_000) -> Entry:
    return Entry(request_id=rid, pool=pool, charge_ms=cost, lease_ms=lease_ms)


async def round_trip(ledger: RedisLedger) -> None:
    """The whole contract in a few calls: what each deployment form must carry."""
    try:
        assert await ledger.reserve(entry("a", 600.0), ceiling_ms=1_000.0)
        assert not await ledger.reserve(entry("b", 500.0), ceiling_ms=1_000.0)
        assert await ledger.renew("a", "p", 60_000)
        assert await ledger.heartbeat("p", ["a", "b"], 60_000) == ["b"]
        assert await ledger.adjust("a", "p", 650.0)
        snap = await ledger.snapshot("p")
        assert (snap.inflight, snap.outstanding_ms) == (1, 650.0)
        await ledger.wait("p", "gw", 1, 60_000)
        assert await ledger.release("a", "p")
        assert not await ledger.release("a", "p")
        await ledger.wait("p", "gw", None, 60_000)
    finally:
        await ledger.close()


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s


@pytest.fixture
async def ledger(server: RedisServer) -> AsyncIterator[RedisLedger]:
    led = make(server.url)
    yield led
    await led.close()


# --- layout, time, scripts -------------------------------------------------------------------

async def test_a_pool_is_six_keys_in_one_slot_and_an_empty_pool_leaves_none(
        server: RedisServer, ledger: RedisLedger) -> None:
    await ledger.reserve(dataclasses.replace(entry("a", 10.0), groups=("p:0", "t:acme")))
    await ledger.wait("p", "gw", 1, 60_000)
    keys = ledger.keys("p")
    assert all(":{p}:" in k for k in keys)
    assert len({key_slot(k.encode()) for k in keys}) == 1
    r = server.client()
    assert sorted(r.keys(f"{ledger.prefix}:*")) == sorted(k.encode() for k in keys)
    assert await ledger.release("a", "p")
    await ledger.wait("p", "gw", None, 60_000)
    assert r.keys(f"{ledger.prefix}:*") == []


async def test_a_dead_gateways_held_requests_leave_no_key_after_a_sweep(
        server: RedisServer, ledger: RedisLedger) -> None:
    await ledger.wait("p", "gw", 1, 50)
    await asyncio.sleep(0.1)
    assert await ledger.expire() == 0
    assert server.client().keys(f"{ledger.prefix}:*") == []


async def test_leases_run_on_redis_time_never_the_gateway_clock(
        server: RedisServer, ledger: RedisLedger, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: 0.0)  # a gateway whose wall clock is far off
    await ledger.reserve(entry("a", lease_ms=60_000))
    r = server.client()
    seconds, micros = r.time()
    end = r.zscore(ledger.keys("p")[0], "a")
    assert end is not None
    assert abs(end - (seconds * 1000 + micros / 1000 + 60_000)) < 1_000
    await ledger.release("a", "p")


async def test_a_server_that_lost_its_scripts_gets_each_one_again(
        server: RedisServer, ledger: RedisLedger) -> None:
    helpers = (SCRIPTS / "entries.lua").read_bytes()  # sent in front of every script
    shas = [hashlib.sha1(helpers + f.read_bytes()).hexdigest()
            for f in sorted(SCRIPTS.glob("*.lua")) if f.name != "entries.lua"]
    r = server.client()
    r.script_flush()  # what a restart or failover does to the script cache
    assert r.script_exists(*shas) == [False] * len(shas)
    await round_trip(make(server.url))
    await ledger.expire()
    assert r.script_exists(*shas) == [True] * len(shas)


async def test_expire_drops_a_bounded_batch_per_call(server: RedisServer) -> None:
    ledger = make(server.url, pools=("p",))
    ledger.sweep_batch, ledger.sweep_max = 100, 200
    try:
        for i in range(250):  # leases of a microsecond: lapsed by the time expire runs
            await ledger.reserve(entry(f"old{i}", 1.0, lease_ms=0.001))
        await ledger.reserve(entry("live", 7.0))
        assert await ledger.expire() == 200
        assert (await ledger.snapshot("p")).inflight == 51
        assert await ledger.expire() == 50
        snap = await ledger.snapshot("p")
        assert (snap.inflight, snap.outstanding_ms) == (1, 7.0)
    finally:
        await ledger.close()


# --- equivalence with the in-process ledger --------------------------------------------------

_ids = st.sampled_from(["a", "b", "c", "d"])
_pools = st.sampled_from(["p", "q"])
_ms = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)
_ops = st.lists(st.one_of(
    st.tuples(st.just("reserve"), _ids, _pools, _ms, st.none() | _ms),
    st.tuples(st.just("release"), _ids, _pools),
    st.tuples(st.just("renew"), _ids, _pools),
    st.tuples(st.just("adjust"), _ids, _pools, _ms),
), max_size=30)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops)
def test_any_sequence_gives_the_same_answers_and_totals_as_the_in_process_ledger(
        server: RedisServer, ops: list[tuple[Any, ...]]) -> None:
    """Bit-for-bit: both add and subtract IEEE doubles in the same order."""

    async def run() -> None:
        memory, shared = MemoryLedger(), make(server.url, pools=("p", "q"))
        try:
            for op in ops:
                if op[0] == "reserve":
                    _, rid, pool, cost, ceiling = op
                    e = entry(rid, cost, pool)
                    assert await memory.reserve(e, ceiling) == await shared.reserve(e, ceiling)
                elif op[0] == "release":
                    assert await memory.release(*op[1:]) == await shared.release(*op[1:])
                elif op[0] == "adjust":
                    assert await memory.adjust(*op[1:]) == await shared.adjust(*op[1:])
                else:
                    assert (await memory.renew(*op[1:], 60_000)
                            == await shared.renew(*op[1:], 60_000))
                for pool in ("p", "q"):
                    assert await memory.snapshot(pool) == await shared.snapshot(pool)
        finally:
            await shared.close()

    asyncio.run(run())


# --- atomicity across OS processes -----------------------------------------------------------

def once(url: str, prefix: str, call: Callable[[RedisLedger], Awaitable[T]]) -> T:
    """One call on a ledger of its own, from synchronous code (each on a fresh event loop)."""

    async def run() -> T:
        ledger = make(url, key_prefix=prefix)
        try:
            return await call(ledger)
        finally:
            await ledger.close()

    return asyncio.run(run())


def dump(server: RedisServer, ledger: RedisLedger) -> tuple[Any, ...]:
    r = server.client()
    leases, costs, total, kv, groups, _ = ledger.keys("p")
    return (r.zrange(leases, 0, -1, withscores=True), r.hgetall(costs), r.get(total),
            r.get(kv), r.hgetall(groups))


def test_processes_racing_for_one_tenant_cap_never_exceed_it(server: RedisServer) -> None:
    """Four processes (four gateway replicas) reserve for one capped tenant at once: the
    tenant's count and work, read while they race, never pass its caps."""
    ledger = make(server.url)
    watching = threading.Event()
    highest = [0, 0.0]

    def watch() -> None:
        r = server.client()
        groups = ledger.keys("p")[4]
        while not watching.is_set():
            value = r.hget(groups, "t:acme")
            if value is not None:
                n, work = value.decode().split()
                highest[0], highest[1] = max(highest[0], int(n)), max(highest[1], float(work))

    watcher = threading.Thread(target=watch)
    watcher.start()
    with multiprocessing.get_context("spawn").Pool(4) as workers:
        try:
            recorded = workers.starmap(hammer_cap, [(server.url, ledger.prefix, seed, 15)
                                                    for seed in range(4)])
        finally:
            watching.set()
            watcher.join()
    assert sum(recorded) > CAP  # the cap was reached again and again, not just once
    assert highest[0] == CAP  # reached, never passed
    assert highest[1] <= CAP * 100.0


def test_processes_racing_for_one_ceiling_never_exceed_it_and_refusals_change_nothing(
        server: RedisServer) -> None:
    ledger = make(server.url)
    prefix = ledger.prefix
    watching = threading.Event()
    highest: list[float] = [0.0]

    def watch() -> None:  # sample the total while the processes race
        r = server.client()
        total = ledger.keys("p")[2]
        while not watching.is_set():
            highest[0] = max(highest[0], float(r.get(total) or 0.0))

    watcher = threading.Thread(target=watch)
    watcher.start()
    with multiprocessing.get_context("spawn").Pool(4) as workers:
        try:
            results = workers.starmap(hammer, [(server.url, prefix, seed, 12, (5.0, 120.0), True)
                                                for seed in range(4)])
        finally:
            watching.set()
            watcher.join()
        recorded = sum(sum(r[0]) for r in results)
        released = sum(sum(r[1]) for r in results)
        assert sum(r[2] for r in results) > 0  # the ceiling was contended
        snap = once(server.url, prefix, lambda led: led.snapshot("p"))
        assert 0 < highest[0] <= CEILING_MS
        assert snap.outstanding_ms <= CEILING_MS
        assert snap.outstanding_ms == pytest.approx(recorded - released, abs=1e-6)
        assert snap.inflight == sum(len(r[0]) - len(r[1]) for r in results)

        # Fill to 1 ms below the ceiling; 10,000 reserves that cannot fit must change nothing.
        filler = entry("filler", CEILING_MS - 1.0 - snap.outstanding_ms)
        assert once(server.url, prefix, lambda led: led.reserve(filler, CEILING_MS))
        before = dump(server, ledger)
        results = workers.starmap(hammer, [(server.url, prefix, 100 + seed, 100, (2.0, 50.0),
                                             False) for seed in range(4)])
        assert [len(r[0]) for r in results] == [0, 0, 0, 0]
        assert sum(r[2] for r in results) == 10_000
        assert dump(server, ledger) == before


def test_four_processes_racing_for_eight_slots_never_hold_a_ninth(server: RedisServer) -> None:
    """The count the decision reasoned about (``max_inflight``) is checked in the same atomic
    step as the work: four OS processes firing waves of 25 concurrent reserves at 8 slots,
    releasing at random between waves, never see a ninth entry."""
    slots = 8
    ledger = make(server.url)
    watching = threading.Event()
    highest = [0]
    samples = [0]

    def watch() -> None:  # sample the count while the processes race
        r = server.client()
        leases = ledger.keys("p")[0]
        while not watching.is_set():
            highest[0] = max(highest[0], int(r.zcard(leases)))
            samples[0] += 1

    watcher = threading.Thread(target=watch)
    watcher.start()
    with multiprocessing.get_context("spawn").Pool(4) as workers:
        try:
            results = workers.starmap(race_for_slots, [(server.url, ledger.prefix, seed, 40,
                                                        slots) for seed in range(4)])
        finally:
            watching.set()
            watcher.join()
    recorded = sum(r[0] for r in results)
    released = sum(r[1] for r in results)
    refused = sum(r[2] for r in results)
    snap = once(server.url, ledger.prefix, lambda led: led.snapshot("p"))
    print(f"slots={slots} recorded={recorded} refused={refused} highest={highest[0]}"
          f" samples={samples[0]}")
    assert refused > 1_000 and recorded > 4 * slots  # contended, and slots were reused
    assert 0 < highest[0] <= slots
    assert snap.inflight == recorded - released <= slots


# --- faults ----------------------------------------------------------------------------------

async def test_a_black_holed_redis_fails_within_the_timeout_then_the_breaker_stops_calling(
        ) -> None:
    with RedisServer() as server:
        ledger = make(server.url, timeout_ms=100, breaker={"failures": 3, "cooldown_ms": 300})
        try:
            await ledger.snapshot("p")
            server.pause()  # SIGSTOP: connections hang, nothing answers
            for _ in range(3):
                started = time.perf_counter()
                with pytest.raises(LedgerUnavailable, match="Timeout"):
                    await ledger.snapshot("p")
                # one attempt, not redis-py's default of several retries with backoff
                assert time.perf_counter() - started < 0.35
            assert ledger.breaker.state is State.OPEN
            started = time.perf_counter()
            with pytest.raises(LedgerUnavailable, match="circuit open"):
                await ledger.reserve(entry("x"))
            assert time.perf_counter() - started < 0.01  # refused without touching Redis
            server.resume()
            back = time.monotonic()
            while True:
                try:
                    await ledger.snapshot("p")
                    break
                except LedgerUnavailable:
                    assert time.monotonic() - back < 1.0, "not recovered within a second"
                    await asyncio.sleep(0.02)
            assert ledger.breaker.state is State.CLOSED
            server.kill()  # connection refused: fails at once
            started = time.perf_counter()
            with pytest.raises(LedgerUnavailable, match="ConnectionError"):
                await ledger.snapshot("p")
            assert time.perf_counter() - started < 0.1
        finally:
            await ledger.close()


async def test_a_cancellation_redis_py_lost_is_given_back_to_the_caller() -> None:
    """On Python 3.11, redis-py's ``asyncio.wait_for`` can swallow a cancellation that races
    with a write; a renewal loop would then renew a finished request forever. The seam raises
    it again. The stand-in client swallows the cancel the way ``wait_for`` can."""

    class Swallowing:
        async def evalsha(self, *args: Any) -> Any:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return [0, b"0"]
            raise AssertionError("not cancelled")

    ledger = RedisLedger(Swallowing())
    call = asyncio.create_task(ledger.snapshot("p"))
    await asyncio.sleep(0.01)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_maxmemory_policies_that_could_evict_ledger_keys_are_reported_loudly(
        server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    r = server.client()
    try:
        for policy, loud in [("allkeys-lru", True), ("volatile-lru", False),
                             ("noeviction", False)]:
            r.config_set("maxmemory-policy", policy)
            caplog.clear()
            ledger = make(server.url)
            await ledger.check()
            await ledger.close()
            assert ledger.eviction_policy == policy
            errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
            assert bool(errors) is loud, policy
            if loud:
                assert "REDIS MAY EVICT LEDGER KEYS" in errors[0].getMessage()
    finally:
        r.config_set("maxmemory-policy", "noeviction")


# --- deployment forms ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return Certs.make(tmp_path_factory.mktemp("certs"))


async def test_tls_with_our_ca_and_refused_without_it(certs: Certs) -> None:
    with RedisServer(tls=certs) as server:
        assert server.url.startswith("rediss://")
        await round_trip(make(server.url, tls={"ca_file": str(certs.ca)}))
        untrusted = make(server.url)
        with pytest.raises(LedgerUnavailable, match=r"(?i)certificate"):
            await untrusted.snapshot("p")
        await untrusted.close()


async def test_unix_socket() -> None:
    with RedisServer(unix=True, port=0) as server:
        assert server.url.startswith("unix://")
        await round_trip(make(server.url))


# The least privilege the ledger needs (also in docs/redis-ledger.md).
LEDGER_ACL = ("ledger on >{password} resetkeys ~extproc:* resetchannels -@all +evalsha +eval"
              " +zadd +zscore +zcard +zrem +zrangebyscore +hget +hset +hdel +hgetall +get +set"
              " +del +incrby +decrby +time"
              " +config|get")


async def test_acl_user_with_least_privilege_and_a_password_from_a_file_or_env(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    acl = [LEDGER_ACL.format(password="s3cret-pw"), "admin on >admin-pw ~* &* +@all",
           "default off"]
    with RedisServer(acl=acl) as server:
        secret = tmp_path / "redis-password"
        secret.write_text("s3cret-pw\n")
        by_file = make(server.url, key_prefix="extproc", username="ledger",
                       password_file=str(secret))
        await by_file.check()  # CONFIG GET is allowed: no warning about eviction
        assert by_file.eviction_policy == "noeviction"
        await round_trip(by_file)
        by_env = RedisLedger.from_config(config.from_mapping({"ledger": {
            "kind": "redis", "url": server.url, "username": "ledger",
            "password_env": "LEDGER_PW"}}).ledger, ["p"], environ={"LEDGER_PW": "s3cret-pw"})
        await round_trip(by_env)
        wrong = make(server.url, username="ledger", password="wrong-pw")
        with pytest.raises(LedgerUnavailable) as err:
            await wrong.snapshot("p")
        assert "wrong-pw" not in str(err.value) and "Authentication" in str(err.value)
        await wrong.close()
        no_password = make(server.url)  # the default user is off
        with pytest.raises(LedgerUnavailable):
            await no_password.snapshot("p")
        await no_password.close()
    assert "s3cret-pw" not in caplog.text


async def test_sentinel_finds_the_master_and_follows_a_failover() -> None:
    # no 5 s wait before the replica's first full sync
    with RedisServer(settings={"repl-diskless-sync-delay": "0"}) as master, \
            RedisServer() as replica:
        replica.client().replicaof("127.0.0.1", master.port)
        poll(lambda: replica.client().info("replication").get("master_link_status") == "up",
             5, "replica in sync")
        with RedisSentinel(master) as sentinel:
            poll(lambda: sentinel.client().execute_command(
                "SENTINEL", "REPLICAS", RedisSentinel.SERVICE) != [], 5, "replica discovered")
            ledger = make(sentinel={"addresses": [f"127.0.0.1:{sentinel.port}"],
                                    "service_name": RedisSentinel.SERVICE},
                          timeout_ms=200, breaker={"failures": 1000})
            try:
                assert await ledger.reserve(entry("before", 100.0))
                poll(lambda: replica.client().hget(ledger.keys("p")[1], "before") is not None,
                     5, "entry replicated")
                master.kill()
                failed_over = time.monotonic()
                while True:  # unavailable until Sentinel promotes the replica, then back
                    try:
                        snap = await ledger.snapshot("p")
                        break
                    except LedgerUnavailable:
                        assert time.monotonic() - failed_over < 15, "no failover"
                        await asyncio.sleep(0.1)
                assert sentinel.master_address() == ("127.0.0.1", replica.port)
                assert snap.inflight == 1  # replicated before the failover
                assert await ledger.release("before", "p")
            finally:
                await ledger.close()
