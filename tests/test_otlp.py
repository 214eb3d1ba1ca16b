"""The sidecar's own OTLP messages and exporter (extproc/observability/otlp.py,
proto/otlp_trace.proto)."""

from __future__ import annotations

import filecmp
import subprocess
import sys
import time
from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from extproc._proto import otlp_trace_pb2 as pb
from extproc.observability.otlp import OtlpSpanExporter, channel_target, encode
from extproc_dev.stack import free_port
from tests.otlp_receiver import Receiver

pytestmark = pytest.mark.integration  # starts processes (Envoy, extproc, helm, an interpreter)

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("otlp_trace_pb2.py", "otlp_trace_pb2.pyi")


def test_checked_in_generated_code_matches_the_proto(tmp_path: Path) -> None:
    # the command in proto/otlp_trace.proto's header, into a temporary tree
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iextproc/_proto=proto",
                    f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                    "extproc/_proto/otlp_trace.proto"], cwd=ROOT, check=True)
    for name in GENERATED:
        fresh, checked_in = tmp_path / "extproc" / "_proto" / name, ROOT / "extproc/_proto" / name
        assert filecmp.cmp(fresh, checked_in, shallow=False), (
            f"extproc/_proto/{name} is stale: regenerate it (see proto/otlp_trace.proto)")


# OTLP renamed two messages on the way to 1.0 without changing their wire layout.
_RENAMED = {"InstrumentationLibrarySpans": "ScopeSpans",
            "InstrumentationLibrary": "InstrumentationScope"}


def _either(module: object, *names: str) -> type:
    found: type = next(getattr(module, n) for n in names if hasattr(module, n))
    return found


def _layout(message: Descriptor) -> dict[int, tuple[int, str]]:
    return {f.number: (f.type, _RENAMED.get(f.message_type.name, f.message_type.name)
                       if f.message_type else "") for f in message.fields}


def test_field_numbers_and_types_agree_with_the_installed_otlp() -> None:
    # xds-protos carries an old but genuine OTLP (what Envoy's tracer config refers to), or a
    # venv made before this project stopped installing opentelemetry-proto has the current one
    # there; every field both define must have the same number and wire type. Envoy's own
    # spans, decoded by tests/otlp_receiver.py in tests/test_tracing_e2e.py, check the current
    # layout end to end.
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ref_service
    from opentelemetry.proto.common.v1 import common_pb2 as ref_common
    from opentelemetry.proto.resource.v1 import resource_pb2 as ref_resource
    from opentelemetry.proto.trace.v1 import trace_pb2 as ref_trace

    pairs = [(pb.ExportTraceServiceRequest, ref_service.ExportTraceServiceRequest),
             (pb.ResourceSpans, ref_trace.ResourceSpans),
             (pb.ScopeSpans, _either(ref_trace, "ScopeSpans", "InstrumentationLibrarySpans")),
             (pb.Span, ref_trace.Span), (pb.Span.Event, ref_trace.Span.Event),
             (pb.Span.Link, ref_trace.Span.Link), (pb.Status, ref_trace.Status),
             (pb.Resource, ref_resource.Resource), (pb.KeyValue, ref_common.KeyValue),
             (pb.AnyValue, ref_common.AnyValue), (pb.ArrayValue, ref_common.ArrayValue),
             (pb.KeyValueList, ref_common.KeyValueList),
             (pb.InstrumentationScope,
              _either(ref_common, "InstrumentationScope", "InstrumentationLibrary"))]
    compared = 0
    for ours, reference in pairs:
        mine, theirs = _layout(ours.DESCRIPTOR), _layout(reference.DESCRIPTOR)
        for number in mine.keys() & theirs.keys():
            assert mine[number] == theirs[number], (ours.DESCRIPTOR.full_name, number)
            compared += 1
    assert compared >= 45
    assert [v.number for v in pb.Span.SpanKind.DESCRIPTOR.values] == [
        v.number for v in ref_trace.Span.SpanKind.DESCRIPTOR.values]


def _spans() -> list:  # type: ignore[type-arg]
    captured: list = []  # type: ignore[type-arg]

    class Capture:
        def export(self, spans: list) -> SpanExportResult:  # type: ignore[type-arg]
            captured.extend(spans)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None: ...

        def force_flush(self, timeout_millis: int = 0) -> bool:
            return True

    provider = TracerProvider(resource=Resource.create({"service.name": "svc"}))
    provider.add_span_processor(SimpleSpanProcessor(Capture()))  # type: ignore[arg-type]
    tracer = provider.get_tracer("extproc", "1.2")
    parent = SpanContext(trace_id=0xABC, span_id=0xDEF, is_remote=True,
                         trace_flags=TraceFlags(TraceFlags.SAMPLED))
    ctx = trace.set_span_in_context(NonRecordingSpan(parent))
    with tracer.start_as_current_span("decide", context=ctx, kind=trace.SpanKind.SERVER) as span:
        span.set_attributes({"s": "x", "b": True, "i": 7, "f": 0.5, "l": [1, 2]})
        span.add_event("shed", {"n": 1})
        span.set_status(trace.StatusCode.ERROR, "bad")
    return captured


def test_encode_keeps_ids_kind_parent_attributes_events_and_status() -> None:
    request = encode(_spans())
    [rs] = request.resource_spans
    assert {kv.key: kv.value.string_value for kv in rs.resource.attributes}["service.name"] == "svc"
    [ss] = rs.scope_spans
    assert (ss.scope.name, ss.scope.version) == ("extproc", "1.2")
    [span] = ss.spans
    assert span.trace_id == (0xABC).to_bytes(16, "big")
    assert span.parent_span_id == (0xDEF).to_bytes(8, "big") and len(span.span_id) == 8
    assert span.kind == pb.Span.SPAN_KIND_SERVER
    assert span.flags == 0x301  # sampled, parent known to be remote
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert attrs["s"].string_value == "x" and attrs["b"].bool_value is True
    assert attrs["i"].int_value == 7 and attrs["f"].double_value == 0.5
    assert [v.int_value for v in attrs["l"].array_value.values] == [1, 2]
    assert [e.name for e in span.events] == ["shed"]
    assert (span.status.code, span.status.message) == (pb.Status.STATUS_CODE_ERROR, "bad")
    assert span.end_time_unix_nano >= span.start_time_unix_nano > 0


def test_exporter_delivers_to_a_real_receiver_and_reports_an_absent_one() -> None:
    spans = _spans()
    with Receiver() as receiver:
        exporter = OtlpSpanExporter(receiver.endpoint, timeout_s=5)
        assert exporter.export(spans) == SpanExportResult.SUCCESS
        exporter.shutdown()
    assert [s["name"] for s in receiver.spans] == ["decide"]
    assert receiver.spans[0]["attributes"]["i"] == 7
    nobody = OtlpSpanExporter(f"http://127.0.0.1:{free_port()}", timeout_s=0.5)
    started = time.monotonic()
    assert nobody.export(spans) == SpanExportResult.FAILURE
    assert time.monotonic() - started < 5
    nobody.shutdown()


def test_endpoint_forms() -> None:
    assert channel_target("http://collector:4317") == ("collector:4317", False)
    assert channel_target("https://collector:4317/") == ("collector:4317", True)
    assert channel_target("collector:4317") == ("collector:4317", False)
