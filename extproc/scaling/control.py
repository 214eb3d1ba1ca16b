"""The autoscaling loop: what admission saw, per pool and control window, into the recommender.

Every window (``autoscale.window_s``, 15 s by default) each pool's counts — requests offered,
admitted, rejected, completed — and gauges — the age of the oldest eligible admitted request
still running, the local backlog, ready/starting/draining replicas from the capacity source —
become an ``autoscale.Window``; the pool's ``Recommender`` turns it into a recommendation,
which is published as metrics and to KEDA's external scaler.

Queue age is measured at one boundary with one monotonic clock: from this process's admission
decision to the end of the request's stream. Eligible means admitted: shadow-mode rejections
and infeasible-but-passed requests run too, but a deadline was never promised for them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from extproc.decision.admission import Outcome
from extproc.scaling.autoscale import Recommendation, Recommender, ScalingPolicy, Window

if TYPE_CHECKING:
    from extproc.fleet.capacity import CapacitySource
    from extproc.gateway.verdict import Ticket, Verdict
    from extproc.observability.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass
class _Counts:
    arrivals: int = 0
    admitted: int = 0
    rejected: int = 0
    departures: int = 0
    # eligible requests in flight: id -> (class, admitted at); insertion order is age order
    open: dict[str, tuple[str, float]] = field(default_factory=dict)

    def reset(self) -> None:
        self.arrivals = self.admitted = self.rejected = self.departures = 0


class Control:
    """The loop's counts and recommenders; the gate's listener
    (``extproc.gateway.verdict.Listener``): it hears of every verdict (``decided``) and every
    settled ticket (``settled``)."""

    def __init__(self, pools: Mapping[str, ScalingPolicy], capacity: CapacitySource,
                 metrics: Metrics, *, classes: tuple[str, ...] = (), window_s: float = 15.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.classes = classes
        self.metrics = metrics
        self.window_s = window_s
        self._clock = clock
        self._recommenders = {name: Recommender(policy) for name, policy in pools.items()}
        self._counts = {name: _Counts() for name in pools}
        self._window_start = clock()
        self.listeners: list[Callable[[], None]] = []  # called after every tick (KEDA)
        # The requests the gateway holds per pool, and the oldest one's age
        # (extproc.decision.defer): backlog in the window (the gate's ``held``, once built).
        self.held: Callable[[str], tuple[int, float]] = lambda pool: (0, 0.0)

    def decided(self, verdict: Verdict) -> None:
        counts = self._counts.get(verdict.pool or "")
        if counts is None:
            return
        counts.arrivals += 1
        if verdict.outcome is Outcome.ADMIT:
            counts.admitted += 1
            if verdict.ticket is not None:
                counts.open[verdict.ticket.request_id] = (verdict.ticket.service_class,
                                                          self._clock())
        elif verdict.outcome is Outcome.REJECT:
            counts.rejected += 1

    def settled(self, ticket: Ticket, completed: bool) -> None:
        counts = self._counts.get(ticket.pool)
        if counts is None:
            return
        if counts.open.pop(ticket.request_id, None) is not None and completed:
            counts.departures += 1

    def oldest_age_s(self, pool: str, now: float, service_class: str | None = None) -> float:
        for cls, started in self._counts[pool].open.values():
            if service_class is None or cls == service_class:
                return now - started
        return 0.0

    def recommendation(self, pool: str) -> Recommendation | None:
        """The pool's latest recommendation (None before the first window); KeyError if
        the pool is unknown. What KEDA's external scaler serves."""
        return self._recommenders[pool].last

    def window(self, pool: str, now: float) -> Window:
        counts = self._counts[pool]
        replicas = self.capacity.replicas(pool)
        slots = self.capacity.capacity(pool).slots
        stale = math.isinf(self.capacity.staleness(pool))
        held, held_age_s = self.held(pool)
        return Window(
            now=now, duration_s=max(1e-9, now - self._window_start),
            arrivals=counts.arrivals, admitted=counts.admitted, rejected=counts.rejected,
            departures=counts.departures,
            oldest_age_s=max(self.oldest_age_s(pool, now), held_age_s),
            queue_depth=max(0, len(counts.open) - slots), held=held, ready=replicas.ready,
            starting=replicas.starting, draining=replicas.draining, stale=stale,
        )

    def tick(self) -> dict[str, Recommendation]:
        """Close the window: one recommendation per pool, metrics published, counts reset."""
        now = self._clock()
        out: dict[str, Recommendation] = {}
        for pool, recommender in self._recommenders.items():
            window = self.window(pool, now)
            rec = out[pool] = recommender.observe(window)
            self.metrics.publish_window(pool, window, rec, self._class_ages(pool, now),
                                        self.capacity.replicas(pool))
            self._counts[pool].reset()
        self._window_start = now
        for listener in self.listeners:
            listener()
        return out

    def _class_ages(self, pool: str, now: float) -> dict[str, float]:
        ages = dict.fromkeys(self.classes, 0.0)
        for cls, started in reversed(self._counts[pool].open.values()):
            ages[cls] = now - started  # reversed: the oldest of each class is written last
        return ages

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.window_s)
            try:
                self.tick()
            except Exception:
                log.exception("autoscaling window failed")

