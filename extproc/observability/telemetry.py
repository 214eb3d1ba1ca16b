"""Traces: one span per admission decision, exported over OTLP/gRPC (Jaeger ingests it;
``extproc.observability.otlp`` says why the exporter is our own).

The span is a child of Envoy's own span for the request: Envoy's tracer injects W3C trace
context (``traceparent``) into the ext_proc gRPC call's metadata; when it is absent we fall
back to the request's own ``traceparent`` header. Attributes explain the decision and use the
OpenTelemetry GenAI names where they exist (``gen_ai.request.model``,
``gen_ai.request.max_tokens``, ``gen_ai.usage.input_tokens``); the rest live under
``extproc.``. Prompt text is never an attribute, and no attribute is derived from it beyond a
token count.

Off costs nothing: with no endpoint configured ``Tracing.span`` returns a shared no-op context
and no OpenTelemetry object is created per request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from extproc.decision.share import priority_label

if TYPE_CHECKING:
    from extproc.config import TracingConfig
    from extproc.gateway.verdict import Verdict

_PROPAGATOR = TraceContextTextMapPropagator()


class DecisionSpan:
    """The span of one decision; ``set`` ignores attributes whose value is None."""

    def __init__(self, span: trace.Span | None) -> None:
        self._span = span

    def set(self, **attributes: Any) -> None:
        if self._span is None:
            return
        for key, value in attributes.items():
            if value is not None:
                self._span.set_attribute(_NAMES.get(key, f"extproc.{key}"), value)

    @property
    def trace_id(self) -> str | None:
        if self._span is None:
            return None
        ctx = self._span.get_span_context()
        return format(ctx.trace_id, "032x") if ctx.is_valid else None


_NAMES = {
    "model": "gen_ai.request.model",
    "max_tokens": "gen_ai.request.max_tokens",
    "prompt_tokens": "gen_ai.usage.input_tokens",
    "stream": "gen_ai.request.stream",
}
_OFF = DecisionSpan(None)


class Tracing:
    def __init__(self, config: TracingConfig) -> None:
        self.config = config
        self._provider: Any = None
        self._tracer: trace.Tracer | None = None
        if config.endpoint:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

            from extproc.observability.otlp import OtlpSpanExporter

            self._provider = TracerProvider(
                resource=Resource.create({"service.name": config.service_name}),
                sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
            )
            exporter = OtlpSpanExporter(config.endpoint)
            self._provider.add_span_processor(BatchSpanProcessor(
                exporter, schedule_delay_millis=500))
            self._tracer = self._provider.get_tracer("extproc")

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @contextlib.contextmanager
    def span(self, metadata: Mapping[str, str],
             headers: Mapping[str, str]) -> Iterator[DecisionSpan]:
        """A decision span parented by ``metadata``'s trace context, else ``headers``'."""
        if self._tracer is None:
            yield _OFF
            return
        carrier = metadata if "traceparent" in metadata else headers
        parent = _PROPAGATOR.extract({"traceparent": carrier.get("traceparent", ""),
                                      "tracestate": carrier.get("tracestate", "")})
        token = otel_context.attach(parent)
        try:
            with self._tracer.start_as_current_span(
                    "extproc.admission", kind=trace.SpanKind.INTERNAL) as span:
                yield DecisionSpan(span)
        finally:
            otel_context.detach(token)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


def annotate(span: DecisionSpan, verdict: Verdict, seconds: float, mode: str) -> None:
    """The decision's explanation on its span: never prompt text."""
    d = verdict.decision
    span.set(**(verdict.trace or {}))
    span.set(pool=verdict.pool, service_class=verdict.service_class, mode=mode,
             outcome=verdict.outcome.value, reason=verdict.reason.value,
             prompt_tokens=verdict.prompt_tokens or None,
             max_output_tokens=verdict.max_output_tokens or None,
             decision_ms=round(seconds * 1000.0, 3))
    if verdict.held_ms:
        span.set(held_ms=round(verdict.held_ms, 3))
    if verdict.admission is not None:
        span.set(priority=priority_label(verdict.admission.priority))
    if verdict.tenant is not None:
        span.set(tenant=verdict.tenant.label)
    if d is not None:
        span.set(wait_ms=d.wait_ms, ttft_ms=d.ttft_ms, completion_ms=d.completion_ms,
                 budget_ms=d.budget_ms, charge_ms=d.charge_ms,
                 retry_after_ms=d.retry_after_ms)
