"""The generated Envoy config at work, through a real Envoy: what reaches the sidecar (only the
headers it reads), how long a client may take to send its request, and a start free of
warnings (the overload manager). The processor and the backend here are recorders, so every
assertion is about what Envoy itself did."""

from __future__ import annotations

import http.server
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct

from extproc import config
from extproc.gateway import envoyconf
from extproc.gateway.request import REQUEST_TIME, header_attribute, headers_from_attributes
from extproc_dev.stack import envoy_binary, free_port, wait_http

pytestmark = pytest.mark.integration


class RecordingProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Continues every phase and keeps the request headers each stream carried (one trip:
    every attribute its body carried, by attribute name)."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        self.attributes: list[dict[str, str]] = []

    def Process(self, requests: Iterator[pb.ProcessingRequest], context: Any
                ) -> Iterator[pb.ProcessingResponse]:
        for request in requests:
            if request.HasField("request_headers"):
                self.headers.append({h.key: (h.raw_value or h.value.encode()).decode()
                                     for h in request.request_headers.headers.headers})
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            elif request.HasField("request_body"):
                for struct in request.attributes.values():
                    self.attributes.append({k: v.string_value
                                            for k, v in struct.fields.items()})
                yield pb.ProcessingResponse(request_body=pb.BodyResponse())


class Backend(http.server.BaseHTTPRequestHandler):
    """/health; POST records its headers and answers, slowly (``/slow``: five chunks 0.5 s
    apart, longer than the test's request timeout) or at once."""

    protocol_version = "HTTP/1.1"
    seen: list[dict[str, str]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        Backend.seen.append({k.lower(): v for k, v in self.headers.items()})
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for _ in range(5 if self.path.endswith("/slow") else 1):
            self.wfile.write(b"4\r\ntok.\r\n")
            self.wfile.flush()
            if self.path.endswith("/slow"):
                time.sleep(0.5)
        self.wfile.write(b"0\r\n\r\n")


@contextmanager
def gateway(tmp_path: Path, settings: dict[str, Any], request_timeout_s: float = 30.0,
            one_trip: bool = envoyconf.Topology.one_trip
            ) -> Iterator[tuple[str, RecordingProcessor, subprocess.Popen[str]]]:
    processor = RecordingProcessor()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, grpc_server)
    grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    Backend.seen = []
    backend = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Backend)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    port, admin = free_port(), free_port()
    topo = envoyconf.Topology(listen_port=port, admin_port=admin,
                              backends=(("127.0.0.1", backend.server_address[1]),),
                              extproc=("127.0.0.1", grpc_port),
                              request_timeout_s=request_timeout_s, one_trip=one_trip)
    path = tmp_path / "envoy.yaml"
    path.write_text(envoyconf.render(config.from_mapping(settings), topo))
    envoy = subprocess.Popen([envoy_binary(), "-c", str(path), "--log-level", "warning",
                              "--base-id", str(admin), "--drain-time-s", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_http(f"http://127.0.0.1:{admin}/ready", proc=envoy)  # type: ignore[arg-type]
        wait_http(f"http://127.0.0.1:{port}/health", proc=envoy)  # type: ignore[arg-type]
        yield f"http://127.0.0.1:{port}", processor, envoy
    finally:
        envoy.terminate()
        envoy.wait(timeout=30)
        backend.shutdown()
        backend.server_close()
        grpc_server.stop(0)


def _struct(values: dict[str, str]) -> Struct:
    out = Struct()
    out.update(values)
    return out


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, body, headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, response.read()


def test_envoy_starts_without_a_warning(tmp_path: Path) -> None:
    with gateway(tmp_path, {}) as (_, _, envoy):
        pass
    log = envoy.stdout.read() if envoy.stdout else ""
    # Envoy 1.40 warns "no configured limit to the number of allowed active downstream
    # connections" unless an overload manager's resource monitor sets one; the only warning
    # left is the one our own SIGTERM causes
    warnings = [line for line in log.splitlines()
                if "[warning]" in line and "caught ENVOY_SIGTERM" not in line]
    assert warnings == [], log


@pytest.mark.parametrize("one_trip", [True, False])
def test_clients_credentials_reach_the_backend_never_the_sidecar(tmp_path: Path,
                                                                 one_trip: bool) -> None:
    secrets = {"authorization": "Bearer sk-secret-1", "cookie": "session=secret-2",
               "x-api-key": "secret-3", "api-key": "secret-4"}
    wanted = {"content-type": "application/json", "x-admission-deadline-ms": "9000",
              "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    settings = {"tenant": {"source": "header"}}
    with gateway(tmp_path, settings, one_trip=one_trip) as (url, processor, _):
        status, _ = post(f"{url}/v1/chat/completions", b'{"model": "m"}', secrets | wanted)
    assert status == 200
    allowed = envoyconf.forwarded_headers(config.from_mapping(settings))
    if one_trip:  # no headers phase: the headers it reads came as the body's attributes
        assert not [h for h in processor.headers if h.get(":path") == "/v1/chat/completions"]
        [attributes] = processor.attributes
        seen = headers_from_attributes(_struct(attributes), allowed)
        assert set(attributes) - {REQUEST_TIME} == {header_attribute(n) for n in seen}
        assert seen[":method"] == "POST" and seen[":path"] == "/v1/chat/completions"
    else:
        [seen] = [h for h in processor.headers if h.get(":path") == "/v1/chat/completions"]
        assert seen[":method"] == "POST" and seen["content-length"] == "14"
    for name, value in wanted.items():
        assert seen[name] == value, name
    assert not set(secrets) & set(seen), seen
    assert not [v for v in seen.values() if "secret" in v]
    # the tenant header is forwarded when it is the tenant's source (a client's own copy is
    # removed before any filter runs: tests/test_tenant.py)
    assert "x-tenant-id" in allowed and set(seen) <= set(allowed)
    # forward_rules filter what the processor is sent, not what the backend gets
    [upstream] = Backend.seen
    assert upstream["authorization"] == "Bearer sk-secret-1" and upstream["x-api-key"] == "secret-3"


def test_a_body_shorter_than_its_content_length_is_cut_by_the_request_timeout(
        tmp_path: Path) -> None:
    with gateway(tmp_path, {}, request_timeout_s=1.0) as (url, _, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
                         b"content-type: application/json\r\ncontent-length: 100\r\n\r\n"
                         b'{"model": "m", ')
            started = time.monotonic()
            answer = conn.recv(4096)
            waited = time.monotonic() - started
        # the timeout runs from the request's start, and it ends the stream: no backend call
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert 0.5 < waited < 5
        assert Backend.seen == []
        # the same timeout never cuts a response that outlasts it once the request is in
        status, body = post(f"{url}/v1/chat/completions/slow", b"{}",
                            {"content-type": "application/json"})
    assert (status, body) == (200, b"tok." * 5)
