"""Replica recommenders for the simulated fleet: what the autoscaler would ask for.

Every ``period_s`` the fleet hands a recommender an ``Observation`` of the last window (what a
controller could scrape: Prometheus counters and gauges of the gateway and the engines) and
asks for a desired replica count. The fleet then starts replicas (ready only after the
provisioning delay), cancels ones still starting, or drains ready ones (a draining replica
takes no new work and leaves once idle).

A recommender is one method, ``recommend(obs) -> int``: plug any policy in. The gateway's own
recommender (``extproc.autoscale``) reads a ``Window`` that maps field for field:
``arrivals``, ``admitted``, ``rejected``, ``departures = completed``, ``oldest_age_s =
oldest_inflight_s``, ``queue_depth = waiting``, ``ready``, ``starting``, ``draining``,
``utilization``, ``duration_s = window_s``, ``now = now_s``. Two ship here:

- ``Fixed``: never scales (the capacity of a static pool);
- ``HpaUtilization``: the Kubernetes HPA on a GPU-utilization metric, the incident's baseline:
  ``desired = ceil(load / target)`` with ``load`` the window's work in replica-equivalents
  (the sum of the replicas' utilizations; a replica that turned ready mid-window counts for its
  ready time only, as HPA counts a pod without metrics at 0% when scaling up), unchanged while
  ``load / (ready x target)`` is within the tolerance of 1; starting replicas count as already
  requested; scale-up at most ``max_step`` x per period; scale-down only to the highest
  recommendation of the last ``scale_down_window_s`` (HPA's stabilization window).

``utilization`` is throughput utilization: the work the ready replicas did in the window
(prefill time plus each generated token at its full-batch cost) over their time, the share of
their full-batch token throughput in use, like a DCGM tensor-activity gauge. It is linear in
load. The observation also carries ``busy`` (nvidia-smi's "a kernel was running": 100% at any
batch size) and ``occupancy`` (``running / max_running``, far from linear: smaller batches step
faster), for recommenders that want them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Observation:
    """One control window, as a controller outside the engines could measure it."""

    now_s: float
    window_s: float
    ready: int
    starting: int
    draining: int
    arrivals: int  # attempts that reached the gateway
    admitted: int  # attempts sent on to the engines (admitted or passed)
    rejected: int  # 429s
    completed: int  # attempts that finished at an engine
    good: int  # completions within their deadline
    load: float  # work done per second, in replicas' worth of full-batch throughput
    utilization: float  # share of the ready replicas' full-batch token throughput in use, 0..1
    occupancy: float  # mean running / max_running over ready replicas, 0..1
    busy: float  # fraction of ready-replica time with at least one running sequence
    waiting: int  # sequences in the engines' FIFO queues now
    oldest_waiting_s: float  # age of the oldest of those (0 when none)
    inflight: int  # requests in the gateway's ledger now
    oldest_inflight_s: float  # age of the oldest admitted-but-unfinished request (0: none)

    @property
    def reject_ratio(self) -> float:
        decided = self.admitted + self.rejected
        return self.rejected / decided if decided else 0.0

    @property
    def departures_per_replica_s(self) -> float:
        return self.completed / self.window_s / self.ready if self.ready and self.window_s else 0.0


class Recommender(Protocol):
    def recommend(self, obs: Observation) -> int: ...


@dataclass
class Fixed:
    replicas: int

    def recommend(self, obs: Observation) -> int:
        return self.replicas


@dataclass
class HpaUtilization:
    target: float = 0.75
    tolerance: float = 0.1
    min_replicas: int = 1
    max_replicas: int = 24
    max_step: float = 2.0
    scale_down_window_s: float = 300.0
    _history: deque[tuple[float, int]] = field(default_factory=deque, repr=False)

    def recommend(self, obs: Observation) -> int:
        requested = obs.ready + obs.starting
        if obs.ready == 0 or abs(obs.load / (obs.ready * self.target) - 1.0) <= self.tolerance:
            raw = requested
        else:
            raw = math.ceil(obs.load / self.target - 1e-9)
            if obs.ready < raw <= requested:
                raw = requested  # what is still starting already covers it
        raw = min(raw, math.ceil(max(requested, 1) * self.max_step))
        raw = max(self.min_replicas, min(self.max_replicas, raw))
        history = self._history
        history.append((obs.now_s, raw))
        while history and history[0][0] < obs.now_s - self.scale_down_window_s:
            history.popleft()
        if raw < requested:  # scale down only as far as the window's highest wish
            return max(raw, min(requested, max(r for _, r in history)))
        return raw
