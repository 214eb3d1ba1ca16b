"""An OTLP/gRPC span exporter that needs no ``opentelemetry.proto`` package.

The official exporter (``opentelemetry-exporter-otlp-proto-grpc``) imports the messages from
the ``opentelemetry.proto`` namespace, which xds-protos (Envoy's ext_proc messages, needed on
the hot path) overwrites with an old copy whenever pip installs it last: tracing then fails at
start with ``cannot import name 'InstrumentationScope'``. OTLP on the wire is only field
numbers and types, so the sidecar carries the few messages it sends in a proto package of its
own (``proto/otlp_trace.proto``) and calls the collector's method by its full path. Nothing
another distribution installs can shadow them.

The exporter is deliberately small: one ``Export`` call per batch that the SDK's
``BatchSpanProcessor`` hands over, a deadline on each call, no retries (a batch that fails is
dropped and counted in the log; traces are best effort, decisions never wait for them).
``http://`` or a bare ``HOST:PORT`` is plaintext, ``https://`` uses the system's CA roots.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanContext, SpanKind, StatusCode

from extproc._proto import otlp_trace_pb2 as pb

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"

log = logging.getLogger(__name__)

# OTLP's SpanKind counts from UNSPECIFIED = 0; the SDK's from INTERNAL = 0.
_KINDS = {
    SpanKind.INTERNAL: pb.Span.SPAN_KIND_INTERNAL,
    SpanKind.SERVER: pb.Span.SPAN_KIND_SERVER,
    SpanKind.CLIENT: pb.Span.SPAN_KIND_CLIENT,
    SpanKind.PRODUCER: pb.Span.SPAN_KIND_PRODUCER,
    SpanKind.CONSUMER: pb.Span.SPAN_KIND_CONSUMER,
}
_CODES = {
    StatusCode.UNSET: pb.Status.STATUS_CODE_UNSET,
    StatusCode.OK: pb.Status.STATUS_CODE_OK,
    StatusCode.ERROR: pb.Status.STATUS_CODE_ERROR,
}
# Span.flags: the W3C trace flags in bits 0-7; bit 8 says whether the parent's remoteness is
# known, bit 9 that it is remote (OTLP 1.x).
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200


class OtlpSpanExporter(SpanExporter):
    """Sends each batch to ``endpoint`` with one ``TraceService/Export`` call."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0) -> None:
        target, secure = channel_target(endpoint)
        self._channel = (grpc.secure_channel(target, grpc.ssl_channel_credentials()) if secure
                         else grpc.insecure_channel(target))
        self._export = self._channel.unary_unary(
            EXPORT_METHOD,
            request_serializer=pb.ExportTraceServiceRequest.SerializeToString,
            response_deserializer=pb.ExportTraceServiceResponse.FromString)
        self._timeout_s = timeout_s
        self._closed = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._closed:
            return SpanExportResult.FAILURE
        try:
            self._export(encode(spans), timeout=self._timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            log.warning("trace export failed, %d spans dropped", len(spans),
                        extra={"grpc_code": str(code)})
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._closed = True
        self._channel.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def channel_target(endpoint: str) -> tuple[str, bool]:
    """``http://host:port`` or ``host:port`` -> (``host:port``, plaintext); ``https://`` -> TLS."""
    for scheme, secure in (("https://", True), ("http://", False)):
        if endpoint.startswith(scheme):
            return endpoint[len(scheme):].rstrip("/"), secure
    return endpoint, False


def encode(spans: Sequence[ReadableSpan]) -> pb.ExportTraceServiceRequest:
    """The spans grouped by resource, then by instrumentation scope, as OTLP nests them."""
    request = pb.ExportTraceServiceRequest()
    resources: dict[int, tuple[pb.ResourceSpans, dict[tuple[str, str], pb.ScopeSpans]]] = {}
    for span in spans:
        key = id(span.resource)
        if key not in resources:
            rs = request.resource_spans.add()
            rs.resource.attributes.extend(_attributes(span.resource.attributes))
            rs.schema_url = span.resource.schema_url or ""
            resources[key] = (rs, {})
        rs, scopes = resources[key]
        scope = span.instrumentation_scope
        scope_key = (scope.name, scope.version or "") if scope else ("", "")
        if scope_key not in scopes:
            ss = rs.scope_spans.add()
            ss.scope.name, ss.scope.version = scope_key
            scopes[scope_key] = ss
        scopes[scope_key].spans.append(_span(span))
    return request


def _span(span: ReadableSpan) -> pb.Span:
    ctx = span.get_span_context()
    out = pb.Span(
        trace_id=_trace_id(ctx), span_id=_span_id(ctx), name=span.name,
        kind=_KINDS.get(span.kind, pb.Span.SPAN_KIND_UNSPECIFIED),
        start_time_unix_nano=span.start_time or 0, end_time_unix_nano=span.end_time or 0,
        attributes=_attributes(span.attributes),
        dropped_attributes_count=span.dropped_attributes,
        dropped_events_count=span.dropped_events, dropped_links_count=span.dropped_links,
        status=pb.Status(code=_CODES.get(span.status.status_code, pb.Status.STATUS_CODE_UNSET),
                         message=span.status.description or ""),
    )
    if ctx is not None:
        out.trace_state = ctx.trace_state.to_header() if ctx.trace_state else ""
        out.flags = int(ctx.trace_flags)
    if span.parent is not None:
        out.parent_span_id = _span_id(span.parent)
        out.flags |= _HAS_IS_REMOTE | (_IS_REMOTE if span.parent.is_remote else 0)
    for event in span.events:
        out.events.add(time_unix_nano=event.timestamp, name=event.name,
                       attributes=_attributes(event.attributes))
    for link in span.links:
        out.links.add(trace_id=_trace_id(link.context), span_id=_span_id(link.context),
                      attributes=_attributes(link.attributes))
    return out


def _trace_id(ctx: SpanContext | None) -> bytes:
    return ctx.trace_id.to_bytes(16, "big") if ctx is not None else b""


def _span_id(ctx: SpanContext | None) -> bytes:
    return ctx.span_id.to_bytes(8, "big") if ctx is not None else b""


def _attributes(attributes: Mapping[str, Any] | None) -> list[pb.KeyValue]:
    return [pb.KeyValue(key=key, value=_value(value))
            for key, value in (attributes or {}).items()]


def _value(value: Any) -> pb.AnyValue:
    # bool before int: True is an int in Python, but OTLP keeps them apart.
    if isinstance(value, bool):
        return pb.AnyValue(bool_value=value)
    if isinstance(value, int):
        return pb.AnyValue(int_value=value)
    if isinstance(value, float):
        return pb.AnyValue(double_value=value)
    if isinstance(value, bytes):
        return pb.AnyValue(bytes_value=value)
    if isinstance(value, str):
        return pb.AnyValue(string_value=value)
    if isinstance(value, Sequence):
        return pb.AnyValue(array_value=pb.ArrayValue(values=[_value(v) for v in value]))
    return pb.AnyValue(string_value=str(value))
