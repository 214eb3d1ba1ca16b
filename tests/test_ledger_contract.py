"""One contract, every ledger implementation: in-process, Redis, and a 3-node Redis Cluster.

The Redis params start their own servers once per session (on free ports, never 6379) and give
every test a fresh key prefix; ``-m 'not redis'`` runs the in-process ledger alone.
"""

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator, Iterator

import pytest

from extproc import config
from extproc.ledger import Cap, Entry, Ledger, Reserved
from extproc.ledger.memory import MemoryLedger
from extproc.ledger.redis import RedisLedger
from tests.redis_server import RedisClusterNodes, RedisServer

_prefixes = itertools.count()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def cluster_url() -> Iterator[str]:
    with RedisClusterNodes() as cluster:
        yield cluster.url


def redis_ledger(url: str, cluster: bool = False) -> RedisLedger:
    settings = config.from_mapping({"ledger": {
        "kind": "redis", "url": url, "cluster": cluster, "timeout_ms": 2_000,
        "key_prefix": f"contract{next(_prefixes)}"}})
    return RedisLedger.from_config(settings.ledger, ["p"])


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("cluster", marks=pytest.mark.redis)])
async def ledger(request: pytest.FixtureRequest) -> AsyncIterator[Ledger]:
    impl: Ledger
    if request.param == "memory":
        impl = MemoryLedger()
    elif request.param == "redis":
        impl = redis_ledger(request.getfixturevalue("redis_url"))
    else:
        impl = redis_ledger(request.getfixturevalue("cluster_url"), cluster=True)
    yield impl
    await impl.close()


def entry(rid: str, cost: float = 100.0, pool: str = "p", lease_ms: float = 60_000,
          kv: int = 1000, groups: tuple[str, ...] = ()) -> Entry:
    return Entry(request_id=rid, pool=pool, charge_ms=cost, lease_ms=lease_ms, kv_tokens=kv,
                 groups=groups)


async def test_empty_pool_snapshot(ledger: Ledger) -> None:
    snap = await ledger.snapshot("p")
    assert (snap.inflight, snap.outstanding_ms, snap.kv_tokens) == (0, 0.0, 0)


async def test_the_kv_tokens_entries_hold_add_up_through_every_operation(ledger: Ledger) -> None:
    await ledger.reserve(entry("a", kv=1200))
    await ledger.reserve(entry("b", kv=30_000))
    await ledger.reserve(entry("a", kv=1200))  # a retried reserve counts once
    assert (await ledger.snapshot("p")).kv_tokens == 31_200
    assert await ledger.adjust("a", "p", 120.0, kv_tokens=1500)  # the exact count came
    assert await ledger.adjust("b", "p", 90.0)  # cost only: its tokens stay
    assert (await ledger.snapshot("p")).kv_tokens == 31_500
    assert not await ledger.reserve(entry("c", 900.0, kv=99), ceiling_ms=1.0)  # refused
    assert (await ledger.snapshot("p")).kv_tokens == 31_500
    await ledger.reserve(entry("short", lease_ms=50, kv=7))
    await asyncio.sleep(0.15)
    assert await ledger.expire() == 1
    assert await ledger.release("a", "p")
    assert (await ledger.snapshot("p")).kv_tokens == 30_000
    assert await ledger.release("b", "p")
    assert (await ledger.snapshot("p")).kv_tokens == 0


async def test_reserve_then_release_round_trip(ledger: Ledger) -> None:
    assert await ledger.reserve(entry("a", 100.0))
    assert await ledger.reserve(entry("b", 250.0))
    snap = await ledger.snapshot("p")
    assert (snap.inflight, snap.outstanding_ms) == (2, pytest.approx(350.0))
    assert await ledger.release("a", "p")
    snap = await ledger.snapshot("p")
    assert (snap.inflight, snap.outstanding_ms) == (1, pytest.approx(250.0))


async def test_reserving_the_same_id_twice_counts_once(ledger: Ledger) -> None:
    assert await ledger.reserve(entry("a", 100.0))
    assert await ledger.reserve(entry("a", 100.0))
    assert (await ledger.snapshot("p")).inflight == 1


async def test_release_is_exactly_once(ledger: Ledger) -> None:
    await ledger.reserve(entry("a"))
    await ledger.reserve(entry("b"))
    assert await ledger.release("a", "p")
    assert not await ledger.release("a", "p")  # double
    assert not await ledger.release("zzz", "p")  # unknown
    assert not await ledger.release("b", "other-pool")  # wrong pool touches nothing
    snap = await ledger.snapshot("p")
    assert (snap.inflight, snap.outstanding_ms) == (1, pytest.approx(100.0))


async def test_ceiling_refuses_atomically_and_leaves_ledger_unchanged(ledger: Ledger) -> None:
    assert await ledger.reserve(entry("a", 600.0), ceiling_ms=1000.0)
    assert not await ledger.reserve(entry("b", 500.0), ceiling_ms=1000.0)
    assert await ledger.reserve(entry("c", 400.0), ceiling_ms=1000.0)  # exactly at the ceiling
    snap = await ledger.snapshot("p")
    assert (snap.inflight, snap.outstanding_ms) == (2, pytest.approx(1000.0))
    assert not await ledger.release("b", "p")


async def test_the_count_refuses_the_slot_another_gateway_took(ledger: Ledger) -> None:
    # Two gateways both saw one entry in flight and one slot free (2 slots): each admits with
    # max_inflight 2 and a work ceiling with room to spare; only the first reserve lands.
    assert await ledger.reserve(entry("held", 100.0))
    assert await ledger.reserve(entry("first", 100.0), ceiling_ms=1000.0, max_inflight=2)
    assert not await ledger.reserve(entry("second", 100.0), ceiling_ms=1000.0, max_inflight=2)
    assert await ledger.reserve(entry("first", 100.0), ceiling_ms=1000.0, max_inflight=2)  # again
    snap = await ledger.snapshot("p")
    assert (snap.inflight, snap.outstanding_ms) == (2, pytest.approx(200.0))
    assert await ledger.release("held", "p")
    assert await ledger.reserve(entry("second", 100.0), ceiling_ms=1000.0, max_inflight=2)


async def test_pools_are_independent(ledger: Ledger) -> None:
    await ledger.reserve(entry("a", 100.0, pool="x"))
    await ledger.reserve(entry("b", 200.0, pool="y"))
    assert (await ledger.snapshot("x")).outstanding_ms == pytest.approx(100.0)
    assert (await ledger.snapshot("y")).outstanding_ms == pytest.approx(200.0)


async def test_expired_leases_are_reclaimed_and_live_ones_kept(ledger: Ledger) -> None:
    await ledger.reserve(entry("short", 100.0, lease_ms=50))
    await ledger.reserve(entry("long", 200.0, lease_ms=60_000))
    await asyncio.sleep(0.15)
    assert await ledger.expire() == 1
    snap = await ledger.snapshot("p")
    assert (snap.inflight, snap.outstanding_ms) == (1, pytest.approx(200.0))
    assert not await ledger.release("short", "p")  # a late release is a no-op


async def test_renewal_keeps_an_entry_past_its_first_lease(ledger: Ledger) -> None:
    await ledger.reserve(entry("a", lease_ms=150))
    for _ in range(4):
        await asyncio.sleep(0.05)
        assert await ledger.renew("a", "p", 150)
    assert await ledger.expire() == 0
    assert (await ledger.snapshot("p")).inflight == 1
    assert not await ledger.renew("gone", "p", 150)


async def test_a_heartbeat_keeps_its_entries_and_the_others_lapse(ledger: Ledger) -> None:
    """Two replicas' entries on short leases; only one replica keeps beating. Its entries
    outlive many leases, the silent one's lapse after one; a heartbeat names the ids it did
    not find and never re-creates them."""
    for rid in ("alive1", "alive2", "dead1", "dead2"):
        assert await ledger.reserve(entry(rid, lease_ms=150))
    for _ in range(6):  # 0.3 s: twice the lease
        await asyncio.sleep(0.05)
        assert await ledger.heartbeat("p", ["alive1", "alive2"], 150) == []
    assert await ledger.expire() == 2
    snap = await ledger.snapshot("p")
    assert (snap.inflight, snap.outstanding_ms, snap.kv_tokens) == (2, 200.0, 2000)
    assert await ledger.heartbeat("p", ["alive1", "dead1", "never"], 150) == ["dead1", "never"]
    assert await ledger.heartbeat("other", ["alive1"], 150) == ["alive1"]
    assert (await ledger.snapshot("p")).inflight == 2
    assert await ledger.heartbeat("p", [], 150) == []
    for rid in ("alive1", "alive2"):
        assert await ledger.release(rid, "p")


async def test_outstanding_returns_to_exactly_zero(ledger: Ledger) -> None:
    ids = [f"r{i}" for i in range(200)]
    for i, rid in enumerate(ids):
        await ledger.reserve(entry(rid, cost=0.1 * (i + 1)))
    for rid in ids:
        await ledger.release(rid, "p")
    snap = await ledger.snapshot("p")
    assert (snap.inflight, snap.outstanding_ms) == (0, 0.0)


async def test_adjust_changes_a_live_entry_and_nothing_else(ledger: Ledger) -> None:
    await ledger.reserve(entry("a", 100.0))
    await ledger.reserve(entry("b", 250.0))
    assert await ledger.adjust("a", "p", 130.0)
    snap = await ledger.snapshot("p")
    assert (snap.inflight, snap.outstanding_ms) == (2, pytest.approx(380.0))
    assert not await ledger.adjust("gone", "p", 999.0)  # never re-creates
    assert not await ledger.adjust("b", "other-pool", 999.0)
    assert await ledger.release("a", "p")  # the release takes the adjusted cost away
    snap = await ledger.snapshot("p")
    assert (snap.inflight, snap.outstanding_ms) == (1, pytest.approx(250.0))
    assert not await ledger.adjust("a", "p", 50.0)  # released: stays gone
    assert (await ledger.snapshot("p")).inflight == 1


async def test_memory_ledger_lease_heap_stays_proportional_to_live_entries() -> None:
    core = MemoryLedger().core
    for i in range(10_000):  # long leases, never expired: released ids must not pile up
        core.reserve(entry(f"r{i}", lease_ms=3_600_000))
        core.renew(f"r{i}", "p", 3_600_000)
        if i >= 10:
            core.release(f"r{i - 10}", "p")
    assert core.snapshot("p").inflight == 10
    assert len(core._pools["p"].leases) <= 2 * 10 + 64
    for i in range(9_990, 10_000):
        assert core.release(f"r{i}", "p")


async def test_groups_count_and_weigh_their_entries_through_every_operation(
        ledger: Ledger) -> None:
    acme, std, crit = "t:acme", "p:0", "p:1"
    await ledger.reserve(entry("a", 100.0, groups=(std, acme)))
    await ledger.reserve(entry("b", 250.5, groups=(crit, acme)))
    await ledger.reserve(entry("c", 40.0, groups=(std, "t:other%20co")))
    await ledger.reserve(entry("a", 100.0, groups=(std, acme)))  # a retry counts once
    snap = await ledger.snapshot("p")
    assert snap.groups == {acme: (2, 350.5), std: (2, 140.0), crit: (1, 250.5),
                           "t:other%20co": (1, 40.0)}
    assert await ledger.adjust("b", "p", 200.5)  # its groups' work follows
    assert (await ledger.snapshot("p")).groups[acme] == (2, 300.5)
    await ledger.reserve(entry("short", 7.0, lease_ms=50, groups=(crit,)))
    await asyncio.sleep(0.15)
    assert await ledger.expire() == 1  # an expired entry leaves its groups too
    assert (await ledger.snapshot("p")).groups[crit] == (1, 200.5)
    assert await ledger.release("a", "p")
    assert not await ledger.release("a", "p")  # a double release touches no group
    assert (await ledger.snapshot("p")).groups == {acme: (1, 200.5), std: (1, 40.0),
                                                    crit: (1, 200.5), "t:other%20co": (1, 40.0)}
    assert await ledger.release("b", "p")
    assert await ledger.release("c", "p")
    assert (await ledger.snapshot("p")).groups == {}  # emptied groups leave nothing


async def test_caps_refuse_atomically_per_group_and_change_nothing(ledger: Ledger) -> None:
    cap = (Cap("t:acme", max_inflight=2, max_ms=500.0),)
    assert await ledger.reserve(entry("a", 200.0, groups=("t:acme",)), caps=cap)
    assert await ledger.reserve(entry("b", 200.0, groups=("t:acme",)), caps=cap)
    before = await ledger.snapshot("p")
    assert not await ledger.reserve(entry("c", 1.0, groups=("t:acme",)), caps=cap)  # count
    assert await ledger.release("b", "p")
    assert not await ledger.reserve(entry("d", 300.5, groups=("t:acme",)), caps=cap)  # work
    assert await ledger.reserve(entry("e", 300.0, groups=("t:acme",)), caps=cap)  # exactly
    # another tenant's entries are not the capped group's
    assert await ledger.reserve(entry("f", 900.0, groups=("t:beta",)),
                                caps=(Cap("t:beta", max_inflight=1),))
    snap = await ledger.snapshot("p")
    assert snap.groups["t:acme"] == (2, 500.0)
    assert (snap.inflight, before.inflight) == (3, 2)
    assert await ledger.reserve(entry("e", 300.0, groups=("t:acme",)), caps=cap)  # a retry


# --- held requests across gateways (``wait``) ------------------------------------------------

def ranked(rid: str, priority: int, gateway: str, cost: float = 100.0) -> Entry:
    return dataclasses.replace(entry(rid, cost), priority=priority, gateway=gateway)


async def test_a_lower_priority_yields_while_another_gateway_holds_a_higher_one(
        ledger: Ledger) -> None:
    """Gateway b holds critical requests (level 1). Gateway a's standard (0) entries yield and
    record nothing, though they fit; a's critical ones, b's own standard ones and entries
    recorded without a ceiling (shadow mode) go. Once b holds only standard, or nothing, a's
    standard entries go too."""
    await ledger.wait("p", "b", 1, 60_000)
    assert await ledger.reserve(ranked("s1", 0, "a"), ceiling_ms=10_000) is Reserved.YIELDED
    assert (await ledger.snapshot("p")).inflight == 0  # a yield records nothing
    assert await ledger.reserve(ranked("c1", 1, "a"), ceiling_ms=10_000) is Reserved.RECORDED
    assert await ledger.reserve(ranked("s2", 0, "b"), ceiling_ms=10_000)  # b's own
    assert await ledger.reserve(ranked("s3", 0, "a"))  # no ceiling: recorded anyway
    assert await ledger.reserve(ranked("f1", 0, "a", 20_000.0),
                                ceiling_ms=10_000) is Reserved.FULL  # full before yielding
    await ledger.wait("p", "b", 0, 60_000)
    assert await ledger.reserve(ranked("s1", 0, "a"), ceiling_ms=10_000)
    await ledger.wait("p", "b", 1, 60_000)
    assert await ledger.reserve(ranked("s4", 0, "a"), ceiling_ms=10_000) is Reserved.YIELDED
    await ledger.wait("p", "b", None, 60_000)  # b holds nothing
    assert await ledger.reserve(ranked("s4", 0, "a"), ceiling_ms=10_000)
    assert (await ledger.snapshot("p")).inflight == 5


async def test_a_dead_gateways_held_requests_lapse_with_their_lease(ledger: Ledger) -> None:
    await ledger.wait("p", "b", 2, 50)
    assert await ledger.reserve(ranked("s", 1, "a"), ceiling_ms=10_000) is Reserved.YIELDED
    await asyncio.sleep(0.15)
    assert await ledger.reserve(ranked("s", 1, "a"), ceiling_ms=10_000)
    assert await ledger.release("s", "p")
    assert await ledger.expire() == 0  # counts entries; the lapsed gateway goes quietly
