"""Running policies side by side and showing what happened: table, JSON, plots, progress.

``compare(scenario, names)`` runs each policy on the same scenario (same jobs, same seed) and
returns their ``Result``s. ``table`` lays them out with one column per policy; ``summary``
is the same as JSON-ready data; ``plot`` draws latency, goodput and rejects, and replicas over
time, one column of panels per policy (matplotlib, imported only here).

Two figures are relative to the ``none`` run when it is in the set, the note's trade for an
admission or scaling change: *queue-delay minutes avoided* (``none``'s total time requests
spent in engine queues, less this policy's) and *idle GPU minutes added* (this policy's
replica-minutes with nothing running, less ``none``'s).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from extproc.sim import policies
from extproc.sim.run import simulate

if TYPE_CHECKING:
    from extproc.sim.result import Result
    from extproc.sim.scenarios import Scenario


class Progress:
    """A plain-text progress bar on a stream, redrawn at most every ``every_s`` seconds."""

    def __init__(self, label: str, stream: TextIO | None = None, every_s: float = 0.5,
                 width: int = 30) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.width = width
        self._last = 0.0
        self._started = time.monotonic()

    def __call__(self, now: float, span: float) -> None:
        wall = time.monotonic()
        if wall - self._last < self.every_s:
            return
        self._last = wall
        self._draw(min(1.0, now / span) if span > 0 else 1.0)

    def _draw(self, done: float) -> None:
        filled = int(done * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self._started
        self.stream.write(f"\r{self.label:28s} [{bar}] {done:4.0%} {elapsed:5.1f}s")
        self.stream.flush()

    def close(self) -> None:
        self._draw(1.0)
        self.stream.write("\n")
        self.stream.flush()


def compare(scenario: Scenario, names: Sequence[str], *,
            progress: Callable[[str], Progress | None] | None = None) -> list[Result]:
    """Run each named policy on ``scenario``."""
    results = []
    for name in names:
        bar = progress(f"{scenario.name}/{name}") if progress else None
        results.append(simulate(scenario, policies.make(name), bar))
        if bar is not None:
            bar.close()
    return results


def _baseline(results: Sequence[Result], name: str) -> Result | None:
    return next((r for r in results if r.policy == name), None)


def figures(results: Sequence[Result]) -> list[dict[str, Any]]:
    """Each result's summary plus the figures relative to ``none`` and ``oracle``."""
    none = _baseline(results, "none")
    oracle = _baseline(results, "oracle")
    rows = []
    for r in results:
        row = r.summary()
        row["goodput_vs_oracle"] = (round(r.goodput / oracle.goodput, 4)
                                    if oracle is not None and oracle.goodput > 0 else None)
        if none is not None:
            row["queue_delay_min_avoided"] = round((none.queue_delay_s - r.queue_delay_s) / 60, 2)
            row["idle_gpu_min_added"] = round((r.idle_replica_s - none.idle_replica_s) / 60, 2)
        rows.append(row)
    return rows


def summary(scenario: Scenario, results: Sequence[Result]) -> dict[str, Any]:
    return {
        "scenario": scenario.name,
        "description": scenario.description,
        "jobs": len(scenario.jobs),
        "span_s": round(scenario.span_s, 1),
        "replicas": scenario.replicas,
        "policies": figures(results),
    }


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "inf"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}f}"
    return str(value)


def _lat(r: dict[str, Any], key: str) -> str:
    q = r[key]
    return "/".join(_fmt(q[p], 1 if (q[p] or 0) >= 10 else 2) for p in ("p50", "p95", "p99"))


def table(scenario: Scenario, results: Sequence[Result]) -> str:
    """A plain-text table, one column per policy."""
    rows = figures(results)
    lines: list[tuple[str, list[str]]] = [
        ("goodput (req/s)", [_fmt(r["goodput_rps"], 3) for r in rows]),
        ("  vs oracle", ["-" if r["goodput_vs_oracle"] is None
                         else _fmt(100 * r["goodput_vs_oracle"], 1) + "%" for r in rows]),
        ("SLO attainment (admitted)", [_fmt(100 * r["attainment"], 2) + "%" for r in rows]),
        ("reject share (429s)", [_fmt(100 * r["reject_share"], 1) + "%" for r in rows]),
        ("jobs shed", [_fmt(100 * r["shed_share"], 1) + "%" for r in rows]),
        ("latency p50/p95/p99 (s)", [_lat(r, "latency_s") for r in rows]),
        ("TTFT p50/p95/p99 (s)", [_lat(r, "ttft_s") for r in rows]),
        ("GPU-s wasted", [_fmt(r["gpu_wasted_s"], 0) for r in rows]),
        ("replica-min (peak)", [f"{r['replica_min']:.0f} ({r['peak_replicas']})" for r in rows]),
    ]
    if "queue_delay_min_avoided" in rows[0]:
        lines += [
            ("queue-delay min avoided", [_fmt(r["queue_delay_min_avoided"], 0) for r in rows]),
            ("idle GPU min added", [_fmt(r["idle_gpu_min_added"], 0) for r in rows]),
        ]
    head = [r["policy"] for r in rows]
    width = max(12, *(len(c) for _, cells in lines for c in cells)) + 2
    label = max(len(name) for name, _ in lines) + 2
    out = [f"{scenario.name}: {scenario.description}",
           " " * label + "".join(h.rjust(width) for h in head)]
    out += [name.ljust(label) + "".join(c.rjust(width) for c in cells) for name, cells in lines]
    return "\n".join(out)


def write_summary(path: str | os.PathLike[str], data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _clock(origin_s: float) -> Callable[[float, Any], str]:
    def label(t: float, _: Any = None) -> str:
        s = int(origin_s + t)
        return f"{s // 3600 % 24:02d}:{s // 60 % 60:02d}" if origin_s else f"{t / 60:.0f}m"
    return label


def plot(scenario: Scenario, results: Sequence[Result], path: str | os.PathLike[str],
         *, title: str | None = None) -> None:
    """Latency p95, goodput and rejects per second, and replicas over time; one column of
    panels per policy, shared axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    n = len(results)
    fig, axes = plt.subplots(3, n, figsize=(3.2 * n + 0.8, 7.2), sharex=True, sharey="row",
                             squeeze=False)
    label = _clock(scenario.clock_origin_s)
    for col, r in enumerate(results):
        s = r.series
        step = scenario.sample_s
        t = s.t
        ax = axes[0][col]
        p95 = [v if v == v else float("nan") for v in s.p95_s]
        ax.plot(t, p95, color="tab:purple", lw=1)
        ax.set_yscale("log")
        ax.set_title(r.policy)
        ax.axhline(_deadline_s(scenario), color="grey", ls="--", lw=0.8)
        ax = axes[1][col]
        ax.plot(t, [g / step for g in s.good], color="tab:green", lw=1, label="good/s")
        ax.plot(t, [x / step for x in s.rejected], color="tab:red", lw=1, label="429/s")
        ax.plot(t, [(x + d) / step for x, d in zip(s.late, s.dropped, strict=True)],
                color="tab:orange", lw=1, label="late/s")
        ax = axes[2][col]
        ax.step(t, s.ready, where="post", color="tab:blue", lw=1, label="ready")
        ax.step(t, [a + b for a, b in zip(s.ready, s.starting, strict=True)], where="post",
                color="tab:blue", lw=1, ls=":", label="+ starting")
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_formatter(FuncFormatter(label))
    axes[0][0].set_ylabel("latency p95 (s)")
    axes[1][0].set_ylabel("requests / s")
    axes[2][0].set_ylabel("replicas")
    axes[1][0].legend(fontsize=7, loc="upper left")
    axes[2][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(title or f"{scenario.name}: {scenario.description}", fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _deadline_s(scenario: Scenario) -> float:
    classes = scenario.config.classes
    service_class = scenario.jobs[0].service_class if scenario.jobs else next(iter(classes))
    return classes[service_class].deadline_ms / 1000.0


def heatmap(rows: Sequence[str], columns: Sequence[str],
            values: Sequence[Sequence[float | None]], path: str | os.PathLike[str], *,
            centres: Sequence[float], spans: Sequence[float], formats: Sequence[str],
            title: str = "") -> None:
    """A grid of coloured cells, one row per label in ``rows`` and one column per label in
    ``columns``, each cell printed with its value (``formats[column]``). Colour: red below the
    column's ``centres`` value, green above, full at ``spans`` away (a ratio's centre is 1, an
    attainment's 0.99); ``None`` is grey and printed ``-``. The figure grows with the rows so
    every label stays readable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    cmap = matplotlib.colormaps["RdYlGn"]
    fig_h = 1.2 + 0.24 * len(rows)
    fig_w = 2.6 + 0.13 * max((len(r) for r in rows), default=10) + 1.25 * len(columns)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    grey = to_rgba("lightgrey")
    colours = []
    for row in values:
        line = []
        for j, v in enumerate(row):
            if v is None or math.isnan(v):
                line.append(grey)
            else:
                line.append(cmap(0.5 + 0.5 * max(-1.0, min(1.0, (v - centres[j]) / spans[j]))))
        colours.append(line)
    ax.imshow(colours, aspect="auto", interpolation="nearest")
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            text = "-" if v is None or math.isnan(v) else format(v, formats[j])
            r, g, b, _ = colours[i][j]
            dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.45
            ax.text(j, i, text, ha="center", va="center", fontsize=7,
                    color="white" if dark else "black")
    ax.set_xticks(range(len(columns)), list(columns), fontsize=8)
    ax.xaxis.tick_top()
    ax.set_yticks(range(len(rows)), list(rows), fontsize=7, family="monospace")
    ax.set_xticks([x - 0.5 for x in range(1, len(columns))], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(rows))], minor=True)
    ax.grid(which="minor", color="white", linewidth=0.6)
    ax.tick_params(which="minor", length=0)
    if title:
        ax.set_title(title, fontsize=9, pad=24)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
