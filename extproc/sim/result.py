"""What one simulated run gives back: its counts, time series and per-group tallies, and the
figures derived from them (``docs/simulator.md`` defines each)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Series:
    """Per-sample time series (one entry per ``sample_s``)."""

    t: list[float] = field(default_factory=list)
    arrivals: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    good: list[int] = field(default_factory=list)
    late: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    p95_s: list[float] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    starting: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    inflight: list[int] = field(default_factory=list)


@dataclass
class Tally:
    """One priority or tenant group's attempts and how they went (``Result.groups``)."""

    attempts: int = 0
    admitted: int = 0
    rejected: int = 0
    good: int = 0
    good_in_span: int = 0
    # its good attempts' jobs: (arrival, whether the answer came within the deadline of the
    # job's first attempt, not only of the attempt that was served)
    good_jobs: list[tuple[float, bool]] = field(default_factory=list, repr=False)

    @property
    def attainment(self) -> float:
        return self.good / self.admitted if self.admitted else 1.0

    def goodput_between(self, start_s: float, end_s: float) -> float:
        """Completions in time a second, of the jobs that arrived in ``[start_s, end_s)``."""
        inside = sum(1 for t, _ in self.good_jobs if start_s <= t < end_s)
        return inside / (end_s - start_s) if end_s > start_s else 0.0


@dataclass
class Result:
    scenario: str
    policy: str
    span_s: float
    jobs: int = 0
    attempts: int = 0
    admitted: int = 0  # attempts forwarded to an engine (admitted, passed, or shadow)
    rejected: int = 0  # 429s sent (enforced)
    would_reject: int = 0  # REJECT decisions, enforced or not (shadow mode counts them)
    refused: int = 0  # 400s: infeasible requests refused by configuration
    unavailable: int = 0  # no ready replica to forward to
    good: int = 0  # admitted attempts that completed within deadline (and TTFT objective)
    good_in_span: int = 0  # ... of which finished while jobs were still arriving
    completed: int = 0  # admitted attempts that finished at an engine (on time or not)
    abandoned: int = 0  # admitted attempts whose client gave up first
    jobs_good: int = 0
    jobs_shed: int = 0  # jobs that gave up after 429s
    jobs_failed: int = 0  # jobs that gave up after timeouts (or 400s)
    latencies_s: list[float] = field(default_factory=list, repr=False)
    ttfts_s: list[float] = field(default_factory=list, repr=False)
    gpu_s: float = 0.0
    gpu_wasted_s: float = 0.0
    queue_delay_s: float = 0.0
    replica_s: float = 0.0
    ready_replica_s: float = 0.0
    idle_replica_s: float = 0.0
    refused_idle_s: int = 0  # seconds of the span with a 429 of a request that would have
    # made it alone (``feasible_alone``) on the replica it would have gone to, idle then
    held_idle_s: int = 0  # ... with a request held after a pass while a ready replica was idle
    peak_replicas: int = 0
    final_replicas: int = 0
    events: int = 0
    series: Series = field(default_factory=Series, repr=False)
    groups: dict[str, Tally] = field(default_factory=dict)  # per priority and tenant group

    def tally(self, group: str) -> Tally:
        tally = self.groups.get(group)
        if tally is None:
            tally = self.groups[group] = Tally()
        return tally

    # ---- derived figures (see docs/simulator.md for the definitions) ----
    @property
    def goodput(self) -> float:
        """Completions within deadline per second, over the workload's span (completions
        after the last arrival are left out, so a policy that defers work past the end of the
        workload gains nothing from it)."""
        return self.good_in_span / self.span_s if self.span_s else 0.0

    @property
    def attainment(self) -> float:
        """Share of admitted attempts that met their deadline."""
        return self.good / self.admitted if self.admitted else 1.0

    @property
    def reject_share(self) -> float:
        return self.rejected / self.attempts if self.attempts else 0.0

    @property
    def shed_share(self) -> float:
        return self.jobs_shed / self.jobs if self.jobs else 0.0

    def latency(self, q: float) -> float:
        return quantile(self.latencies_s, q)

    def ttft(self, q: float) -> float:
        return quantile(self.ttfts_s, q)

    def summary(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario, "policy": self.policy, "span_s": round(self.span_s, 1),
            "jobs": self.jobs, "attempts": self.attempts,
            "goodput_rps": round(self.goodput, 4), "good": self.good,
            "attainment": round(self.attainment, 5), "admitted": self.admitted,
            "rejected": self.rejected, "reject_share": round(self.reject_share, 5),
            "would_reject": self.would_reject, "refused": self.refused,
            "unavailable": self.unavailable,
            "jobs_good": self.jobs_good, "jobs_shed": self.jobs_shed,
            "jobs_failed": self.jobs_failed, "shed_share": round(self.shed_share, 5),
            "completed": self.completed, "abandoned": self.abandoned,
            "latency_s": {f"p{q}": _round(self.latency(q / 100)) for q in (50, 95, 99)},
            "ttft_s": {f"p{q}": _round(self.ttft(q / 100)) for q in (50, 95, 99)},
            "gpu_s": round(self.gpu_s, 1), "gpu_wasted_s": round(self.gpu_wasted_s, 1),
            "queue_delay_min": round(self.queue_delay_s / 60, 2),
            "replica_min": round(self.replica_s / 60, 2),
            "ready_replica_min": round(self.ready_replica_s / 60, 2),
            "idle_replica_min": round(self.idle_replica_s / 60, 2),
            "refused_idle_s": self.refused_idle_s, "held_idle_s": self.held_idle_s,
            "peak_replicas": self.peak_replicas, "final_replicas": self.final_replicas,
            "events": self.events,
            "groups": {g: {"attempts": t.attempts, "admitted": t.admitted,
                           "rejected": t.rejected, "good": t.good,
                           "goodput_rps": round(t.good_in_span / self.span_s, 4)
                           if self.span_s else 0.0,
                           "attainment": round(t.attainment, 5)}
                       for g, t in sorted(self.groups.items())},
        }


def _round(x: float) -> float | None:
    return None if math.isinf(x) or math.isnan(x) else round(x, 3)


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the nearest rank; NaN when there are none)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
