"""The decision log: one JSON line per admission decision, for replay and shadow evaluation.

Enabled by the top-level config key ``decision_log: PATH``. Run ``extproc serve`` in shadow
mode with it, then ``extproc replay --trace PATH`` shows what enforcing would have done to that
traffic. A line never holds prompt text or anything else from the body but token counts:

    {"time": 1764460800.123, "pool": "llama", "class": "latency", "prompt_tokens": 812,
     "max_output_tokens": 256, "deadline_ms": 30000.0, "decision": "admit", "reason": "fits",
     "mode": "shadow", "predicted_ms": 2310.4, "wait_ms": 0.0, "duration_ms": 2875.2}

``time`` is wall-clock seconds (to line up with other logs); ``max_output_tokens`` is the most
output the request may write (``max_tokens`` or the pool default, times choices; logs written
before it had this name call it ``charged_tokens``, and are read either way); ``decision`` and
``reason`` are the ``Outcome`` and ``Reason`` values; ``predicted_ms`` is the predicted
completion; ``tenant`` (only with tenant attribution on, ``extproc.gateway.tenant``) is who was
charged. ``duration_ms`` is the measured time from the decision to the end of the request's
stream, known only for requests that ran (``null`` for rejected ones). A request that runs is
logged when its stream ends, so lines are ordered by end, not by ``time``; readers sort.

Writing stays off the hot path: ``write`` appends a line to a memory buffer; the buffer is
written out at most every ``flush_interval_s`` by a timer on the running event loop (one
``write`` call for the whole batch), when it holds ``max_buffered`` lines, and at exit.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from extproc.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Record:
    time_s: float
    pool: str
    service_class: str
    prompt_tokens: int
    max_output_tokens: int
    deadline_ms: float
    decision: str
    reason: str
    mode: str
    predicted_ms: float | None = None
    wait_ms: float | None = None
    duration_ms: float | None = None
    output_tokens: int | None = None  # only when a source knows it (never the gateway today)
    tenant: str | None = None  # who was charged, when tenant attribution is on
    promised_tokens: float | None = None  # the output length its admission was promised on
    priority: int | None = None  # its priority level (extproc.decision.share)

    def to_json(self) -> str:
        row: dict[str, Any] = {
            "time": round(self.time_s, 3), "pool": self.pool, "class": self.service_class,
            "prompt_tokens": self.prompt_tokens, "max_output_tokens": self.max_output_tokens,
            "deadline_ms": self.deadline_ms, "decision": self.decision, "reason": self.reason,
            "mode": self.mode,
            "predicted_ms": None if self.predicted_ms is None else round(self.predicted_ms, 1),
            "wait_ms": None if self.wait_ms is None else round(self.wait_ms, 1),
            "duration_ms": None if self.duration_ms is None else round(self.duration_ms, 1),
        }
        if self.output_tokens is not None:
            row["output_tokens"] = self.output_tokens
        if self.tenant is not None:
            row["tenant"] = self.tenant
        if self.promised_tokens is not None:
            row["promised_tokens"] = self.promised_tokens
        if self.priority is not None:
            row["priority"] = self.priority
        return json.dumps(row, separators=(",", ":"))


@dataclass
class Pending:
    """A record waiting for its request's stream to end."""

    record: Record
    started: float  # the gate's monotonic clock at the decision


class DecisionLog:
    def __init__(self, path: str | os.PathLike[str], *, flush_interval_s: float = 1.0,
                 max_buffered: int = 10_000) -> None:
        self.path = os.fspath(path)
        self.flush_interval_s = flush_interval_s
        self.max_buffered = max_buffered
        self._buffer: list[str] = []
        self._timer: asyncio.TimerHandle | None = None
        atexit.register(self.flush)

    def write(self, record: Record) -> None:
        self._buffer.append(record.to_json())
        if len(self._buffer) >= self.max_buffered:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a tool, a test): write at once
                self.flush()
                return
            self._timer = loop.call_later(self.flush_interval_s, self.flush)

    def end(self, pending: Pending, now: float) -> None:
        """The request's stream ended at ``now`` (same clock as ``pending.started``)."""
        self.write(dataclasses.replace(
            pending.record, duration_ms=max(0.0, (now - pending.started) * 1000.0)))

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._buffer:
            return
        text = "\n".join(self._buffer) + "\n"
        self._buffer.clear()
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)

    def close(self) -> None:
        self.flush()
        atexit.unregister(self.flush)


def _record(raw: Any, where: str) -> Record:
    if not isinstance(raw, dict):
        raise ConfigError([f"{where}: must be a JSON object"])
    try:
        return Record(
            time_s=float(raw["time"]), pool=str(raw["pool"]), service_class=str(raw["class"]),
            prompt_tokens=int(raw["prompt_tokens"]),
            max_output_tokens=int(raw["max_output_tokens"] if "max_output_tokens" in raw
                                  else raw["charged_tokens"]),  # (its name before)
            deadline_ms=float(raw["deadline_ms"]), decision=str(raw["decision"]),
            reason=str(raw.get("reason", "")), mode=str(raw.get("mode", "")),
            predicted_ms=_opt_float(raw.get("predicted_ms")),
            wait_ms=_opt_float(raw.get("wait_ms")),
            duration_ms=_opt_float(raw.get("duration_ms")),
            output_tokens=None if raw.get("output_tokens") is None
            else int(raw["output_tokens"]),
            tenant=None if raw.get("tenant") is None else str(raw["tenant"]),
            priority=None if raw.get("priority") is None else int(raw["priority"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError([f"{where}: bad decision record ({exc!r})"]) from exc


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def read(path: str | os.PathLike[str]) -> Iterator[Record]:
    """The records of a decision log, sorted by decision time."""
    records: list[Record] = []
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if text.strip():
                try:
                    raw = json.loads(text)
                except ValueError as exc:
                    raise ConfigError([f"{path}:{line}: not JSON ({exc})"]) from exc
                records.append(_record(raw, f"{path}:{line}"))
    records.sort(key=lambda r: r.time_s)
    return iter(records)
