"""Contract tests for the fake backend: OpenAI wire format, continuous-batching timing, metrics.

Timing tests use models where the effect under test is several times larger than scheduling
noise, and assert relations between measurements rather than absolute durations.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from extproc.fleet.engine import EngineModel
from extproc_dev.fakebackend import build_app, serve

Client = TestClient[web.Request, web.Application]
DEFAULT = EngineModel()


def flat(ms_per_step: float, **overrides: Any) -> EngineModel:
    """A model whose every step takes ``ms_per_step`` whatever it holds, with no KV limit."""
    fields: dict[str, Any] = {"step_base_ms": ms_per_step, "ms_per_token": 0.0,
                              "ms_per_seq": 0.0, "ms_per_kv_token": 0.0,
                              "ms_per_prefill_pair": 0.0, "num_gpu_blocks": 0} | overrides
    return EngineModel(**fields)


@asynccontextmanager
async def serving(model: EngineModel = DEFAULT, time_scale: float = 0.01,
                  **kwargs: Any) -> AsyncIterator[Client]:
    app = build_app(model, time_scale=time_scale, **kwargs)
    async with TestClient(TestServer(app)) as client:
        yield client


def chat(output_tokens: int | None = None, *, content: str = "x" * 40,
         **extra: Any) -> dict[str, Any]:
    """A chat body; ``content`` is four bytes a prompt token."""
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": content}]}
    if output_tokens is not None:
        body["extproc_output_tokens"] = output_tokens
    return body | extra


async def post_json(client: Client, body: dict[str, Any],
                    path: str = "/v1/chat/completions") -> Any:
    response = await client.post(path, json=body)
    assert response.status == 200, await response.text()
    return await response.json()


async def stream_events(client: Client, body: dict[str, Any],
                        path: str = "/v1/chat/completions") -> list[str]:
    """The ``data:`` payloads of one streamed call, in order."""
    response = await client.post(path, json=body | {"stream": True})
    assert response.headers["Content-Type"].startswith("text/event-stream")
    return [line[6:] for line in (await response.text()).splitlines() if line.startswith("data: ")]


async def generate(client: Client, path: str, body: dict[str, Any],
                   stream: bool) -> tuple[str, dict[str, int], str]:
    """(text, usage, finish_reason) of one call to ``path``, whole or streamed with usage."""
    if not stream:
        choice = (answer := await post_json(client, body, path))["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return text, answer["usage"], choice["finish_reason"]
    events = await stream_events(client, body | {"stream_options": {"include_usage": True}}, path)
    chunks = [json.loads(e) for e in events[:-1]]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join(c["text"] if "text" in c else c["delta"].get("content", "") for c in choices)
    return text, chunks[-1]["usage"], choices[-1]["finish_reason"]


def length_body(path: str, natural: int, limit: int, **extra: Any) -> dict[str, Any]:
    """A call to ``path`` whose model would stop after ``natural`` tokens, capped at ``limit``
    (``max_completion_tokens`` for chat, ``max_tokens`` for completions)."""
    if path == "/v1/chat/completions":
        return chat(natural, max_completion_tokens=limit, **extra)
    return {"model": "m", "prompt": "x" * 40, "extproc_output_tokens": natural,
            "max_tokens": limit} | extra


ENDPOINTS = pytest.mark.parametrize(("path", "stream"), [
    (path, stream) for path in ("/v1/completions", "/v1/chat/completions")
    for stream in (False, True)])


async def stream_timing(client: Client, output_tokens: int) -> tuple[float, float]:
    """Client-side (time to first token, time to last byte) of one streamed call."""
    start = time.monotonic()
    response = await client.post("/v1/chat/completions", json=chat(output_tokens, stream=True))
    await response.content.readline()
    first = time.monotonic() - start
    await response.read()
    return first, time.monotonic() - start


async def scrape(client: Client) -> dict[str, float]:
    """Every metric sample except histogram buckets, summed over labels."""
    text = await (await client.get("/metrics")).text()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def until(client: Client, check: Callable[[dict[str, float]], bool]) -> None:
    """Poll ``/metrics`` until ``check`` holds; TimeoutError after 3 s."""
    async with asyncio.timeout(3):
        while not check(await scrape(client)):  # noqa: ASYNC110 - the state is in the server
            await asyncio.sleep(0.005)


RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"


def test_a_negative_time_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="time_scale"):
        build_app(DEFAULT, time_scale=-1.0)


@pytest.mark.asyncio
async def test_chat_usage_counts_the_requested_output_tokens() -> None:
    async with serving() as client:
        answer = await post_json(client, chat(7))
    assert answer["object"] == "chat.completion"
    assert answer["usage"] == {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": " tok" * 7}
    assert answer["choices"][0]["finish_reason"] == "stop"


@pytest.mark.asyncio
async def test_completion_stops_at_max_tokens_with_finish_reason_length() -> None:
    async with serving() as client:
        body = {"model": "m", "prompt": "hello", "max_tokens": 5, "extproc_output_tokens": 50}
        answer = await post_json(client, body, "/v1/completions")
    assert answer["object"] == "text_completion"
    assert answer["usage"]["completion_tokens"] == 5
    assert answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.asyncio
async def test_drawn_output_lengths_are_seeded_and_capped() -> None:
    async def lengths(seed: int) -> list[int]:
        async with serving(time_scale=0.0, seed=seed) as client:
            answers = [await post_json(client, chat(max_tokens=300)) for _ in range(6)]
        return [a["usage"]["completion_tokens"] for a in answers]

    first = await lengths(7)
    assert first == await lengths(7)
    assert len(set(first)) > 1 and all(1 <= n <= 300 for n in first)


@pytest.mark.asyncio
@ENDPOINTS
async def test_ignore_eos_generates_exactly_the_token_limit(path: str, stream: bool) -> None:
    async with serving() as client:
        fixed = await generate(client, path, length_body(path, 3, 12, ignore_eos=True), stream)
        natural = await generate(client, path, length_body(path, 3, 12, ignore_eos=False), stream)
    assert fixed == (" tok" * 12, {"prompt_tokens": 10, "completion_tokens": 12,
                                   "total_tokens": 22}, "length")
    assert natural[1]["completion_tokens"] == 3 and natural[2] == "stop"


@pytest.mark.asyncio
@ENDPOINTS
async def test_min_tokens_is_a_floor_under_the_model_length(path: str, stream: bool) -> None:
    async with serving() as client:
        raised = await generate(client, path, length_body(path, 3, 12, min_tokens=8), stream)
        kept = await generate(client, path, length_body(path, 5, 12, min_tokens=2), stream)
    assert raised[0] == " tok" * 8 and raised[1]["completion_tokens"] == 8
    assert kept[1]["completion_tokens"] == 5


@pytest.mark.asyncio
@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"ignore_eos": "true"}, "ignore_eos"),
    ("/v1/chat/completions", {"ignore_eos": 1}, "ignore_eos"),
    ("/v1/chat/completions", {"ignore_eos": None}, "ignore_eos"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/chat/completions", {"min_tokens": 2.0}, "min_tokens"),
    ("/v1/completions", {"min_tokens": 13}, "min_tokens"),  # above max_tokens=12
    ("/v1/chat/completions", {"min_tokens": 13}, "min_tokens"),  # max_completion_tokens=12
])
async def test_bad_length_controls_get_an_openai_error(path: str, extra: dict[str, Any],
                                                       param: str) -> None:
    async with serving() as client:
        response = await client.post(path, json=length_body(path, 3, 12, **extra))
        body = await response.json()
    assert response.status == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param


@pytest.mark.asyncio
async def test_stream_sends_one_chunk_per_token_then_done() -> None:
    async with serving() as client:
        events = await stream_events(client, chat(4))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": " tok"}
    assert deltas[1:4] == [{"content": " tok"}] * 3
    assert deltas[4] == {} and chunks[4]["choices"][0]["finish_reason"] == "stop"
    assert len(chunks) == 5


@pytest.mark.asyncio
async def test_third_request_waits_for_a_free_slot() -> None:
    async with serving(flat(30, max_num_seqs=2), time_scale=0.1) as client:  # 3 ms a token
        timings = await asyncio.gather(*(stream_timing(client, 30) for _ in range(3)))
    ttfts = sorted(first for first, _ in timings)
    shortest = min(last for _, last in timings)
    assert ttfts[1] < 0.5 * shortest  # two start at once
    assert ttfts[2] > 0.8 * shortest  # the third starts when one of them ends


@pytest.mark.asyncio
async def test_inter_token_latency_grows_with_the_batch() -> None:
    model = flat(0.0, ms_per_seq=1.0)
    async with serving(model, time_scale=1.0) as client:  # itl(1) = 1 ms, itl(8) = 8 ms
        _, alone = await stream_timing(client, 20)
        batch = await asyncio.gather(*(stream_timing(client, 20) for _ in range(8)))
    assert min(last for _, last in batch) > 3 * alone


@pytest.mark.asyncio
async def test_client_disconnect_mid_stream_frees_its_slot() -> None:
    # the stream alone would take 10 s
    async with serving(flat(10, max_num_seqs=1), time_scale=1.0) as client:
        body = chat(1000, max_tokens=1000, stream=True)
        stream = await client.post("/v1/chat/completions", json=body)
        await stream.content.readline()
        queued = asyncio.create_task(post_json(client, chat(3)))
        await until(client, lambda m: m[WAITING] == 1)
        stream.close()
        answer = await asyncio.wait_for(queued, timeout=3)
        assert answer["usage"]["completion_tokens"] == 3
        metrics = await scrape(client)
    assert metrics[RUNNING] == 0 and metrics[WAITING] == 0


@pytest.mark.asyncio
async def test_client_disconnect_while_waiting_leaves_the_queue() -> None:
    async with serving(flat(10, max_num_seqs=1), time_scale=1.0) as client:
        running = asyncio.create_task(post_json(client, chat(1000, max_tokens=1000)))
        await until(client, lambda m: m[RUNNING] == 1)
        waiting = asyncio.create_task(post_json(client, chat(3)))
        await until(client, lambda m: m[WAITING] == 1)
        waiting.cancel()
        await until(client, lambda m: m[WAITING] == 0)
        assert (await scrape(client))[RUNNING] == 1
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


@pytest.mark.asyncio
async def test_kv_budget_holds_back_a_sequence_that_would_not_fit() -> None:
    model = flat(5, num_gpu_blocks=25, block_size=4)  # 100 tokens; each call needs 40 + 20
    async with serving(model, time_scale=1.0) as client:
        calls = [asyncio.create_task(post_json(client, chat(20, content="x" * 160)))
                 for _ in range(2)]
        await until(client, lambda m: m[RUNNING] == 1 and m[WAITING] == 1)
        assert 0 < (await scrape(client))["vllm:kv_cache_usage_perc"] <= 0.6
        answers = await asyncio.gather(*calls)
    assert [a["usage"]["completion_tokens"] for a in answers] == [20, 20]


@pytest.mark.asyncio
async def test_replicas_share_the_load() -> None:
    async with serving(flat(10, max_num_seqs=1), time_scale=1.0, replicas=2) as client:
        calls = [asyncio.create_task(post_json(client, chat(30))) for _ in range(2)]
        await until(client, lambda m: m[RUNNING] == 2)
        assert (await scrape(client))[WAITING] == 0
        await asyncio.gather(*calls)


@pytest.mark.asyncio
async def test_metrics_use_vllm_names() -> None:
    async with serving(model_name="llama") as client:
        await post_json(client, chat(5))
        response = await client.get("/metrics")
        text = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["vllm:cache_config_info"].samples[0].labels == {
        "block_size": "16", "num_gpu_blocks": "12800"}
    assert families["vllm:num_preemptions"].type == "counter"
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_success"):
        assert families[name].samples[0].labels["model_name"] == "llama"
    assert families["vllm:request_success"].type == "counter"
    success = [s for s in families["vllm:request_success"].samples if s.name.endswith("_total")]
    assert [(s.labels["finished_reason"], s.value) for s in success] == [("stop", 1.0)]
    ttft = {s.name: s.value for s in families["vllm:time_to_first_token_seconds"].samples}
    e2e = {s.name: s.value for s in families["vllm:e2e_request_latency_seconds"].samples}
    assert ttft["vllm:time_to_first_token_seconds_count"] == 1
    first, last = (ttft["vllm:time_to_first_token_seconds_sum"],
                   e2e["vllm:e2e_request_latency_seconds_sum"])
    assert 0 < first < last


@pytest.mark.asyncio
@pytest.mark.parametrize(("path", "data"), [
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", json.dumps({"model": "m"}).encode()),
    ("/v1/chat/completions", json.dumps(chat(max_tokens=0)).encode()),
    ("/v1/completions", json.dumps({"model": "m", "prompt": 3}).encode()),
])
async def test_bad_requests_get_an_openai_error(path: str, data: bytes) -> None:
    async with serving() as client:
        response = await client.post(path, data=data, headers={"Content-Type": "application/json"})
        body = await response.json()
    assert response.status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert set(body["error"]) == {"message", "type", "param", "code"}


@pytest.mark.asyncio
async def test_request_larger_than_the_kv_cache_is_refused() -> None:
    async with serving(flat(1, num_gpu_blocks=5, block_size=10)) as client:
        response = await client.post("/v1/chat/completions", json=chat(45))  # 10 + 45 tokens
        body = await response.json()
    assert response.status == 400
    assert body["error"]["code"] == "context_length_exceeded"


@pytest.mark.asyncio
async def test_a_prefill_stalls_the_batch_for_its_chunk_and_no_longer() -> None:
    # 1 ms a prompt token, budget 100 tokens a step: a 400-token prompt joining a decode
    # stretches four of its steps by ~100 ms each, then decodes are fast again.
    model = flat(1.0, ms_per_token=1.0, max_num_batched_tokens=100)
    async with serving(model, time_scale=1.0) as client:
        response = await client.post("/v1/chat/completions", json=chat(60, stream=True))
        await response.content.readline()
        gaps: list[float] = []
        last = time.monotonic()
        joiner = None
        while line := await response.content.readline():
            if not line.startswith(b"data: {"):
                continue
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            if len(gaps) == 10:
                joiner = asyncio.create_task(post_json(client, chat(2, content="x" * 1600)))
        assert joiner is not None
        await joiner
    stalled = [g for g in gaps if g > 0.05]
    assert 3 <= len(stalled) <= 5  # ceil(399 / 99) chunks beside the decode


@pytest.mark.asyncio
async def test_health_can_be_switched_off_and_on() -> None:
    async with serving() as client:
        assert (await client.get("/health")).status == 200
        await client.post("/admin/health", json={"healthy": False})
        assert (await client.get("/health")).status == 503
        await client.post("/admin/health", json={"healthy": True})
        assert (await client.get("/health")).status == 200


@pytest.mark.asyncio
async def test_serve_logs_probes_at_debug_and_other_requests_at_info(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="aiohttp.access")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    server = asyncio.create_task(serve("127.0.0.1", port, DEFAULT, time_scale=0.01))

    def levels() -> dict[str, set[int]]:
        """Access-log levels of each path, from the request line in each message."""
        seen: dict[str, set[int]] = {}
        for record in caplog.records:
            for path in ("/v1/models", "/health", "/metrics"):
                if record.name == "aiohttp.access" and f"GET {path} " in record.getMessage():
                    seen.setdefault(path, set()).add(record.levelno)
        return seen

    try:
        async with aiohttp.ClientSession() as session, asyncio.timeout(10):
            while True:  # until serve listens
                if server.done():
                    server.result()  # raises what stopped it (the port taken meanwhile?)
                try:
                    async with session.get(base + "/v1/models") as response:
                        assert response.status == 200
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.02)
            for path in ("/health", "/metrics"):
                async with session.get(base + path) as response:
                    assert response.status == 200
            while len(levels()) < 3:  # noqa: ASYNC110 - a line is written after its response
                await asyncio.sleep(0.01)
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
    assert levels() == {"/v1/models": {logging.INFO}, "/health": {logging.DEBUG},
                        "/metrics": {logging.DEBUG}}


@pytest.mark.asyncio
async def test_openai_sdk_reads_whole_answers() -> None:
    async with serving() as client:
        sdk = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
        answer = await sdk.chat.completions.create(
            model="fake-llm", messages=[{"role": "user", "content": "hi"}],
            extra_body={"extproc_output_tokens": 4})
        completion = await sdk.completions.create(model="fake-llm", prompt="hi", max_tokens=3)
        await sdk.close()
    assert answer.choices[0].message.content == " tok" * 4
    assert answer.usage is not None and answer.usage.completion_tokens == 4
    assert completion.choices[0].finish_reason == "length"


@pytest.mark.asyncio
async def test_openai_sdk_reads_streams() -> None:
    async with serving() as client:
        sdk = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
        stream = await sdk.chat.completions.create(
            model="fake-llm", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True}, extra_body={"extproc_output_tokens": 4})
        chunks = [chunk async for chunk in stream]
        await sdk.close()
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " tok" * 4
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


@pytest.mark.asyncio
async def test_completion_takes_a_token_id_prompt_and_counts_its_length() -> None:
    async with serving() as client:
        body = {"model": "m", "prompt": [128000, 9906, 1917, 0], "max_tokens": 2}
        answer = await post_json(client, body, "/v1/completions")
        bad = await client.post("/v1/completions", json={"model": "m", "prompt": [1, -2]})
        assert bad.status == 400
        assert (await bad.json())["error"]["param"] == "prompt"
    assert answer["usage"]["prompt_tokens"] == 4


@pytest.mark.asyncio
async def test_embeddings_and_models_through_the_openai_sdk() -> None:
    async with serving() as client:
        sdk = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
        # the SDK asks for base64 by default and decodes it itself
        one = await sdk.embeddings.create(model="fake-llm", input="x" * 40)
        ids = await sdk.embeddings.create(model="fake-llm", input=[[1, 2, 3], [4, 5]],
                                          encoding_format="float")
        models = await sdk.models.list()
        await sdk.close()
        bad = await client.post("/v1/embeddings", json={"model": "m", "input": [1, "a"]})
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "input"
        # prefill only: every embedding sequence left the engines
        await until(client, lambda m: m[RUNNING] == 0 and m[WAITING] == 0)
    assert len(one.data) == 1 and len(one.data[0].embedding) == 8
    assert one.usage.prompt_tokens == 10
    assert [d.index for d in ids.data] == [0, 1] and ids.usage.prompt_tokens == 5
    assert all(-1 <= v <= 1 for d in ids.data for v in d.embedding)
    assert [m.id for m in models.data] == ["fake-llm"]
