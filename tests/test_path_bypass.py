"""No spelling of an admission path slips past admission: percent-encoded, dot-segment and
double-slash paths, behind an upstream that routes on the decoded path as vLLM's OpenAI server
(Starlette on uvicorn) does, reach it only through the decision; and Envoy's access log says
what was decided, one JSON line per request."""

from __future__ import annotations

import http.server
import json
import posixpath
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from extproc import config
from extproc_dev.stack import LocalStack
from tests.conftest import pool

ADMISSION_PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                   "/invocations", "/v1/rerank"}
SPELLINGS = [
    "/v1/chat%2Fcompletions", "/v1/chat%2fcompletions", "/%761/chat/completions",
    "/v1/chat/%63ompletions", "//v1/chat/completions", "/v1//chat/completions",
    "/v1/./chat/completions", "/v1/x/../chat/completions", "/v1/%2e/chat/completions",
    "/v1/x/%2e%2e/chat/completions", "/v1/chat/completions/", "/v1%2Fchat%2Fcompletions",
]


def decoded(raw: str) -> str:
    """How a lenient backend routes ``raw``: decoded, dot segments resolved, slashes merged."""
    path = urllib.parse.unquote(urllib.parse.urlsplit(raw).path)
    return posixpath.normpath("/" + path.lstrip("/")).replace("//", "/")


class DecodingUpstream:
    """An OpenAI-ish upstream that serves the chat endpoint at any spelling of its path and
    records every raw path it was sent."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        upstream = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self._reply(200 if self.path == "/health" else 404, {})

            def do_POST(self) -> None:
                if decoded(self.path) not in ADMISSION_PATHS:
                    self._reply(404, {})
                    return
                length = int(self.headers.get("content-length") or 0)  # 0: chunked, unread
                body = json.loads(self.rfile.read(length) or b"{}")
                upstream.seen.append((self.path, body))
                self._reply(200, {"id": "x", "object": "chat.completion", "created": 0,
                                  "model": body.get("model", "m"), "choices": [{
                                      "index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": "ok"}}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                            "total_tokens": 2}})

            def _reply(self, status: int, doc: dict[str, Any]) -> None:
                payload = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstream() -> Iterator[DecodingUpstream]:
    server = DecodingUpstream()
    yield server
    server.close()


def test_every_spelling_routes_as_the_admission_path() -> None:
    """The processor's own route match (whatever Envoy in front normalized)."""
    c = config.from_mapping({})
    chat = c.route("/v1/chat/completions")
    assert chat is not None
    for raw in [*SPELLINGS, "/v1/chat%252Fcompletions", "/v1\\chat\\completions",
                "/v1/chat/completions?x=1"]:
        assert c.route(raw) == chat, raw
    assert c.route("/v1/models") is None and c.route("/v1/chat") is None


@pytest.mark.integration
def test_encoded_paths_reach_a_decoding_upstream_only_through_admission(
        stack_factory: Any, upstream: DecodingUpstream) -> None:
    stack: LocalStack = stack_factory(
        {"pools": [pool(replicas=1, max_num_seqs=4)]}, backends=0,
        envoy={"backends": (("127.0.0.1", upstream.port),)})
    hopeless = {"model": "m", "max_tokens": 10**9,
                "messages": [{"role": "user", "content": "hi"}]}
    small = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=30.0) as http:  # whole URLs: a base URL would read "//v1" as a host
        refused = {raw: http.post(stack.url + raw, json=hopeless).status_code
                   for raw in ["/v1/chat/completions", *SPELLINGS]}
        assert upstream.seen == [], upstream.seen  # not one reached the upstream unjudged
        assert set(refused.values()) <= {400, 429}, refused
        assert len(set(refused.values())) == 1, refused  # each judged as the plain path
        admitted = http.post(stack.url + "/v1/chat%2Fcompletions", json=small)
        assert admitted.status_code == 200, admitted.text
    # Envoy sent the canonical path on, so the backend never has to guess
    assert [path for path, _ in upstream.seen] == ["/v1/chat/completions"]

    lines = access_log(stack, want=len(SPELLINGS) + 2)
    judged = [line for line in lines if line["method"] == "POST"]
    # the canonical path (Envoy keeps a trailing slash; the processor reads past it)
    assert all(line["path"].rstrip("/") == "/v1/chat/completions" for line in judged), judged
    assert {(line["status"], line["admission"]) for line in judged} == {
        (next(iter(set(refused.values()))), "reject" if 429 in refused.values() else "invalid"),
        (200, "admit")}
    assert all(line["pool"] == "llama" and line["class"] for line in judged), judged
    assert all(line["reason"] for line in judged), judged


def access_log(stack: LocalStack, want: int, timeout: float = 15.0) -> list[dict[str, Any]]:
    """Envoy's JSON access log lines, once at least ``want`` POSTs are there (Envoy flushes
    its log file about once a second)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(line) for line in stack.processes["envoy"].log().splitlines()
                 if line.startswith("{")]
        if sum(line.get("method") == "POST" for line in lines) >= want:
            return lines
        assert time.monotonic() < deadline, lines
        time.sleep(0.2)


@pytest.mark.integration
def test_the_other_generation_paths_vllm_serves_are_decided_too(
        stack_factory: Any, upstream: DecodingUpstream) -> None:
    """vLLM generates on ``/v1/responses``, ``/v1/messages`` and SageMaker's ``/invocations``
    as well as on the chat and completion paths, and its pooling models prefill on ``/rerank``
    and its kin: each is an admission route by default, or a client could take any of them
    around the decision. A hopeless request on each is refused
    before the upstream, an ordinary one reaches it under its own path."""
    stack: LocalStack = stack_factory(
        {"pools": [pool(replicas=1, max_num_seqs=4)]}, backends=0,
        envoy={"backends": (("127.0.0.1", upstream.port),)})
    hi = [{"role": "user", "content": "hi"}]

    def rerank(document: str) -> dict[str, Any]:
        return {"model": "m", "query": "q", "documents": [document]}

    bodies = {  # path: (hopeless, ordinary)
        "/v1/responses": ({"model": "m", "input": "hi", "max_output_tokens": 10**9},
                          {"model": "m", "input": "hi", "max_output_tokens": 16}),
        "/v1/messages": ({"model": "m", "messages": hi, "max_tokens": 10**9},
                         {"model": "m", "messages": hi, "max_tokens": 16}),
        "/invocations": ({"model": "m", "messages": hi, "max_tokens": 10**9},
                         {"model": "m", "messages": hi, "max_tokens": 16}),
        # a pooling model's: a query against a document longer than the model's context
        "/v1/rerank": (rerank("lorem ipsum " * 100_000), rerank("lorem ipsum")),
    }
    with httpx.Client(timeout=30.0) as http:
        refused = {path: http.post(stack.url + path, json=hopeless)
                   for path, (hopeless, _) in bodies.items()}
        assert upstream.seen == [], upstream.seen
        assert {path: r.status_code for path, r in refused.items()} == dict.fromkeys(bodies, 400)
        assert all(r.json()["error"]["code"] == "context_length_exceeded"
                   for r in refused.values())
        for path, (_, ordinary) in bodies.items():
            assert http.post(stack.url + path, json=ordinary).status_code == 200, path
    assert [path for path, _ in upstream.seen] == list(bodies)

