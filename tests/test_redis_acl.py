"""The Redis ledger with least privilege over TLS: an ACL user confined to the ledger's key
prefix and the commands its scripts run does every ledger operation, and nothing else."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from extproc import config
from extproc.errors import LedgerUnavailable
from extproc.ledger import Entry
from extproc.ledger.redis import RedisLedger
from tests.redis_server import Certs, RedisServer
from tests.test_ledger_redis import LEDGER_ACL

pytestmark = pytest.mark.redis

PASSWORD = "ledger-pw-7c1e"
REFUSED = r"(?i)noperm|no permissions|can't access|can't run"  # Redis's ACL refusals


def ledger(server: RedisServer, certs: Certs, prefix: str = "extproc") -> RedisLedger:
    section = {"kind": "redis", "url": server.url, "username": "ledger", "password": PASSWORD,
               "key_prefix": prefix, "tls": {"ca_file": str(certs.ca)}, "timeout_ms": 2_000}
    return RedisLedger.from_config(config.from_mapping({"ledger": section}).ledger, ["p"])


def entry(rid: str, cost: float, lease_ms: float = 60_000) -> Entry:
    return Entry(request_id=rid, pool="p", charge_ms=cost, lease_ms=lease_ms)


async def test_a_user_confined_to_the_ledger_prefix_runs_it_over_tls_and_nothing_else(
        tmp_path: Path) -> None:
    certs = Certs.make(tmp_path / "certs")
    acl = [LEDGER_ACL.format(password=PASSWORD), "admin on >admin-pw ~* &* +@all",
           "default off"]
    with RedisServer(tls=certs, acl=acl) as server:
        assert server.url.startswith("rediss://")  # TLS only: no plaintext port
        admin = server.client(username="admin", password="admin-pw")
        admin.set("app:secret", "s3cret")
        led = ledger(server, certs)
        try:
            await led.check()  # CONFIG GET maxmemory-policy is allowed
            assert led.eviction_policy == "noeviction"
            assert await led.reserve(entry("a", 600.0), ceiling_ms=1_000.0)
            assert not await led.reserve(entry("b", 500.0), ceiling_ms=1_000.0)
            assert await led.renew("a", "p", 60_000)
            assert await led.reserve(entry("lapses", 100.0, lease_ms=1))
            await asyncio.sleep(0.05)
            assert await led.expire() == 1
            admin.script_flush()  # the scripts are sent again (EVAL), under the same ACL
            snap = await led.snapshot("p")
            assert (snap.inflight, snap.outstanding_ms) == (1, 600.0)
            assert await led.release("a", "p")
            assert (await led.snapshot("p")).inflight == 0
        finally:
            await led.close()

        user = server.client(username="ledger", password=PASSWORD)
        attempts: dict[str, Callable[[], Any]] = {
            "read another key": lambda: user.get("app:secret"),
            "write another key": lambda: user.set("app:secret", "x"),
            "list keys": lambda: user.keys("*"),
            "script on another key": lambda: user.eval(
                "return redis.call('GET', KEYS[1])", 1, "app:secret"),
            "script reaching past its keys": lambda: user.eval(
                "return redis.call('GET', 'app:secret')", 0),
            "flush": lambda: user.flushall(),
            "change the config": lambda: user.config_set("maxmemory-policy", "allkeys-lru"),
        }
        for what, attempt in attempts.items():
            with pytest.raises(redis.ResponseError, match=REFUSED) as err:
                attempt()
            assert "s3cret" not in str(err.value), what
        user.close()
        assert admin.get("app:secret") == b"s3cret"
        assert admin.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"

        elsewhere = ledger(server, certs, prefix="other")  # its keys are outside ~extproc:*
        with pytest.raises(LedgerUnavailable, match=REFUSED):
            await elsewhere.snapshot("p")
        await elsewhere.close()
        admin.close()
