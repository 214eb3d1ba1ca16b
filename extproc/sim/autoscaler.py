"""Replica recommenders for the simulated fleet: what the autoscaler would ask for.

Every ``period_s`` the fleet hands a recommender an ``Observation`` of the last window (what a
controller could scrape: Prometheus counters and gauges of the gateway and the engines) and
asks for a desired replica count. The fleet then starts replicas (ready only after the
provisioning delay), cancels ones still starting, or drains ready ones (a draining replica
takes no new work and leaves once idle).

A recommender is one method, ``recommend(obs) -> int``: plug any policy in. The gateway's own
recommender (``extproc.scaling.autoscale``) reads a ``Window`` that maps field for field:
``arrivals``, ``admitted``, ``rejected``, ``departures = completed``, ``oldest_age_s =
oldest_inflight_s``, ``queue_depth = waiting``, ``ready``, ``starting``, ``draining``,
``utilization``, ``duration_s = window_s``, ``now = now_s``. Three ship here:

- ``Fixed``: never scales (the capacity of a static pool);
- ``HpaUtilization``: the Kubernetes HPA on a GPU-utilization metric, the incident's baseline:
  ``desired = ceil(load / target)`` with ``load`` the window's work in replica-equivalents
  (the sum of the replicas' utilizations; a replica that turned ready mid-window counts for its
  ready time only, as HPA counts a pod without metrics at 0% when scaling up), unchanged while
  ``load / (ready x target)`` is within the tolerance of 1; starting replicas count as already
  requested; scale-up at most ``max_step`` x per period; scale-down only to the highest
  recommendation of the last ``scale_down_window_s`` (HPA's stabilization window);
- ``GatewayRecommender``: the gateway's replica recommender (``extproc.scaling.autoscale``) fed that
  ``Window``; it keeps every recommendation with its time (``log``) so a run can be judged by it.

``make(name, min_replicas=, max_replicas=)`` builds one by name (``AUTOSCALERS``): ``hpa``,
``recommender`` or ``keda`` (``KedaWaiting``, KEDA's Prometheus scaler on the engines'
``vllm:num_requests_waiting``, the queue-depth baseline).

``utilization`` is throughput utilization: the work the ready replicas did in the window
(prefill time plus each generated token at its full-batch cost) over their time, the share of
their full-batch token throughput in use, like a DCGM tensor-activity gauge. It is linear in
load. The observation also carries ``busy`` (nvidia-smi's "a kernel was running": 100% at any
batch size) and ``occupancy`` (``running / max_num_seqs``, far from linear: smaller batches
step faster), for recommenders that want them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from extproc.scaling import autoscale


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
    occupancy: float  # mean running / max_num_seqs over ready replicas, 0..1
    busy: float  # fraction of ready-replica time with at least one running sequence
    waiting: int  # sequences in the engines' FIFO queues now
    oldest_waiting_s: float  # age of the oldest of those (0 when none)
    inflight: int  # requests in the gateway's ledger now
    oldest_inflight_s: float  # age of the oldest admitted-but-unfinished request (0: none)
    held: int = 0  # requests the gateway holds (``decision.defer``): no engine's metric has them

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


def _stabilized(history: deque[tuple[float, int]], now_s: float, raw: int, current: int,
                low: int, high: int, window_s: float) -> int:
    """The HPA's last step, for the HPA and for KEDA (which drives one): the wish clamped to
    the bounds, and a scale-down only as far as the highest wish of the stabilization
    window."""
    raw = max(low, min(high, raw))
    history.append((now_s, raw))
    while history and history[0][0] < now_s - window_s:
        history.popleft()
    if raw < current:
        return max(raw, min(current, max(r for _, r in history)))
    return raw


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
        return _stabilized(self._history, obs.now_s, raw, requested, self.min_replicas,
                           self.max_replicas, self.scale_down_window_s)


@dataclass
class GatewayRecommender:
    """``extproc.scaling.autoscale.Recommender`` behind the simulator's ``recommend(obs) -> int``.

    Replicas the fleet has requested but that are not ready yet are ``starting`` (never
    capacity: the recommender compares its ask with ``ready + starting``); the fleet makes
    them ready ``provisioning_s`` after the ask, as for any recommender."""

    policy: autoscale.ScalingPolicy = field(default_factory=autoscale.ScalingPolicy)
    log: list[tuple[float, autoscale.Recommendation]] = field(default_factory=list,
                                                              repr=False)  # (now_s, rec)

    def __post_init__(self) -> None:
        self._recommender = autoscale.Recommender(self.policy)

    @staticmethod
    def window(obs: Observation) -> autoscale.Window:
        return autoscale.Window(
            now=obs.now_s, duration_s=obs.window_s, arrivals=obs.arrivals,
            admitted=obs.admitted, rejected=obs.rejected, departures=obs.completed,
            oldest_age_s=obs.oldest_inflight_s, queue_depth=obs.waiting,
            held=obs.held, ready=obs.ready,
            starting=obs.starting, draining=obs.draining, utilization=obs.utilization)

    def recommend(self, obs: Observation) -> int:
        rec = self._recommender.observe(self.window(obs))
        self.log.append((obs.now_s, rec))
        return rec.desired


@dataclass
class KedaWaiting:
    """KEDA's Prometheus scaler on ``sum(vllm:num_requests_waiting)`` with an ``AverageValue``
    target, as the HPA that KEDA generates computes it (External metric, ``AverageValue``)::

        usage   = sum of waiting / (target x current)      current = ready + starting
        desired = current                       if |usage - 1| <= tolerance (0.1, HPA's)
                = ceil(sum of waiting / target) otherwise

    then HPA's default scale-up limit (at most ``max(2 x current, current + 4)`` a period:
    its 100% and 4-pod policies, the larger one), its scale-down stabilization (the highest
    recommendation of the last ``scale_down_window_s``, 300 s), and the replica bounds.

    ``target`` 5 is llm-d's number for this signal: the Workload Variant Autoscaler
    (llm-d-incubation/workload-variant-autoscaler, ``docs/saturation-analyzer.md``) calls a
    vLLM replica saturated at ``queueLengthThreshold: 5`` requests in
    ``vllm:num_requests_waiting`` (and 80% KV cache); llm-d's KEDA guide
    (llm-d/llm-d ``docs/architecture/advanced/autoscaling/keda-epp.md``) points at
    ``vllm:num_requests_waiting`` as the vLLM-native signal when the gateway's flow control
    is off, with ``pollingInterval: 15``, scale-up stabilization 0 (100% a period) and a
    300 s scale-down window, the settings here. The signal sees only work that does not fit:
    with every queue empty it asks for ``min_replicas`` (held for the stabilization window)."""

    target: float = 5.0
    tolerance: float = 0.1
    min_replicas: int = 1
    max_replicas: int = 24
    scale_down_window_s: float = 300.0
    _history: deque[tuple[float, int]] = field(default_factory=deque, repr=False)

    def recommend(self, obs: Observation) -> int:
        current = obs.ready + obs.starting
        if current > 0 and abs(obs.waiting / (self.target * current) - 1.0) <= self.tolerance:
            raw = current
        else:
            raw = math.ceil(obs.waiting / self.target - 1e-9)
        raw = min(raw, max(2 * current, current + 4))
        return _stabilized(self._history, obs.now_s, raw, current, self.min_replicas,
                           self.max_replicas, self.scale_down_window_s)


AUTOSCALERS = ("hpa", "recommender", "keda")


def make(name: str, *, min_replicas: int, max_replicas: int) -> Recommender:
    """An autoscaler by name: ``hpa`` (the baseline, utilization target 0.75),
    ``recommender`` (the gateway's, default ``ScalingPolicy`` within the same bounds) or
    ``keda`` (``KedaWaiting``, 5 waiting requests a replica)."""
    if name == "hpa":
        return HpaUtilization(target=0.75, min_replicas=min_replicas, max_replicas=max_replicas)
    if name == "recommender":
        return GatewayRecommender(autoscale.ScalingPolicy(min_replicas=min_replicas,
                                                          max_replicas=max_replicas))
    if name == "keda":
        return KedaWaiting(min_replicas=min_replicas, max_replicas=max_replicas)
    raise ValueError(f"unknown autoscaler {name!r}; choose from {', '.join(AUTOSCALERS)}")
