"""The ext_proc servicer over a real gRPC channel, driven message by message (no Envoy)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc import config
from extproc.gateway.server import SERVICE_NAME, Service
from extproc_dev.stack import scrape
from tests.extproc_client import Stream, admit_one, body, chat, headers, serving


def settings(**extra: Any) -> dict[str, Any]:
    return {"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0",
            "pools": [{"name": "llama", "replicas": 1, "engine": {"max_num_seqs": 2}}], **extra}


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    svc = Service(config.from_mapping(settings(
        classes={"latency": {"deadline_ms": 30_000, "ttft_ms": 2_000}})))
    await svc.start()
    yield svc
    await svc.stop()


@pytest.fixture(autouse=True)
async def end_streams() -> AsyncIterator[None]:
    yield
    await Stream.end_all()


def immediate_headers(resp: pb.ProcessingResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode()
            for h in resp.immediate_response.headers.set_headers}


async def metric(service: Service, name: str, **labels: str) -> float:
    """Read a metric through the real /metrics endpoint (off the loop that serves it)."""
    url = f"http://127.0.0.1:{service.metrics_port}/metrics"
    return await asyncio.to_thread(scrape, url, name, labels)


async def test_unmanaged_path_skips_its_body(stub: pb_grpc.ExternalProcessorStub) -> None:
    s = Stream(stub)
    resp = await s.send(headers("/v1/models", method="GET", eos=True))
    assert resp.HasField("request_headers") and resp.HasField("mode_override")
    assert resp.mode_override.request_body_mode == ProcessingMode.NONE
    await s.close()


async def test_admitted_stream_holds_its_entry_until_the_stream_ends(
        service: Service, stub: pb_grpc.ExternalProcessorStub) -> None:
    s = await admit_one(stub)
    assert (await service.gate.ledger.snapshot("llama")).inflight == 1
    assert await metric(service, "extproc_outstanding_work_seconds", pool="llama") > 0
    await s.close()
    assert (await service.gate.ledger.snapshot("llama")).inflight == 0
    assert await metric(service, "extproc_inflight_requests", pool="llama") == 0
    # the pool is empty now, not at the next decision
    assert await metric(service, "extproc_outstanding_work_seconds", pool="llama") == 0


async def test_every_decided_answer_carries_the_verdict_for_envoys_access_log(
        stub: pb_grpc.ExternalProcessorStub) -> None:
    s = Stream(stub)
    await s.send(headers())
    admitted = await s.send(body(chat(100)))
    refused = await Stream(stub).send(one_trip(b"{not json"))
    verdicts = [{k: v for k, v in resp.dynamic_metadata.fields["extproc"].struct_value.items()}
                for resp in (admitted, refused)]
    ticket = verdicts[0].pop("ticket")  # a request that runs: its ticket, a random id
    assert len(ticket) == 32 and int(ticket, 16) >= 0
    assert verdicts == [
        {"outcome": "admit", "reason": "fits", "pool": "llama", "class": "latency"},
        {"outcome": "invalid", "reason": "bad_request", "class": "latency"}]  # no model read


async def test_cancelled_stream_releases_its_entry(
        service: Service, stub: pb_grpc.ExternalProcessorStub) -> None:
    s = await admit_one(stub)
    assert (await service.gate.ledger.snapshot("llama")).inflight == 1
    s.call.cancel()  # what Envoy does when the client goes away
    for _ in range(100):
        if (await service.gate.ledger.snapshot("llama")).inflight == 0:
            break
        await asyncio.sleep(0.01)
    assert (await service.gate.ledger.snapshot("llama")).inflight == 0


async def test_overload_answers_429_with_retry_after_and_json(
        service: Service, stub: pb_grpc.ExternalProcessorStub) -> None:
    held = [await admit_one(stub, 500) for _ in range(2)]  # both slots, ~9 s of work each
    s = Stream(stub)
    await s.send(headers())
    resp = await s.send(body(chat(100)))
    assert resp.immediate_response.status.code == 429
    hdrs = immediate_headers(resp)
    assert int(hdrs["retry-after"]) >= 1
    assert hdrs["x-admission-reason"] in ("ttft", "deadline")
    error = json.loads(resp.immediate_response.body)["error"]
    assert error["type"] == "overloaded_error" and "Retry after" in error["message"]
    assert (await service.gate.ledger.snapshot("llama")).inflight == 2  # nothing leaked
    assert await metric(service, "extproc_admission_decisions_total", outcome="reject") == 1
    for h in held:
        await h.close()


async def test_malformed_body_is_400_json(stub: pb_grpc.ExternalProcessorStub) -> None:
    s = Stream(stub)
    await s.send(headers())
    resp = await s.send(body(b"{not json"))
    assert resp.immediate_response.status.code == 400
    assert json.loads(resp.immediate_response.body)["error"]["code"] == "invalid_json"
    assert immediate_headers(resp)["x-should-retry"] == "false"


async def test_content_length_over_the_cap_is_413_at_headers(
        service: Service, stub: pb_grpc.ExternalProcessorStub) -> None:
    s = Stream(stub)
    too_big = str(service.config.max_body_bytes + 1)
    resp = await s.send(headers(**{"content-length": too_big}))
    assert resp.immediate_response.status.code == 413
    assert json.loads(resp.immediate_response.body)["error"]["code"] == "request_too_large"


async def test_body_cut_short_by_envoy_is_413(stub: pb_grpc.ExternalProcessorStub) -> None:
    s = Stream(stub)
    await s.send(headers())
    resp = await s.send(body(b'{"model": "m", "messages": [', eos=False))
    assert resp.immediate_response.status.code == 413


async def test_client_deadline_header_tightens_and_bad_values_are_400(
        stub: pb_grpc.ExternalProcessorStub) -> None:
    s = Stream(stub)
    await s.send(headers(**{"x-admission-deadline-ms": "soon"}))
    resp = await s.send(body(chat()))
    assert resp.immediate_response.status.code == 400
    # 100 output tokens take ~1.9 s idle: a 1 s deadline makes it infeasible, and a deadline
    # the client tightened gets the request refused (400), never let through unmanaged
    s = Stream(stub)
    await s.send(headers(**{"x-admission-deadline-ms": "1000"}))
    resp = await s.send(body(chat()))
    assert resp.immediate_response.status.code == 400
    assert b"deadline_infeasible" in resp.immediate_response.body
    # a looser header changes nothing: the class deadline stands
    s = Stream(stub)
    await s.send(headers(**{"x-admission-deadline-ms": "99999999"}))
    assert (await s.send(body(chat()))).HasField("request_body")
    await s.close()


async def test_shadow_mode_counts_rejections_but_continues() -> None:
    async with serving(settings(mode="shadow")) as (svc, stub):
        streams = [await admit_one(stub, 500) for _ in range(4)]
        assert await metric(svc, "extproc_admission_decisions_total", outcome="reject",
                      mode="shadow") >= 1
        assert (await svc.gate.ledger.snapshot("llama")).inflight == 4
        for s in streams:
            await s.close()
        assert (await svc.gate.ledger.snapshot("llama")).inflight == 0


async def test_health_serves_then_turns_not_serving_on_drain(service: Service) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        resp = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.ExternalProcessorStub(channel)
        s = await admit_one(stub)
        drain = asyncio.create_task(service.drain())
        await asyncio.sleep(0.2)
        resp = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        # open streams are still served during the grace period
        late = await admit_one(stub)
        assert not drain.done()
        await s.close()
        await late.close()
        await asyncio.wait_for(drain, 5)


def one_trip(doc: Any, path: str = "/v1/chat/completions", began_s_ago: float = 0.0,
             **extra: str) -> pb.ProcessingRequest:
    """A body as Envoy's one-trip route sends it: no headers phase, the headers we read as
    attributes (extproc.gateway.envoyconf._attributes), and the request's start."""
    import datetime as dt

    from extproc.gateway.request import ATTRIBUTES_KEY, REQUEST_TIME, header_attribute

    message = body(doc)
    began = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=began_s_ago)
    values = {":path": path, ":method": "POST", "content-type": "application/json", **extra}
    message.attributes[ATTRIBUTES_KEY].update(
        {REQUEST_TIME: began.isoformat(), **{header_attribute(k): v for k, v in values.items()}})
    return message


async def test_one_trip_body_is_decided_from_its_attributes(
        service: Service, stub: pb_grpc.ExternalProcessorStub) -> None:
    """The same decisions as two trips: admitted (the entry held until the stream ends), a
    malformed body 400, a client deadline header read from the attributes."""
    s = Stream(stub)
    resp = await s.send(one_trip(chat(100)))
    assert resp.HasField("request_body") and not resp.HasField("immediate_response")
    assert (await service.gate.ledger.snapshot("llama")).inflight == 1
    await s.close()
    assert (await service.gate.ledger.snapshot("llama")).inflight == 0
    resp = await Stream(stub).send(one_trip(b"{not json"))
    assert json.loads(resp.immediate_response.body)["error"]["code"] == "invalid_json"
    resp = await Stream(stub).send(one_trip(chat(100), **{"x-admission-deadline-ms": "-1"}))
    assert resp.immediate_response.status.code == 400
    assert await metric(service, "extproc_admission_decisions_total", outcome="admit") == 1


async def test_one_trip_checks_what_the_headers_would_have(
        stub: pb_grpc.ExternalProcessorStub) -> None:
    """Envoy's route sends only clean headers one trip; were it to send others, the body's
    check refuses them as the headers phase does (415), and an unmanaged path passes."""
    resp = await Stream(stub).send(one_trip(chat(100), **{"content-type": "text/plain"}))
    assert resp.immediate_response.status.code == 415
    resp = await Stream(stub).send(one_trip(chat(100), **{"content-encoding": "br"}))
    assert resp.immediate_response.status.code == 415
    resp = await Stream(stub).send(one_trip(chat(100), path="/v1/models"))
    assert resp.HasField("request_body") and not resp.HasField("immediate_response")


async def test_a_body_without_headers_or_attributes_is_counted_and_passes(
        service: Service, stub: pb_grpc.ExternalProcessorStub) -> None:
    """An Envoy configuration that skips the headers phase and sends no attributes leaves
    nothing to decide on: the body passes, and the fallthrough says so."""
    resp = await Stream(stub).send(body(chat(100)))
    assert resp.HasField("request_body") and not resp.HasField("immediate_response")
    assert await metric(service, "extproc_decision_fallthroughs_total", kind="no_headers") == 1
    assert (await service.gate.ledger.snapshot("llama")).inflight == 0


async def test_one_trip_wait_counts_from_the_request_start() -> None:
    """Shedding in one trip: the wait is from Envoy's request.time to the body reaching us;
    a backlog of slow ones sheds the next body unparsed (429 processor_overloaded)."""
    async with serving(settings(shed_wait_ms=100)) as (svc, stub):
        for _ in range(svc.processor.delay.SIZE):
            svc.processor.delay.add(0.0)
        for _ in range(svc.processor.delay.SIZE // 2 + 1):
            await Stream(stub).send(one_trip(b"{not json", began_s_ago=0.5))
        assert svc.processor.delay.behind
        resp = await Stream(stub).send(one_trip(chat(100)))
        assert resp.immediate_response.status.code == 429
        assert immediate_headers(resp)["x-admission-reason"] == "processor_overloaded"
