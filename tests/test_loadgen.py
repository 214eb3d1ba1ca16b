"""The load generator: seeded workloads, prompt text, the client against real servers, summaries."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from extproc.fleet.engine import EngineModel
from extproc_dev import loadgen
from extproc_dev.fakebackend import build_app
from extproc_dev.loadgen import Lengths, Planned, Result, Workload, percentile, summarize
from extproc_dev.stack import free_port

# -- workloads ------------------------------------------------------------------------------


def test_same_seed_same_workload() -> None:
    assert Workload.generate(10, 30, seed=3) == Workload.generate(10, 30, seed=3)


def test_other_seed_other_workload() -> None:
    assert Workload.generate(10, 30, seed=3).requests != Workload.generate(10, 30, seed=4).requests


def test_lengths_stay_within_their_caps() -> None:
    lengths = Lengths(prompt_cap=4000, max_tokens=512)
    work = Workload.generate(100, 50, seed=1, lengths=lengths)
    assert all(1 <= p.prompt_tokens <= 4000 for p in work.requests)
    assert all(1 <= p.output_tokens <= p.max_tokens == 512 for p in work.requests)
    # the caps bind for some requests: the fits' tails do reach them
    assert any(p.prompt_tokens == 4000 for p in work.requests)
    assert any(p.output_tokens == 512 for p in work.requests)


def test_poisson_arrivals_come_at_the_rate_asked() -> None:
    work = Workload.generate(20, 100, seed=5)
    times = [p.at_s for p in work.requests]
    assert times == sorted(times)
    assert times[0] >= 0 and times[-1] < 100
    assert abs(len(times) - 2000) < 5 * 2000**0.5  # Poisson: sd = sqrt(mean)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 20, rel=0.1)  # exponential: sd = mean


def test_even_arrivals_are_evenly_spaced() -> None:
    work = Workload.generate(4, 2.5, poisson=False)
    assert [p.at_s for p in work.requests] == pytest.approx([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5,
                                                             1.75, 2, 2.25])


def test_request_lengths_do_not_depend_on_the_rate() -> None:
    slow, fast = Workload.generate(5, 20, seed=2), Workload.generate(50, 20, seed=2)
    pairs = zip(slow.requests, fast.requests, strict=False)
    assert all((a.prompt_tokens, a.output_tokens) == (b.prompt_tokens, b.output_tokens)
               for a, b in pairs)


def test_sample_means_match_the_capped_log_normal_means() -> None:
    lengths = Lengths()
    work = Workload.generate(400, 100, seed=9, lengths=lengths)
    prompts = statistics.mean(p.prompt_tokens for p in work.requests)
    outputs = statistics.mean(p.output_tokens for p in work.requests)
    assert prompts == pytest.approx(lengths.mean_prompt(), rel=0.03)
    assert outputs == pytest.approx(lengths.mean_output(), rel=0.03)


def test_capped_mean_without_a_binding_cap_is_the_log_normal_mean() -> None:
    lengths = Lengths(output_mu=2.0, output_sigma=0.5, max_tokens=10**9)
    assert lengths.mean_output() == pytest.approx(2.718281828 ** (2.0 + 0.125))


@pytest.mark.parametrize("bad", [(0, 10), (10, 0), (-1, 10)])
def test_rate_and_duration_must_be_positive(bad: tuple[float, float]) -> None:
    with pytest.raises(ValueError):
        Workload.generate(*bad)


# -- prompt text and bodies -----------------------------------------------------------------


def test_prompt_text_is_four_bytes_a_token_of_real_words() -> None:
    text = loadgen.prompt_text(1000, random.Random(1))
    assert len(text.encode()) == 4000
    words = {w.strip(".,?").lower() for w in text.split()}
    assert len(words) > 100  # not one token repeated
    assert "the" in words
    assert text == loadgen.prompt_text(1000, random.Random(1))


def test_chat_body_carries_the_lengths() -> None:
    planned = Planned(at_s=0.0, prompt_tokens=3, output_tokens=7, max_tokens=512)
    body = json.loads(loadgen.chat_body(planned, "hello there", model="m"))
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hello there"}],
                    "max_tokens": 512, "stream": True, "extproc_output_tokens": 7}
    plain = json.loads(loadgen.chat_body(planned, "x", model="m", stream=False,
                                         hint_output=False))
    assert plain["stream"] is False and "extproc_output_tokens" not in plain


# -- summaries ------------------------------------------------------------------------------


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([1.0, 2.0, 3.0, 11.0], 95) == pytest.approx(3.0 + 0.85 * 8.0)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


HAND_MADE = [
    Result(0, 200, 1.0, ttft_s=0.1, tokens=10, completed=True),
    Result(1, 200, 2.0, ttft_s=0.2, tokens=20, completed=True),
    Result(2, 200, 3.0, ttft_s=3.0, tokens=30, completed=True),  # misses a 2.5 s TTFT
    Result(3, 200, 40.0, ttft_s=0.5, tokens=40, completed=True),  # misses a 30 s deadline
    Result(4, 429, 0.01, retry_after_s=2.0),
    Result(5, 200, 30.0, ttft_s=25.0, tokens=5, abandoned=True),  # gave up mid-answer
    Result(6, 0, 30.0, abandoned=True),  # gave up before the head
    Result(7, 500, 0.02),
]


def test_summarize_hand_made_results() -> None:
    s = summarize(HAND_MADE, duration_s=10.0, deadline_s=30.0, ttft_objective_s=2.5)
    assert s == {
        "sent": 8, "ok": 4, "rejected_429": 1, "share_429": 0.125, "abandoned": 2, "failed": 1,
        "latency_p50_s": 2.5,
        "latency_p95_s": pytest.approx(3.0 + 0.85 * 37.0),
        "latency_p99_s": pytest.approx(3.0 + 0.97 * 37.0),
        "ttft_p50_s": pytest.approx(0.35),
        "ttft_p95_s": pytest.approx(0.5 + 0.85 * 2.5),
        "within_deadline": 3, "within_deadline_share": 0.375, "goodput_rps": 0.3,
        "good_tokens_per_s": 6.0,
        "within_slo": 2, "within_slo_share": 0.25, "slo_goodput_rps": 0.2,
        "tokens": 105, "start_lag_max_s": 0.0,
    }


def test_without_a_ttft_objective_the_slo_is_the_deadline() -> None:
    s = summarize(HAND_MADE, duration_s=10.0, deadline_s=30.0)
    assert s["within_slo"] == s["within_deadline"] == 3


def test_summarize_nothing() -> None:
    s = summarize([], duration_s=5.0, deadline_s=30.0)
    assert s["sent"] == 0 and s["share_429"] == 0.0 and s["goodput_rps"] == 0.0
    assert s["latency_p95_s"] is None and s["ttft_p50_s"] is None


# -- the client against real servers --------------------------------------------------------


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    server = TestServer(app)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def scripted_app(seen: list[float]) -> web.Application:
    """Answers by the hinted output length: 1 -> 429, 2 -> hangs, N -> N streamed tokens."""

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(asyncio.get_running_loop().time())
        n = (await request.json())["extproc_output_tokens"]
        if n == 1:
            return web.json_response({"error": {}}, status=429, headers={"Retry-After": "3"})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if n == 2:
            await asyncio.sleep(10)
        await response.write(b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n')
        for _ in range(n):
            await response.write(b'data: {"choices": [{"delta": {"content": " tok"}}]}\n\n')
        await response.write(b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_run_records_tokens_rejections_and_abandonment() -> None:
    seen: list[float] = []
    work = Workload(0, 1.0, 1.0, (Planned(0.0, 10, 5, 512), Planned(0.3, 10, 1, 512),
                                  Planned(0.35, 10, 2, 512)))
    async with serving(scripted_app(seen)) as url:
        streamed, rejected, hung = await loadgen.run(work, url, timeout_s=0.5)

    assert streamed.ok and streamed.tokens == 5
    assert streamed.ttft_s is not None and 0 < streamed.ttft_s <= streamed.latency_s
    assert rejected.status == 429 and rejected.retry_after_s == 3.0 and not rejected.ok
    assert hung.abandoned and hung.status == 200 and not hung.completed
    assert hung.latency_s == pytest.approx(0.5, abs=0.1)
    assert seen[1] - seen[0] == pytest.approx(0.3, abs=0.08)  # left on schedule (open loop)
    s = summarize([streamed, rejected, hung], duration_s=1.0, deadline_s=30.0)
    assert (s["ok"], s["rejected_429"], s["abandoned"], s["failed"]) == (1, 1, 1, 0)


async def test_run_against_the_fake_backend_gets_every_token() -> None:
    work = Workload.generate(100, 0.2, seed=4, lengths=Lengths(prompt_cap=300, max_tokens=40))
    async with serving(build_app(EngineModel(), time_scale=0.01)) as url:
        results = await loadgen.run(work, url, timeout_s=10)
    assert len(results) == len(work.requests) > 5
    assert all(r.ok for r in results)
    assert [r.tokens for r in results] == [p.output_tokens for p in work.requests]


async def test_a_refused_connection_is_a_failure_not_a_crash() -> None:
    work = Workload(0, 1.0, 1.0, (Planned(0.0, 1, 1, 8),))
    (result,) = await loadgen.run(work, f"http://127.0.0.1:{free_port()}", timeout_s=2)
    assert result.status == 0 and result.error is not None and not result.abandoned
    assert summarize([result], 1.0, 30.0)["failed"] == 1


async def test_a_whole_answer_counts_its_usage_tokens() -> None:
    work = Workload.generate(50, 0.1, seed=6, lengths=Lengths(prompt_cap=100, max_tokens=20))
    async with serving(build_app(EngineModel(), time_scale=0.01)) as url:
        results = await loadgen.run(work, url, timeout_s=10, stream=False)
    assert all(r.ok and r.ttft_s is None for r in results)
    assert [r.tokens for r in results] == [p.output_tokens for p in work.requests]
