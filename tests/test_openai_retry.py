"""The official OpenAI SDK, pointed at the gateway, retries our 429 after Retry-After."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from extproc_dev.stack import LocalStack
from tests.conftest import pool

pytestmark = pytest.mark.integration


async def test_sdk_retries_a_rejected_call_after_the_advertised_delay_and_succeeds(
        stack_factory: Any) -> None:
    # One slot. A TTFT objective of 500 ms (budget 400 ms) makes a second request wait behind
    # the first's ~0.75 s of work: it is rejected with Retry-After 1 s (no jitter here), and by
    # the time the SDK retries the slot is free again.
    stack: LocalStack = stack_factory(
        {"pools": [pool(replicas=1, max_num_seqs=1)],
         "classes": {"latency": {"ttft_ms": 500}},
         "retry_after": {"min_s": 1, "max_s": 1, "jitter": 0.0}},
        backend_args=["--max-running", "1"])
    attempts: list[tuple[float, int, str | None]] = []  # the second call's, in order
    sent: list[float] = []

    async def on_request(request: httpx.Request) -> None:
        if b"second" in request.content:
            sent.append(time.monotonic())

    async def record(response: httpx.Response) -> None:
        if b"second" in response.request.content:
            attempts.append((time.monotonic(), response.status_code,
                             response.headers.get("retry-after")))

    async with httpx.AsyncClient(event_hooks={"request": [on_request],
                                              "response": [record]}) as http:
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused",
                                    http_client=http)
        first = asyncio.create_task(client.chat.completions.create(
            model="m", max_tokens=40, messages=[{"role": "user", "content": "first"}],
            extra_body={"extproc_output_tokens": 40}))
        while stack.metric("extproc_inflight_requests") < 1:  # noqa: ASYNC110  (another process)
            await asyncio.sleep(0.01)
        second = await client.chat.completions.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "second"}],
            extra_body={"extproc_output_tokens": 5})
        assert (await first).choices[0].finish_reason == "length"
    assert second.usage is not None and second.usage.completion_tokens == 5
    assert [status for _, status, _ in attempts] == [429, 200]
    rejected_at, _, retry_after = attempts[0]
    assert retry_after == "1"
    assert len(sent) == 2
    assert sent[1] - rejected_at >= 0.9  # the SDK waited the advertised second



async def test_with_defer_a_burst_beyond_the_slots_is_held_past_envoys_timeout(
        stack_factory: Any) -> None:
    # Four slots, 6 s deadlines, 48 concurrent calls of the official SDK with its retries
    # off: more than the deadline lets the engine queue, so the gateway holds the rest
    # (extproc.decision.defer) and sends them as slots free, some after more than Envoy's 2 s
    # message timeout (each held request extends it). Every call gets its answer or, held until its
    # deadline could no longer be met, a 429: never Envoy's 504.
    stack: LocalStack = stack_factory(
        {"pools": [pool(replicas=1, max_num_seqs=4)],
         "classes": {"latency": {"deadline_ms": 6_000, "ttft_ms": 0}},
         "defer": {"enabled": True}},
        backend_args=["--max-running", "4"])
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    samples: list[tuple[float, float]] = []  # (seconds since the burst, requests held)
    started = time.monotonic()

    async def watch() -> None:
        while True:
            held = await asyncio.to_thread(stack.metric, "extproc_held_requests",
                                           {"priority": "standard"})
            samples.append((time.monotonic() - started, held))
            await asyncio.sleep(0.05)

    async def call(i: int) -> int:
        try:
            await client.chat.completions.create(
                model="m", max_tokens=40, messages=[{"role": "user", "content": f"call {i}"}],
                extra_body={"extproc_output_tokens": 40})
        except openai.APIStatusError as exc:
            return exc.status_code
        return 200

    watcher = asyncio.create_task(watch())
    try:
        statuses = await asyncio.gather(*(call(i) for i in range(48)))
    finally:
        watcher.cancel()
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) > 24  # more than the deadline let in at once
    assert any(t > 2.2 and held > 0 for t, held in samples)  # held past Envoy's 2 s
    assert stack.metric("extproc_held_requests", {"priority": "standard"}) == 0
