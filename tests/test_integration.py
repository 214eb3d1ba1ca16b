"""Real Envoy + ``extproc serve`` + the fake backend, on free ports, over real HTTP."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from extproc_dev.stack import LocalStack
from tests.conftest import pool

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


def settings(**extra: Any) -> dict[str, Any]:
    return {"pools": [pool(replicas=1, max_num_seqs=2)], **extra}


def post(url: str, doc: Any, headers: dict[str, str] | None = None,
         timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    req = urllib.request.Request(url, data=raw, method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers.items()), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers.items()), err.read()


def chat(max_tokens: int = 20, output: int | None = None, stream: bool = False) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": "m", "max_tokens": max_tokens, "stream": stream,
                           "messages": [{"role": "user", "content": "Tell me a story."}]}
    if output is not None:
        doc["extproc_output_tokens"] = output
    return doc


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def inflight(stack: LocalStack) -> float:
    return stack.metric("extproc_inflight_requests", {"pool": "llama"})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, llama3_tokenizer: str) -> Any:
    """One stack for the module: 1 replica x 2 slots; the backend runs at 1/10 of real time."""
    with LocalStack(tmp_path_factory.mktemp("stack"),
                    {"pools": [pool(replicas=1, max_num_seqs=2, tokenizer=llama3_tokenizer)]},
                    backend_args=["--max-running", "2", "--time-scale", "0.1"]) as s:
        yield s


def test_normal_request_is_200(stack: LocalStack) -> None:
    status, _, raw = post(stack.url + CHAT, chat(max_tokens=10, output=5))
    assert status == 200
    assert json.loads(raw)["usage"]["completion_tokens"] == 5
    wait_for(lambda: inflight(stack) == 0)
    assert stack.metric("extproc_admission_decisions_total",
                        {"outcome": "admit", "pool": "llama"}) >= 1


def test_malformed_body_is_400_json(stack: LocalStack) -> None:
    status, headers, raw = post(stack.url + CHAT, b'{"model": "m", "messages": [')
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert json.loads(raw)["error"]["type"] == "invalid_request_error"
    status, _, raw = post(stack.url + CHAT, chat(max_tokens=0))
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"


def test_unmanaged_paths_pass_untouched(stack: LocalStack) -> None:
    with urllib.request.urlopen(stack.url + "/metrics", timeout=5) as resp:
        assert b"vllm:num_requests_running" in resp.read()


def test_nine_mib_body_gets_our_413_before_it_is_sent(stack: LocalStack) -> None:
    """A content-length over the cap is refused at the headers: the client need not send the
    body (and a client that waits, like curl with ``Expect: 100-continue``, never does)."""
    with socket.create_connection(("127.0.0.1", stack.envoy_port), timeout=10) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {9 * 1024 * 1024}\r\n\r\n".encode())
        reply = sock.recv(65536)
    head, _, raw = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert b"x-admission-reason: body_too_large" in head
    assert json.loads(raw)["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("mib", [9, 40])
def test_oversize_chunked_body_gets_our_413(stack: LocalStack, mib: int) -> None:
    """No content-length: Envoy cuts the body at its buffer limit and we refuse it."""
    chunk = b"a" * (1024 * 1024)
    with socket.create_connection(("127.0.0.1", stack.envoy_port), timeout=30) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     "Content-Type: application/json\r\n\r\n".encode())
        try:
            for _ in range(mib):
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # Envoy may answer and close before we finish sending
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413")
    assert b"request_too_large" in reply


def test_eight_mib_body_is_admitted_normally(stack: LocalStack) -> None:
    """A body just under the cap reaches us whole and is decided like any other. (The bulk
    rides in a field the fake backend ignores, so its simulated prefill stays short.)"""
    doc = chat(max_tokens=5, output=1)
    doc["metadata"] = {"blob": "x" * (8 * 1024 * 1024 - 200)}
    raw = json.dumps(doc).encode()
    assert 8 * 1024 * 1024 - 100 < len(raw) <= 8 * 1024 * 1024
    labels = {"outcome": "admit"}
    before = stack.metric("extproc_admission_decisions_total", labels)
    status, _, _ = post(stack.url + CHAT, raw)
    assert status == 200
    assert stack.metric("extproc_admission_decisions_total", labels) == before + 1


def test_streaming_request_holds_its_entry_until_the_stream_ends(stack: LocalStack) -> None:
    wait_for(lambda: inflight(stack) == 0)
    req = urllib.request.Request(stack.url + CHAT, data=json.dumps(
        chat(max_tokens=200, output=200, stream=True)).encode(),
        headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        first = resp.readline()
        assert first.startswith(b"data: ")
        assert inflight(stack) == 1  # mid-stream: still in the ledger
        rest = resp.read()
    assert rest.rstrip().endswith(b"data: [DONE]")
    wait_for(lambda: inflight(stack) == 0)


def test_client_disconnect_mid_stream_releases_its_entry(stack: LocalStack) -> None:
    wait_for(lambda: inflight(stack) == 0)
    raw = json.dumps(chat(max_tokens=2000, output=2000, stream=True)).encode()
    sock = socket.create_connection(("127.0.0.1", stack.envoy_port), timeout=10)
    sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    wait_for(lambda: inflight(stack) == 1)
    sock.close()  # gone mid-stream: ~3.7 s of generation left
    wait_for(lambda: inflight(stack) == 0, timeout=3)


def test_overload_is_429_with_retry_after_and_json_and_ledger_ends_empty(
        stack: LocalStack) -> None:
    wait_for(lambda: inflight(stack) == 0)
    results: list[tuple[int, dict[str, str], bytes]] = []

    def one() -> None:
        results.append(post(stack.url + CHAT, chat(max_tokens=300, output=150)))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(r[0] for r in results)
    assert statuses.count(200) >= 2 and statuses.count(429) >= 1, statuses
    assert set(statuses) <= {200, 429}
    _, headers, raw = next(r for r in results if r[0] == 429)
    assert int(headers["retry-after"]) >= 1
    assert headers["x-admission-reason"] in ("ttft", "deadline")
    error = json.loads(raw)["error"]
    assert error["type"] == "overloaded_error" and error["code"] in ("ttft", "deadline")
    wait_for(lambda: inflight(stack) == 0)
    assert stack.metric("extproc_inflight_requests") == 0
