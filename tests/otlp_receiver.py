"""A real OTLP/gRPC trace receiver for tests: what Jaeger's collector port speaks.

It serves ``TraceService/Export`` at its full OTLP path and decodes with the sidecar's own copy
of the messages (``proto/otlp_trace.proto``); Envoy's OpenTelemetry tracer exports to the same
receiver, so a span of Envoy's decoded here checks that copy against a real implementation.
"""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Any

import grpc

from extproc._proto import otlp_trace_pb2 as pb
from extproc.observability.otlp import EXPORT_METHOD
from extproc_dev.stack import free_port


class Receiver:
    def __init__(self) -> None:
        self.requests: list[bytes] = []  # raw bytes, to search for canaries
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.port = free_port()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        service, method = EXPORT_METHOD.strip("/").split("/")
        self._server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {
            method: grpc.unary_unary_rpc_method_handler(
                self.Export, request_deserializer=pb.ExportTraceServiceRequest.FromString,
                response_serializer=pb.ExportTraceServiceResponse.SerializeToString)})])
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request: Any, context: Any) -> Any:
        with self._lock:
            self.requests.append(request.SerializeToString())
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes
                                if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.spans.append({
                            "service": service,
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                        })
        return pb.ExportTraceServiceResponse()

    def __enter__(self) -> Receiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(0)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None
