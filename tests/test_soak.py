"""Soak: half of saturation for a bounded time, with faults injected every period, through a
real Envoy, two ``extproc serve`` replicas sharing a real Redis ledger and the fake backend.

Each period brings every fault once, a third of a period apart:

- ``kill -9`` of replica 1 and its restart a second later (its ledger entries stay in Redis
  until their leases end: the survivor's sweeper must remove them);
- SIGSTOP of the fake backend for a second, then SIGCONT (admitted work stalls, then
  finishes; Envoy's health check, 1 s timeout every 2 s, needs two failures in a row to take
  it out of rotation, so it stays in: a longer stop would turn into 503s by design);
- ``kill -9`` of Redis and its restart, empty, a second later (the ledger's fault policy,
  fail-open, admits meanwhile; releases of entries Redis forgot must be harmless).

Replica 0 is never touched: its resident memory is the one that must stay flat. Pass criteria:
every request answered 200 or 429 (Envoy is fail-open, the default), none unanswered (no
client timeout, no connection error); at the end no ledger entry left (no key of the ledger in
Redis, in-flight gauge 0 on both replicas); replica 0's RSS at the end within
``RSS_TOLERANCE`` of its RSS after the first period.

``RSS_TOLERANCE`` (12 MiB): with no tokenizer configured nothing in the process may grow with
traffic (metrics have fixed labels, the ledger lives in Redis), yet a Python process's RSS
moves by a few MiB without a leak (pymalloc arenas kept, gRPC's per-thread malloc arenas,
Redis reconnections). Medians of a few samples damp the noise. Over the long run's ~10^5
requests to replica 0 after the first minute, 12 MiB still catches a leak of ~100 bytes per
request; the short run catches only a few KiB per request (it is a smoke test of the same
code; the long run is the measurement).

Two durations, one implementation: the short run is part of ``make test``; the long one is
marked ``soak`` (``pytest -m soak tests/test_soak.py -s``; ``EXTPROC_SOAK_S`` seconds, 600 by
default, faults every minute) and prints the figures for the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from redis.exceptions import RedisError

from extproc_dev.stack import LocalStack
from tests.conftest import pool
from tests.redis_server import RedisServer
from tests.traffic import Ask, Traffic, count, figures, rss_bytes, saturation_rps, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.redis]

SOAK_S = float(os.environ.get("EXTPROC_SOAK_S", "600"))
RSS_TOLERANCE = 12 * 1024 * 1024
RSS_EVERY_S = 1.0
LEASE_GRACE_MS = 1_000.0
BACKEND_STOP_S = 1.0
PREFIX = "soak"

# As in the process-fault tests: two requests fit at a time in the pool's model, the rest of
# the load gets 429; the backend really serves each in ~0.2 s, with slots to spare for the
# unadmitted traffic of fail-open moments (processor or Redis away).
ASK = Ask(prompt_tokens=20, max_tokens=300, output_tokens=20, deadline_ms=1200)


def settings(redis: RedisServer) -> dict[str, Any]:
    return {
        "pools": [pool(replicas=1, max_num_seqs=2,
                   engine={"step_base_ms": 1.1, "ms_per_seq": 0.82})],
        "drain_grace_s": 0,
        "ledger": {"kind": "redis", "url": redis.url, "key_prefix": PREFIX,
                   "timeout_ms": 200, "decision_deadline_ms": 300,
                   "lease_grace_ms": LEASE_GRACE_MS, "sweep_interval_ms": 200},
    }


@dataclass
class Record:
    started: float = field(default_factory=time.monotonic)
    faults: Counter[str] = field(default_factory=Counter)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds in, bytes)
    most_entries: int = 0  # the largest ledger seen

    def rss_near(self, at_s: float, n: int = 3) -> float:
        """Median of the ``n`` samples nearest ``at_s`` seconds into the run."""
        nearest = sorted(self.rss, key=lambda s: abs(s[0] - at_s))[:n]
        return statistics.median(b for _, b in nearest)


async def inject(stack: LocalStack, redis: RedisServer, period_s: float, periods: int,
                 rec: Record) -> None:
    async def at(offset: float) -> None:
        await asyncio.sleep(max(0.0, rec.started + offset - time.monotonic()))

    backend = stack.processes["backend0"]
    for k in range(periods):
        base = k * period_s
        await at(base + 0.1 * period_s)
        stack.processes["extproc1"].signal(signal.SIGKILL)
        await asyncio.sleep(1.0)
        await asyncio.to_thread(stack.start_extproc, 1)
        rec.faults["extproc_kill9"] += 1

        await at(base + 0.4 * period_s)
        backend.signal(signal.SIGSTOP)
        await asyncio.sleep(BACKEND_STOP_S)
        backend.signal(signal.SIGCONT)
        rec.faults["backend_sigstop"] += 1

        await at(base + 0.7 * period_s)
        await asyncio.to_thread(redis.kill)
        await asyncio.sleep(1.0)
        await asyncio.to_thread(redis.start)
        rec.faults["redis_restart"] += 1


async def sample(pid: int, redis: RedisServer, rec: Record, stop: asyncio.Event) -> None:
    """Replica 0's RSS and the ledger's size (when Redis is up), every ``RSS_EVERY_S``."""
    leases = f"{PREFIX}:{{llama}}:leases"
    client = Redis(host="127.0.0.1", port=redis.port, socket_timeout=0.5,
                   socket_connect_timeout=0.5)
    while not stop.is_set():
        rec.rss.append((time.monotonic() - rec.started, rss_bytes(pid)))
        with contextlib.suppress(RedisError):
            rec.most_entries = max(rec.most_entries, int(await asyncio.to_thread(
                client.zcard, leases)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), RSS_EVERY_S)


def ledger_keys(redis: RedisServer) -> list[bytes]:
    return list(redis.client().scan_iter(f"{PREFIX}:*"))


def inflight(stack: LocalStack, replica: int) -> float:
    from extproc_dev.stack import scrape

    return scrape(stack.replica_metrics_url(replica), "extproc_inflight_requests")


async def soak(stack: LocalStack, redis: RedisServer, duration_s: float,
               period_s: float) -> dict[str, Any]:
    saturation = await saturation_rps(stack.url, ASK, clients=32, seconds=2.0)
    rate = saturation / 2
    survivor = stack.processes["extproc"].pid
    periods = max(1, round(duration_s / period_s))
    rec = Record()
    async with Traffic(stack.url, ASK, timeout_s=30.0) as traffic:
        stop = asyncio.Event()
        load = asyncio.create_task(traffic.open(rate, stop))
        sampler = asyncio.create_task(sample(survivor, redis, rec, stop))
        await inject(stack, redis, period_s, periods, rec)
        await asyncio.sleep(max(0.0, rec.started + periods * period_s - time.monotonic()))
        stop.set()
        await load
        await sampler
    ran_s = time.monotonic() - rec.started
    assert stack.processes["extproc"].pid == survivor and stack.processes[
        "extproc"].popen.poll() is None, "replica 0 survived the soak"
    # every lease (a request's expected finish + LEASE_GRACE_MS) has ended well before this
    settled_s = await wait_until(lambda: not ledger_keys(redis), 15.0, "ledger empty")
    await wait_until(lambda: inflight(stack, 0) == 0 and inflight(stack, 1) == 0, 5.0,
                     "in-flight gauges 0")
    return {"saturation_rps": saturation, "rate_rps": rate, "ran_s": ran_s, "rec": rec,
            "traffic": traffic, "periods": periods, "settled_s": settled_s,
            "swept": swept(stack.processes["extproc"].log())}


def swept(log: str) -> int:
    """Entries whose lease ended (a killed replica's), as the survivor's sweeper logged them."""
    return sum(int(n) for n in re.findall(r"expired (\d+) ledger entries", log))


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.mark.parametrize("duration_s, period_s", [
    pytest.param(30.0, 10.0, id="short"),
    pytest.param(SOAK_S, 60.0, id="long", marks=pytest.mark.soak),
])
def test_soak_with_faults_every_period(tmp_path: Path, redis: RedisServer, duration_s: float,
                                       period_s: float) -> None:
    with LocalStack(tmp_path / "stack", settings(redis), extproc_replicas=2,
                    backend_args=["--max-running", "32", "--time-scale", "0.5"]) as stack:
        run = asyncio.run(soak(stack, redis, duration_s, period_s))
    rec: Record = run["rec"]
    traffic: Traffic = run["traffic"]
    replies = traffic.replies
    kinds = count(replies)
    rss_start = rec.rss_near(period_s)
    rss_end = rec.rss_near(rec.rss[-1][0])
    print(figures(
        duration_s=run["ran_s"], period_s=period_s, saturation_rps=run["saturation_rps"],
        rate_rps=run["rate_rps"], requests=len(replies), outcomes=kinds,
        faults=dict(rec.faults), p99_s=sorted(r.seconds for r in replies)[
            int(0.99 * (len(replies) - 1))], slowest_s=max(r.seconds for r in replies),
        rss_first_mib=rec.rss[0][1] / 2**20, rss_after_first_period_mib=rss_start / 2**20,
        rss_max_mib=max(b for _, b in rec.rss) / 2**20, rss_end_mib=rss_end / 2**20,
        rss_growth_mib=(rss_end - rss_start) / 2**20, most_ledger_entries=rec.most_entries,
        swept_by_lease=run["swept"], ledger_settled_s=run["settled_s"]))

    assert rec.faults == {"extproc_kill9": run["periods"], "backend_sigstop": run["periods"],
                          "redis_restart": run["periods"]}
    assert set(kinds) <= {"200", "429"}, kinds  # none unanswered, nothing else
    assert kinds.get("200", 0) > 0 and kinds.get("429", 0) > 0, kinds
    assert len(replies) >= 0.9 * run["rate_rps"] * run["periods"] * period_s
    assert rec.most_entries > 0  # the ledger emptied at the end had been in use
    assert rss_end - rss_start <= RSS_TOLERANCE, (rss_start, rss_end)
