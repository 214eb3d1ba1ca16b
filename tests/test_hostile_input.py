"""Hostile request bodies and headers: a 4xx with an OpenAI-style JSON error, never a 500, a
crash or a hang. Proved on the real gRPC server message by message, then a representative
subset (and what only Envoy can do: lying ``Content-Length``, chunked oversize bodies) through
real Envoy."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import socket
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc import config
from extproc.gateway.server import Service
from extproc_dev.stack import LocalStack
from tests.conftest import pool
from tests.extproc_client import Stream, body, headers, serving

CHAT = "/v1/chat/completions"
CANARY = "CANARY-HOSTILE-93c1"
MIB = 1024 * 1024
PHASE_S = 2.0  # Envoy's message_timeout: every answer must come well within it

Doc = dict[str, Any]


def settings(**extra: Any) -> Doc:
    return {"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0",
            "pools": [{"name": "llama", "replicas": 1, "engine": {"max_num_seqs": 4}}], **extra}


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    svc = Service(config.from_mapping(settings()))
    await svc.start()
    yield svc
    await svc.stop()


@pytest.fixture(autouse=True)
async def end_streams() -> AsyncIterator[None]:
    yield
    await Stream.end_all()


def refusal(resp: pb.ProcessingResponse) -> tuple[int, dict[str, str], Doc]:
    """Status, headers and ``error`` object of our own answer; checks its OpenAI shape."""
    assert resp.HasField("immediate_response"), resp
    answer = resp.immediate_response
    hdrs = {h.header.key: h.header.raw_value.decode() for h in answer.headers.set_headers}
    assert hdrs["content-type"] == "application/json"
    assert hdrs["x-should-retry"] == "false"
    error = json.loads(answer.body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert CANARY not in answer.body.decode()
    return answer.status.code, hdrs, error


async def ask(stub: pb_grpc.ExternalProcessorStub, raw: bytes, path: str = CHAT,
              **extra: str) -> pb.ProcessingResponse:
    """Headers, then the body (unless the headers were answered); within ``PHASE_S``."""
    s = Stream(stub)
    started = time.perf_counter()
    first = await s.send(headers(path, **extra))
    if first.HasField("immediate_response"):
        return first
    resp = await s.send(body(raw))
    assert time.perf_counter() - started < PHASE_S
    if not resp.HasField("immediate_response"):
        await s.close()
    return resp


async def ledger_is_empty(service: Service) -> None:
    assert (await service.gate.ledger.snapshot("llama")).inflight == 0
    assert service.metrics.registry.get_sample_value(
        "extproc_inflight_requests", {"pool": "llama"}) in (None, 0.0)


def msg(content: Any = "hi", **extra: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}],
                       **extra}).encode()


DEEP = 100_000
HOSTILE: list[tuple[str, bytes, str]] = [  # name, body, expected error code
    ("deep arrays", b"[" * DEEP + b"]" * DEEP, "bad_request"),
    ("deep objects", b'{"a":' * DEEP + b"1" + b"}" * DEEP, "bad_request"),
    ("deep inside messages",
     b'{"model": "m", "messages": ' + b"[" * DEEP + b"]" * DEEP + b"}", "bad_request"),
    ("5000-digit max_tokens", msg()[:-1] + b', "max_tokens": ' + b"9" * 5000 + b"}",
     "bad_request"),
    ("5000-digit unused field", msg()[:-1] + b', "seed": -' + b"7" * 5000 + b"}", "bad_request"),
    ("400-digit max_tokens", msg()[:-1] + b', "max_tokens": ' + b"9" * 400 + b"}",
     "bad_request"),
    ("NaN", msg()[:-1] + b', "temperature": NaN}', "bad_request"),
    ("Infinity", msg()[:-1] + b', "max_tokens": Infinity}', "bad_request"),
    ("-Infinity", msg()[:-1] + b', "top_p": -Infinity}', "bad_request"),
    ("1e400", msg()[:-1] + b', "max_tokens": 1e400}', "bad_request"),
    ("invalid UTF-8", msg(CANARY)[:-10] + b"\xff\xfe\xc3" + msg()[-10:], "bad_request"),
    ("overlong UTF-8", msg()[:-4] + b"\xc0\xaf" + msg()[-4:], "bad_request"),
    ("lone surrogate in content", msg(CANARY + "\ud800"), "bad_request"),
    ("lone surrogate in a part",
     msg([{"type": "text", "text": "\udc00" + CANARY}]), "bad_request"),
    ("lone surrogate in tools", msg(tools=[{"type": "function",
                                             "function": {"name": "\ud800"}}]), "bad_request"),
    ("lone surrogate in model", json.dumps({"model": "\udbff", "messages": [
        {"role": "user", "content": "x"}]}).encode(), "bad_request"),
    ("duplicate keys", b'{"model": "m", "model": "n", "messages": []}', "duplicate_key"),
    ("duplicate canary keys", b'{"model": "m", "' + CANARY.encode() + b'": 1, "'
     + CANARY.encode() + b'": 2}', "duplicate_key"),
    ("truncated around the canary", msg(CANARY)[:-5], "invalid_json"),
    ("not JSON at all", CANARY.encode(), "invalid_json"),
    ("array body", b"[1, 2, 3]", "bad_request"),
    ("string body", b'"' + CANARY.encode() + b'"', "bad_request"),
    ("null body", b"null", "bad_request"),
    ("BOM first", b"\xef\xbb\xbf" + msg(), "invalid_json"),
    ("NUL bytes", b"\x00" * 64, "invalid_json"),
    ("600,000 empty arrays", b'{"model": "m", "messages": ['
     + b",".join([b"[]"] * 600_000) + b"]}", "too_complex"),
    ("empty body", b"", "bad_request"),
]


@pytest.mark.parametrize("name, raw, code", HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_hostile_body_is_400_json(service: Service, stub: pb_grpc.ExternalProcessorStub,
                                        name: str, raw: bytes, code: str) -> None:
    status, hdrs, error = refusal(await ask(stub, raw))
    assert status == 400
    assert hdrs["x-admission-reason"] == "bad_request"
    assert error["code"] == code
    await ledger_is_empty(service)


async def test_a_post_without_a_body_is_400_at_the_headers(
        stub: pb_grpc.ExternalProcessorStub) -> None:
    s = Stream(stub)
    status, _, error = refusal(await s.send(headers(eos=True)))
    assert status == 400 and "empty" in error["message"]


# Every field we read, holding wrong types: a 400 naming the field.
_CHAT: Doc = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
_COUNTS = ("1", 1.5, True, False, [], {}, 0, -1, 2**31, 10**30)
_PROMPTS = (None, 1, 1.5, True, {}, [], [1, "a"], [[]], [True], [-1], [[1], "a"])


def _message(**fields: Any) -> Doc:
    return {**_CHAT, "messages": [{"role": "user", "content": "x", **fields}]}


WRONG: list[tuple[str, Doc, str]] = [
    *[(CHAT, {**_CHAT, "model": v}, "model") for v in (1, 1.5, True, [], {}, None, "")],
    *[(CHAT, {**_CHAT, "messages": v}, "messages") for v in ("x", 1, 1.5, True, {}, None, [])],
    *[(CHAT, {**_CHAT, "messages": [v]}, "messages[0]") for v in ("x", 1, True, [], None)],
    *[(CHAT, _message(role=v), "messages[0].role") for v in (1, 1.5, True, [], {}, None)],
    *[(CHAT, _message(content=v), "messages[0].content") for v in (1, 1.5, True, {})],
    *[(CHAT, _message(content=[v]), "messages[0].content[0]")
      for v in ("x", 1, True, [], None, {}, {"type": 1})],
    *[(CHAT, _message(content=[{"type": "text", "text": v}]), "messages[0].content[0].text")
      for v in (1, 1.5, True, [], {}, None)],
    *[(CHAT, _message(tool_calls=v), "messages[0].tool_calls") for v in ("x", 1, True, {})],
    *[(CHAT, {**_CHAT, "tools": v}, "tools") for v in ("x", 1, 1.5, True, {})],
    *[(CHAT, {**_CHAT, key: v}, key) for key in ("max_tokens", "max_completion_tokens", "n")
      for v in _COUNTS],
    *[(CHAT, {**_CHAT, "stream": v}, "stream") for v in ("yes", 1, 1.5, [], {})],
    *[("/v1/completions", {"model": "m", "prompt": v}, "prompt") for v in _PROMPTS],
    ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 2**63}, "max_tokens"),
    *[("/v1/embeddings", {"model": "m", "input": v}, "input") for v in _PROMPTS],
    *[("/generate", {"inputs": v}, "inputs") for v in (1, 1.5, True, [], {}, None)],
    *[("/generate", {"inputs": "x", "parameters": v}, "parameters")
      for v in ("x", 1, 1.5, True, [])],
    *[("/generate", {"inputs": "x", "parameters": {"max_new_tokens": v}}, "max_new_tokens")
      for v in _COUNTS],
    *[("/generate", {"inputs": "x", "model": v}, "model") for v in (1, True, [], {}, None)],
    *[("/generate", {"inputs": "x", "stream": v}, "stream") for v in ("x", 1, [])],
]


async def test_wrong_types_everywhere_are_400_naming_the_field(
        service: Service, stub: pb_grpc.ExternalProcessorStub) -> None:
    assert len(WRONG) > 100
    for path, doc, param in WRONG:
        status, _, error = refusal(await ask(stub, json.dumps(doc).encode(), path))
        assert (status, error["param"]) == (400, param), (path, doc)
    await ledger_is_empty(service)


async def test_100000_content_parts_are_costed_within_the_phase_timeout(
        service: Service, stub: pb_grpc.ExternalProcessorStub) -> None:
    raw = msg([{"type": "text", "text": "hello"}] * 100_000, max_tokens=10)
    resp = await ask(stub, raw)  # ask() holds it to PHASE_S
    # ~200,000 prompt tokens: whatever the verdict, it was decided on a costed prompt
    assert resp.HasField("request_body") or resp.immediate_response.status.code == 429
    assert service.metrics.registry.get_sample_value(
        "extproc_admission_decisions_total", {"pool": "llama", "class": "latency",
                                              "outcome": "invalid", "reason": "bad_request",
                                              "mode": "enforce"}) is None
    await ledger_is_empty(service)


CONTENT_TYPES_415 = ["text/plain", "application/x-www-form-urlencoded", "text/json",
                     "multipart/form-data; boundary=x", "application/json; charset=utf-16"]


@pytest.mark.parametrize("content_type", CONTENT_TYPES_415)
async def test_a_non_json_content_type_is_415_before_the_body_is_sent(
        stub: pb_grpc.ExternalProcessorStub, content_type: str) -> None:
    s = Stream(stub)
    status, hdrs, error = refusal(await s.send(headers(**{"content-type": content_type})))
    assert status == 415 and error["code"] == "unsupported_media_type"
    assert hdrs["x-admission-reason"] == "unsupported_media"


async def test_json_content_types_and_none_reach_the_decision(
        stub: pb_grpc.ExternalProcessorStub) -> None:
    for content_type in ("application/json", "application/json; charset=UTF-8",
                         "application/vnd.api+json", ""):
        resp = await ask(stub, msg(max_tokens=5), **{"content-type": content_type})
        assert resp.HasField("request_body"), content_type
    # JSON declared, something else sent: the body decides (400)
    status, _, error = refusal(await ask(stub, b"model=m&prompt=" + CANARY.encode()))
    assert status == 400 and error["code"] == "invalid_json"


async def test_a_compressed_body_is_415_naming_its_coding_by_default(
        service: Service, stub: pb_grpc.ExternalProcessorStub) -> None:
    for coding in ("gzip", "deflate", "br"):
        s = Stream(stub)
        status, _, error = refusal(await s.send(headers(**{"content-encoding": coding})))
        assert status == 415 and error["code"] == "unsupported_content_encoding"
        assert f"Content-Encoding {coding} " in error["message"]
    # identity is no coding at all
    assert (await ask(stub, msg(max_tokens=5), **{"content-encoding": "identity"})
            ).HasField("request_body")
    await ledger_is_empty(service)


async def test_decode_mode_reads_gzip_and_refuses_bombs_and_garbage() -> None:
    async with serving(settings(content_encoding="decode", max_body_bytes=MIB,
                                max_inflation_ratio=20)) as (svc, stub):
        gz = {"content-encoding": "gzip"}
        assert (await ask(stub, gzip.compress(msg(max_tokens=5)), **gz)
                ).HasField("request_body")
        assert (await ask(stub, zlib.compress(msg(max_tokens=5)),
                          **{"content-encoding": "deflate"})).HasField("request_body")
        # decoded, then parsed: invalid JSON inside gzip is still our 400
        status, _, error = refusal(await ask(stub, gzip.compress(msg(CANARY)[:-3]), **gz))
        assert (status, error["code"]) == (400, "invalid_json")
        bomb = gzip.compress(b"[" * (16 * MIB), 9)  # 16 MiB in ~16 KiB
        started = time.perf_counter()
        status, hdrs, error = refusal(await ask(stub, bomb, **gz))
        assert time.perf_counter() - started < 1.0
        assert (status, error["code"]) == (413, "inflation_ratio_exceeded")
        assert hdrs["x-admission-reason"] == "body_too_large"
        # ~2x compressible: within the ratio, over the 1 MiB cap once inflated
        within_ratio = gzip.compress(msg(os.urandom(768 * 1024).hex()))
        assert len(within_ratio) < MIB
        status, _, error = refusal(await ask(stub, within_ratio, **gz))
        assert (status, error["code"]) == (413, "request_too_large")
        status, _, error = refusal(await ask(stub, b"\x1f\x8b garbage", **gz))
        assert (status, error["code"]) == (400, "invalid_encoding")
        status, _, error = refusal(await Stream(stub).send(
            headers(**{"content-encoding": "gzip, gzip"})))
        assert (status, error["code"]) == (415, "unsupported_content_encoding")
        await ledger_is_empty(svc)


@pytest.mark.parametrize("length, expect", [
    (b"\xb2", "continue"),  # latin-1 superscript two: str.isdigit() says yes, int() says no
    ("\u0663".encode(), "continue"),  # an Arabic-Indic three, in UTF-8
    (b"9" * 5000, 413),  # more digits than int() converts
    (b"99999999999999999999", 413),
    (b" 12", "continue"), (b"-1", "continue"), (b"1e9", "continue"), (b"", "continue"),
], ids=["superscript", "arabic-indic", "5000 digits", "20 digits", "space", "negative",
        "exponent", "empty"])
async def test_odd_content_lengths_never_crash_the_server(
        stub: pb_grpc.ExternalProcessorStub, length: bytes, expect: int | str) -> None:
    """Envoy's codec refuses such values before us; the server must not rely on it. (The
    first and the third used to raise in the servicer: Envoy got a gRPC error.)"""
    message = headers()
    message.request_headers.headers.headers.add(key="content-length", raw_value=length)
    resp = await Stream(stub).send(message)
    if expect == "continue":
        assert resp.HasField("request_headers"), resp
    else:
        assert refusal(resp)[0] == expect


async def test_oversize_answers_come_within_100_ms(
        stub: pb_grpc.ExternalProcessorStub) -> None:
    """Our 413s, measured at the gRPC server (best of 3: the machine is shared): at the
    headers for a declared length, and for a body Envoy cut at its buffer limit."""
    cut = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{" + b" " * (9 * MIB),
                                                         end_of_stream=False))
    for first, then in ((headers(**{"content-length": str(9 * MIB)}), None), (headers(), cut)):
        best = float("inf")
        for _ in range(3):
            s = Stream(stub)
            if then is not None:
                await s.send(first)
            started = time.perf_counter()
            resp = await s.send(then or first)
            best = min(best, time.perf_counter() - started)
            assert refusal(resp)[0] == 413
        assert best < 0.1, best


async def test_a_message_over_the_grpc_limit_is_refused_by_grpc_not_held() -> None:
    """Memory per stream is bounded by gRPC's receive limit (2 x max_body_bytes + 1 MiB):
    a bigger message ends the stream at once with RESOURCE_EXHAUSTED (Envoy, which never
    sends one that big, would apply its failure mode), nothing is held, and the server
    serves the next stream."""
    async with serving(settings(max_body_bytes=64 * 1024),
                       options=[("grpc.max_send_message_length", 64 * MIB)]) as (svc, stub):
        s = Stream(stub)
        await s.send(headers())
        started = time.perf_counter()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await s.send(body(b"x" * (4 * MIB)))
        assert time.perf_counter() - started < 1.0
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for _ in range(100):
            if svc.processor.open_streams == 0:
                break
            await asyncio.sleep(0.01)
        assert svc.processor.open_streams == 0
        assert (await ask(stub, msg(max_tokens=5))).HasField("request_body")
        await ledger_is_empty(svc)


# ---- through real Envoy ------------------------------------------------------------------


def http(url: str, raw: bytes, content_type: str = "application/json",
         extra: dict[str, str] | None = None, timeout: float = 30,
         ) -> tuple[int, dict[str, str], bytes, float]:
    req = urllib.request.Request(url, data=raw, method="POST",
                                 headers={"content-type": content_type, **(extra or {})})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            out = resp.status, dict(resp.headers.items()), resp.read()
    except urllib.error.HTTPError as err:
        out = err.code, dict(err.headers.items()), err.read()
    return (*out, time.perf_counter() - started)


def raw_http(port: int, head: str, chunks: Iterable[bytes] = (),
             read_s: float = 10.0) -> bytes:
    """Send ``head`` and ``chunks`` on one connection; what came back until it went quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_s) as sock:
        sock.sendall(head.encode())
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # Envoy answered and closed before we finished
        reply = b""
        try:
            while data := sock.recv(65536):
                reply += data
                if b"\r\n\r\n" in reply and _complete(reply):
                    break
        except (TimeoutError, ConnectionResetError):
            pass
    return reply


def _complete(reply: bytes) -> bool:
    head, _, rest = reply.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(rest) >= int(line.split(b":")[1])
    return True


def envoy_error(status: int, hdrs: dict[str, str], raw: bytes) -> Doc:
    assert hdrs.get("content-type") == "application/json", (status, hdrs, raw[:200])
    assert CANARY.encode() not in raw
    error: Doc = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def inflight(stack: LocalStack) -> float:
    return stack.metric("extproc_inflight_requests", {"pool": "llama"})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with LocalStack(tmp_path_factory.mktemp("hostile"),
                    {"pools": [pool(replicas=1, max_num_seqs=4)]},
                    backend_args=["--max-running", "4", "--time-scale", "0.05"]) as s:
        yield s


ENVOY_SUBSET = ["deep arrays", "deep objects", "5000-digit max_tokens", "400-digit max_tokens",
                "NaN", "invalid UTF-8", "lone surrogate in content", "duplicate keys",
                "truncated around the canary", "600,000 empty arrays", "empty body"]


@pytest.mark.integration
def test_hostile_bodies_through_envoy_are_400_json(stack: LocalStack) -> None:
    cases = {name: (raw, code) for name, raw, code in HOSTILE}
    for name in ENVOY_SUBSET:
        raw, code = cases[name]
        status, hdrs, out, seconds = http(stack.url + CHAT, raw)
        assert status == 400, (name, status, out[:200])
        assert envoy_error(status, hdrs, out)["code"] == code, name
        assert hdrs["x-admission-reason"] == "bad_request"
        assert seconds < PHASE_S, (name, seconds)
    assert inflight(stack) == 0
    assert stack.processes["extproc"].popen.poll() is None  # still serving


@pytest.mark.integration
def test_content_type_and_encoding_refusals_through_envoy(stack: LocalStack) -> None:
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        status, hdrs, out, _ = http(stack.url + CHAT, msg(CANARY), content_type)
        assert status == 415, out
        assert envoy_error(status, hdrs, out)["code"] == "unsupported_media_type"
    status, hdrs, out, _ = http(stack.url + CHAT, gzip.compress(msg(CANARY)),
                                extra={"content-encoding": "gzip"})
    assert status == 415
    error = envoy_error(status, hdrs, out)
    assert error["code"] == "unsupported_content_encoding" and "gzip" in error["message"]
    # no content type at all (urllib would add a form type): read as JSON
    raw = msg(max_tokens=3)
    reply = raw_http(stack.envoy_port, f"POST {CHAT} HTTP/1.1\r\nHost: x\r\n"
                     f"Content-Length: {len(raw)}\r\n\r\n", [raw])
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    raw = msg([{"type": "text", "text": "hello"}] * 100_000, max_tokens=3)
    status, _, out, seconds = http(stack.url + CHAT, raw)
    assert status in (200, 429), out[:300]
    assert seconds < 10


@pytest.mark.integration
def test_content_length_smaller_than_the_body(stack: LocalStack) -> None:
    """Envoy reads what was declared: we judge those bytes (cut JSON: our 400); the rest is
    a malformed next request on the connection, which Envoy refuses itself."""
    raw = msg(CANARY, max_tokens=3)
    reply = raw_http(stack.envoy_port,
                     f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 20\r\n\r\n", [raw])
    head, _, rest = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), reply[:300]
    assert b"x-admission-reason: bad_request" in head
    assert json.loads(rest[:rest.index(b"}}") + 2])["error"]["code"] == "invalid_json"
    assert CANARY.encode() not in reply
    assert inflight(stack) == 0


@pytest.mark.integration
def test_content_length_larger_than_the_body(stack: LocalStack) -> None:
    """Envoy waits for the promised bytes and never sends us a partial body, so nothing is
    decided and nothing is held; when the client gives up, the next request is served."""
    labels = {"outcome": "admit"}
    before = stack.metric("extproc_admission_decisions_total")
    raw = msg(max_tokens=3)
    with socket.create_connection(("127.0.0.1", stack.envoy_port), timeout=5) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(raw) + 1000}\r\n\r\n".encode() + raw)
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(1)  # no answer: Envoy is still reading the body
    assert stack.metric("extproc_admission_decisions_total") == before
    admitted = stack.metric("extproc_admission_decisions_total", labels)
    status, _, body, _ = http(stack.url + CHAT, raw)
    assert status == 200, body
    assert stack.metric("extproc_admission_decisions_total", labels) == admitted + 1
    assert inflight(stack) == 0


@pytest.mark.integration
def test_declared_oversize_is_our_413_within_100_ms_through_envoy(stack: LocalStack) -> None:
    """A content-length over the cap is answered at the headers (Envoy + one gRPC round
    trip); best of five, since the machine is shared."""
    best = float("inf")
    for length in (9 * MIB, 100 * 1024 * MIB, 10**18):
        for _ in range(5 if length == 9 * MIB else 1):
            started = time.perf_counter()
            reply = raw_http(stack.envoy_port,
                             f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/"
                             f"json\r\nContent-Length: {length}\r\n\r\n", [b'{"model": "m"'])
            best = min(best, time.perf_counter() - started)
            assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
            assert b"request_too_large" in reply
    assert best < 0.1, best


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.mark.integration
def test_memory_stays_bounded_by_the_cap_not_the_body(
        stack_factory: Callable[..., LocalStack]) -> None:
    """A 1 MiB cap, decode mode: 64 MiB chunked bodies and a gzip bomb (256 MiB in 256 KiB)
    each get our 413, and extproc's peak memory grows by less than half of one body. (Not
    by exactly the cap: the allocator keeps freed buffers a while, so over many oversize
    requests RSS wanders tens of MiB above the baseline and comes back.)"""
    small = stack_factory({"pools": [pool(replicas=1, max_num_seqs=4)], "max_body_bytes": MIB,
                           "content_encoding": "decode"},
                          backend_args=["--time-scale", "0.05"])
    pid = small.processes["extproc"].pid
    status, _, _, _ = http(small.url + CHAT, gzip.compress(msg(max_tokens=3)),
                           extra={"content-encoding": "gzip"})
    assert status == 200  # read inflated; the backend gets the body as sent (aiohttp inflates)
    baseline = vm_hwm_kib(pid)
    chunk = f"{MIB:x}\r\n".encode() + b"a" * MIB + b"\r\n"
    for _ in range(2):
        reply = raw_http(small.envoy_port,
                         f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                         "Content-Type: application/json\r\n\r\n",
                         [chunk] * 64 + [b"0\r\n\r\n"])
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    bomb = gzip.compress(bytes(MIB), 9) * 256  # 256 gzip members of 1 MiB of zeros each
    status, hdrs, out, _ = http(small.url + CHAT, bomb, extra={"content-encoding": "gzip"})
    assert status == 413
    assert envoy_error(status, hdrs, out)["code"] == "request_too_large"
    growth_mib = (vm_hwm_kib(pid) - baseline) / 1024
    assert growth_mib < 32, growth_mib
    assert inflight(small) == 0
