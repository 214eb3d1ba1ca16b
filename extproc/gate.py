"""The admission service: request in, verdict out, ledger kept honest. No gRPC, no Envoy.

One request's path: ``check(...)`` parses the body, counts tokens, reads the ledger snapshot
and capacity, calls the pure ``decide`` and, when the request will run, reserves its ledger
entry and returns a ``Ticket``. ``settle(ticket)``
releases the entry when the request ends, however it ends.

Leases follow the gateway's liveness, not the request's length. An entry's lease is short
(``ledger.liveness_ms``, 3 s) and the gate's heartbeat (``heartbeat``, every third of it, one
ledger call per pool whatever the load) renews every entry whose request still runs here; a
request that overruns its prediction keeps its entry for as long as it runs. A replica that
dies stops beating, so its entries lapse within ``liveness_ms`` and the sweepers of the
survivors remove them: a crash costs the fleet its requests' capacity for seconds, where a
lease of expected finish + ``lease_grace_ms`` held it for half a minute. The price: a replica
whose event loop stalls longer than ``liveness_ms`` loses its entries until its next beat
records them again.

The server adapter maps the ``Verdict`` to Envoy's answer; nothing here knows about Envoy.

Counting tokens. Texts counted before cost a lookup (``TokenizerCounter``'s cache: a chat turn
pays only for its new message). New text up to ``ESTIMATE_CHARS`` is counted on the event loop
(about 2.5 ms at the limit). Longer new text (a long prompt never seen: 8,000 tokens take ~20
ms to count) is priced by the pool's ``Calibration`` instead, and the decision is taken at once
when it comes out the same at the estimate's low and high ends (``margin``) on the local view
of the ledger; only a close decision waits for the exact count, on the gate's counting thread
(``encode_batch_fast`` releases the GIL), and for at most ``COUNT_WAIT_S``: a thread behind on
a burst of long cold prompts would otherwise hold decisions past Envoy's message timeout (which
forwards the request unchecked when fail-open). Past it the decision is taken on the estimate's
high end, the conservative one, and counted
(``extproc_decision_fallthroughs_total{kind="count_wait"}``). An admission made on an estimate
is counted exactly on that thread afterwards, and its ledger entry's charge is set to the exact
cost (``adjust``), so the ledger ends exact; the calibration learns from every exact count. One
thread: on a small machine a pool of tokenizing threads starves the loop that answers Envoy.
That thread counts ~45 prompts of 8,000 tokens a second; when long cold prompts come faster, at
most ``MAX_PENDING_COUNTS`` corrections wait for it and the others keep their estimate (the
calibration has learned from the counted ones), so neither memory nor a close decision's wait
for the thread grows with the backlog.

Engine signals. For a pool with ``engine_metrics``, what ``decide`` sees is the ledger's
snapshot plus the work the engines report that the ledger does not know about (traffic that
bypassed this gateway, other gateways' in-process ledgers): ``extproc.enginestats`` has the
formula. The engines' view is read once per decision (``EngineStats.latest``, a walk over the
pool's last samples); a stale one adds nothing. The ledger and the local view stay
uncorrected: the correction changes what is decided, never what is recorded.

Output lengths. Every cost carries the pool's output-length prediction from one predictor per
pool (``predictor``). For a pool with ``engine_metrics`` and ``learn_output_lengths`` it is an
``Observed`` fed by each scrape round's increase of the engines' generation-token histogram
and decayed once a round (``decay_factor`` of ``interval_s``); until it has seen enough
outputs, and on engines without the histogram (TGI), the configured prediction applies.

The ledger may be shared (Redis) and may fail. A decision's ledger calls (snapshot, then the
atomic reserve against the decision's ``ceiling_ms``) together get ``decision_deadline_ms``.
If another gateway took the room between our snapshot and our reserve, the ledger refuses and
the request is decided again on a fresh snapshot (``RESERVE_ATTEMPTS`` in all). When the ledger
is unavailable (``LedgerUnavailable``, or the deadline passed) the configured policy decides:

- ``fail_open``: decide by the local view, the last snapshot the ledger gave for the pool moved
  by this process's own admissions and completions since. Other gateways' work since then is
  unseen, so over-admission is bounded by what they admit during the outage. An admitted
  request keeps a ticket; it is recorded in the ledger as soon as the ledger answers.
- ``fail_closed``: refuse with 429 ``ledger_unavailable`` (the Retry-After minimum).

Both are counted (``extproc_ledger_unavailable_decisions_total``) and logged once per outage,
never with request content. Renewals and releases never fail a request: a heartbeat that finds
an entry gone (its lease lapsed during an outage, a failover lost it, it was never recorded)
records it again, because the request is demonstrably still running; a release the ledger did
not take is retried (release is idempotent by id), and the lease ends it anyway.

Recovery is reconciled before it is used (``reconcile``): the first decision that finds the
ledger answering again first applies the releases it missed and records the requests admitted
without it, then reads the snapshot it decides on. Deciding first would count the outage's
admissions nowhere and its completions still, and let a burst through on a ledger that shows
less than is running; reconciled, in-flight exceeds the slots by at most what the outage
admitted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from extproc import decisionlog
from extproc.admission import Decision, Outcome, Reason, Snapshot
from extproc.capacity import CapacitySource
from extproc.config import Config, Mode, OnUnavailable, Pool, Route, TracingConfig
from extproc.enginestats import Bucket, Correction, EngineStats, PoolStats, correction
from extproc.errors import BadRequest, LedgerUnavailable, RequestError
from extproc.estimate import Calibration, TokenCounter, counter_for, prompt_tokens
from extproc.learning import PoolLearning, learning_for
from extproc.ledger import Entry, Ledger
from extproc.lengths import decay_factor
from extproc.metrics import Metrics
from extproc.request import InferenceRequest, parse
from extproc.share import parse_priority, priority_label
from extproc.step import (
    NO_CORRECTION,
    Admission,
    Ask,
    admit,
    charge_of,
    kv_of,
    priority_of,
    running_of,
)
from extproc.telemetry import DecisionSpan, Tracing
from extproc.tenant import Tenant, Tenants

if TYPE_CHECKING:
    from extproc.control import Control

log = logging.getLogger(__name__)

ESTIMATE_CHARS = 8 * 1024  # new prompt text longer than this is estimated (docstring)
MAX_PENDING_COUNTS = 8  # exact counts queued for the counting thread; beyond, estimates stay
COUNT_WAIT_S = 0.25  # the most a close decision waits for its exact count (docstring)
RESERVE_ATTEMPTS = 3  # decisions per request when other gateways keep taking the room
HEARTBEATS_PER_LEASE = 3  # a lease survives two lost heartbeats
RECORD_BATCH = 32  # entries recorded again concurrently after the ledger lost them
MAX_DEFERRED_RELEASES = 100_000  # beyond this, a lost release is left to its lease
T = TypeVar("T")


@dataclass
class Ticket:
    """A reserved ledger entry; ``Gate.settle`` must be called exactly once for it."""

    request_id: str
    pool: str
    service_class: str
    lease_ms: float
    cost_ms: float = 0.0  # its ledger charge
    kv_tokens: int = 0  # the KV tokens its ledger entry holds
    groups: tuple[str, ...] = ()  # ... and the groups it counts in (priority, tenant)
    recorded: bool = True  # False when admitted while the ledger was unavailable
    settled: bool = False  # set by ``Gate.settle``: the heartbeat stops renewing it
    correction: asyncio.Task[None] | None = field(default=None, repr=False)  # exact count
    log: decisionlog.Pending | None = field(default=None, repr=False)  # its decision log line
    started: float = 0.0  # the gate's clock at admission
    deadline_s: float = math.inf  # its deadline (the promise's feedback)
    batch: bool = False  # its class is a batch class
    unavoidable: float = 0.0  # the step's: chance it misses even alone
    ttft_ms: float = 0.0  # its decision's predicted first token ...
    step_ms: float = 0.0  # ... and decode step (its class's lengths learn from them)


@dataclass(frozen=True)
class _Uncounted:
    """Prompt text a decision priced by estimate: what its exact count is still owed on."""

    texts: list[str] = field(repr=False)
    chars: int
    known: int  # tokens of the request's texts counted before
    counting: asyncio.Future[int] | None = field(default=None, repr=False)  # already begun


@dataclass
class _View:
    """One pool's local view: the ledger's last snapshot, plus this process's own admissions
    and minus its own completions since. The decision's input while the ledger is away."""

    base: Snapshot = field(default_factory=lambda: Snapshot(inflight=0, outstanding_ms=0.0))
    inflight: int = 0
    outstanding_ms: float = 0.0
    kv_tokens: int = 0

    def snapshot(self) -> Snapshot:
        return Snapshot(inflight=max(0, self.base.inflight + self.inflight),
                        outstanding_ms=max(0.0, self.base.outstanding_ms + self.outstanding_ms),
                        kv_tokens=max(0, self.base.kv_tokens + self.kv_tokens))


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: Reason
    pool: str | None = None
    service_class: str | None = None
    decision: Decision | None = None
    error: RequestError | None = None
    ticket: Ticket | None = None
    enforced: bool = True  # False in shadow mode: the request continues whatever the outcome
    prompt_tokens: int = 0
    output_tokens: int = 0  # output charged
    trace: Mapping[str, Any] | None = None  # span attributes known only here (when tracing)
    tenant: Tenant | None = None  # who is charged (extproc.tenant); None: attribution off
    admission: Admission | None = None  # the step's answer, when it decided

    @property
    def blocks(self) -> bool:
        """True when the request must be answered by us instead of reaching the backend."""
        return self.enforced and self.outcome in (Outcome.REJECT, Outcome.INVALID, Outcome.ERROR)


class Gate:
    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        capacity: CapacitySource,
        metrics: Metrics,
        *,
        counters: Mapping[str, TokenCounter] | None = None,
        engines: Mapping[str, EngineStats] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.engines = dict(engines or {})  # pool name -> its engines' scraper (started elsewhere)
        self.ledger = ledger
        self.capacity = capacity
        self.metrics = metrics
        self._clock = clock
        self._counters = dict(counters) if counters is not None else {
            p.name: counter_for(p) for p in config.pools
        }
        self._views: dict[str, _View] = {}
        self._labels = Tenants(config.tenant)  # tenant names -> bounded metric labels
        self._counting = concurrent.futures.ThreadPoolExecutor(1, "extproc-count")
        self._pending_counts = 0  # corrections waiting for or running on that thread
        self._calibrations = {p.name: Calibration(p.bytes_per_token) for p in config.pools}
        self.learning: dict[str, PoolLearning] = {p.name: learning_for(p) for p in config.pools}
        self._learns_lengths: set[str] = set()  # pools fed by their engines' histogram
        self._forgotten_at = self._clock()
        self._reported: dict[tuple[str, int, int], Pool] = {}  # pools with engines' KV sizes
        for pool in config.pools:
            settings, stats = pool.engine_metrics, self.engines.get(pool.name)
            if settings is not None and settings.learn_output_lengths and stats is not None:
                self._learns_lengths.add(pool.name)
                stats.on_lengths = self.learn_lengths
            metrics.watch_learning(pool.name, self.learning[pool.name])
        self.control: Control | None = None  # the autoscaling loop counts what we decide
        self.tracing: Tracing = Tracing(TracingConfig())  # off unless the service sets it
        self.decision_log = (decisionlog.DecisionLog(config.decision_log)
                             if config.decision_log else None)
        self._deferred: dict[str, str] = {}  # request id -> pool: releases to retry
        self._live: dict[str, Ticket] = {}  # request id -> ticket: what the heartbeat renews
        self._unrecorded: set[str] = set()  # live tickets admitted while the ledger was away
        self._reconciling = asyncio.Lock()
        self._unreachable = False  # the last ledger call failed
        self._stale = False  # the ledger came back and our entries are not renewed yet
        self._back_at = -math.inf  # the gate's clock when the ledger last came back
        self._down_since: float | None = None  # the ledger has been unavailable since
        self._down_decisions = 0
        for pool in config.pools:
            if not self._counters[pool.name].exact:
                log.warning("pool %s has no tokenizer: prompt tokens are estimated at %.1f bytes"
                            " per token", pool.name, pool.bytes_per_token)

    def learn_lengths(self, pool: str, finished: Sequence[Bucket]) -> None:
        """One scrape round of the pool's engines: the outputs that finished since the last
        round (``EngineStats.on_lengths``)."""
        if pool not in self._learns_lengths:
            return
        lengths = self.learning[pool].lengths
        for low, high, count in finished:
            lengths.observe_bucket(low, high, count)

    def forget(self) -> None:
        """Decay what the pools learned by the time since the last call (``decay_factor``:
        the same memory in seconds however often it is called; the sweeper calls it)."""
        now = self._clock()
        factor = decay_factor(max(0.0, now - self._forgotten_at))
        self._forgotten_at = now
        for learning in self.learning.values():
            learning.decay(factor)
            learning.resolve(now)  # the requests whose deadline came, while none asks

    def _as_reported(self, pool: Pool, engines: PoolStats | None) -> Pool:
        """The pool with the KV cache its engines report (``vllm:cache_config_info``, the
        smallest fresh replica's) instead of the configured one: vLLM sizes its cache at
        start from the memory left, so what it says beats what was written down."""
        if engines is None or engines.stale or engines.kv_blocks is None:
            return pool
        blocks, size = engines.kv_blocks
        if (blocks, size) == (pool.engine.num_gpu_blocks, pool.engine.block_size):
            return pool
        key = (pool.name, blocks, size)
        seen = self._reported.get(key)
        if seen is None:
            engine = dataclasses.replace(pool.engine, num_gpu_blocks=blocks, block_size=size)
            seen = self._reported[key] = dataclasses.replace(pool, engine=engine)
        return seen

    def deadline(self, headers: Mapping[str, str]) -> float | None:
        """The client's deadline header in ms (it can only tighten the class deadline)."""
        raw = headers.get(self.config.deadline_header)
        if raw is None:
            return None
        try:
            asked = float(raw)
        except ValueError:
            asked = float("nan")
        if not asked > 0 or asked == float("inf"):
            raise BadRequest(f"header {self.config.deadline_header} must be a positive"
                             " number of milliseconds")
        return asked

    async def check(self, route: Route, path: str, headers: Mapping[str, str],
                    body: bytes, trace: Mapping[str, str] | None = None,
                    tenant: Tenant | None = None) -> Verdict:
        """Decide one request. ``trace``: the gRPC call's W3C trace context (Envoy's span);
        ``tenant``: who is charged, as the server resolved it from what Envoy vouches for."""
        with self.tracing.span(trace or {}, headers) as span:
            started = time.perf_counter()
            verdict = await self._check(route, path, headers, body, tenant)
            if verdict.tenant is not tenant:  # a refusal before the decision
                verdict = dataclasses.replace(verdict, tenant=tenant)
            elapsed = time.perf_counter() - started
            self.metrics.observe(verdict, self.config.mode, elapsed)
            if self.control is not None:
                self.control.decided(verdict)
            if self.tracing.enabled:
                _annotate(span, verdict, elapsed, self.config.mode.value)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("decision", extra={
                    "pool": verdict.pool, "class": verdict.service_class,
                    "outcome": verdict.outcome.value, "reason": verdict.reason.value,
                    "prompt_tokens": verdict.prompt_tokens,
                    "decision_ms": round(elapsed * 1000.0, 3)})
        return verdict

    async def _check(self, route: Route, path: str, headers: Mapping[str, str],
                     body: bytes, tenant: Tenant | None = None) -> Verdict:
        cls = route.service_class
        try:
            deadline = self.deadline(headers)
            request = parse(route.api, body, path=path)
        except RequestError as exc:
            return self._refuse(exc, None, cls)
        pool = self.config.pool_for(request.model)
        if pool is None:
            return Verdict(Outcome.PASS, Reason.UNMANAGED, service_class=cls)
        replicas = self.capacity.capacity(pool.name).replicas
        stats = self.engines.get(pool.name)
        engines = stats.latest(pool.name) if stats is not None else None  # once per decision
        pool = self._as_reported(pool, engines)
        try:
            ask, uncounted = await self._ask(request, pool, cls, deadline, replicas, engines)
        except RequestError as exc:
            return self._refuse(exc, pool.name, cls)
        who = tenant.name if tenant is not None else None
        ask = dataclasses.replace(ask, tenant=who, priority=priority_of(
            self.config, cls, who, self._stated_priority(headers)))
        self.learning[pool.name].arrived(cls, self.config.classes[cls].batch, self._clock(),
                                         ask.prompt_tokens, ask.groups)
        started = time.perf_counter()
        verdict = await self._admit(pool, ask, replicas, engines)
        if (uncounted is not None and verdict.ticket is not None
                and self._pending_counts < MAX_PENDING_COUNTS):
            self._pending_counts += 1
            verdict.ticket.correction = asyncio.create_task(
                self._correct(verdict.ticket, request, pool, uncounted, ask, replicas))
        if self.tracing.enabled:
            verdict = dataclasses.replace(verdict, trace={
                "model": request.model, "max_tokens": request.max_tokens,
                "stream": request.stream,
                "ledger_ms": round((time.perf_counter() - started) * 1000.0, 3),
                "capacity_replicas": replicas})
        if tenant is not None:
            verdict = dataclasses.replace(verdict, tenant=tenant)
        if self.decision_log is not None:
            self._log_decision(verdict)
        return verdict

    def _log_decision(self, verdict: Verdict) -> None:
        """One line for ``extproc replay`` (``extproc.decisionlog``): written now, or when the
        request's stream ends if it runs (the line then carries its measured duration)."""
        assert self.decision_log is not None and verdict.admission is not None
        adm = verdict.admission
        d = adm.decision
        record = decisionlog.Record(
            time.time(), verdict.pool or "", verdict.service_class or "",
            adm.cost.prompt_tokens, adm.cost.output_tokens, adm.policy.deadline_ms,
            verdict.outcome.value, verdict.reason.value, self.config.mode.value,
            d.completion_ms if d else None, d.wait_ms if d else None,
            tenant=verdict.tenant.name if verdict.tenant is not None else None,
            promised_tokens=round(adm.cost.promised, 1), priority=adm.priority)
        if verdict.ticket is not None:
            verdict.ticket.log = decisionlog.Pending(record, self._clock())
        else:
            self.decision_log.write(record)

    def _tenant_label(self, name: str) -> str:
        return self._labels.label(name)

    def _stated_priority(self, headers: Mapping[str, str]) -> int | None:
        """The priority the header Envoy sets names (``priority.header``), if any: a value
        that names none is counted and ignored."""
        name = self.config.priority.header
        if name is None or name not in headers:
            return None
        level = parse_priority(headers[name])
        if level is None:
            self.metrics.fallthroughs.labels("priority_header").inc()
        return level

    async def _admit(self, pool: Pool, ask: Ask, replicas: int,
                     engines: PoolStats | None = None) -> Verdict:
        """Decide on the ledger's snapshot and record atomically, within the deadline; apply
        the fault policy when the ledger does not answer (module docstring)."""
        request_id = uuid.uuid4().hex
        sent = False  # a reserve went out: it may have landed even if no answer came back
        learning = self.learning[pool.name]
        try:
            async with asyncio.timeout(self.config.ledger.decision_deadline_ms / 1000.0):
                if self.owed():
                    await self.reconcile()
                for _ in range(RESERVE_ATTEMPTS):
                    snapshot = await self._ledger("snapshot", self.ledger.snapshot(pool.name))
                    self._views[pool.name] = _View(snapshot)
                    self._ledger_back()
                    self.metrics.outstanding.labels(pool.name).set(
                        snapshot.outstanding_ms / 1000.0)
                    self.metrics.groups(pool.name, snapshot, ask.groups, self._tenant_label)
                    fix = self._correction(pool, snapshot, engines)
                    verdict = self._verdict(admit(ask, pool, self.config, learning, snapshot,
                                                  replicas, self._clock(), fix), pool.name)
                    if verdict.blocks:
                        return verdict
                    entry = self._entry(request_id, pool.name, verdict)
                    # Shadow mode and infeasible-but-passed requests run whatever the ledger
                    # holds: they are recorded without a ceiling.
                    assert verdict.admission is not None
                    enforced = verdict.enforced
                    ceiling = verdict.admission.ceiling_ms if enforced else None
                    most = verdict.admission.max_inflight if enforced else None
                    caps = verdict.admission.caps if enforced else ()
                    sent = True
                    if await self._ledger("reserve", self.ledger.reserve(entry, ceiling, most,
                                                                         caps)):
                        return dataclasses.replace(verdict,
                                                   ticket=self._ticket(entry, verdict))
                    # Refused: another gateway took the room since our snapshot. Again.
                return _contended(verdict)
        except (LedgerUnavailable, TimeoutError) as exc:
            return self._unavailable(exc, request_id if sent else None, pool, ask, replicas,
                                     engines)
        except asyncio.CancelledError:
            if sent:  # the stream went away mid-decision: undo a reserve that may have landed
                self._defer_release(request_id, pool.name)
            raise

    def _verdict(self, adm: Admission, pool: str) -> Verdict:
        return Verdict(adm.outcome, adm.reason, pool, adm.service_class, adm.decision,
                       error=adm.error, enforced=self.config.mode is Mode.ENFORCE,
                       prompt_tokens=adm.cost.prompt_tokens,
                       output_tokens=adm.cost.output_tokens, admission=adm)

    def _unavailable(self, exc: Exception, sent: str | None, pool: Pool, ask: Ask,
                     replicas: int, engines: PoolStats | None) -> Verdict:
        """The fault policy. The decision is always made on the local view (fail-closed
        keeps it only for metrics and the Retry-After hint, and for shadow mode)."""
        on_unavailable = self.config.ledger.on_unavailable
        self._ledger_away(exc, on_unavailable)
        self.metrics.ledger_fallbacks.labels(pool.name, on_unavailable.value).inc()
        local = self._views.setdefault(pool.name, _View()).snapshot()
        fix = self._correction(pool, local, engines)
        verdict = self._verdict(admit(ask, pool, self.config, self.learning[pool.name], local,
                                      replicas, self._clock(), fix), pool.name)
        if on_unavailable is OnUnavailable.FAIL_CLOSED and verdict.outcome is not Outcome.INVALID:
            # Fail-closed: we cannot record the request, so we do not let it run.
            verdict = dataclasses.replace(verdict, outcome=Outcome.REJECT,
                                          reason=Reason.LEDGER_UNAVAILABLE)
        if verdict.blocks:
            if sent is not None:
                self._defer_release(sent, pool.name)
            return verdict
        # Fail-open (or shadow mode): it runs, so it is counted locally and recorded later.
        entry = self._entry(sent or uuid.uuid4().hex, pool.name, verdict)
        return dataclasses.replace(verdict, ticket=self._ticket(entry, verdict, recorded=False))

    def _ledger_away(self, exc: Exception, on_unavailable: OnUnavailable) -> None:
        self._unreachable = True  # also when the decision's deadline cut a call short
        self._down_decisions += 1
        if self._down_since is None:
            self._down_since = time.monotonic()
            why = str(exc) or (f"no answer within decision_deadline_ms"
                               f" ({self.config.ledger.decision_deadline_ms:g} ms)")
            log.warning("ledger unavailable: deciding %s until it answers again (%s)",
                        on_unavailable.value, why)

    def _ledger_back(self) -> None:
        if self._down_since is not None:
            log.warning("ledger available again after %.1f s; %d decisions were made without"
                        " it", time.monotonic() - self._down_since, self._down_decisions)
            self._down_since = None
            self._down_decisions = 0

    async def _ledger(self, op: str, call: Awaitable[T]) -> T:
        """One ledger call, timed; a failure is counted and re-raised. The first success
        after a failure marks the ledger as back (``reconcile``, ``sweep``)."""
        started = time.perf_counter()
        try:
            result = await call
        except LedgerUnavailable:
            self.metrics.ledger_errors.labels(op).inc()
            self._unreachable = True
            raise
        else:
            if self._unreachable:
                self._unreachable = False
                self._stale = True
                self._back_at = self._clock()
            return result
        finally:
            self.metrics.ledger_seconds.labels(op).observe(time.perf_counter() - started)

    def refuse(self, error: RequestError, service_class: str,
               tenant: Tenant | None = None) -> Verdict:
        """A verdict for a request refused before it could be checked (e.g. too large)."""
        verdict = dataclasses.replace(self._refuse(error, None, service_class), tenant=tenant)
        self.metrics.observe(verdict, self.config.mode, 0.0)
        return verdict

    def shed(self, service_class: str, tenant: Tenant | None = None) -> Verdict:
        """A 429 without a decision: the processor itself is behind (``extproc.server``)."""
        verdict = Verdict(Outcome.REJECT, Reason.PROCESSOR_OVERLOADED,
                          service_class=service_class, tenant=tenant,
                          enforced=self.config.mode is Mode.ENFORCE)
        self.metrics.observe(verdict, self.config.mode, 0.0)
        return verdict

    def _refuse(self, error: RequestError, pool: str | None, cls: str) -> Verdict:
        reason = {413: Reason.BODY_TOO_LARGE, 415: Reason.UNSUPPORTED_MEDIA}.get(
            error.status, Reason.BAD_REQUEST)
        return Verdict(Outcome.INVALID, reason, pool, cls, error=error,
                       enforced=True)


    def _ask_for(self, request: InferenceRequest, pool: Pool, cls: str,
                 deadline: float | None, text_tokens: int) -> Ask:
        return Ask(cls, prompt_tokens(request, pool, text_tokens), request.max_tokens,
                   request.choices, deadline, request.prefill_only)

    async def _ask(self, request: InferenceRequest, pool: Pool, cls: str,
                   deadline: float | None, replicas: int, engines: PoolStats | None = None,
                   ) -> tuple[Ask, _Uncounted | None]:
        """The request's ask, its prompt counted exactly or (long new text, decision not
        close) estimated; then also what is still to count (module docstring)."""
        counter = self._counters[pool.name]
        known, missing = counter.cached(request.texts)
        chars = sum(len(t) for t in missing)
        if not missing or not counter.exact or chars <= ESTIMATE_CHARS:
            how = "counted" if missing else "cached"
            self.metrics.prompt_counts.labels(pool.name, how).inc()
            text = known + counter.count(missing)
            return self._ask_for(request, pool, cls, deadline, text), None
        calibration = self._calibrations[pool.name]
        guess = calibration.estimate(chars)
        estimated = self._ask_for(request, pool, cls, deadline, known + guess)
        low, high = (self._ask_for(request, pool, cls, deadline,
                                   known + round(guess * (1.0 + m)))
                     for m in (-calibration.margin, calibration.margin))
        local = self._views.get(pool.name, _View()).snapshot()
        fix = self._correction(pool, local, engines)
        now, learning = self._clock(), self.learning[pool.name]
        a, b = (admit(x, pool, self.config, learning, local, replicas, now, fix)
                for x in (low, high))
        if (a.outcome, a.reason) == (b.outcome, b.reason):
            self.metrics.prompt_counts.labels(pool.name, "estimated").inc()
            return estimated, _Uncounted(missing, chars, known)
        self.metrics.prompt_counts.labels(pool.name, "awaited").inc()
        counting = asyncio.get_running_loop().run_in_executor(
            self._counting, counter.count, missing)
        try:
            tokens = await asyncio.wait_for(asyncio.shield(counting), COUNT_WAIT_S)
        except TimeoutError:
            # The counting thread is behind (long cold prompts arriving faster than it counts):
            # decide now on the estimate's high end, the conservative one; the count corrects
            # the ledger when it comes, as for an estimated prompt.
            self.metrics.fallthroughs.labels("count_wait").inc()
            return high, _Uncounted(missing, chars, known, counting)
        calibration.learn(chars, tokens)
        return self._ask_for(request, pool, cls, deadline, known + tokens), None

    def _correction(self, pool: Pool, snapshot: Snapshot,
                    engines: PoolStats | None) -> Correction:
        """The work the pool's engines hold that the ledger does not know about
        (``extproc.enginestats.correction``; nothing while their scrapes are stale). An unseen
        request is charged the ledger's mean, or the pool's mean request on an empty ledger."""
        settings = pool.engine_metrics
        if engines is None or settings is None:
            return NO_CORRECTION
        mix = self.learning[pool.name].mix()
        fix = correction(snapshot, engines,
                         fallback_request_ms=pool.engine.request_ms(mix.prompt_tokens,
                                                                    mix.output_tokens),
                         tolerance=settings.tolerance, slack=settings.slack)
        self.metrics.engine_correction.labels(pool.name).set(fix.extra_inflight)
        return fix

    async def _correct(self, ticket: Ticket, request: InferenceRequest, pool: Pool,
                       uncounted: _Uncounted, ask: Ask, replicas: int) -> None:
        """Count a prompt admitted on an estimate exactly, off the event loop, and charge its
        ledger entry the exact cost. One ledger call: if the ledger does not answer, the
        estimate stays on the entry (the heartbeat re-records a lost entry at the exact cost)."""
        try:
            tokens = await (uncounted.counting or asyncio.get_running_loop().run_in_executor(
                self._counting, self._counters[pool.name].count, uncounted.texts))
        except RequestError:  # the text cannot be tokenized: the estimate stands
            return
        finally:
            self._pending_counts -= 1
        self._calibrations[pool.name].learn(uncounted.chars, tokens)
        if ticket.settled:
            return
        exact_ask = dataclasses.replace(
            ask, prompt_tokens=prompt_tokens(request, pool, uncounted.known + tokens))
        learning = self.learning[pool.name]
        exact = charge_of(exact_ask, pool, learning, replicas)
        kv = kv_of(exact_ask, pool, learning)
        view = self._views.get(pool.name)
        if view is not None:
            view.outstanding_ms += exact - ticket.cost_ms
            view.kv_tokens += kv - ticket.kv_tokens
        ticket.cost_ms, ticket.kv_tokens = exact, kv
        with contextlib.suppress(LedgerUnavailable):
            await self._ledger("adjust", self.ledger.adjust(ticket.request_id, pool.name, exact,
                                                            kv))

    def _entry(self, request_id: str, pool: str, verdict: Verdict) -> Entry:
        """Every request that reaches the backend is in the ledger, admitted or not (shadow
        mode, infeasible-but-passed): it occupies the GPUs. Its lease: the gateway's liveness
        (module docstring), renewed by the heartbeat while it runs."""
        assert verdict.decision is not None and verdict.admission is not None
        return Entry(request_id, pool, verdict.decision.service_ms,
                     self.config.ledger.liveness_ms, verdict.admission.kv_tokens,
                     verdict.admission.groups)

    def _ticket(self, entry: Entry, verdict: Verdict, *, recorded: bool = True) -> Ticket:
        adm = verdict.admission
        assert adm is not None
        ticket = Ticket(entry.request_id, entry.pool, adm.service_class, entry.lease_ms,
                        cost_ms=entry.cost_ms, kv_tokens=entry.kv_tokens, groups=entry.groups,
                        recorded=recorded,
                        started=self._clock(),
                        deadline_s=adm.policy.deadline_ms / 1000.0, batch=adm.policy.batch,
                        unavoidable=adm.unavoidable,
                        ttft_ms=adm.decision.ttft_ms if adm.decision else 0.0,
                        step_ms=adm.decision.step_ms if adm.decision else 0.0)
        self._live[ticket.request_id] = ticket
        if not recorded:
            self._unrecorded.add(ticket.request_id)
        view = self._views.setdefault(entry.pool, _View())
        view.inflight += 1
        view.outstanding_ms += entry.cost_ms
        view.kv_tokens += entry.kv_tokens
        self.metrics.inflight(entry.pool, +1)
        self.learning[entry.pool].admitted(
            adm.service_class, adm.cost.prompt_tokens, batch=adm.policy.batch,
            expected_s=adm.decision.completion_ms / 1000.0 if adm.decision else 0.0,
            now=self._clock(), prefill_rate=adm.prefill_rate, key=ticket.request_id,
            running=running_of(adm, self._clock()), groups=adm.groups)
        return ticket

    async def heartbeat(self) -> None:
        """Renew the entries of every request running here, one ledger call per pool, and
        record again those the ledger lost (module docstring). Raises ``LedgerUnavailable``;
        the next beat retries."""
        pools: dict[str, list[str]] = {}
        for rid, ticket in self._live.items():
            pools.setdefault(ticket.pool, []).append(rid)
        lease_ms = self.config.ledger.liveness_ms
        for pool, ids in pools.items():
            missing = set(await self._ledger("heartbeat",
                                             self.ledger.heartbeat(pool, ids, lease_ms)))
            lost = []
            for rid in ids:
                live = self._live.get(rid)
                if live is None:
                    continue
                if rid not in missing:
                    self._recorded(live)
                else:
                    lost.append(live)
            await self._record_all(lost)

    async def _record_all(self, tickets: Sequence[Ticket]) -> None:
        """Record many at once, ``RECORD_BATCH`` calls in flight (after a Redis restart every
        running request is lost: one at a time would keep the first decisions waiting)."""
        for i in range(0, len(tickets), RECORD_BATCH):
            await asyncio.gather(*(self._record(t) for t in tickets[i:i + RECORD_BATCH]))

    async def _record(self, ticket: Ticket) -> None:
        """Record a running request's entry again (no ceiling: it runs whatever the ledger
        holds). A release that raced with it is applied again afterwards."""
        await self._ledger("reserve", self.ledger.reserve(Entry(
            ticket.request_id, ticket.pool, ticket.cost_ms, self.config.ledger.liveness_ms,
            ticket.kv_tokens, ticket.groups)))
        self._recorded(ticket)
        if ticket.settled:  # it ended while we recorded it: its release may have come first
            await self._ledger("release", self.ledger.release(ticket.request_id, ticket.pool))

    def _recorded(self, ticket: Ticket) -> None:
        ticket.recorded = True
        self._unrecorded.discard(ticket.request_id)

    def owed(self) -> bool:
        """Releases the ledger missed, requests admitted without it, or (the ledger was
        away) entries whose leases may have lapsed meanwhile are waiting. O(1): every
        decision asks."""
        return self._stale or bool(self._deferred) or bool(self._unrecorded)

    async def reconcile(self) -> None:
        """Give the ledger what it missed while away: the releases first (they free room),
        then the requests admitted meanwhile. One caller at a time; the others wait for it
        and find nothing left to do. Raises ``LedgerUnavailable``; what was done stays done."""
        async with self._reconciling:
            for request_id, pool in list(self._deferred.items()):
                await self._ledger("release", self.ledger.release(request_id, pool))
                self._deferred.pop(request_id, None)
            if self._stale:  # an outage longer than a lease: every entry may have lapsed
                self._stale = False
                try:
                    await self.heartbeat()  # renews ours, records the lapsed and the unrecorded
                except BaseException:
                    self._stale = True
                    raise
            await self._record_all([self._live[rid] for rid in list(self._unrecorded)
                                    if rid in self._live])

    async def settle(self, ticket: Ticket, completed: bool = True) -> None:
        """Release a ticket's entry; shielded, so a cancelled stream still releases.
        ``completed``: the request ended normally (not cancelled, not failed)."""
        ticket.settled = True
        now = self._clock()
        self.learning[ticket.pool].settled(
            ticket.service_class, batch=ticket.batch, seconds=now - ticket.started,
            deadline_s=ticket.deadline_s, completed=completed, unavoidable=ticket.unavoidable,
            now=now, ttft_ms=ticket.ttft_ms, step_ms=ticket.step_ms, key=ticket.request_id,
            groups=ticket.groups)
        if self.control is not None:
            self.control.settled(ticket, completed)
        self._live.pop(ticket.request_id, None)
        self._unrecorded.discard(ticket.request_id)
        if ticket.log is not None and self.decision_log is not None:
            self.decision_log.end(ticket.log, self._clock())
            ticket.log = None
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(self._release(ticket))

    async def _release(self, ticket: Ticket) -> None:
        self.metrics.inflight(ticket.pool, -1)
        view = self._views.get(ticket.pool)
        if view is not None:
            view.inflight -= 1
            view.outstanding_ms -= ticket.cost_ms
            view.kv_tokens -= ticket.kv_tokens
        try:
            await self._ledger("release", self.ledger.release(ticket.request_id, ticket.pool))
        except LedgerUnavailable:
            self._defer_release(ticket.request_id, ticket.pool)

    def _defer_release(self, request_id: str, pool: str) -> None:
        if len(self._deferred) < MAX_DEFERRED_RELEASES:
            self._deferred[request_id] = pool

    async def sweep(self) -> int:
        """Retry releases the ledger did not take, then expire entries whose lease ended (the
        backstop for lost streams). Raises ``LedgerUnavailable``; the next sweep retries. The
        pools' learning forgets a sweep's worth first."""
        self.forget()
        if self.owed():
            await self.reconcile()
        if self._clock() - self._back_at < self.config.ledger.liveness_ms / 1000.0:
            # The ledger was away until moments ago: every gateway's leases ran on while none
            # could renew them. Expiring now would reclaim requests still running behind
            # gateways that have not beaten yet; one lease from now all living ones have.
            return 0
        return await self._ledger("expire", self.ledger.expire())


def _annotate(span: DecisionSpan, verdict: Verdict, seconds: float, mode: str) -> None:
    """The decision's explanation on its span: never prompt text."""
    d = verdict.decision
    span.set(**(verdict.trace or {}))
    span.set(pool=verdict.pool, service_class=verdict.service_class, mode=mode,
             outcome=verdict.outcome.value, reason=verdict.reason.value,
             prompt_tokens=verdict.prompt_tokens or None,
             output_tokens_charged=verdict.output_tokens or None,
             decision_ms=round(seconds * 1000.0, 3))
    if verdict.admission is not None:
        span.set(priority=priority_label(verdict.admission.priority))
    if verdict.tenant is not None:
        span.set(tenant=verdict.tenant.label)
    if d is not None:
        span.set(wait_ms=d.wait_ms, ttft_ms=d.ttft_ms, completion_ms=d.completion_ms,
                 budget_ms=d.budget_ms, service_ms=d.service_ms,
                 retry_after_ms=d.retry_after_ms)


def _contended(verdict: Verdict) -> Verdict:
    """Every reserve was refused: other gateways keep filling the room we saw. A 429."""
    assert verdict.decision is not None
    decision = dataclasses.replace(verdict.decision, outcome=Outcome.REJECT,
                                   reason=Reason.DEADLINE, ceiling_ms=None)
    return dataclasses.replace(verdict, outcome=Outcome.REJECT, reason=Reason.DEADLINE,
                               decision=decision)
