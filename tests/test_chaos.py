"""Chaos: the failure-mode guarantees of the README, each measured through real parts (Envoy,
two ``extproc serve`` replicas sharing a real Redis ledger, the fake backend) and written to
JSON (``EXTPROC_CHAOS_OUT``, ``out/chaos`` by default), one file per scenario and size.

- ``bursts``: bursts of 16 simultaneous requests on 8 slots (2 backends x 4), through both
  replicas: each burst admits exactly what one gateway alone would (8), never more.
- ``kill``: ``kill -9`` of one replica under open-loop load, fail-open and fail-closed: how
  soon Envoy stops sending it streams (Envoy's count of requests that passed without a
  processor, or its 503s, stop growing; the host is flagged), that nothing fails after that
  window, and how long its ledger entries hold capacity (held on it before the kill).
- ``redis_restart``: Redis killed and restarted empty under load, fail-closed: no decision
  falls back (429 ``ledger_unavailable``) once both replicas see it answering again.

Two sizes, one implementation: ``short`` is part of ``make test`` (CI: ~1.5 min on 2 cores);
``long`` is marked ``chaos`` (``make chaos``) and repeats each scenario more (100 bursts,
longer loads, more restarts). Timing assertions have generous bounds; the JSON has the
measured figures, which the README's failure-mode table quotes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from extproc import config
from extproc.decision.admission import Outcome
from extproc.fleet.capacity import StaticCapacity
from extproc.gateway.gate import Gate
from extproc.ledger.memory import MemoryLedger
from extproc.observability.metrics import Metrics
from extproc_dev.stack import LocalStack, scrape
from tests.redis_server import RedisServer
from tests.test_redis_stack import HeldStream
from tests.traffic import Ask, Traffic, count, envoy_stats, health, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.redis]

OUT = Path(os.environ.get("EXTPROC_CHAOS_OUT", "out/chaos"))
CHAT = "/v1/chat/completions"
SLOTS = 8
PREFIX = "chaos"
FAILED_STAT = "http.ingress.ext_proc.failure_mode_allowed"
# 300 tokens charged with a 1.2 s deadline: no wait for a slot fits, so exactly the free
# slots are admitted (the decision's max_inflight); the backend makes 40 tokens (~0.3 s).
BURST_ASK = Ask(prompt_tokens=20, max_tokens=300, output_tokens=40, deadline_ms=1200)
# Under load: a generous deadline, so nearly everything is admitted and served.
LOAD_ASK = Ask(prompt_tokens=20, max_tokens=100, output_tokens=40)
LIVENESS_MS = 3_000.0  # the default


def settings(redis: RedisServer, **ledger: Any) -> dict[str, Any]:
    return {
        "pools": [{"name": "llama", "models": ["*"], "replicas": 2,
                   "engine": {"max_num_seqs": 4, "step_base_ms": 1.1, "ms_per_seq": 0.82}}],
        "drain_grace_s": 0,
        "ledger": {"kind": "redis", "url": redis.url, "key_prefix": PREFIX, "timeout_ms": 200,
                   "decision_deadline_ms": 500, "sweep_interval_ms": 200,
                   "liveness_ms": LIVENESS_MS, **ledger},
    }


def write(name: str, figures: dict[str, Any]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    print(name, json.dumps(figures, sort_keys=True))


def leases_key() -> str:
    return f"{PREFIX}:{{llama}}:leases"


def entries(redis: RedisServer) -> int:
    return int(redis.client().zcard(leases_key()))


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def start(tmp_path: Path, redis: RedisServer, *, fail_open: bool = True,
          **ledger: Any) -> LocalStack:
    stack = LocalStack(tmp_path / "stack", settings(redis, **ledger), extproc_replicas=2,
                       backends=2, fail_open=fail_open,
                       backend_args=["--max-running", "4", "--time-scale", "0.5"])
    stack.start()
    return stack


# --- bursts ----------------------------------------------------------------------------------

def one_gateway_admits(cfg: dict[str, Any], n: int) -> int:
    """What a single gateway, in process, on its own ledger, admits of ``n`` such requests
    arriving together (nothing finishing in between): the reference for the fleet."""
    c = config.from_mapping({**cfg, "ledger": {}})
    gate = Gate(c, MemoryLedger(), StaticCapacity(c.pools), Metrics())
    route = c.route(CHAT)
    assert route is not None
    texts = BURST_ASK.texts()

    async def run() -> int:
        verdicts = [await gate.check(route, CHAT, BURST_ASK.headers(), BURST_ASK.body(i, texts))
                    for i in range(n)]
        for v in verdicts:
            if v.ticket is not None:
                await gate.settle(v.ticket)
        return sum(v.outcome is Outcome.ADMIT for v in verdicts)

    return asyncio.run(run())


async def bursts(stack: LocalStack, redis: RedisServer, n: int, size: int) -> list[int]:
    admitted = []
    async with Traffic(stack.url, BURST_ASK, timeout_s=30.0) as traffic:
        for _ in range(n):
            replies = await asyncio.gather(*(traffic.one() for _ in range(size)))
            admitted.append(sum(r.status == 200 for r in replies))
            assert {r.kind for r in replies} <= {"200", "429"}, count(replies)
            await wait_until(lambda: entries(redis) == 0, 10.0, "burst finished")
    return admitted


@pytest.mark.parametrize("n", [pytest.param(20, id="short"),
                               pytest.param(100, id="long", marks=pytest.mark.chaos)])
def test_bursts_on_two_replicas_admit_exactly_the_slots(tmp_path: Path, redis: RedisServer,
                                                        n: int) -> None:
    size = 2 * SLOTS
    expected = one_gateway_admits(settings(redis), size)
    assert expected == SLOTS  # the decision admits the free slots and no queue
    stack = start(tmp_path, redis)
    try:
        admitted = asyncio.run(bursts(stack, redis, n, size))
        decided = [scrape(stack.replica_metrics_url(i), "extproc_admission_decisions_total")
                   for i in range(2)]
    finally:
        stack.stop()
    write(f"bursts-{'long' if n >= 100 else 'short'}", {
        "bursts": n, "burst_size": size, "slots": SLOTS,
        "exact": sum(a == SLOTS for a in admitted), "most_admitted": max(admitted),
        "fewest_admitted": min(admitted), "over_slots_max": max(admitted) - SLOTS,
        "decisions_per_replica": decided})
    assert all(d > 0 for d in decided), f"Envoy used both replicas: {decided}"
    assert admitted == [SLOTS] * n, admitted


# --- kill -9 of a replica --------------------------------------------------------------------

class Sampler:
    """Envoy's counters and the dead host's flags, every 50 ms, on a thread."""

    def __init__(self, stack: LocalStack, host_port: int) -> None:
        self.stack = stack
        self.host = f"127.0.0.1:{host_port}"
        # (t, passed without a processor, 5xx, dead host flagged, streams sent to the host or
        # attempted on it: rq_total + cx_connect_fail, since a refused connection never
        # counts a request)
        self.samples: list[tuple[float, int, int, bool, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _host(self) -> tuple[bool, int]:
        """The host's health flags (failed?) and its streams (``rq_total`` plus
        ``cx_connect_fail``) from ``/clusters``."""
        url = f"http://127.0.0.1:{self.stack.admin_port}/clusters"
        flagged, streams = False, 0
        with urllib.request.urlopen(url, timeout=2) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(f"extproc::{self.host}::health_flags::"):
                    flagged = "failed" in line
                elif line.startswith((f"extproc::{self.host}::rq_total::",
                                      f"extproc::{self.host}::cx_connect_fail::")):
                    streams += int(line.rsplit("::", 1)[1])
        return flagged, streams

    def _run(self) -> None:
        while not self._stop.is_set():
            stats = envoy_stats(self.stack.admin_port, "")
            allowed = stats.get(FAILED_STAT, 0)
            errors = stats.get("http.ingress.downstream_rq_5xx", 0)
            self.samples.append((time.monotonic(), allowed, errors, *self._host()))
            self._stop.wait(0.05)

    def last_growth(self, index: int, after: float) -> float | None:
        """When counter ``index`` last grew after ``after`` (None: it never did)."""
        last = None
        previous = None
        for sample in self.samples:
            value = sample[index]
            if previous is not None and value > previous and sample[0] >= after:
                last = sample[0]
            previous = value
        return last

    def first_flagged(self, after: float) -> float | None:
        return next((s[0] for s in self.samples if s[0] >= after and s[3]), None)

    def grown(self, index: int, after: float) -> int:
        before = [s[index] for s in self.samples if s[0] < after]
        return self.samples[-1][index] - (before[-1] if before else 0)


async def kill_under_load(stack: LocalStack, redis: RedisServer, sampler: Sampler,
                          rate: float, after_s: float) -> dict[str, Any]:
    held = [HeldStream(stack.replica_grpc_port(1)) for _ in range(2)]
    try:
        assert [h.decide() for h in held] == ["admit", "admit"]
        held_ids = set(redis.client().zrange(leases_key(), 0, -1))
        assert len(held_ids) == 2
        async with Traffic(stack.url, LOAD_ASK, timeout_s=30.0) as traffic:
            stop = asyncio.Event()
            load = asyncio.create_task(traffic.open(rate, stop))
            await asyncio.sleep(2.0)
            stack.processes["extproc1"].signal(signal.SIGKILL)
            killed = time.monotonic()
            decided = await asyncio.to_thread(decisions, stack)  # a little after the kill

            def reclaimed() -> bool:
                return not held_ids & set(redis.client().zrange(leases_key(), 0, -1))

            reclaim_s = await wait_until(reclaimed, 30.0, "dead replica's entries reclaimed")
            await asyncio.sleep(max(0.0, killed + after_s - time.monotonic()))
            stop.set()
            await load
            decided = await asyncio.to_thread(decisions, stack) - decided
    finally:
        for h in held:
            h.close()
    return {"killed": killed, "reclaim_s": reclaim_s, "traffic": traffic,
            "survivor_decisions": decided}


def decisions(stack: LocalStack) -> float:
    """The survivor's decisions (replica 0's ``extproc_admission_decisions_total``)."""
    return scrape(stack.replica_metrics_url(0), "extproc_admission_decisions_total")


@pytest.mark.parametrize("fail_open", [True, False], ids=["fail-open", "fail-closed"])
@pytest.mark.parametrize("after_s", [pytest.param(8.0, id="short"),
                                     pytest.param(30.0, id="long", marks=pytest.mark.chaos)])
def test_kill_9_of_a_replica_under_load_stops_its_traffic_within_2_s(
        tmp_path: Path, redis: RedisServer, fail_open: bool, after_s: float) -> None:
    window_s = 2.0
    stack = start(tmp_path, redis, fail_open=fail_open)
    try:
        with Sampler(stack, stack.replica_grpc_port(1)) as sampler:
            run = asyncio.run(kill_under_load(stack, redis, sampler, 20.0, after_s))
        assert health(stack.replica_grpc_port(0)) == "SERVING"
    finally:
        stack.stop()
    killed: float = run["killed"]
    traffic: Traffic = run["traffic"]
    index = 1 if fail_open else 2
    last = sampler.last_growth(index, killed)
    flagged = sampler.first_flagged(killed)
    late = traffic.between(killed + window_s, killed + after_s)
    last_stream = sampler.last_growth(4, killed)
    started_after = len(traffic.between(killed, killed + after_s))
    figures = {
        "policy": "fail_open" if fail_open else "fail_closed",
        "requests": len(traffic.replies), "outcomes": count(traffic.replies),
        "after_window_outcomes": count(late),
        "unadmitted_after_kill" if fail_open else "errors_after_kill": sampler.grown(
            index, killed),
        "last_unprocessed_s": None if last is None else round(last - killed, 3),
        "host_flagged_s": None if flagged is None else round(flagged - killed, 3),
        "dead_entries_reclaimed_s": round(run["reclaim_s"], 3),
        "started_after_kill": started_after,
        "decided_by_survivor_after_kill": run["survivor_decisions"],
        "streams_to_dead_after_kill": sampler.grown(4, killed),
        "last_stream_to_dead_s": None if last_stream is None else round(last_stream - killed, 3),
        "liveness_ms": LIVENESS_MS,
    }
    write(f"kill-{figures['policy']}-{'long' if after_s >= 30 else 'short'}", figures)
    assert flagged is not None and flagged - killed <= window_s, figures
    assert last is None or last - killed <= window_s, figures
    assert set(count(late)) <= {"200", "429"}, figures  # nothing fails after the window
    # Envoy's own count of streams it sent to the dead host stops within the window
    assert last_stream is None or last_stream - killed <= window_s, figures
    assert set(count(traffic.replies)) <= {"200", "429", "503"}, figures
    # the dead replica's entries: its last beat's lease, a sweep, slack for a busy machine
    assert run["reclaim_s"] <= LIVENESS_MS / 1000 + 0.2 + 2.0, figures


# --- Redis restart ---------------------------------------------------------------------------

def fallbacks(stack: LocalStack) -> float:
    return sum(scrape(stack.replica_metrics_url(i), "extproc_ledger_unavailable_decisions_total")
               for i in range(2))


async def restarts(stack: LocalStack, redis: RedisServer, n: int) -> dict[str, Any]:
    spurious = 0
    outage = 0.0
    async with Traffic(stack.url, LOAD_ASK, timeout_s=30.0) as traffic:
        stop = asyncio.Event()
        load = asyncio.create_task(traffic.open(20.0, stop))
        for _ in range(n):
            await asyncio.sleep(1.5)
            await asyncio.to_thread(redis.kill)
            down = time.monotonic()
            await asyncio.sleep(1.0)
            await asyncio.to_thread(redis.start)
            await wait_until(lambda: all(health(stack.replica_grpc_port(i), "extproc.ledger")
                                         == "SERVING" for i in range(2)), 10.0, "ledger back")
            outage += time.monotonic() - down
            back = await asyncio.to_thread(fallbacks, stack)
            await asyncio.sleep(2.0)
            spurious += int(await asyncio.to_thread(fallbacks, stack) - back)
        stop.set()
        await load
    return {"spurious": spurious, "outage_s": outage, "traffic": traffic}


@pytest.mark.parametrize("n", [pytest.param(2, id="short"),
                               pytest.param(10, id="long", marks=pytest.mark.chaos)])
def test_a_restarted_redis_gives_no_spurious_ledger_unavailable(
        tmp_path: Path, redis: RedisServer, n: int) -> None:
    stack = start(tmp_path, redis, on_unavailable="fail_closed")
    try:
        run = asyncio.run(restarts(stack, redis, n))
        total = fallbacks(stack)
    finally:
        stack.stop()
    traffic: Traffic = run["traffic"]
    figures = {"restarts": n, "requests": len(traffic.replies),
               "outcomes": count(traffic.replies), "fallbacks_during_outages": total -
               run["spurious"], "spurious_after_recovery": run["spurious"],
               "mean_outage_s": round(run["outage_s"] / n, 3)}
    write(f"redis-restart-{'long' if n >= 10 else 'short'}", figures)
    assert run["spurious"] == 0, figures
    assert set(count(traffic.replies)) <= {"200", "429"}, figures
    client = Redis(host="127.0.0.1", port=redis.port)
    assert not list(client.scan_iter(f"{PREFIX}:*")), "no ledger entry left"
