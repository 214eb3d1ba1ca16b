"""Two ``extproc serve`` replicas behind one real Envoy, sharing one real Redis: together they
admit what a single replica would, and a replica killed with ``kill -9`` mid-request gives its
capacity back once its entries' leases end (its heartbeat's ``liveness_ms``)."""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc import config
from extproc.decision.admission import Outcome
from extproc.fleet.capacity import StaticCapacity
from extproc.gateway.gate import Gate
from extproc.ledger.memory import MemoryLedger
from extproc.observability.metrics import Metrics
from extproc_dev.stack import LocalStack
from tests.conftest import pool
from tests.redis_server import RedisServer, poll

pytestmark = [pytest.mark.integration, pytest.mark.redis]

CHAT = "/v1/chat/completions"
DEADLINE = {"x-admission-deadline-ms": "1200"}  # budget 0.96 s: two requests fit, not three
GRACE_MS = 500.0
LIVENESS_MS = 1_000.0
_prefixes = itertools.count()


def settings(ledger: dict[str, Any]) -> dict[str, Any]:
    """1 replica x 2 slots; 300 output tokens take ~0.6 s alone (2 ms/token), ~0.85 s two at a
    time; a third would wait behind them and finish past the 0.96 s budget."""
    return {"pools": [pool(replicas=1, max_num_seqs=2,
                   engine={"step_base_ms": 1.1, "ms_per_seq": 0.82})],
            "drain_grace_s": 0,
            "ledger": {"lease_grace_ms": GRACE_MS, "liveness_ms": LIVENESS_MS,
                       "sweep_interval_ms": 100, **ledger}}


def story(output: int = 100) -> dict[str, Any]:
    """Charged 300 tokens; the fake backend makes 100 (~0.9 s at --time-scale 0.5): long enough
    that the whole burst is decided while the first admitted requests still run."""
    return {"model": "m", "max_tokens": 300, "extproc_output_tokens": output,
            "messages": [{"role": "user", "content": "Tell me a story."}]}


def post(url: str, doc: Any, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, data=json.dumps(doc).encode(), method="POST",
                                 headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def one_replica_admits(cfg: dict[str, Any], n: int) -> int:
    """What a single gateway admits of ``n`` such requests arriving together: the very Gate,
    in process, on its own ledger, nothing finishing in between."""
    import asyncio

    c = config.from_mapping({**cfg, "ledger": {}})
    gate = Gate(c, MemoryLedger(), StaticCapacity(c.pools), Metrics())
    route = c.route(CHAT)
    assert route is not None
    body = json.dumps(story()).encode()

    async def run() -> int:
        verdicts = [await gate.check(route, CHAT, DEADLINE, body) for _ in range(n)]
        for v in verdicts:
            if v.ticket is not None:
                await gate.settle(v.ticket)
        return sum(v.outcome is Outcome.ADMIT for v in verdicts)

    return asyncio.run(run())


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def start_stack(workdir: Path, redis: RedisServer | None) -> LocalStack:
    ledger = {} if redis is None else {
        "kind": "redis", "url": redis.url, "key_prefix": f"stack{next(_prefixes)}",
        "timeout_ms": 500, "decision_deadline_ms": 1_000}
    stack = LocalStack(workdir, settings(ledger), extproc_replicas=2,
                       backend_args=["--max-running", "2", "--time-scale", "0.5"])
    stack.start()
    return stack


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory: pytest.TempPathFactory,
                 redis: RedisServer) -> Iterator[LocalStack]:
    """Two replicas on one Redis ledger (the kill test, last in this module, kills one)."""
    stack = start_stack(tmp_path_factory.mktemp("shared"), redis)
    yield stack
    stack.stop()


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "memory-control"])
def test_two_replicas_sharing_redis_admit_what_one_would(
        request: pytest.FixtureRequest, tmp_path: Path, shared: bool) -> None:
    burst = 10
    expected = one_replica_admits(settings({}), burst)
    assert 1 <= expected < burst / 2  # the burst overloads even two independent replicas
    stack = request.getfixturevalue("shared_stack") if shared else start_stack(tmp_path, None)
    try:
        statuses: list[int] = []
        threads = [threading.Thread(target=lambda: statuses.append(
            post(stack.url + CHAT, story(), DEADLINE))) for _ in range(burst)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(statuses) <= {200, 429}
        decided = [_decisions(stack, i) for i in range(2)]
        assert all(d > 0 for d in decided), f"Envoy used both replicas: {decided}"
        if shared:
            assert statuses.count(200) == expected, statuses
        else:  # the control: without a shared ledger each replica admits a fleet's worth
            assert statuses.count(200) > expected, statuses
    finally:
        if not shared:
            stack.stop()


def _decisions(stack: LocalStack, replica: int) -> float:
    from extproc_dev.stack import scrape

    return scrape(stack.replica_metrics_url(replica), "extproc_admission_decisions_total")


class HeldStream:
    """An ext_proc stream straight to one replica (as its Envoy would open it), held open."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.requests: queue.Queue[pb.ProcessingRequest | None] = queue.Queue()
        self.responses = pb_grpc.ExternalProcessorStub(self.channel).Process(
            iter(self.requests.get, None))

    def decide(self, headers: dict[str, str] | None = None) -> str:
        pairs = {":path": CHAT, ":method": "POST", "content-type": "application/json",
                 **(headers or {})}
        self.requests.put(pb.ProcessingRequest(request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[
                base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))))
        next(self.responses)
        self.requests.put(pb.ProcessingRequest(request_body=pb.HttpBody(
            body=json.dumps(story()).encode(), end_of_stream=True)))
        resp = next(self.responses)
        return "admit" if resp.HasField("request_body") else str(
            resp.immediate_response.status.code)

    def close(self) -> None:
        self.requests.put(None)
        self.responses.cancel()
        self.channel.close()


def test_kill_9_of_a_replica_mid_request_gives_its_capacity_back_after_the_lease(
        shared_stack: LocalStack, redis: RedisServer) -> None:
    stack = shared_stack
    leases = f"{stack.settings['ledger']['key_prefix']}:{{llama}}:leases"
    poll(lambda: redis.client().zcard(leases) == 0, 10, "earlier requests released")
    held = [HeldStream(stack.replica_grpc_port(1)) for _ in range(2)]
    probes: list[HeldStream] = []
    try:
        assert [h.decide() for h in held] == ["admit", "admit"]  # both slots, via replica 1
        assert redis.client().zcard(leases) == 2

        stack.processes["extproc1"].signal(9)  # kill -9: no release, no goodbye
        killed = time.monotonic()
        probes.append(HeldStream(stack.replica_grpc_port(0)))
        assert probes[-1].decide(DEADLINE) == "429"  # the dead replica's work still counts

        poll(lambda: redis.client().zcard(leases) == 0, 10, "dead replica's entries gone")
        gone = time.monotonic() - killed
        # the lease since the last beat (at most the liveness), a sweep, slack
        assert gone < LIVENESS_MS / 1000 + 0.1 + 1.0, f"entries lived {gone:.2f}s after the kill"

        probes.append(HeldStream(stack.replica_grpc_port(0)))
        assert probes[-1].decide(DEADLINE) == "admit"  # capacity is back
    finally:
        for s in held + probes:
            s.close()


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "memory-control"])
def test_two_replicas_on_one_redis_hold_a_tenant_to_its_cap_between_them(
        tmp_path: Path, redis: RedisServer, shared: bool) -> None:
    """A tenant capped at 3 requests in flight sends bursts of 12 through Envoy's two
    replicas (JWT-verified tenant): on one Redis exactly 3 of each burst are admitted, the
    rest refused ``tenant_cap``; with each replica's own ledger, each admits its 3."""
    from tests.test_tenant import jwt_filter, token

    ledger = {"kind": "redis", "url": redis.url, "key_prefix": f"caps{next(_prefixes)}",
              "timeout_ms": 500, "decision_deadline_ms": 1_000} if shared else {}
    cfg = {"pools": [pool(replicas=1, max_num_seqs=16)],
           "classes": {"latency": {"deadline_ms": 60_000, "ttft_ms": 0}},
           "tenant": {"source": "metadata", "known": ["acme"],
                      "tenants": {"acme": {"max_inflight": 3}}},
           "ledger": ledger}
    headers = {"authorization": f"Bearer {token('acme')}"}
    with LocalStack(tmp_path / "caps", cfg, extproc_replicas=2,
                    envoy={"http_filters": (jwt_filter(),)},
                    backend_args=["--max-running", "16", "--time-scale", "0.5"]) as stack:
        def burst() -> list[int]:
            statuses: list[int] = []
            threads = [threading.Thread(target=lambda: statuses.append(
                post(stack.url + CHAT, story(), headers))) for _ in range(12)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert set(statuses) <= {200, 429}
            return statuses

        admitted = [burst().count(200) for _ in range(4)]
        assert all(_decisions(stack, i) > 0 for i in range(2)), "Envoy used both replicas"
        capped = sum(scrape_reason(stack, i, "tenant_cap") for i in range(2))
    if shared:
        assert admitted == [3, 3, 3, 3] and capped == 36
    else:  # the control: each replica keeps its own count
        assert max(admitted) > 3


def scrape_reason(stack: LocalStack, replica: int, reason: str) -> float:
    from extproc_dev.stack import scrape

    return scrape(stack.replica_metrics_url(replica), "extproc_priority_decisions_total",
                  {"reason": reason})
