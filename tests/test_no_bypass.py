"""No way around admission: on a saturated fleet, through real Envoy with the official SDK,
requests shaped to slip past the decision (a huge ``max_tokens``, a 1 ms deadline header,
10,000 empty messages, a 2 MiB prompt) are refused at the door and none reaches the engines'
queue, while an ordinary request is refused the same way and admitted once a slot frees."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from extproc_dev.stack import LocalStack, scrape
from tests.conftest import pool

pytestmark = pytest.mark.integration

HOLD = {"extproc_output_tokens": 400}  # ~8 s of decoding each: the slots stay taken


def engine_holds(stack: LocalStack) -> tuple[float, float]:
    url = stack.backend_url() + "/metrics"
    return (scrape(url, "vllm:num_requests_running"), scrape(url, "vllm:num_requests_waiting"))


@contextlib.asynccontextmanager
async def slots_held(stack: LocalStack, client: openai.AsyncOpenAI,
                     slots: int) -> AsyncIterator[None]:
    """``slots`` streams decoding long answers (the engine running them all, none waiting),
    cancelled on the way out."""

    async def hold() -> None:
        stream = await client.chat.completions.create(
            model="m", max_tokens=400, stream=True, extra_body=HOLD,
            messages=[{"role": "user", "content": "hold a slot"}])
        async for _ in stream:
            pass

    holders = [asyncio.create_task(hold()) for _ in range(slots)]
    try:
        deadline = time.monotonic() + 10
        while engine_holds(stack) != (float(slots), 0.0):
            assert time.monotonic() < deadline, engine_holds(stack)
            await asyncio.sleep(0.05)
        yield
    finally:
        for task in holders:
            task.cancel()
        await asyncio.gather(*holders, return_exceptions=True)


async def test_no_request_shape_reaches_a_saturated_fleet_out_of_turn(
        stack_factory: Any) -> None:
    stack: LocalStack = stack_factory(
        {"pools": [pool(replicas=1, max_num_seqs=2, default_max_tokens=512)],
         "classes": {"latency": {"deadline_ms": 30_000, "ttft_ms": 2_000}}},
        backend_args=["--max-num-seqs", "2"])
    statuses: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=60.0) as http:
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused",
                                    http_client=http, max_retries=0)

        async with slots_held(stack, client, 2):

            async def attempt(name: str, **kwargs: Any) -> None:
                try:
                    await client.chat.completions.create(model="m", **kwargs)
                    statuses[name] = 200
                except openai.APIStatusError as err:
                    statuses[name] = err.status_code
                assert engine_holds(stack) == (2.0, 0.0), name  # nothing joined the queue

            hello = [{"role": "user", "content": "hello"}]
            await attempt("ordinary", max_tokens=100, messages=hello)
            await attempt("max_tokens 4096", max_tokens=4096, messages=hello)
            await attempt("deadline 1 ms", max_tokens=100, messages=hello,
                          extra_headers={"x-admission-deadline-ms": "1"})
            await attempt("10,000 empty messages", max_tokens=10,
                          messages=[{"role": "user", "content": ""}] * 10_000)
            await attempt("2 MiB prompt", max_tokens=10,
                          messages=[{"role": "user", "content": "lorem ipsum " * 174_763}])
        assert statuses == {"ordinary": 429, "max_tokens 4096": 429, "deadline 1 ms": 400,
                            "10,000 empty messages": 429, "2 MiB prompt": 400}
        # and with the slots free again, the ordinary request goes through
        deadline = time.monotonic() + 10
        while engine_holds(stack) != (0.0, 0.0):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        ok = await client.chat.completions.create(model="m", max_tokens=5, messages=hello,
                                                  extra_body={"extproc_output_tokens": 5})
        assert ok.usage is not None and ok.usage.completion_tokens == 5


async def test_choices_are_sequences_n_takes_n_slots(stack_factory: Any) -> None:
    """``n`` choices are ``n`` sequences in the engine: with two of four slots taken, through
    real Envoy with the SDK, ``n = 2`` is admitted and ``n = 4`` refused (priced as one answer,
    it took a slot the way ``n = 1`` does)."""
    stack: LocalStack = stack_factory(
        {"pools": [pool(replicas=1, max_num_seqs=4, default_max_tokens=512)],
         "classes": {"latency": {"deadline_ms": 30_000, "ttft_ms": 2_000}}},
        backend_args=["--max-num-seqs", "4"])
    async with httpx.AsyncClient(timeout=60.0) as http:
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused",
                                    http_client=http, max_retries=0)

        async with slots_held(stack, client, 2):
            hello = [{"role": "user", "content": "hello"}]
            with pytest.raises(openai.RateLimitError):
                await client.chat.completions.create(model="m", max_tokens=20, n=4,
                                                     messages=hello)
            two = await client.chat.completions.create(
                model="m", max_tokens=20, n=2, messages=hello,
                extra_body={"extproc_output_tokens": 5})
            assert two.choices
