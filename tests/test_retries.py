"""A retry is judged by what its last attempt showed (``extproc.decision.retries``): the gateway
saw the request run, so one whose client left ``d`` seconds after it was admitted had about
``(d - ttft) / itl`` tokens at the speed the engines measured, and where that is more than the
request's budget lets it write even alone, the same request sent again is infeasible."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import aiohttp
import grpc
import httpx
import openai
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from extproc.config import Api
from extproc.decision import retries
from extproc.decision.admission import Outcome, Snapshot
from extproc.decision.learning import PoolLearning, learning_for
from extproc.decision.retries import Shown
from extproc.decision.step import Admission, Ask, running_of
from extproc.gateway.request import parse
from extproc.gateway.responses import ADMISSION_NAMESPACE
from extproc.sim import families, policies
from extproc.sim.run import Simulation
from extproc.sim.workload import Job
from extproc_dev.stack import LocalStack, Process, free_port, wait_http
from tests.conftest import pool
from tests.extproc_client import Stream, body, headers, serving
from tests.test_no_harm import POOL, decide_at

SPEED = (500.0, 15.0)  # the engines' measured first token and inter-token latency, ms


def short_answers() -> PoolLearning:
    """A pool whose engines finished 400 answers of 20 tokens, measuring ``SPEED``."""
    learning = learning_for(POOL)
    for _ in range(400):
        learning.finished(20)
    learning.engine_speed(*SPEED, 0.0)
    return learning


def left(learning: PoolLearning, request: Ask, seconds: float, now: float = 0.0) -> None:
    """``request`` is admitted at ``now``; its client leaves ``seconds`` later."""
    adm = decide_at(learning, 0, now, request)
    assert adm.outcome is Outcome.ADMIT
    running = running_of(adm, now)
    key = f"{request.fingerprint}/{now}"
    learning.admitted(running, key=key)
    learning.engine_speed(*SPEED, now + seconds)
    learning.settled(running, completed=False, now=now + seconds, key=key)


def test_an_answer_shown_too_long_to_finish_alone_makes_its_retry_infeasible() -> None:
    """Its client left 30 s after it was admitted, at 500 ms to a first token and 15 ms a
    token: about 1,970 tokens, more than fit its 20 s deadline even alone. The same request
    again is infeasible (certain to miss alone, priced at that length), while another request
    is admitted as the first was."""
    learning = short_answers()
    request = Ask("latency", 500, 4096, fingerprint="a")
    left(learning, request, 30.0)
    predicted = decide_at(learning, 0, 0.0, dataclasses.replace(request, fingerprint="x"))
    assert predicted.decision is not None and predicted.decision.ttft_ms < SPEED[0]
    shown = (30.0 * 1000.0 - SPEED[0]) / SPEED[1]
    assert learning.shown.least("a") == pytest.approx(shown)
    retry = decide_at(learning, 0, 40.0, request)
    assert retry.outcome is not Outcome.ADMIT  # passed into a free slot as infeasible, or refused
    assert retry.unavoidable == 1.0 and retry.cost.typical == pytest.approx(shown)
    fresh = decide_at(learning, 0, 40.0, dataclasses.replace(request, fingerprint="b"))
    assert fresh.outcome is Outcome.ADMIT and fresh.unavoidable < 0.05
    assert fresh.cost.typical < 100


def test_a_shorter_showing_changes_nothing() -> None:
    """Left after 5 s (some 300 tokens), it fits the deadline alone: read at the pool's mean
    step the count may overstate what a long context, a wait for KV memory or a preempted
    request wrote, so the retry is priced as before."""
    learning = short_answers()
    request = Ask("latency", 500, 4096, fingerprint="a")
    before = decide_at(learning, 0, 0.0, request)
    left(learning, request, 5.0, now=1.0)
    assert learning.shown.least("a") > 250
    retry = decide_at(learning, 0, 10.0, request)
    assert retry.outcome is Outcome.ADMIT
    assert retry.cost.typical == pytest.approx(before.cost.typical, rel=0.05)


def test_what_was_shown_needs_a_measured_speed() -> None:
    """Without a fresh measurement of the engines' speed nothing is kept."""
    learning = learning_for(POOL)  # no speed measured
    request = Ask("latency", 500, 4096, fingerprint="a")
    adm = decide_at(learning, 0, 0.0, request)
    running = running_of(adm, 0.0)
    learning.abandoned(running, 20.0, 20.0)
    assert len(learning.shown) == 0
    learning.engine_speed(*SPEED, 0.0)
    learning.abandoned(running, 20.0, 20.0)
    assert learning.shown.least("a") == pytest.approx((20_000.0 - SPEED[0]) / SPEED[1])
    learning.abandoned(running, 60.0, 1000.0)  # the measurement has gone stale: nothing more
    assert learning.shown.least("a") == pytest.approx((20_000.0 - SPEED[0]) / SPEED[1])


def test_what_was_shown_is_kept_for_a_while_and_bounded() -> None:
    shown = Shown()
    shown.keep("a", 100.0, 0.0)
    shown.keep("a", 50.0, 10.0)  # a shorter showing does not lower it
    assert shown.least("a") == 100.0 and shown.least(None) == 0.0
    shown.forget(10.0 + retries.KEEP_S)
    assert shown.least("a") == 100.0  # kept from its last showing
    shown.forget(10.0 + retries.KEEP_S + 1.0)
    assert shown.least("a") == 0.0 and len(shown) == 0
    for i in range(retries.MOST + 5):
        shown.keep(str(i), 1.0, 0.0)
    assert len(shown) == retries.MOST and shown.least("0") == 0.0
    assert shown.least(str(retries.MOST + 4)) == 1.0


def test_a_retry_has_the_fingerprint_of_its_first_attempt_and_no_other() -> None:
    """The gateway's fingerprint is a digest of the body: the SDK's retry sends the same bytes;
    a different body or route reads as a different request; the body is not in it."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "secret words"}]}'
    first = parse(Api.OPENAI_CHAT, body).fingerprint
    assert first is not None and first == parse(Api.OPENAI_CHAT, body).fingerprint
    assert first != parse(Api.OPENAI_CHAT, body.replace(b"secret", b"public")).fingerprint
    assert first != parse(Api.OPENAI_COMPLETIONS, body.replace(b"messages", b"prompt")
                          .replace(b'[{"role": "user", "content": "secret words"}]',
                                   b'"secret words"')).fingerprint
    assert "secret" not in first and "secret" not in repr(parse(Api.OPENAI_CHAT, body))


def doomed_admissions(monkeypatch: pytest.MonkeyPatch, shown: bool) -> tuple[float, float]:
    """A quarter-length output-tail run on 8b-vllm at 0.8x (a fifth of the answers too long to
    finish in time even alone; clients wait 1.5-4 deadlines, then retry twice), simulated:
    the admitted attempts per job whose answer cannot finish in time alone, and the run's
    attainment. ``shown``: retries are judged by what their last attempt showed."""
    if not shown:
        monkeypatch.setattr(retries.Shown, "least", lambda *_: 0.0)
    sim = Simulation(families.draw("output-tail", 0, 0.8, "8b-vllm", 0.25).scenario,
                     policies.make("default"))
    admitted: collections.Counter[int] = collections.Counter()
    doomed: set[int] = set()

    def record(job: Job, _: Snapshot, adm: Admission) -> None:
        alone_ms = job.output_tokens * sim.pool.engine.itl_ms(1, job.prompt_tokens)
        if alone_ms > adm.policy.deadline_ms:
            doomed.add(id(job))
            admitted[id(job)] += adm.runs

    sim.on_decision = record
    result = sim.run()
    return sum(admitted.values()) / len(doomed), result.attainment


@pytest.mark.slow
def test_a_doomed_request_is_not_run_again_and_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Judged fresh, an answer too long for its deadline ran on each of its client's retries;
    judged by what it showed, mostly once, and the pool's attainment is no longer set by how
    often the gateway let such retries in."""
    fresh, fresh_attainment = doomed_admissions(monkeypatch, shown=False)
    monkeypatch.undo()
    seen, seen_attainment = doomed_admissions(monkeypatch, shown=True)
    assert seen <= 0.7 * fresh, (seen, fresh)
    assert seen_attainment >= fresh_attainment + 0.1, (seen_attainment, fresh_attainment)


# -- through the real service: its gRPC stream, a real fake vLLM scraped for its speed ------------

@pytest.fixture
def engine(tmp_path: Path) -> Iterator[str]:
    """A fake vLLM replica (the default engine, in real time)."""
    port = free_port()
    proc = Process("backend", [sys.executable, "-m", "extproc", "fake-backend", "--port",
                               str(port), "--max-running", "4"], tmp_path)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc.popen)
        yield f"127.0.0.1:{port}"
    finally:
        proc.stop()


@pytest.mark.integration
async def test_the_service_refuses_the_retry_of_a_request_whose_client_left(
        engine: str) -> None:
    """A 3 s deadline; the engines' speed scraped from a real engine. A request is admitted,
    and its stream ends 4.5 s later as a completion would (as Envoy ends it either way); then
    Envoy's access log says its client had left, its answer streamed from 0.1 s to 4.4 s (the
    entry of a request flagged ``DC``, with the ticket its verdict's metadata carried, over the
    real AccessLogService). At the speed measured, 4.3 s of answer is more than fits 3 s alone,
    so the same body again is refused as infeasible (400, not to be retried), while another
    body is admitted as the first was. An entry for a ticket the service does not hold, with no
    ticket, changes nothing."""
    settings = {
        "listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0", "infeasible": "reject",
        "pools": [{"name": "llama", "replicas": 1, "engine": {"max_num_seqs": 4},
                   "expected_output_tokens": 20, "long_output_tokens": 60,
                   "engine_metrics": {"targets": [engine], "interval_s": 0.1,
                                      "timeout_s": 0.5, "max_age_s": 1.0}}],
        "classes": {"latency": {"deadline_ms": 3000, "ttft_ms": 0}}}
    doc = {"model": "m", "max_tokens": 4096, "messages": [{"role": "user", "content": "essay"}]}
    async with serving(settings) as (svc, stub):
        learning = svc.gate.learning["llama"]
        await asyncio.sleep(0.3)  # the scraper's first round: the histograms' baseline
        async with aiohttp.ClientSession() as client:  # answers the engine's histograms count
            for _ in range(2):
                async with client.post(f"http://{engine}/v1/chat/completions", json={
                        **doc, "max_tokens": 20, "extproc_output_tokens": 20}) as r:
                    assert r.status == 200
        for _ in range(100):
            if learning._speed is not None:
                break
            await asyncio.sleep(0.05)
        assert learning._speed is not None
        first = Stream(stub)
        await first.send(headers())
        admitted = await first.send(body(doc))
        assert admitted.HasField("request_body")
        ticket = admitted.dynamic_metadata.fields[ADMISSION_NAMESPACE].struct_value.fields[
            "ticket"].string_value
        await asyncio.sleep(4.5)
        await first.close()  # Envoy ends the stream as it ends a completed one
        assert len(learning.shown) == 0
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{svc.grpc_port}")
        logs = als_pb2_grpc.AccessLogServiceStub(channel)

        def entry(fields: dict[str, str] | None, streamed: tuple[float, float] | None = (0.1, 4.4),
                  ) -> als_pb2.StreamAccessLogsMessage:
            one = accesslog_pb2.HTTPAccessLogEntry()
            common = one.common_properties
            common.response_flags.downstream_connection_termination = True
            if streamed is not None:  # its answer's first byte to the client, its end
                common.time_to_first_downstream_tx_byte.FromTimedelta(
                    timedelta(seconds=streamed[0]))
                common.duration.FromTimedelta(timedelta(seconds=streamed[1]))
            if fields is not None:
                common.metadata.filter_metadata[ADMISSION_NAMESPACE].update(fields)
            message = als_pb2.StreamAccessLogsMessage()
            message.http_logs.log_entry.append(one)
            return message

        await logs.StreamAccessLogs(iter([entry(None), entry({"ticket": "someone-else"})]))
        assert len(learning.shown) == 0  # no ticket, or none of its
        await logs.StreamAccessLogs(iter([entry({"outcome": "admit", "ticket": ticket})]))
        await channel.close()
        assert len(learning.shown) == 1
        retry = Stream(stub)
        await retry.send(headers())
        refused = await retry.send(body(doc))
        assert refused.immediate_response.status.code == 400
        assert json.loads(refused.immediate_response.body)["error"]["code"] == (
            "deadline_infeasible")
        other = Stream(stub)
        await other.send(headers())
        assert (await other.send(body({**doc, "messages": [
            {"role": "user", "content": "haiku"}]}))).HasField("request_body")
        await other.close()


@pytest.mark.integration
async def test_through_envoy_the_sdk_s_retry_of_a_call_it_timed_out_is_refused(
        tmp_path: Path) -> None:
    """The official OpenAI SDK, a 4.5 s timeout and one retry, against a 3 s deadline: its call
    of a 4,000-token answer is admitted (priced by the pool's short answers), runs past its
    deadline, and the SDK gives up and sends it again, byte for byte. Envoy's access log tells
    the sidecar the client left after 4.5 s, more than 3 s lets the answer write alone at the
    engine's measured speed, so the retry is refused as infeasible (400, which the SDK does
    not retry) instead of running to the timeout again."""
    settings = {"infeasible": "reject", "pools": [pool(
        max_num_seqs=4, expected_output_tokens=20, long_output_tokens=60)],
        "classes": {"latency": {"deadline_ms": 3000, "ttft_ms": 0}}}
    stack = LocalStack(tmp_path, settings, backend_args=["--max-running", "4"])
    stack.settings["pools"][0]["engine_metrics"] = {
        "targets": [f"127.0.0.1:{stack.backend_ports[0]}"], "interval_s": 0.1,
        "timeout_s": 0.5, "max_age_s": 1.0}
    statuses: list[int] = []

    async def record(response: httpx.Response) -> None:
        statuses.append(response.status_code)

    with stack:
        await asyncio.sleep(0.5)  # the scraper's first round: the histograms' baseline
        async with aiohttp.ClientSession() as client:  # answers the engine's histograms count
            for _ in range(2):
                async with client.post(f"{stack.backend_url()}/v1/chat/completions", json={
                        "model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 20, "extproc_output_tokens": 20}) as r:
                    assert r.status == 200
        await asyncio.sleep(0.5)  # scraped
        async with httpx.AsyncClient(event_hooks={"response": [record]}) as http:
            sdk = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused",
                                     timeout=4.5, max_retries=1, http_client=http)
            with pytest.raises(openai.BadRequestError) as refused:
                await sdk.chat.completions.create(
                    model="m", max_tokens=4096, messages=[{"role": "user", "content": "essay"}],
                    extra_body={"extproc_output_tokens": 4000})
    assert refused.value.code == "deadline_infeasible"
    assert statuses == [400]  # the first attempt got no answer: the SDK timed it out
