"""One request through real Envoy: Envoy's span and our decision span in one trace, on the
wire of a real OTLP receiver, with no prompt text in any exported byte."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest

from tests.conftest import pool
from tests.otlp_receiver import Receiver

pytestmark = pytest.mark.integration

CANARY = "CANARY-PROMPT-9d1c"


def test_decision_span_is_a_child_of_envoys_span(stack_factory: Any) -> None:
    with Receiver() as receiver:
        stack = stack_factory(
            {"pools": [pool()], "tracing": {"endpoint": receiver.endpoint}},
            backend_args=["--time-scale", "0.05"])
        body = json.dumps({"model": "llama-3", "max_tokens": 8, "extproc_output_tokens": 3,
                           "messages": [{"role": "user", "content": CANARY}]}).encode()
        req = urllib.request.Request(stack.url + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
        deadline = time.monotonic() + 15
        ours: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            ours = [s for s in receiver.spans if s["name"] == "extproc.admission"]
            envoy = [s for s in receiver.spans if s["service"] == "envoy"]
            if ours and envoy and any(s["span_id"] == ours[0]["parent_span_id"]
                                      for s in envoy):
                break
            time.sleep(0.1)
        stack.stop()  # flushes both exporters
    [span] = ours
    envoy_spans = {s["span_id"]: s for s in receiver.spans
                   if s["service"] == "envoy" and s["trace_id"] == span["trace_id"]}
    assert span["parent_span_id"] in envoy_spans, "our span is not parented under Envoy's"
    # the request's ingress span is the root of the trace our decision belongs to
    roots = [s for s in envoy_spans.values() if not s["parent_span_id"]]
    assert len(roots) == 1, envoy_spans
    attrs = span["attributes"]
    assert attrs["extproc.outcome"] == "admit" and attrs["extproc.reason"] == "fits"
    assert attrs["extproc.pool"] == "llama" and attrs["extproc.service_class"] == "latency"
    assert attrs["extproc.priority"] == "standard"
    assert attrs["gen_ai.request.model"] == "llama-3"
    assert attrs["gen_ai.usage.input_tokens"] > 0
    assert attrs["gen_ai.request.max_tokens"] == 8 and attrs["gen_ai.request.stream"] is False
    assert attrs["extproc.capacity_replicas"] == 1 and attrs["extproc.ledger_ms"] >= 0
    for key in ("extproc.wait_ms", "extproc.completion_ms", "extproc.budget_ms"):
        assert isinstance(attrs[key], float)
    assert all(CANARY.encode() not in raw for raw in receiver.requests)
