"""Drive the ext_proc server message by message over real gRPC, as Envoy does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc import config
from extproc.gateway.server import Service

CHAT = "/v1/chat/completions"


class Stream:
    """One ext_proc stream: send a phase, read its answer; every read is bounded (a hang fails
    the test). ``end_all`` finishes every stream opened, so none outlives its event loop."""

    opened: list[Stream] = []

    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
        self.call = stub.Process(self._requests())
        Stream.opened.append(self)

    async def _requests(self) -> AsyncIterator[pb.ProcessingRequest]:
        while (item := await self.queue.get()) is not None:
            yield item

    async def send(self, message: pb.ProcessingRequest) -> pb.ProcessingResponse:
        await self.queue.put(message)
        return await asyncio.wait_for(self.call.read(), 5)

    async def close(self) -> None:
        await self.queue.put(None)
        assert await asyncio.wait_for(self.call.read(), 5) == grpc.aio.EOF

    @classmethod
    async def end_all(cls) -> None:
        """Finish the streams opened on this event loop (each test has its own loop)."""
        loop = asyncio.get_running_loop()
        for stream in [s for s in cls.opened if s.loop is loop]:
            await stream.queue.put(None)
            stream.call.cancel()
        await asyncio.sleep(0)
        cls.opened.clear()


@asynccontextmanager
async def serving(settings: Mapping[str, Any], options: Sequence[tuple[str, Any]] = ()
                  ) -> AsyncIterator[tuple[Service, pb_grpc.ExternalProcessorStub]]:
    """A started ``Service`` on ``settings`` and an ext_proc stub on a real channel to it
    (``options`` for the channel); on exit every stream is ended and the service stopped."""
    svc = Service(config.from_mapping(dict(settings)))
    await svc.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.grpc_port}",
                                             options=list(options)) as channel:
            yield svc, pb_grpc.ExternalProcessorStub(channel)
    finally:
        await Stream.end_all()
        await svc.stop()


def headers(path: str = CHAT, method: str = "POST", eos: bool = False,
            **extra: str) -> pb.ProcessingRequest:
    pairs = {":path": path, ":method": method, "content-type": "application/json", **extra}
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
        end_of_stream=eos))


def body(doc: Any, eos: bool = True) -> pb.ProcessingRequest:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=eos))


def chat(max_tokens: int = 100) -> dict[str, Any]:
    return {"model": "m", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello"}]}


async def admit_one(stub: pb_grpc.ExternalProcessorStub, max_tokens: int = 100) -> Stream:
    s = Stream(stub)
    assert (await s.send(headers())).HasField("request_headers")
    assert (await s.send(body(chat(max_tokens)))).HasField("request_body")
    return s
