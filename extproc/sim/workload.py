"""Workloads: what clients ask of a pool, as a list of jobs in arrival order.

A ``Job`` is one request a client wants served: when it first arrives, its prompt tokens, the
``max_tokens`` it sends (``None``: the pool's default is charged), the output tokens the model
will really generate (known to the simulator and the oracle, never to the gateway), its
service class and tenant, and optionally a deadline the client sends in the deadline header.

Formats and sources:

- **Azure LLM inference trace CSV** (``TIMESTAMP,ContextTokens,GeneratedTokens``, plain or
  ``.gz``; the 2023 traces, vendored in ``tests/data/traces``): ``read_azure``. Arrivals are
  seconds from the first row, divided by ``rate_x`` (``rate_x = 2`` replays the same requests
  at twice the rate). The CSV carries no ``max_tokens``: pass the one the clients should send,
  or ``None``.
- **JSONL** of our own, one job per line: ``{"arrival_s": 0.25, "prompt_tokens": 812,
  "max_tokens": 256, "output_tokens": 97, "class": "latency", "tenant": "a"}``
  (``max_tokens``, ``class``, ``tenant``, ``priority``, ``deadline_ms`` optional;
  ``priority`` is as an Envoy-set header would state it: a name or a level; ``"prefix": KEY,
  "prefix_tokens": N`` says that the prompt's first N tokens are those of earlier requests
  with the same key, a conversation's history, which an engine's prefix cache may hold):
  ``read_jsonl`` and ``write_jsonl``.
- **Decision logs** written by ``extproc serve`` (see ``extproc.observability.decisionlog``):
  ``read_decision_log`` turns each logged decision back into a job.
- **Synthetic**, which the product ships and which never needs the shared traces: log-normal
  lengths from the fitted parameters (``CONVERSATION``, ``CODE``), with Poisson, bursty on/off
  or piecewise-rate (step spike) arrivals: ``synthetic``.

Everything random takes a ``random.Random``: the same seed gives the same workload.
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import itertools
import json
import math
import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from extproc.decision.share import parse_priority, priority_label
from extproc.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Job:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int  # what the model will generate (before any max_tokens cut)
    max_tokens: int | None = None
    service_class: str = "latency"
    tenant: str = "default"
    deadline_ms: float | None = None  # a tighter deadline the client sends, if any
    prefix_key: str | None = None  # requests that share a prompt prefix share this key ...
    prefix_tokens: int = 0  # ... and this many leading prompt tokens (the engine may cache)
    priority: int | None = None  # its priority level as stated (a header Envoy sets), if any


@dataclass(frozen=True, slots=True)
class LogNormal:
    """Token counts whose natural log is normal(mu, sigma), rounded, at least ``low``."""

    mu: float
    sigma: float
    low: int = 1
    high: int | None = None

    def draw(self, rng: random.Random) -> int:
        value = max(self.low, round(rng.lognormvariate(self.mu, self.sigma)))
        return value if self.high is None else min(self.high, value)

    @property
    def mean(self) -> float:
        return math.exp(self.mu + self.sigma ** 2 / 2)


@dataclass(frozen=True, slots=True)
class Mix:
    """A request mix: prompt and output length distributions (drawn independently, as the
    Azure traces show them to be close to independent) and the max_tokens clients send."""

    prompt: LogNormal
    output: LogNormal
    max_tokens: int | None = None


# Log-normal fits of the Azure 2023 traces (tests/data/traces/README.md).
CONVERSATION = Mix(prompt=LogNormal(6.63, 0.99, high=16_000),
                   output=LogNormal(5.02, 0.86, high=4_000))
CODE = Mix(prompt=LogNormal(7.00, 1.36, high=16_000), output=LogNormal(2.79, 0.85, high=4_000))
MIXES = {"conversation": CONVERSATION, "code": CODE}


# ---- arrivals -------------------------------------------------------------------------------

def poisson_arrivals(rate: float, duration_s: float, rng: random.Random,
                     start_s: float = 0.0) -> Iterator[float]:
    """Arrival times of a Poisson process of ``rate`` per second over ``duration_s``."""
    if rate <= 0:
        return
    t = start_s
    end = start_s + duration_s
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            return
        yield t


def on_off_arrivals(rate_on: float, rate_off: float, mean_on_s: float, mean_off_s: float,
                    duration_s: float, rng: random.Random) -> Iterator[float]:
    """Bursty arrivals: Poisson at ``rate_on`` during ON periods and ``rate_off`` during OFF
    periods, with exponentially distributed period lengths (a Markov-modulated Poisson
    process), starting OFF."""
    t, on = 0.0, False
    while t < duration_s:
        length = rng.expovariate(1.0 / (mean_on_s if on else mean_off_s))
        span = min(length, duration_s - t)
        yield from poisson_arrivals(rate_on if on else rate_off, span, rng, start_s=t)
        t += length
        on = not on


@dataclass(frozen=True, slots=True)
class RatePoint:
    """The arrival rate (per second) at ``at_s``; between points the rate is linear."""

    at_s: float
    rate: float


def piecewise_arrivals(points: Sequence[RatePoint], rng: random.Random) -> Iterator[float]:
    """Arrivals of a Poisson process whose rate follows straight lines between ``points``
    (a step spike is two points at the same time), by thinning: candidates at the segment's
    peak rate are kept with probability ``rate(t) / peak``."""
    for a, b in itertools.pairwise(points):
        span = b.at_s - a.at_s
        peak = max(a.rate, b.rate)
        if span <= 0 or peak <= 0:
            continue
        for t in poisson_arrivals(peak, span, rng, start_s=a.at_s):
            rate = a.rate + (b.rate - a.rate) * (t - a.at_s) / span
            if rng.random() * peak < rate:
                yield t


def step_spike(base: float, peak: float, start_s: float, length_s: float,
               duration_s: float) -> list[RatePoint]:
    """Rate ``base``, jumping to ``peak`` at ``start_s`` for ``length_s``, then ``base``."""
    end = start_s + length_s
    return [RatePoint(0.0, base), RatePoint(start_s, base), RatePoint(start_s, peak),
            RatePoint(end, peak), RatePoint(end, base), RatePoint(duration_s, base)]


def synthetic(arrivals: Iterable[float], mix: Mix, rng: random.Random, *,
              service_class: str = "latency", tenant: str = "default") -> list[Job]:
    """Jobs at ``arrivals`` with lengths drawn from ``mix``."""
    return [Job(arrival_s=t, prompt_tokens=mix.prompt.draw(rng),
                output_tokens=mix.output.draw(rng), max_tokens=mix.max_tokens,
                service_class=service_class, tenant=tenant)
            for t in arrivals]


# ---- files ----------------------------------------------------------------------------------

def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.strip()[:26])


def read_azure(path: str | os.PathLike[str], *, rate_x: float = 1.0,
               max_tokens: int | None = None, service_class: str = "latency",
               start_s: float = 0.0, duration_s: float | None = None) -> list[Job]:
    """Jobs from an Azure LLM inference trace CSV. ``start_s``/``duration_s`` cut a window of
    the original timeline (before scaling); arrivals are then divided by ``rate_x`` and start
    at 0."""
    if rate_x <= 0:
        raise ConfigError([f"rate_x: must be > 0 (got {rate_x})"])
    jobs: list[Job] = []
    with _open_text(path) as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:3]] != [
                "TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise ConfigError([f"{path}: not an Azure LLM trace (header {header!r})"])
        t0: datetime | None = None
        for line, row in enumerate(reader, start=2):
            try:
                stamp, prompt, output = _parse_time(row[0]), int(row[1]), int(row[2])
            except (ValueError, IndexError) as exc:
                raise ConfigError([f"{path}:{line}: bad row ({exc})"]) from exc
            t0 = t0 or stamp
            at = (stamp - t0).total_seconds() - start_s
            if at < 0:
                continue
            if duration_s is not None and at >= duration_s:
                break
            jobs.append(Job(arrival_s=at / rate_x, prompt_tokens=max(1, prompt),
                            output_tokens=max(1, output), max_tokens=max_tokens,
                            service_class=service_class))
    jobs.sort(key=lambda j: j.arrival_s)
    if jobs:
        first = jobs[0].arrival_s
        jobs = [_shift(j, -first) for j in jobs]
    return jobs


def _open_text(path: str | os.PathLike[str]) -> TextIO:
    """A trace as text; gzip-compressed when its name ends in ``.gz``."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", newline="", encoding="utf-8")
    return open(path, newline="", encoding="utf-8")


def _shift(job: Job, by: float) -> Job:
    return dataclasses.replace(job, arrival_s=job.arrival_s + by)


def _job_from(raw: Any, where: str) -> Job:
    if not isinstance(raw, dict):
        raise ConfigError([f"{where}: must be a JSON object"])
    problems: list[str] = []

    def number(key: str, kind: Callable[[Any], Any], required: bool = True) -> Any:
        value = raw.get(key)
        if value is None:
            if required:
                problems.append(f"{where}: {key}: required")
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            problems.append(f"{where}: {key}: must be a non-negative number (got {value!r})")
            return None
        return kind(value)

    arrival = number("arrival_s", float)
    prompt = number("prompt_tokens", int)
    output = number("output_tokens", int)
    max_tokens = number("max_tokens", int, required=False)
    deadline_ms = number("deadline_ms", float, required=False)
    shared = number("prefix_tokens", int, required=False)
    cls, tenant = raw.get("class", "latency"), raw.get("tenant", "default")
    prefix = raw.get("prefix")
    if not isinstance(cls, str) or not isinstance(tenant, str):
        problems.append(f"{where}: class and tenant must be strings")
    priority = raw.get("priority")
    if priority is not None and (priority := parse_priority(priority)) is None:
        problems.append(f"{where}: priority: must be critical, standard, sheddable or a whole"
                        f" number (got {raw.get('priority')!r})")
    if prefix is not None and not isinstance(prefix, str):
        problems.append(f"{where}: prefix must be a string")
    if problems:
        raise ConfigError(problems)
    return Job(arrival_s=arrival, prompt_tokens=max(1, prompt), output_tokens=max(1, output),
               max_tokens=max_tokens or None, service_class=cls, tenant=tenant,
               deadline_ms=deadline_ms or None, prefix_key=prefix,
               prefix_tokens=min(shared or 0, max(1, prompt)) if prefix else 0,
               priority=priority)


def read_jsonl(path: str | os.PathLike[str], *, rate_x: float = 1.0) -> list[Job]:
    """Jobs from our JSONL format (see the module docstring), sorted by arrival."""
    jobs: list[Job] = []
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                raw = json.loads(text)
            except ValueError as exc:
                raise ConfigError([f"{path}:{line}: not JSON ({exc})"]) from exc
            job = _job_from(raw, f"{path}:{line}")
            jobs.append(_shift(job, job.arrival_s / rate_x - job.arrival_s))
    jobs.sort(key=lambda j: j.arrival_s)
    return jobs


def write_jsonl(jobs: Iterable[Job], path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for j in jobs:
            row: dict[str, Any] = {"arrival_s": round(j.arrival_s, 6),
                                   "prompt_tokens": j.prompt_tokens,
                                   "output_tokens": j.output_tokens}
            if j.max_tokens is not None:
                row["max_tokens"] = j.max_tokens
            row["class"], row["tenant"] = j.service_class, j.tenant
            if j.deadline_ms is not None:
                row["deadline_ms"] = j.deadline_ms
            if j.prefix_key is not None:
                row["prefix"], row["prefix_tokens"] = j.prefix_key, j.prefix_tokens
            if j.priority is not None:
                row["priority"] = priority_label(j.priority)
            f.write(json.dumps(row) + "\n")


def sniff(path: str | os.PathLike[str]) -> str:
    """``azure``, ``jsonl`` or ``decisions``, from the file's first line."""
    with _open_text(path) as f:
        first = f.readline().strip()
    if first.startswith("TIMESTAMP"):
        return "azure"
    if first.startswith("{"):
        try:
            return "decisions" if "decision" in json.loads(first) else "jsonl"
        except ValueError:
            pass
    raise ConfigError([f"{path}: unknown trace format (first line {first[:60]!r})"])


def read_decision_log(path: str | os.PathLike[str], *, pool: str | None = None,
                      itl_ms: float = 31.2, prefill_ms_per_token: float = 0.08,
                      rate_x: float = 1.0) -> list[Job]:
    """Jobs from a decision log (``extproc.observability.decisionlog``): one per logged decision.

    The gateway never reads responses, so a log has no true output length unless a line
    carries ``output_tokens``. Otherwise it is inferred from the measured duration:
    ``output = (duration_ms - prompt x prefill) / itl``, with ``itl`` the inter-token latency
    of a busy replica (an approximation: the duration also holds the queue wait). Lines with
    neither (the stream had not ended) keep the charge as their output."""
    from extproc.observability.decisionlog import read

    jobs: list[Job] = []
    t0: float | None = None
    for rec in read(path):
        if pool is not None and rec.pool != pool:
            continue
        t0 = rec.time_s if t0 is None else t0
        if rec.output_tokens is not None:
            output = rec.output_tokens
        elif rec.duration_ms is not None:
            gen_ms = rec.duration_ms - rec.prompt_tokens * prefill_ms_per_token
            output = max(1, round(gen_ms / itl_ms))
        else:
            output = rec.max_output_tokens
        jobs.append(Job(arrival_s=(rec.time_s - t0) / rate_x,
                        prompt_tokens=max(1, rec.prompt_tokens), output_tokens=max(1, output),
                        max_tokens=rec.max_output_tokens or None,
                        service_class=rec.service_class, deadline_ms=rec.deadline_ms,
                        tenant=rec.tenant or "default", priority=rec.priority))
    jobs.sort(key=lambda j: j.arrival_s)
    return jobs


def load(path: str | os.PathLike[str], fmt: str | None = None, *, rate_x: float = 1.0,
         max_tokens: int | None = None) -> list[Job]:
    """Any supported trace file; ``fmt`` is ``azure``, ``jsonl`` or ``decisions`` (sniffed when
    None)."""
    if not Path(path).is_file():
        raise ConfigError([f"{path}: no such file"])
    kind = fmt or sniff(path)
    if kind == "azure":
        return read_azure(path, rate_x=rate_x, max_tokens=max_tokens)
    if kind == "jsonl":
        return read_jsonl(path, rate_x=rate_x)
    if kind == "decisions":
        return read_decision_log(path, rate_x=rate_x)
    raise ConfigError([f"format: must be 'azure', 'jsonl' or 'decisions' (got {kind!r})"])
