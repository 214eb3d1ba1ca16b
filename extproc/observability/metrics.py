"""Prometheus metrics of the admission service, on a registry of its own.

Labels stay low-cardinality: pool and class names come from configuration, outcome and reason
from closed enums, mode is enforce or shadow, tenant is a name listed in ``tenant.known``, the
default tenant or ``other``. Nothing derived from a request's content is ever a label.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client import Counter as _Counter
from prometheus_client import Gauge as _Gauge
from prometheus_client import Histogram as _Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from extproc.decision.share import level_of, priority_label, tenant_of
from extproc.gateway.tenant import OTHER

if TYPE_CHECKING:

    from extproc.config import Mode
    from extproc.decision.admission import Snapshot
    from extproc.decision.learning import PoolLearning
    from extproc.fleet.capacity import Replicas
    from extproc.fleet.enginestats import PoolStats
    from extproc.gateway.verdict import Verdict
    from extproc.scaling.autoscale import Recommendation, Window

class _Remembered:
    """``labels(*values)`` remembered by the values as given: prometheus_client keeps each
    child already, but finds it again by converting, checking and locking on every call (~4
    µs; a decision makes about ten). Children are never removed here, so none goes stale."""

    _children: dict[tuple[object, ...], Any]

    def labels(self, *values: object, **named: object) -> Any:
        if named:
            return super().labels(*values, **named)  # type: ignore[misc]
        try:
            return self._children[values]
        except AttributeError:
            self._children = {}
        except KeyError:
            pass
        child = self._children[values] = super().labels(*values)  # type: ignore[misc]
        return child


class Counter(_Remembered, _Counter):
    pass


class Gauge(_Remembered, _Gauge):
    pass


class Histogram(_Remembered, _Histogram):
    pass


_WAIT_BUCKETS = (0.0, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.01, 0.025,
                    0.05, 0.1, 0.5)


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # *_created doubles scrapes
        self.registry = CollectorRegistry()
        self.decisions = Counter(
            "extproc_admission_decisions", "Admission decisions.",
            ["pool", "class", "outcome", "reason", "mode"], registry=self.registry)
        self.inflight_requests = Gauge(
            "extproc_inflight_requests", "Requests recorded in the ledger by this process.",
            ["pool"], registry=self.registry)
        self.predicted_wait = Histogram(
            "extproc_predicted_wait_seconds", "Predicted queue wait at decision time.",
            ["pool", "class"], buckets=_WAIT_BUCKETS, registry=self.registry)
        self.decision_seconds = Histogram(
            "extproc_decision_duration_seconds",
            "Time from a complete request to a verdict (parse, tokenize, ledger, decide).",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.fallthroughs = Counter(
            "extproc_decision_fallthroughs",
            "Decisions that could not be taken as designed: count_wait (a close decision"
            " decided on its estimate's high end: the exact count was too slow), too_late (the"
            " stream ended before we answered: Envoy's message timeout, which forwards the"
            " request unchecked when fail-open, or a client gone), priority_header (the"
            " priority header named no priority: the next source decided), no_headers (a body"
            " came without its headers or the attributes that carry them: passed undecided).",
            ["kind"], registry=self.registry)
        for kind in ("count_wait", "too_late", "priority_header", "no_headers"):
            self.fallthroughs.labels(kind)
        self.prompt_counts = Counter(
            "extproc_prompt_token_counts",
            "How prompts were counted: counted (exactly, before the decision), cached (every"
            " text seen before), estimated (decided on an estimate, counted exactly off the"
            " loop later), awaited (a close decision waited for the exact count off the loop).",
            ["pool", "how"], registry=self.registry)
        self.processor_wait = Histogram(
            "extproc_processor_wait_seconds",
            "From our answer to a request's headers to its body reaching us: the processor's"
            " own queueing delay (gRPC and event loop).",
            buckets=(*_LATENCY_BUCKETS, 1.0, 2.0), registry=self.registry)
        self.outstanding = Gauge(
            "extproc_outstanding_work_seconds",
            "Estimated GPU work owed to in-flight requests, per pool, as this gateway sees it"
            " when scraped: the ledger's newest answer and its own admissions and releases"
            " since.",
            ["pool"], registry=self.registry)

        self.ledger_seconds = Histogram(
            "extproc_ledger_call_duration_seconds",
            "Ledger calls (snapshot, reserve, release, renew, adjust, expire), however they"
            " ended.",
            ["op"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.ledger_errors = Counter(
            "extproc_ledger_errors",
            "Ledger calls that failed: store unreachable, too slow, or refused by the breaker.",
            ["op"], registry=self.registry)
        self.ledger_fallbacks = Counter(
            "extproc_ledger_unavailable_decisions",
            "Decisions made without the ledger, by fault policy (fail_open: on the local"
            " view; fail_closed: refused).", ["pool", "policy"], registry=self.registry)
        self.ledger_breaker_state = Gauge(
            "extproc_ledger_breaker_state",
            "Circuit breaker towards the ledger's store: 0 closed, 1 half-open, 2 open.",
            registry=self.registry)
        self.ledger_up = Gauge(
            "extproc_ledger_up", "1 while the ledger answers its health probe, else 0.",
            registry=self.registry)
        # the autoscaling loop, once per control window (extproc.scaling.control)
        self.reject_ratio = Gauge(
            "extproc_admission_reject_ratio",
            "Rejected / (admitted + rejected) over the last control window.",
            ["pool"], registry=self.registry)
        self.queue_oldest_age = Gauge(
            "extproc_queue_oldest_age_seconds",
            "Age of the oldest admitted request still running (monotonic clock).",
            ["pool", "class"], registry=self.registry)
        self.queue_depth = Gauge(
            "extproc_queue_depth", "Admitted requests beyond the pool's batch slots.",
            ["pool"], registry=self.registry)
        # the requests the gateway holds (extproc.decision.defer): demand, unlike the engines' queue
        self.held = Gauge(
            "extproc_held_requests", "Requests the gateway holds until they fit, per priority.",
            ["pool", "priority"], registry=self.registry)
        self.held_oldest = Gauge(
            "extproc_held_oldest_seconds",
            "How long the longest-held request has waited in the gateway.",
            ["pool"], registry=self.registry)
        self.pool_replicas = Gauge(
            "extproc_pool_replicas", "Replicas by state: ready, starting, draining, unhealthy.",
            ["pool", "state"], registry=self.registry)
        self.desired_replicas = Gauge(
            "extproc_autoscale_desired_replicas", "The replica recommendation.",
            ["pool"], registry=self.registry)
        self.unmet_replicas = Gauge(
            "extproc_autoscale_unmet_replicas", "Replicas wanted above max_replicas.",
            ["pool"], registry=self.registry)
        self.recommendations = Counter(
            "extproc_autoscale_recommendations", "Recommendations, one per control window.",
            ["pool", "direction", "reason", "reading"], registry=self.registry)
        # who is charged (gateway.tenant): tenant is a configured name, the default or "other"
        self.tenant_decisions = Counter(
            "extproc_tenant_decisions", "Admission decisions by the tenant charged.",
            ["pool", "tenant", "outcome"], registry=self.registry)
        # priorities and fair shares (decision.share): a priority is a level's name or number
        self.priority_decisions = Counter(
            "extproc_priority_decisions", "Admission decisions by priority.",
            ["pool", "priority", "outcome", "reason"], registry=self.registry)
        self.group_outstanding = Gauge(
            "extproc_group_outstanding_seconds",
            "Outstanding GPU work of a priority or tenant in the ledger (kind: priority or"
            " tenant; a tenant not in tenant.known is not shown), as of its last decision.",
            ["pool", "kind", "name"], registry=self.registry)
        self.group_share = Gauge(
            "extproc_group_share_ratio",
            "A priority's or tenant's share of the pool's outstanding work, as of its last"
            " decision.", ["pool", "kind", "name"], registry=self.registry)
        self.tenant_fallbacks = Counter(
            "extproc_tenant_fallbacks",
            "Requests charged to the default tenant for want of one: missing, ambiguous"
            " (the tenant header arrived more than once) or invalid.",
            ["why"], registry=self.registry)
        # the engines' own /metrics (extproc.fleet.enginestats), for pools with engine_metrics
        self.engine_waiting = Gauge(
            "extproc_engine_waiting_requests",
            "Requests waiting in the pool's engines, summed over replicas with a fresh scrape.",
            ["pool"], registry=self.registry)
        self.engine_running = Gauge(
            "extproc_engine_running_requests",
            "Requests running in the pool's engines, summed over replicas with a fresh scrape.",
            ["pool"], registry=self.registry)
        self.engine_kv_usage = Gauge(
            "extproc_engine_kv_cache_usage_max",
            "KV-cache usage of the fullest replica with a fresh scrape, 0..1 (NaN when the"
            " engines report none, as TGI).", ["pool"], registry=self.registry)
        self.engine_targets = Gauge(
            "extproc_engine_metrics_targets", "Replicas whose engine metrics are scraped.",
            ["pool"], registry=self.registry)
        self.engine_fresh = Gauge(
            "extproc_engine_metrics_fresh_targets",
            "Replicas with an engine sample younger than max_age_s.",
            ["pool"], registry=self.registry)
        self.engine_stale = Gauge(
            "extproc_engine_metrics_stale",
            "1 while too few replicas have a fresh sample to trust (the correction is off:"
            " stale is not overload), else 0.", ["pool"], registry=self.registry)
        self.engine_correction = Gauge(
            "extproc_engine_correction_requests",
            "Requests the engines hold that the ledger does not know about, added to the"
            " ledger's view at the pool's last decision.", ["pool"], registry=self.registry)
        self.output_tokens_predicted = Gauge(
            "extproc_output_tokens_predicted",
            "Output tokens of the pool's requests as learned (a prior, then the engines'"
            " vllm:request_generation_tokens): kind expected (mean) or long (p99).",
            ["pool", "kind"], registry=self.registry)
        self._learning: dict[str, PoolLearning] = {}
        self.registry.register(_Promises(self._learning))
        self.tls_reloads = Counter(
            "extproc_tls_reloads",
            "Changed certificate files found on the listener: served (ok) or refused.",
            ["result"], registry=self.registry)

    def watch_engines(self, pool: str, latest: Callable[[], PoolStats]) -> None:
        """The pool's engine gauges, read from ``latest()`` when Prometheus scrapes: a
        scraper that stopped shows stale by itself, without a loop to publish it."""
        self.engine_waiting.labels(pool).set_function(lambda: latest().waiting)
        self.engine_running.labels(pool).set_function(lambda: latest().running)
        self.engine_kv_usage.labels(pool).set_function(
            lambda: math.nan if (kv := latest().kv_usage_max) is None else kv)
        self.engine_targets.labels(pool).set_function(lambda: latest().targets)
        self.engine_fresh.labels(pool).set_function(lambda: latest().fresh)
        self.engine_stale.labels(pool).set_function(lambda: int(latest().stale))
        self.engine_correction.labels(pool).set(0)

    def watch_learning(self, pool: str, learning: PoolLearning) -> None:
        """The pool's learned state, read when Prometheus scrapes: its output lengths (the
        mean, the 99th percentile) and each class's promise quantile."""
        lengths = learning.lengths
        self.output_tokens_predicted.labels(pool, "expected").set_function(lengths.mean)
        self.output_tokens_predicted.labels(pool, "long").set_function(
            lambda: lengths.quantile(0.99))
        self._learning[pool] = learning

    def tls_reload(self, ok: bool) -> None:
        self.tls_reloads.labels("ok" if ok else "refused").inc()

    def ledger_breaker(self, state: int) -> None:
        self.ledger_breaker_state.set(int(state))

    def observe(self, verdict: Verdict, mode: Mode, seconds: float) -> None:
        pool = verdict.pool or ""
        service_class = verdict.service_class or ""
        self.decisions.labels(pool, service_class, verdict.outcome.value, verdict.reason.value,
                              mode.value).inc()
        self.decision_seconds.observe(seconds)
        if verdict.decision is not None:
            wait_s = verdict.decision.wait_ms / 1000.0
            self.predicted_wait.labels(pool, service_class).observe(wait_s)
        if verdict.admission is not None:
            self.priority_decisions.labels(pool, priority_label(verdict.admission.priority),
                                           verdict.outcome.value, verdict.reason.value).inc()
        if verdict.tenant is not None:
            self.tenant_decisions.labels(pool, verdict.tenant.label,
                                         verdict.outcome.value).inc()
            if verdict.tenant.fallback is not None:
                self.tenant_fallbacks.labels(verdict.tenant.fallback.value).inc()

    def groups(self, pool: str, snapshot: Snapshot, groups: Sequence[str],
               tenant_label: Callable[[str], str]) -> None:
        """The outstanding work and share of a decision's own groups, from its snapshot."""
        for group in groups:
            level, tenant = level_of(group), tenant_of(group)
            if level is not None:
                kind, name = "priority", priority_label(level)
            elif tenant is not None and (name := tenant_label(tenant)) != OTHER:
                kind = "tenant"
            else:
                continue
            _, work = snapshot.groups.get(group, (0, 0.0))
            self.group_outstanding.labels(pool, kind, name).set(work / 1000.0)
            total = snapshot.outstanding_ms
            self.group_share.labels(pool, kind, name).set(work / total if total else 0.0)

    def inflight(self, pool: str, delta: int) -> None:
        self.inflight_requests.labels(pool).inc(delta)

    def publish_window(self, pool: str, window: Window, rec: Recommendation,
                       ages: Mapping[str, float], replicas: Replicas) -> None:
        decided = window.admitted + window.rejected
        self.reject_ratio.labels(pool).set(window.rejected / decided if decided else 0.0)
        for service_class, age in ages.items():
            self.queue_oldest_age.labels(pool, service_class).set(age)
        self.queue_depth.labels(pool).set(window.queue_depth)
        for state in ("ready", "starting", "draining", "unhealthy"):
            self.pool_replicas.labels(pool, state).set(getattr(replicas, state))
        self.desired_replicas.labels(pool).set(rec.desired)
        self.unmet_replicas.labels(pool).set(rec.unmet)
        self.recommendations.labels(pool, rec.direction.value, rec.reason.value,
                                    rec.reading.value).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Promises:
    """Each pool and class's promise (``extproc.decision.learning.Promise``), read when scraped: the
    quantile admission promises, and the hits and misses that moved it."""

    def __init__(self, learning: Mapping[str, PoolLearning]) -> None:
        self.learning = learning

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        quantile = GaugeMetricFamily(
            "extproc_promise_quantile", "The output-length quantile admission promises each"
            " request, held by feedback on predicted and measured attainment.",
            labels=["pool", "class"])
        level = GaugeMetricFamily(
            "extproc_measured_level_seconds", "Outstanding GPU work per ready replica the pool"
            " was measured to finish in time: admitted within it whatever the model predicts"
            " (extproc/decision/level.py).", labels=["pool"])
        settled = CounterMetricFamily(
            "extproc_promise_settled", "Admitted requests resolved for the promise at their"
            " deadline: completed within it (hit) or not (miss).",
            labels=["pool", "class", "result"])
        for pool, learning in self.learning.items():
            level.add_metric([pool], learning.level.level_ms / 1000.0)
            for service_class, promise in learning.promises.items():
                quantile.add_metric([pool, service_class], promise.quantile)
                settled.add_metric([pool, service_class, "hit"], promise.hits)
                settled.add_metric([pool, service_class, "miss"], promise.misses)
        yield quantile
        yield level
        yield settled
