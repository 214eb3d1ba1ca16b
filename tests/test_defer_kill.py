"""``kill -9`` of a gateway holding requests (``decision.defer``), beside another on one Redis.

Two ``extproc serve`` processes share a Redis ledger and one slot. Gateway A runs the request
in that slot and holds one more; gateway B holds one. A is killed: only A's streams fail (at
once, not at a timeout), and B's held request is sent as soon as A's ledger entry has lapsed
(its liveness lease, ``ledger.liveness_ms``): nothing A held was in the ledger, and what it ran
goes with its lease, so the slot comes back to the living without any operator action.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc_dev.stack import scrape
from tests.extproc_client import Stream, admit_one, body, chat, headers
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.redis]

LIVENESS_MS = 1500  # A's entry outlives its last heartbeat by this (the default is 3 s)
TOKENS = 1000  # one slot, a 20 s deadline: a second request waits for the first, held


def settings(url: str) -> dict[str, Any]:
    return {"pools": [{"name": "llama", "models": ["*"], "replicas": 1,
                       "engine": {"max_num_seqs": 1}}],
            "classes": {"latency": {"deadline_ms": 20_000, "ttft_ms": 0}},
            "defer": {"enabled": True},
            "ledger": {"kind": "redis", "url": url, "liveness_ms": LIVENESS_MS},
            "drain_grace_s": 0}


async def held(stub: pb_grpc.ExternalProcessorStub) -> asyncio.Task[pb.ProcessingResponse]:
    """A request sent and left waiting: the task ends with its verdict (the body's answer,
    past any message-timeout extensions the hold sends), or the stream's error."""
    stream = Stream(stub)
    assert (await stream.send(headers())).HasField("request_headers")
    await stream.queue.put(body(chat(TOKENS)))

    async def verdict() -> pb.ProcessingResponse:
        while True:
            answer = await stream.call.read()
            assert answer is not grpc.aio.EOF
            if not answer.HasField("override_message_timeout"):
                return answer
    return asyncio.create_task(verdict())


def held_now(stack: Any, replica: int) -> float:
    return scrape(stack.replica_metrics_url(replica), "extproc_held_requests")


async def until(predicate: Any) -> None:
    async with asyncio.timeout(10):
        while not predicate():  # noqa: ASYNC110  (a poll of another process's metrics)
            await asyncio.sleep(0.05)


def test_kill_9_of_a_gateway_holding_requests_fails_only_its_streams(
        stack_factory: Any) -> None:
    with RedisServer() as redis:
        stack = stack_factory(settings(redis.url), extproc_replicas=2)

        async def scenario() -> None:
            a_addr = f"127.0.0.1:{stack.replica_grpc_port(0)}"
            b_addr = f"127.0.0.1:{stack.replica_grpc_port(1)}"
            async with (grpc.aio.insecure_channel(a_addr) as a_channel,
                        grpc.aio.insecure_channel(b_addr) as b_channel):
                a, b = (pb_grpc.ExternalProcessorStub(c) for c in (a_channel, b_channel))
                try:
                    await admit_one(a, TOKENS)  # the slot, A's in the ledger: its stream stays open
                    a_held, b_held = await held(a), await held(b)
                    await until(lambda: held_now(stack, 0) == 1 and held_now(stack, 1) == 1)
                    assert not a_held.done() and not b_held.done()

                    stack.processes["extproc"].signal(signal.SIGKILL)
                    killed = time.monotonic()
                    with pytest.raises(grpc.aio.AioRpcError) as failed:
                        await asyncio.wait_for(a_held, 5)
                    assert failed.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                                   grpc.StatusCode.CANCELLED), failed.value
                    assert time.monotonic() - killed < 2.0  # at once, not at a timeout

                    # B's held request is sent once A's entry has lapsed: its slot was A's.
                    verdict = await asyncio.wait_for(b_held, 15)
                    waited = time.monotonic() - killed
                    assert verdict.HasField("request_body"), verdict
                    assert not verdict.HasField("immediate_response")
                    assert waited >= LIVENESS_MS / 1000.0 * 0.5, waited  # not before it lapsed
                    assert waited < LIVENESS_MS / 1000.0 + 5.0, waited  # lease, sweep, a pass
                    assert held_now(stack, 1) == 0
                finally:
                    await Stream.end_all()

        asyncio.run(scenario())
