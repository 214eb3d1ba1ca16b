"""JSON log lines: structured, with the decision's trace id, and never the prompt."""

import json
import logging
from collections.abc import Iterator

import pytest

from extproc import config
from extproc.fleet.capacity import StaticCapacity
from extproc.gateway.gate import Gate
from extproc.ledger.memory import MemoryLedger
from extproc.observability.logs import JsonFormatter
from extproc.observability.metrics import Metrics
from extproc.observability.telemetry import Tracing
from tests.otlp_receiver import Receiver

CANARY = "CANARY-LOG-41f7"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def lines() -> Iterator[Lines]:
    handler = Lines()
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(old)


async def test_decision_log_line_has_the_trace_id_and_no_prompt(lines: Lines) -> None:
    cfg = config.from_mapping({"pools": [{"name": "llama", "replicas": 1}]})
    with Receiver() as receiver:
        gate = Gate(cfg, MemoryLedger(), StaticCapacity(cfg.pools), Metrics())
        gate.tracing = Tracing(config.TracingConfig(endpoint=receiver.endpoint))
        route = cfg.route("/v1/chat/completions")
        assert route is not None
        for body in (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": CANARY}]},
            {"model": "m", "max_tokens": CANARY, "messages": []},
        ):
            verdict = await gate.check(route, "/v1/chat/completions", {},
                                       json.dumps(body).encode(), {"traceparent": TRACEPARENT})
            if verdict.ticket is not None:
                await gate.settle(verdict.ticket)
        gate.tracing.shutdown()
    decisions = [json.loads(line) for line in lines.lines if '"msg": "decision"' in line]
    assert [d["outcome"] for d in decisions] == ["admit", "invalid"]
    assert all(d["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736" for d in decisions)
    assert all(d["level"] == "debug" and d["pool"] in ("llama", None) for d in decisions)
    assert not any(CANARY in line for line in lines.lines)
