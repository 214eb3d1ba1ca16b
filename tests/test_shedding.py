"""Shedding while the processor itself is the queue (``extproc.gateway.server`` docstring)."""

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc import config
from extproc.gateway.server import Delay, Service
from tests.extproc_client import Stream, body, chat, headers

STUCK_S = 0.3


def test_the_signal_is_the_median_wait_so_one_slow_upload_does_not_shed() -> None:
    delay = Delay(shed_wait_s=0.2, size=5)
    delay.add(30.0)  # one client uploading a large body slowly
    delay.add(0.0003)
    assert not delay.behind
    for _ in range(2):
        delay.add(0.5)
    assert delay.behind  # three of five waited: the queue is ours
    for _ in range(3):
        delay.add(0.0002)
    assert not delay.behind
    off = Delay(shed_wait_s=0.0, size=1)
    off.add(10.0)
    assert not off.behind


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    cfg = config.from_mapping({"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0",
                               "shed_wait_ms": 200, "pools": [{"name": "llama"}]})
    svc = Service(cfg)
    svc.processor.delay = Delay(0.2, size=3)
    await svc.start()
    yield svc
    await svc.stop()


def reason(answer: pb.ProcessingResponse) -> str:
    if not answer.HasField("immediate_response"):
        return "continue"
    return next(h.header.raw_value.decode() for h in
                answer.immediate_response.headers.set_headers
                if h.header.key == "x-admission-reason")


async def test_while_bodies_wait_for_us_they_are_refused_unparsed_then_decided_again(
        service: Service) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        streams = [Stream(stub) for _ in range(3)]
        for s in streams:
            assert reason(await s.send(headers())) == "continue"
        # The loop is stuck (a flood of work) while the bodies are on their way to us.
        asyncio.get_running_loop().call_soon(time.sleep, STUCK_S)
        answers = await asyncio.gather(*(s.send(body(b"{not json")) for s in streams))
        # Once most waited, a 429 without parsing (a parse would give the 400).
        assert reason(answers[-1]) == "processor_overloaded"
        assert answers[-1].immediate_response.status.code == 429
        # Bodies that do not wait are decided as usual again.
        kinds = []
        for _ in range(3):
            s = Stream(stub)
            assert reason(await s.send(headers())) == "continue"
            kinds.append(reason(await s.send(body(chat(max_tokens=5)))))
            await s.close()
        assert kinds[-1] == "continue"
        await Stream.end_all()
    metrics = service.metrics
    assert metrics.decisions.labels("", "latency", "reject", "processor_overloaded",
                                    "enforce")._value.get() >= 1
    assert metrics.processor_wait._sum.get() >= 3 * STUCK_S * 0.9
