"""Engine signals in the running service: real fake-backend processes, a real ``Service`` and
its gRPC ext_proc stream. The engines' own queues tighten admission when traffic bypasses the
gateway; a stale scrape never does; the configuration names its bad keys; the scraper ends
with the service.

The pool: one replica of two slots; the latency class holds a first token to 2 s x 0.8. A
``chat(100)`` costs ~972 ms of GPU time in a full batch; on an empty ledger it starts at once.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import config
from extproc.decision.admission import Outcome, Reason, Snapshot
from extproc.errors import ConfigError
from extproc.fleet.capacity import StaticCapacity
from extproc.fleet.enginestats import EngineStats
from extproc.gateway.gate import Gate
from extproc.gateway.server import Service
from extproc.ledger import Cap, Entry
from extproc.ledger.memory import MemoryLedger
from extproc.observability.metrics import Metrics
from extproc_dev.stack import LocalStack, Process, free_port, scrape, wait_http
from tests.extproc_client import Stream, body, chat, headers, serving

FAST = {"interval_s": 0.1, "timeout_s": 0.3, "max_age_s": 1.0}  # max_age >= interval + timeout
BYPASSING = 6  # requests sent straight to the engine: 1 runs (max_running 1), 5 wait


def settings(engine_metrics: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    pool: dict[str, Any] = {"name": "llama", "replicas": 1, "engine": {"max_num_seqs": 2}}
    if engine_metrics is not None:
        pool["engine_metrics"] = engine_metrics
    return {"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0", "pools": [pool],
            "classes": {"latency": {"deadline_ms": 30_000, "ttft_ms": 2_000}}, **extra}


def start_backend(workdir: Path, name: str) -> tuple[str, Process]:
    """A fake vLLM replica that runs one sequence at a time (the rest wait)."""
    port = free_port()
    proc = Process(name, [sys.executable, "-m", "extproc", "fake-backend", "--port", str(port),
                          "--max-running", "1", "--kv-cache-tokens", "100000"], workdir)
    wait_http(f"http://127.0.0.1:{port}/health", proc=proc.popen)
    return f"127.0.0.1:{port}", proc


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[tuple[str, Process]]:
    addr, proc = start_backend(tmp_path, "backend")
    yield addr, proc
    proc.stop()


@pytest.fixture
def other_backend(tmp_path: Path) -> Iterator[tuple[str, Process]]:
    addr, proc = start_backend(tmp_path, "other-backend")
    yield addr, proc
    proc.stop()


@pytest.fixture(autouse=True)
async def end_streams() -> AsyncIterator[None]:
    yield
    await Stream.end_all()


@asynccontextmanager
async def bypassing(addr: str, n: int) -> AsyncIterator[None]:
    """``n`` long requests (2,000 tokens, ~37 s each) sent to the engine itself, not through
    the gateway: the ledger never hears of them. Cancelled on exit (the engine aborts them)."""
    doc = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}],
           "max_tokens": 2000, "extproc_output_tokens": 2000}
    async with aiohttp.ClientSession() as client:
        calls = [asyncio.create_task(client.post(f"http://{addr}/v1/chat/completions", json=doc))
                 for _ in range(n)]
        try:
            yield
        finally:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)


async def metric(url: str, name: str, **labels: str) -> float:
    """One metric through a real /metrics endpoint, read off the loop that serves it."""
    return await asyncio.to_thread(scrape, url, name, labels)


def gateway(svc: Service) -> str:
    return f"http://127.0.0.1:{svc.metrics_port}/metrics"


async def engines_hold(svc: Service) -> float:
    waiting = await metric(gateway(svc), "extproc_engine_waiting_requests", pool="llama")
    running = await metric(gateway(svc), "extproc_engine_running_requests", pool="llama")
    return waiting + running


async def until(read: Callable[[], Awaitable[object]], expected: object,
                within: float = 10.0) -> None:
    """Poll ``read()`` until it returns ``expected``; fail after ``within`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while (got := await read()) != expected:
        assert loop.time() < deadline, f"still {got!r}, not {expected!r}"
        await asyncio.sleep(0.05)


async def decide(stub: Any) -> pb.ProcessingResponse:
    """One chat(100) through the ext_proc stream; an admitted one is ended at once."""
    s = Stream(stub)
    await s.send(headers())
    resp = await s.send(body(chat(100)))
    if resp.HasField("request_body"):
        await s.close()
    return resp


def reason(resp: pb.ProcessingResponse) -> str:
    return next(h.header.raw_value.decode() for h in resp.immediate_response.headers.set_headers
                if h.header.key == "x-admission-reason")


async def test_engines_busy_with_bypassing_traffic_tighten_admission(
        backend: tuple[str, Process]) -> None:
    addr, _ = backend
    engine = f"http://{addr}/metrics"
    async with bypassing(addr, BYPASSING):
        async def engine_queues() -> tuple[float, float]:
            return (await metric(engine, "vllm:num_requests_running"),
                    await metric(engine, "vllm:num_requests_waiting"))

        await until(engine_queues, (1, BYPASSING - 1))

        # The ledger's view alone: nothing in flight, the request starts at once.
        async with serving(settings()) as (svc, stub):
            assert (await decide(stub)).HasField("request_body")
            assert await metric(gateway(svc), "extproc_admission_decisions_total",
                                outcome="admit") == 1

        # With the engines' view: 6 held, the ledger knows 0, so 6 - (0 x 1.25 + 2) = 4 unseen
        # requests at this request's own charge put it 3rd in the queue: ~6 s to a first
        # token, past the 1.6 s budget.
        async with serving(settings({"targets": [addr], **FAST})) as (svc, stub):
            await until(lambda: engines_hold(svc), BYPASSING)
            resp = await decide(stub)
            assert resp.immediate_response.status.code == 429
            assert reason(resp) == "ttft"
            url = gateway(svc)
            assert await metric(url, "extproc_engine_correction_requests", pool="llama") == 4
            assert await metric(url, "extproc_engine_running_requests", pool="llama") == 1
            assert await metric(url, "extproc_engine_waiting_requests", pool="llama") == 5
            assert await metric(url, "extproc_engine_metrics_targets", pool="llama") == 1
            assert await metric(url, "extproc_engine_metrics_fresh_targets", pool="llama") == 1
            assert await metric(url, "extproc_engine_metrics_stale", pool="llama") == 0
            assert 0 < await metric(url, "extproc_engine_kv_cache_usage_max", pool="llama") < 1
            # what is decided changed; what is recorded did not
            assert (await svc.gate.ledger.snapshot("llama")).inflight == 0


async def test_stale_engine_metrics_never_tighten(
        backend: tuple[str, Process], other_backend: tuple[str, Process]) -> None:
    """Two replicas, both required (min_coverage 1): the busy one keeps answering, the idle
    one goes away. Its last sample counts until it is max_age_s old; then the pool is stale
    and, though the busy engine's queue is still there, admission is not tightened."""
    (busy, _), (idle, idle_proc) = backend, other_backend
    section = {"targets": [busy, idle], "min_coverage": 1.0, **FAST}
    async with serving(settings(section)) as (svc, stub), bypassing(busy, BYPASSING):
        url = gateway(svc)
        await until(lambda: engines_hold(svc), BYPASSING)
        assert (await decide(stub)).immediate_response.status.code == 429  # fresh: tighten
        assert await metric(url, "extproc_engine_correction_requests", pool="llama") == 4

        stopped = time.monotonic()
        await asyncio.to_thread(idle_proc.stop)  # its metrics endpoint is gone
        await until(lambda: metric(url, "extproc_engine_metrics_stale", pool="llama"), 1)
        # not at the first failed scrape (within 0.1 s): once its last sample was max_age_s
        # (1 s) old, less a scrape round and some scheduling
        assert time.monotonic() - stopped >= 0.5
        assert await metric(url, "extproc_engine_metrics_fresh_targets", pool="llama") == 1
        assert await metric(url, "extproc_engine_metrics_targets", pool="llama") == 2
        assert await engines_hold(svc) == BYPASSING  # what the fresh replica says, shown

        # Stale is not overload: the same decision as without the engines' view.
        assert (await decide(stub)).HasField("request_body")
        assert await metric(url, "extproc_engine_correction_requests", pool="llama") == 0
        assert await metric(url, "extproc_admission_decisions_total", outcome="admit") == 1
        assert await metric(url, "extproc_admission_decisions_total", outcome="reject") == 1


class RacedLedger(MemoryLedger):
    """A memory ledger in which another gateway records ``rival`` right after our first
    snapshot: the race the reserve's atomic ceiling check is for. ``answers``: our reserves."""

    def __init__(self, rival: Entry) -> None:
        super().__init__()
        self.rival: Entry | None = rival
        self.answers: list[bool] = []

    async def snapshot(self, pool: str) -> Snapshot:
        taken = await super().snapshot(pool)
        if self.rival is not None:
            await super().reserve(self.rival)
            self.rival = None
        return taken

    async def reserve(self, entry: Entry, ceiling_ms: float | None = None,
                      max_inflight: int | None = None, caps: Sequence[Cap] = ()) -> bool:
        self.answers.append(await super().reserve(entry, ceiling_ms, max_inflight, caps))
        return self.answers[-1]


async def test_the_reserve_ceiling_leaves_the_correction_out(
        backend: tuple[str, Process]) -> None:
    """The engines hold 3, the ledger 0: one unseen request (972 ms) is added to what decide
    sees, and the request still starts at once with 1,600 ms of first-token slack, so its
    ceiling lets 1,600 ms of other gateways' work in before the reserve. A rival records
    2,000 ms meanwhile: the reserve must be refused and the request decided again; had the
    ceiling kept the correction's 972 ms, the ledger (which never holds them) would take it."""
    addr, _ = backend
    cfg = config.from_mapping(settings({"targets": [addr], **FAST}))
    ledger = RacedLedger(Entry("rival", "llama", 2_000.0, 60_000.0))
    stats = EngineStats({"llama": [addr]}, timeout_s=0.5)
    gate = Gate(cfg, ledger, StaticCapacity(cfg.pools), Metrics(), engines={"llama": stats})
    route = cfg.route("/v1/chat/completions")
    assert route is not None
    async def engines_hold_now() -> int:
        return (await stats.scrape("llama")).total

    async with bypassing(addr, 3):
        await until(engines_hold_now, 3)
        verdict = await gate.check(route, route.path, {}, json.dumps(chat(100)).encode())
    assert verdict.ticket is not None
    assert ledger.answers == [False, True]
    await gate.settle(verdict.ticket)


async def test_stopping_the_service_ends_the_scraper(backend: tuple[str, Process]) -> None:
    addr, _ = backend
    svc = Service(config.from_mapping(settings({"targets": [addr], **FAST})))
    await svc.start()
    await until(lambda: metric(gateway(svc), "extproc_engine_metrics_fresh_targets",
                               pool="llama"), 1)
    stats = svc.gate.engines["llama"]
    session = stats._session
    assert session is not None and not session.closed
    assert len(scrapers()) == 1

    await svc.stop()  # what drain ends with, too

    assert session.closed and stats._session is None
    assert scrapers() == []


def scrapers() -> list[asyncio.Task[Any]]:
    """Scrape loops still alive on this event loop."""
    return [t for t in asyncio.all_tasks() if not t.done()
            and getattr(t.get_coro(), "__qualname__", "") == EngineStats._loop.__qualname__]


BAD = [
    ({"targets": ["127.0.0.1:8000"], "min_coverage": 1.5},
     "pools[0].engine_metrics.min_coverage: must be in (0, 1] (got 1.5)"),
    ({"targets": "127.0.0.1:8000"},
     "pools[0].engine_metrics.targets: must be a non-empty list of HOST:PORT or http(s):// URLs,"
     " or 'from_capacity' (got '127.0.0.1:8000')"),
    ({"targets": ["h:1", "127.0.0.1"]},
     "pools[0].engine_metrics.targets[1]: must be HOST:PORT or an http(s):// URL"
     " (got '127.0.0.1')"),
    ({"targets": ["ftp://h:21"]},
     "pools[0].engine_metrics.targets[0]: must be HOST:PORT or an http(s):// URL"),
    ({"targets": ["h:1", "h:1"]}, "pools[0].engine_metrics.targets: duplicate target 'h:1'"),
    ({"targets": ["h:1"], "interval_s": 2, "timeout_s": 1, "max_age_s": 2},
     "pools[0].engine_metrics.max_age_s: must be >= interval_s + timeout_s (3) (got 2)"),
    ({"targets": ["h:1"], "slack": 1.5}, "pools[0].engine_metrics.slack: must be an integer"),
    ({"targets": ["h:1"], "tolerance": -0.1},
     "pools[0].engine_metrics.tolerance: must be >= 0 (got -0.1)"),
    ({"targets": ["h:1"], "every_s": 1}, "pools[0].engine_metrics.every_s: unknown key"),
    ({}, "pools[0].engine_metrics.targets: a list is required with capacity.source 'static'"),
    ("on", "pools[0].engine_metrics: must be a mapping, got str"),
]


@pytest.mark.parametrize(("section", "message"), BAD, ids=[m.split(": ")[0] for _, m in BAD])
def test_config_errors_name_the_bad_key(section: Any, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.from_mapping(settings(section))
    assert len(err.value.problems) == 1, err.value.problems
    assert err.value.problems[0].startswith(message), err.value.problems


def test_config_defaults_and_targets_from_the_capacity_source() -> None:
    assert config.from_mapping(settings()).pools[0].engine_metrics is None  # off when absent
    got = config.from_mapping(settings({}, capacity={"source": "envoy"})).pools[0]
    assert got.engine_metrics == config.EngineMetricsConfig(
        targets=None, interval_s=2.0, timeout_s=0.5, max_age_s=5.0, min_coverage=0.5,
        tolerance=0.25, slack=2)
    listed = config.from_mapping(settings({"targets": ["10.0.0.5:8000", "http://h:8000/"]}))
    assert listed.pools[0].engine_metrics is not None
    assert listed.pools[0].engine_metrics.targets == ("10.0.0.5:8000", "http://h:8000/")


@pytest.mark.integration
async def test_targets_from_capacity_scrape_the_hosts_envoy_routes_to(tmp_path: Path) -> None:
    """``targets`` omitted: the ready hosts the ``envoy`` capacity source reads from a real
    Envoy's admin endpoint are the replicas scraped."""
    with LocalStack(tmp_path, {"pools": [{"name": "llama"}]}, backends=1) as stack:
        admin = f"http://127.0.0.1:{stack.admin_port}"
        async with serving(settings(dict(FAST), capacity={
                "source": "envoy", "envoy_admin_url": admin})) as (svc, _):
            url = gateway(svc)
            await until(lambda: metric(url, "extproc_engine_metrics_fresh_targets",
                                       pool="llama"), 1)
            assert await metric(url, "extproc_engine_metrics_targets", pool="llama") == 1
            assert await metric(url, "extproc_engine_metrics_stale", pool="llama") == 0
            assert svc.capacity.replicas("llama").addresses == (
                f"127.0.0.1:{stack.backend_ports[0]}",)


async def test_the_kv_cache_the_engines_report_bounds_the_batch(tmp_path: Path) -> None:
    # The configuration says the default engine (12,800 blocks: all 64 sequences fit); the
    # engine says 200 blocks (3,200 tokens: some 30 sequences of ~100 tokens, a short prompt
    # and the typical answer under max_tokens 100). Once scraped, admission counts on that.
    port = free_port()
    proc = Process("small-kv", [sys.executable, "-m", "extproc", "fake-backend", "--port",
                                str(port), "--max-num-seqs", "64", "--num-gpu-blocks", "200"],
                   tmp_path)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc.popen)
        pool = {"name": "llama", "replicas": 1, "engine": {"max_num_seqs": 64},
                "engine_metrics": {"targets": [f"127.0.0.1:{port}"], **FAST}}
        cfg = config.from_mapping({"pools": [pool], "classes": {
            "latency": {"deadline_ms": 600_000}}})
        stats = EngineStats({"llama": [f"127.0.0.1:{port}"]}, timeout_s=0.5)
        gate = Gate(cfg, MemoryLedger(), StaticCapacity(cfg.pools), Metrics(),
                    engines={"llama": stats})
        route = cfg.route("/v1/chat/completions")
        assert route is not None
        first = [await gate.check(route, route.path, {}, json.dumps(chat(100)).encode())
                 for _ in range(3)]
        assert [v.decision.position for v in first if v.decision] == [-63, -62, -61]
        await stats.scrape("llama")
        assert stats.latest("llama").kv_blocks == (200, 16)
        third = await gate.check(route, route.path, {}, json.dumps(chat(100)).encode())
        assert third.admission is not None and third.decision is not None
        each = third.admission.kv_tokens  # all four alike: prompt + typical output
        fits = int(3200 / each)
        assert 16 <= fits <= 40
        assert third.decision.position == 3 + 1 - fits
        for v in (*first, third):
            if v.ticket is not None:
                await gate.settle(v.ticket)
        await stats.close()
    finally:
        proc.stop()


async def test_a_request_that_fits_the_cache_its_engines_report_free_is_admitted(
        tmp_path: Path) -> None:
    # Two replicas of 100 blocks (1,600 KV tokens each) and four long prompts in flight, each
    # about 730 tokens: whole slots of their mean footprint are two a replica, four in all,
    # so by the mean a short fifth request waits for memory (refused: kv_cache). The engines
    # have been sent none of them, so once scraped they report their caches free, and
    # the short one fits where it goes (Capacity.fits_reported).
    procs, targets = [], []
    for i in range(2):
        port = free_port()
        procs.append(Process(f"kv-{i}", [sys.executable, "-m", "extproc", "fake-backend",
                                         "--port", str(port), "--max-num-seqs", "64",
                                         "--num-gpu-blocks", "100"], tmp_path))
        targets.append(f"127.0.0.1:{port}")
    try:
        for t in targets:
            wait_http(f"http://{t}/health", proc=procs[targets.index(t)].popen)
        pool = {"name": "llama", "replicas": 2,
                "engine": {"max_num_seqs": 64, "num_gpu_blocks": 100},
                "engine_metrics": {"targets": targets, **FAST}}
        cfg = config.from_mapping({"pools": [pool], "classes": {
            "latency": {"deadline_ms": 600_000}}})
        stats = EngineStats({"llama": targets}, timeout_s=0.5)
        gate = Gate(cfg, MemoryLedger(), StaticCapacity(cfg.pools), Metrics(),
                    engines={"llama": stats})
        route = cfg.route("/v1/chat/completions")
        assert route is not None

        def ask(words: int) -> bytes:
            return json.dumps({"model": "m", "max_tokens": 1, "messages": [
                {"role": "user", "content": "word " * words}]}).encode()

        async def footprint(words: int) -> int:
            v = await gate.check(route, route.path, {}, ask(words))
            assert v.admission is not None and v.ticket is not None
            await gate.settle(v.ticket)
            return v.admission.kv_tokens

        short = await footprint(1)
        at_100, at_600 = await footprint(100), await footprint(600)
        # the window where the mean's whole slots refuse it but the ledger's share holds it:
        # 2 x 1,600 x 5 / 6 < K + short, and K + 2 x short <= 3,200
        target = ((3200 * 5 / 6 - short) + (3200 - 2 * short)) / 2 / 4
        words = round(100 + (target - at_100) * 500 / (at_600 - at_100))
        long = [await gate.check(route, route.path, {}, ask(words)) for _ in range(4)]
        held = sum(v.admission.kv_tokens for v in long if v.admission is not None)
        assert 3200 * 5 / 6 < held + short <= 3200 - 2 * short, (held, short)
        blind = await gate.check(route, route.path, {}, ask(1))
        assert blind.admission is not None and blind.admission.reason is Reason.KV_CACHE
        await stats.scrape("llama")
        assert stats.latest("llama").kv_usage_max == 0.0
        # the prompts admitted but not prefilled yet are not free either: they drain at the
        # fleet's prefill rate, well within a second here
        await asyncio.sleep(1.0)
        seen = await gate.check(route, route.path, {}, ask(1))
        assert seen.admission is not None and seen.admission.outcome is Outcome.ADMIT
        for v in (*long, seen):
            if v.ticket is not None:
                await gate.settle(v.ticket)
        await stats.close()
    finally:
        for proc in procs:
            proc.stop()


async def test_a_prompt_no_replica_reports_room_for_is_refused_for_memory(
        tmp_path: Path) -> None:
    # One replica of 100 blocks (1,600 KV tokens). A 1,200-token document sent to the engine
    # itself holds three quarters of its cache; the ledger never hears of it. A 600-token
    # prompt fits whole slots of the ledger's (empty) mean, but not what the engine reports
    # free: refused for memory, and admitted again once the document is gone.
    port = free_port()
    addr = f"127.0.0.1:{port}"
    proc = Process("full-kv", [sys.executable, "-m", "extproc", "fake-backend", "--port",
                               str(port), "--max-num-seqs", "64", "--num-gpu-blocks", "100"],
                   tmp_path)
    try:
        wait_http(f"http://{addr}/health", proc=proc.popen)
        pool = {"name": "llama", "replicas": 1,
                "engine": {"max_num_seqs": 64, "num_gpu_blocks": 100},
                "engine_metrics": {"targets": [addr], **FAST}}
        cfg = config.from_mapping({"pools": [pool], "classes": {
            "latency": {"deadline_ms": 600_000}}})
        stats = EngineStats({"llama": [addr]}, timeout_s=0.5)
        gate = Gate(cfg, MemoryLedger(), StaticCapacity(cfg.pools), Metrics(),
                    engines={"llama": stats})
        route = cfg.route("/v1/chat/completions")
        assert route is not None
        prompt = json.dumps({"model": "m", "max_tokens": 100, "messages": [
            {"role": "user", "content": "x" * 2400}]}).encode()

        async def usage() -> float:
            await stats.scrape("llama")
            return stats.latest("llama").kv_usage_max or 0.0

        doc = {"model": "m", "messages": [{"role": "user", "content": "x" * 4800}],
               "max_tokens": 300, "extproc_output_tokens": 300}
        async with aiohttp.ClientSession() as client:
            call = asyncio.create_task(client.post(f"http://{addr}/v1/chat/completions",
                                                   json=doc))
            try:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10.0
                while await usage() < 0.75:
                    assert loop.time() < deadline, "the document never filled the cache"
                    await asyncio.sleep(0.05)
                full = await gate.check(route, route.path, {}, prompt)
                assert full.admission is not None and full.ticket is None
                assert full.admission.reason is Reason.KV_CACHE
                assert full.admission.retry_after_ms is not None
            finally:
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
        await until(usage, 0.0)
        free = await gate.check(route, route.path, {}, prompt)
        assert free.admission is not None and free.admission.outcome is Outcome.ADMIT
        if free.ticket is not None:
            await gate.settle(free.ticket)
        await stats.close()
    finally:
        proc.stop()
