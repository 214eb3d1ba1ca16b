"""Work conservation per replica, in the running service: real fake-backend processes, a real
``Service`` and its gRPC ext_proc stream (``extproc.fleet.enginestats``,
``extproc.decision.level.measured``).

The pool: two replicas; its ledger holds 800 s of other work, so the model refuses every
request (its first token is minutes away). An endpoint picker in front of the gateway names
the replica it chose in Envoy's metadata (``envoy.lb`` / ``x-gateway-destination-endpoint``):
a request whose replica reports nothing running or waiting is admitted (``idle``), once per
report; one for the busy replica, one with no pick, and one that names the idle replica in a
header of its own are refused as before.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import config
from extproc.fleet.enginestats import DESTINATION_KEY, DESTINATION_NAMESPACE
from extproc.gateway import envoyconf
from extproc.gateway.server import destination_of
from extproc.ledger import Entry
from tests.extproc_client import Stream, body, chat, headers, serving
from tests.test_engine_correction import (
    bypassing,
    gateway,
    metric,
    reason,
    start_backend,
    until,
)

SLOW = {"interval_s": 30.0, "timeout_s": 0.5, "max_age_s": 60.0}  # one scrape in the test


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[str, str]]:
    (idle, idle_proc), (busy, busy_proc) = (start_backend(tmp_path, "idle"),
                                            start_backend(tmp_path, "busy"))
    yield idle, busy
    idle_proc.stop()
    busy_proc.stop()


@pytest.fixture(autouse=True)
async def end_streams() -> AsyncIterator[None]:
    yield
    await Stream.end_all()


def settings(targets: list[str], **section: Any) -> dict[str, Any]:
    pool = {"name": "llama", "replicas": 2, "engine": {"max_num_seqs": 2},
            "engine_metrics": {"targets": targets, **SLOW, **section}}
    return {"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0", "pools": [pool],
            "classes": {"latency": {"deadline_ms": 30_000, "ttft_ms": 2_000}}}


def picked(message: pb.ProcessingRequest, destination: str) -> pb.ProcessingRequest:
    """``message`` with the metadata an endpoint picker leaves for the filters after it."""
    message.metadata_context.filter_metadata[DESTINATION_NAMESPACE].update(
        {DESTINATION_KEY: destination})
    return message


async def ask(stub: Any, message: pb.ProcessingRequest, **header: str) -> pb.ProcessingResponse:
    s = Stream(stub)
    await s.send(headers(**header))
    resp = await s.send(message)
    if resp.HasField("request_body"):
        await s.close()
    return resp


async def test_a_request_for_an_idle_replica_is_admitted_once_per_report(
        replicas: tuple[str, str]) -> None:
    idle, busy = replicas
    async with bypassing(busy, 2):
        # the busy engine holds both before the gateway's one scrape reads it
        await until(lambda: metric(f"http://{busy}/metrics", "vllm:num_requests_running"), 1)
        await serve_with_a_busy_and_an_idle_replica(idle, busy)


async def serve_with_a_busy_and_an_idle_replica(idle: str, busy: str) -> None:
    async with serving(settings([idle, busy])) as (svc, stub):
        for i in range(4):  # 800 s of work the ledger knows of, none of it on an engine
            await svc.gate.ledger.reserve(Entry(f"other-{i}", "llama", 200_000.0, 600_000.0))
        url = gateway(svc)
        await until(lambda: metric(url, "extproc_engine_metrics_fresh_targets", pool="llama"),
                    2)
        await until(lambda: metric(url, "extproc_engine_running_requests", pool="llama"), 1)

        refused = await ask(stub, body(chat(100)))  # no pick: the pool's sum decides
        assert refused.immediate_response.status.code == 429
        assert reason(refused) == "ttft"

        to_busy = await ask(stub, picked(body(chat(100)), busy))
        assert to_busy.immediate_response.status.code == 429

        forged = await ask(stub, body(chat(100)), **{DESTINATION_KEY: idle})
        assert forged.immediate_response.status.code == 429  # a header is not the picker's

        assert (await ask(stub, picked(body(chat(100)), idle))).HasField("request_body")
        assert await metric(url, "extproc_admission_decisions_total", outcome="admit",
                            reason="idle") == 1
        # The engine's report predates the request just sent there: it covers one.
        again = await ask(stub, picked(body(chat(100)), idle))
        assert again.immediate_response.status.code == 429


async def test_off_when_the_pool_says_so(replicas: tuple[str, str]) -> None:
    idle, busy = replicas
    async with serving(settings([idle, busy], idle_destination=False)) as (svc, stub):
        for i in range(4):
            await svc.gate.ledger.reserve(Entry(f"other-{i}", "llama", 200_000.0, 600_000.0))
        await until(lambda: metric(gateway(svc), "extproc_engine_metrics_fresh_targets",
                                   pool="llama"), 2)
        resp = await ask(stub, picked(body(chat(100)), idle))
        assert resp.immediate_response.status.code == 429


def test_the_destination_comes_only_from_the_pickers_metadata() -> None:
    assert destination_of(body(chat(100))) is None
    assert destination_of(picked(body(chat(100)), "10.0.0.7:8000")) == "10.0.0.7:8000"
    # a primary and its fallbacks: the primary
    assert destination_of(picked(body(chat(100)), "10.0.0.7:8000,10.0.0.8:8000")) \
        == "10.0.0.7:8000"
    odd = body(chat(100))
    odd.metadata_context.filter_metadata[DESTINATION_NAMESPACE].update({DESTINATION_KEY: 7})
    assert destination_of(odd) is None  # not a string: no pick
    assert destination_of(picked(body(chat(100)), "")) is None


def test_envoy_forwards_the_pickers_namespace_only_when_a_pool_reads_it() -> None:
    def forwarded(section: dict[str, Any]) -> Any:
        c = config.from_mapping({"pools": [
            {"name": "llama", "replicas": 2,
             "engine_metrics": {"targets": ["10.0.0.7:8000"], **section}}]})
        doc = envoyconf.bootstrap(c, envoyconf.Topology())
        hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
            "typed_config"]
        ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
        return ext["typed_config"]["metadata_options"].get("forwarding_namespaces")

    assert forwarded({}) == {"untyped": [DESTINATION_NAMESPACE]}
    assert forwarded({"idle_destination": False}) is None


async def test_a_request_for_a_replica_with_a_queue_starts_after_it(
        replicas: tuple[str, str]) -> None:
    """Each replica runs one request at a time (``max_num_seqs: 1``, as the fake engines
    do). The ledger holds one request of 5 s, so the model admits at once; but the busy
    replica's engine holds a request waiting for its slot. A request the picker sends there
    is predicted to start after it, two releases of the ledger's mean request away, past its
    first-token budget, and refused. One for the idle replica is admitted, and so is one with
    no pick (a least-loaded balancer sends it where nothing waits)."""
    idle, busy = replicas
    async with bypassing(busy, 2):
        await until(lambda: metric(f"http://{busy}/metrics", "vllm:num_requests_waiting"), 1)
        one = settings([idle, busy])
        one["pools"][0]["engine"]["max_num_seqs"] = 1
        async with serving(one) as (svc, stub):
            await svc.gate.ledger.reserve(Entry("other", "llama", 5_000.0, 600_000.0))
            url = gateway(svc)
            await until(lambda: metric(url, "extproc_engine_metrics_fresh_targets",
                                       pool="llama"), 2)
            to_busy = await ask(stub, picked(body(chat(100)), busy))
            assert to_busy.immediate_response.status.code == 429
            assert reason(to_busy) == "ttft"
            assert (await ask(stub, body(chat(100)))).HasField("request_body")
            assert (await ask(stub, picked(body(chat(100)), idle))).HasField("request_body")
