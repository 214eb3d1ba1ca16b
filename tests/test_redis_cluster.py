"""The Redis ledger on a real 3-node Redis Cluster, beyond the contract suite (which also runs
there, see ``test_ledger_contract.py``): pools spread over the nodes, a pool never spans two
slots, and scripts come back after a node lost them."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.crc import key_slot

from extproc import config
from extproc.ledger import Entry
from extproc.ledger.redis import RedisLedger
from tests.redis_server import RedisClusterNodes

pytestmark = pytest.mark.redis

POOLS = tuple(f"model-{i}" for i in range(12))


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterNodes]:
    with RedisClusterNodes() as c:
        yield c


def make(cluster: RedisClusterNodes, prefix: str) -> RedisLedger:
    settings = config.from_mapping({"ledger": {
        "kind": "redis", "url": cluster.url, "cluster": True, "timeout_ms": 2_000,
        "key_prefix": prefix}})
    return RedisLedger.from_config(settings.ledger, POOLS)


def owner(cluster: RedisClusterNodes, key: str) -> int:
    """The port of the node serving ``key``'s slot, asked of the nodes themselves."""
    slot = key_slot(key.encode())
    for start, end, (_, port, *_rest), *_ in cluster.nodes[0].client().cluster("SLOTS"):
        if start <= slot <= end:
            return int(port)
    raise AssertionError(f"slot {slot} unassigned")


async def test_pools_spread_over_the_nodes_each_pool_in_one_slot(
        cluster: RedisClusterNodes) -> None:
    ledger = make(cluster, "spread")
    try:
        for pool in POOLS:
            assert await ledger.reserve(Entry(f"r-{pool}", pool, 10.0, 60_000), 100.0)
            assert len({key_slot(k.encode()) for k in ledger.keys(pool)}) == 1
        owners = {owner(cluster, ledger.keys(pool)[0]) for pool in POOLS}
        assert len(owners) >= 2  # the work really is spread, and every call found its node
        for pool in POOLS:
            snap = await ledger.snapshot(pool)
            assert (snap.inflight, snap.outstanding_ms) == (1, 10.0)
            assert await ledger.release(f"r-{pool}", pool)
        assert await ledger.expire() == 0
    finally:
        await ledger.close()


async def test_every_node_that_lost_its_scripts_gets_them_again(
        cluster: RedisClusterNodes) -> None:
    scripts = Path(__file__).parent.parent / "extproc/ledger"
    source = (scripts / "entries.lua").read_bytes() + (scripts / "reserve.lua").read_bytes()
    sha = hashlib.sha1(source).hexdigest()  # as sent: the shared helpers, then the script
    for node in cluster.nodes:
        node.client().script_flush()
    ledger = make(cluster, "flushed")
    try:
        for pool in POOLS:
            assert await ledger.reserve(Entry(f"r-{pool}", pool, 10.0, 60_000))
            assert await ledger.release(f"r-{pool}", pool)
        owners = {owner(cluster, ledger.keys(pool)[0]) for pool in POOLS}
        for node in cluster.nodes:
            assert node.client().script_exists(sha) == [node.port in owners]
    finally:
        await ledger.close()
