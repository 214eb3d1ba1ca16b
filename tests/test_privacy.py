"""Prompts never leave through us. A canary rides in every prompt field of every API we read
(chat messages and content parts, tool-call arguments and tool definitions, completions
prompts, embeddings inputs, TGI inputs), in valid and invalid bodies, compressed or not, in
requests we answer 200, 400, 413, 415 and 429, through real Envoy, with ``extproc serve``
logging at DEBUG, tracing to a real OTLP receiver and a decision log on. Then the canary must
be in none of: extproc's log, any exported span (every byte of every OTLP export, Envoy's
included), ``/metrics``, the decision log, or any error body or header we answered with.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from extproc_dev.stack import LocalStack, Process
from tests.conftest import pool
from tests.otlp_receiver import Receiver

pytestmark = pytest.mark.integration

CANARY = "CANARY-PRIVACY-4b7e"
CAP = 256 * 1024  # max_body_bytes: keeps the oversize cases small


class DebugStack(LocalStack):
    """``extproc serve`` at DEBUG. ``LocalStack`` has no switch for the log level, so the
    global ``--log-level`` is put in front of the ``serve`` arguments."""

    def _spawn(self, name: str, args: Sequence[str]) -> Process:
        if name.startswith("extproc"):
            args = ["--log-level", "debug", *args]
        return super()._spawn(name, args)


Reply = tuple[int, dict[str, str], bytes]


def post(url: str, raw: bytes, headers: dict[str, str] | None = None) -> Reply:
    req = urllib.request.Request(url, data=raw, method="POST", headers={
        "content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers.items()), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers.items()), err.read()


def doc(**fields: Any) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def say(content: Any = CANARY, **extra: Any) -> bytes:
    return doc(messages=[{"role": "user", "content": content}], **extra)


CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
SHORT = {"max_tokens": 5, "extproc_output_tokens": 2}
TOOL = {"type": "function", "function": {"name": "lookup", "description": CANARY,
                                          "parameters": {"type": "object"}}}
CALL = {"id": "1", "type": "function",
        "function": {"name": "lookup", "arguments": json.dumps({"q": CANARY})}}

# path, body, extra headers, the status expected (admitted ones get the fake backend's,
# which lacks some routes and list prompts)
ADMITTED: list[tuple[str, bytes, dict[str, str], int]] = [
    (CHAT, say(**SHORT), {}, 200),
    (CHAT, say([{"type": "text", "text": CANARY},
                {"type": "image_url", "image_url": {"url": f"data:,{CANARY}"}}], **SHORT), {},
     200),
    (CHAT, doc(messages=[{"role": "user", "content": "find it"},
                         {"role": "assistant", "content": None, "tool_calls": [CALL]},
                         {"role": "tool", "content": CANARY, "tool_call_id": "1"}],
               tools=[TOOL], **SHORT), {}, 200),
    (CHAT, say(stream=True, **SHORT), {}, 200),
    (CHAT, gzip.compress(say(**SHORT)), {"content-encoding": "gzip"}, 200),
    (COMPLETIONS, doc(prompt=CANARY, **SHORT), {}, 200),
    (COMPLETIONS, doc(prompt=[CANARY, CANARY + "2"], **SHORT), {}, 400),  # backend: 1 prompt
    (EMBEDDINGS, doc(input=[CANARY]), {}, 200),  # admitted and answered (vectors, no text)
    ("/generate", json.dumps({"inputs": CANARY, "parameters": {"max_new_tokens": 5}}).encode(),
     {}, 404),
]
REFUSED: list[tuple[str, bytes, dict[str, str], int]] = [
    (CHAT, say()[:-3], {}, 400),  # invalid JSON around the canary
    (CHAT, say(max_tokens=CANARY), {}, 400),  # wrong types holding it
    (CHAT, say({"text": CANARY}), {}, 400),
    (CHAT, say(stream=CANARY), {}, 400),
    (CHAT, doc(messages=[{"role": 5, "content": CANARY}]), {}, 400),
    (CHAT, say(CANARY + "\udfff"), {}, 400),  # a lone surrogate beside it
    (CHAT, b'{"model": "m", "' + CANARY.encode() + b'": 1, "' + CANARY.encode() + b'": 2}',
     {}, 400),  # duplicate keys
    (CHAT, say(tools={"x": CANARY}), {}, 400),
    (CHAT, say(**SHORT), {"x-admission-deadline-ms": "soon"}, 400),
    (CHAT, gzip.compress(say()[:-3]), {"content-encoding": "gzip"}, 400),
    (CHAT, b"\x1f\x8b" + CANARY.encode() * 4, {"content-encoding": "gzip"}, 400),
    (CHAT, CANARY.encode() + b"\xff", {}, 400),
    (COMPLETIONS, doc(prompt=[CANARY, 1]), {}, 400),
    (EMBEDDINGS, doc(input={"text": CANARY}), {}, 400),
    ("/generate", json.dumps({"inputs": [CANARY]}).encode(), {}, 400),
    (CHAT, say(**SHORT), {"content-type": "text/plain"}, 415),
    (CHAT, say(**SHORT), {"content-encoding": "br"}, 415),
    (CHAT, say(CANARY * (CAP // len(CANARY) + 10)), {}, 413),
    (CHAT, gzip.compress(say(CANARY * 200_000), 9), {"content-encoding": "gzip"}, 413),
]


def chunked_oversize(port: int) -> Reply:
    """A chunked body past the cap, all canary: Envoy cuts it and we refuse what it sent."""
    chunk = (CANARY * (64 * 1024 // len(CANARY))).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     "Content-Type: application/json\r\n\r\n".encode())
        try:
            sock.sendall(b'14\r\n{"model": "m", "a": "\r\n')
            for _ in range(2 * CAP // len(chunk) + 2):
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = sock.recv(65536)
    head, _, raw = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    hdrs = dict(line.decode().split(": ", 1) for line in head.split(b"\r\n")[1:])
    return status, hdrs, raw


def overloaded(stack: LocalStack) -> list[Reply]:
    """Two long streams hold both slots; canary requests meanwhile get our 429."""
    held: list[Any] = []
    started = threading.Event()

    def hold() -> None:
        req = urllib.request.Request(stack.url + CHAT, data=say(
            "hold", max_tokens=2000, extproc_output_tokens=2000, stream=True),
            headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            held.append(resp.status)
            resp.readline()
            started.set()
            resp.read()

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for t in threads:
        t.start()
    assert started.wait(20)
    deadline = time.monotonic() + 20
    while stack.metric("extproc_inflight_requests") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    replies = [post(stack.url + CHAT, say(max_tokens=500)) for _ in range(3)]
    for t in threads:
        t.join()
    assert held == [200, 200]
    return replies


def test_the_canary_never_leaves(tmp_path: Path, llama3_tokenizer: str) -> None:
    decisions = tmp_path / "decisions.jsonl"
    with Receiver() as receiver:
        stack = DebugStack(tmp_path / "stack", {
            "pools": [pool(replicas=1, max_num_seqs=2, tokenizer=llama3_tokenizer)],
            "max_body_bytes": CAP, "content_encoding": "decode", "max_inflation_ratio": 20,
            "decision_log": str(decisions), "tracing": {"endpoint": receiver.endpoint},
        }, backend_args=["--max-running", "2", "--time-scale", "0.1"])
        with stack:
            replies: list[tuple[str, Reply]] = []
            for path, raw, hdrs, status in ADMITTED + REFUSED:
                reply = post(stack.url + path, raw, hdrs)
                assert reply[0] == status, (path, raw[:80], reply)
                replies.append((path, reply))
            reply = chunked_oversize(stack.envoy_port)
            assert reply[0] == 413
            replies.append(("chunked", reply))
            throttled = overloaded(stack)
            assert [r[0] for r in throttled] == [429, 429, 429]
            replies += [(CHAT, r) for r in throttled]
            with urllib.request.urlopen(stack.metrics_url, timeout=5) as resp:
                metrics = resp.read().decode()
            decided = stack.metric("extproc_admission_decisions_total")
        # stopped: the span exporter, the decision log and the log file are all flushed
        log = stack.processes["extproc"].log()
        spans = list(receiver.spans)
        exports = list(receiver.requests)

    ours = [s for s in spans if s["name"] == "extproc.admission"]
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    decision_lines = [x for x in lines if x.get("msg") == "decision"]
    records = [json.loads(line) for line in decisions.read_text().splitlines()]
    # the telemetry was really on: a debug line, a span and a record per decision
    assert decided >= len(ADMITTED) + len(REFUSED)
    assert len(decision_lines) >= len(ADMITTED) + 14 and decision_lines[0]["level"] == "debug"
    assert len(ours) >= len(ADMITTED) + 14
    assert any(s["service"] == "envoy" for s in spans)
    assert len(records) >= len(ADMITTED) + 3  # admitted and throttled ones
    assert "extproc_admission_decisions_total" in metrics

    assert CANARY not in log
    assert CANARY not in metrics
    assert CANARY not in decisions.read_text()
    assert all(CANARY.encode() not in raw for raw in exports)
    for path, (status, hdrs, raw) in replies:
        if status >= 400:
            assert CANARY.encode() not in raw, (path, status, raw[:200])
            assert CANARY not in json.dumps(hdrs), (path, status)
            if "x-admission-reason" in hdrs:  # ours, not the backend's 404
                assert json.loads(raw)["error"]["message"]
