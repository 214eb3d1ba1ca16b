import time

from extproc import config as config_mod
from extproc.config import TracingConfig
from extproc.decision.admission import Snapshot
from extproc.decision.learning import learning_for
from extproc.decision.rules import Rules
from extproc.decision.step import Ask, admit
from extproc.gateway.verdict import Verdict
from extproc.observability.telemetry import Tracing, annotate
from tests.otlp_receiver import Receiver

PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


def wait_for_spans(receiver: Receiver, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while len(receiver.spans) < n:
        assert time.monotonic() < deadline, f"only {len(receiver.spans)} spans arrived"
        time.sleep(0.05)


def test_off_creates_no_span_and_costs_nothing() -> None:
    tracing = Tracing(TracingConfig(endpoint=None))
    with tracing.span({}, {}) as span:
        span.set(model="m", outcome="admit")
        assert span.trace_id is None
    assert not tracing.enabled


def test_decision_span_is_exported_over_otlp_under_the_grpc_parent() -> None:
    with Receiver() as receiver:
        tracing = Tracing(TracingConfig(endpoint=receiver.endpoint))
        metadata = {"traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"}
        header = {"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"}
        with tracing.span(metadata, header) as span:
            span.set(model="llama", prompt_tokens=42, outcome="reject", wait_ms=1234.5,
                     pool="p", ignored=None)
            assert span.trace_id == PARENT_TRACE
        tracing.shutdown()
        wait_for_spans(receiver, 1)
    [exported] = receiver.spans
    assert exported["service"] == "extproc" and exported["name"] == "extproc.admission"
    assert (exported["trace_id"], exported["parent_span_id"]) == (PARENT_TRACE, PARENT_SPAN)
    attrs = exported["attributes"]
    assert attrs["gen_ai.request.model"] == "llama"
    assert attrs["gen_ai.usage.input_tokens"] == 42
    assert attrs["extproc.outcome"] == "reject" and attrs["extproc.wait_ms"] == 1234.5
    assert "extproc.ignored" not in attrs


def test_request_traceparent_is_the_fallback_parent() -> None:
    with Receiver() as receiver:
        tracing = Tracing(TracingConfig(endpoint=receiver.endpoint))
        with tracing.span({}, {"traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"}):
            pass
        with tracing.span({}, {}):  # no parent at all: a new root trace
            pass
        tracing.shutdown()
        wait_for_spans(receiver, 2)
    child, root = receiver.spans
    assert child["parent_span_id"] == PARENT_SPAN
    assert root["parent_span_id"] == "" and root["trace_id"] != PARENT_TRACE


def test_a_decided_verdict_explains_itself_on_its_span() -> None:
    """What the README lists reaches the collector, read from the step's admission (the
    verdict keeps no copies of it): the charge, the prediction, the tokens, never the text."""
    config = config_mod.from_mapping({})
    pool = config.pools[0]
    adm = admit(Ask("latency", 300, 50), pool, Rules.of(config), learning_for(pool),
                Snapshot(0, 0.0), 2, 0.0)
    verdict = Verdict(adm, pool.name)
    assert verdict.decision is adm.decision and adm.decision is not None
    with Receiver() as receiver:
        tracing = Tracing(TracingConfig(endpoint=receiver.endpoint))
        with tracing.span({}, {}) as span:
            annotate(span, verdict, 0.001, "enforce")
        tracing.shutdown()
        wait_for_spans(receiver, 1)
    attrs = receiver.spans[0]["attributes"]
    assert attrs["extproc.outcome"] == "admit" and attrs["extproc.pool"] == pool.name
    assert attrs["extproc.charge_ms"] == adm.decision.charge_ms > 0
    assert attrs["extproc.completion_ms"] == adm.decision.completion_ms
    assert attrs["gen_ai.usage.input_tokens"] == 300
    assert attrs["extproc.max_output_tokens"] == adm.cost.max_output_tokens == 50
    assert "extproc.service_ms" not in attrs and "extproc.output_tokens_charged" not in attrs
