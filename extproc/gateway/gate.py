"""The admission service: request in, verdict out, ledger kept honest. No gRPC, no Envoy.

One request's path: ``check(...)`` parses the body, prices it (``extproc.tokens.pricing``: its
prompt counted, or estimated when the decision is not close), reads the ledger snapshot and
capacity, calls the pure step (``extproc.decision.step.admit``, around ``decide``) and, when the
request will run, reserves its ledger entry and returns a ``Ticket`` (``extproc.gateway.verdict``).
``settle(ticket)`` releases the entry when the request ends, however it ends. The heartbeat keeps
the entries of running requests alive and a ledger that was away is given what it missed
(``extproc.gateway.leases``, through which every ledger call goes). An admission priced on an
estimate is counted exactly afterwards and its entry charged the exact cost (``_recount``).

Passed in, not built or set afterwards: the ledger, the capacity source, metrics, the
engine scrapers, tracing (off by default) and the listeners that hear of every
verdict and settled ticket (``extproc.gateway.verdict.Listener``: the autoscaling loop; none by
default). The server maps the ``Verdict`` to Envoy's answer; nothing here knows about Envoy.

Engine signals. For a pool with ``engine_metrics``, what ``decide`` sees is the ledger's
snapshot plus the work the engines report that the ledger does not know about (traffic that
bypassed this gateway, other gateways' in-process ledgers; ``extproc.fleet.enginestats`` has the
formula), and the KV cache they report replaces the configured one. The engines' view is read
once per decision (``EngineStats.latest``); a stale one adds nothing. The ledger and the local
view stay uncorrected: the correction changes what is decided, never what is recorded. With
``learn_output_lengths``, each scrape round's finished outputs (the engines' generation-token
histogram) feed the pool's learned lengths (``learn_lengths``).

The ledger may be shared (Redis) and may fail. A decision's ledger calls (snapshot, then the
atomic reserve against the decision's ``ceiling_ms``) together get ``decision_deadline_ms``.
If another gateway took the room between our snapshot and our reserve, the ledger refuses and
the request is decided again on a fresh snapshot (``RESERVE_ATTEMPTS`` in all). When the ledger
is unavailable (``LedgerUnavailable``, or the deadline passed) the configured policy decides:

- ``fail_open``: decide by the local view (``Leases.local``: the last snapshot the ledger gave
  for the pool moved by this process's own admissions and completions since). Other gateways'
  work since then is unseen, so over-admission is bounded by what they admit during the
  outage. An admitted request keeps a ticket, recorded as soon as the ledger answers.
- ``fail_closed``: refuse with 429 ``ledger_unavailable`` (the Retry-After minimum).

Both are counted (``extproc_ledger_unavailable_decisions_total``) and logged once per outage,
never with request content.

One round trip per admission. A ledger whose answers carry the pool's snapshot (Redis:
``Leases.recent``) saves the snapshot call: the decision reuses the newest such snapshot while
it is at most ``leases.FRESH_MS`` old. Such a view may miss what other gateways (and this one's
calls still in flight) did in those milliseconds, so only a decision the reserve checks again
atomically stands on it: an enforced admission, recorded only if the pool at that instant is
still within its ceiling, count and caps (as for any snapshot, which is always a little old by
the time its reserve lands). Any other outcome (a refusal, shadow mode, a pass) is decided again
on a snapshot read for this decision, and a reserve refused on a reused view does not count as
an attempt: its answer carries the pool as the reserve found it, the next attempt's input. So a
refusal, ``contended`` included, is always decided on a view as of after the request arrived.

Length: past the house's ~400 lines because it is one decision's orchestration (check, price,
admit and reserve, the fault policy, settle) and reads top to bottom as that path; each job
with a model of its own already lives apart (pricing, leases, verdict, step, enginestats).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from extproc.config import Config, Mode, OnUnavailable, Pool, Route, TracingConfig
from extproc.decision.admission import Outcome, Reason, Snapshot
from extproc.decision.defer import DEFERRABLE
from extproc.decision.learning import PoolLearning, learning_for
from extproc.decision.lengths import decay_factor
from extproc.decision.rules import Rules
from extproc.decision.share import parse_priority
from extproc.decision.step import (
    NO_CORRECTION,
    Admission,
    Ask,
    admit,
    charge_of,
    kv_of,
    priority_of,
    reported,
    running_of,
)
from extproc.errors import LedgerUnavailable, RequestError
from extproc.fleet.enginestats import (
    Bucket,
    Correction,
    EngineSample,
    EngineStats,
    PoolStats,
    correction,
    with_reported_kv,
)
from extproc.gateway.holding import Holding
from extproc.gateway.leases import Leases
from extproc.gateway.request import InferenceRequest, deadline_ms, parse
from extproc.gateway.tenant import Tenant, Tenants
from extproc.gateway.verdict import Answer, Listener, Ticket, Verdict, contended, invalid
from extproc.ledger import Entry, Ledger, Reserved
from extproc.observability import decisionlog
from extproc.observability.telemetry import Tracing, annotate
from extproc.tokens.estimate import prompt_tokens
from extproc.tokens.pricing import Pricing, Uncounted

if TYPE_CHECKING:
    from extproc.decision.running import Running
    from extproc.fleet.capacity import CapacitySource
    from extproc.observability.metrics import Metrics

log = logging.getLogger(__name__)

RESERVE_ATTEMPTS = 3  # decisions per request when other gateways keep taking the room
ENDED_KEPT = 4096  # tickets whose end Envoy's access log may still correct (``Gate.left``)


class Gate:
    """One process's admission service over its pools: ``check`` decides a request,
    ``settle`` ends it; ``heartbeat`` and ``sweep`` are the server's periodic calls. It owns
    what the pools learn (``learning``) and the decision log; the rest is passed in."""

    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        capacity: CapacitySource,
        metrics: Metrics,
        *,
        engines: Mapping[str, EngineStats] | None = None,
        tracing: Tracing | None = None,
        listeners: Sequence[Listener] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.rules = Rules.of(config)  # what the step reads of it (``extproc.decision.rules``)
        self.engines = dict(engines or {})  # pool name -> its engines' scraper (started elsewhere)
        self.ledger = ledger
        self.capacity = capacity
        self.metrics = metrics
        self._clock = clock
        self.pricing = Pricing(config, metrics)  # the pools' token counters, from the config
        self.leases = Leases(ledger, config.ledger, metrics, clock)
        self._labels = Tenants(config.tenant)  # tenant names -> bounded metric labels
        self.learning: dict[str, PoolLearning] = {p.name: learning_for(p) for p in config.pools}
        # Tickets whose streams ended as completions, for a while: (pool, record, when)
        self._ended: OrderedDict[str, tuple[str, Running, float]] = OrderedDict()
        self._learns_lengths: set[str] = set()  # pools fed by their engines' histogram
        self._forgotten_at = self._clock()
        self._reported: dict[tuple[str, int, int], Pool] = {}  # pools with engines' KV sizes
        for pool in config.pools:
            # read when scraped, so it falls to zero as the pool empties, not at the next
            # decision: the ledger's newest answer and this gateway's own changes since
            metrics.outstanding.labels(pool.name).set_function(
                functools.partial(self._outstanding_s, pool.name))
            settings, stats = pool.engine_metrics, self.engines.get(pool.name)
            if settings is not None and settings.learn_output_lengths and stats is not None:
                self._learns_lengths.add(pool.name)
                stats.on_lengths = self.learn_lengths
                stats.on_speed = self.learn_speed
            if stats is not None:
                stats.on_round = self.learn_round
            metrics.watch_learning(pool.name, self.learning[pool.name])
        self.listeners = tuple(listeners)  # hear of every verdict and settled ticket
        self.tracing = tracing if tracing is not None else Tracing(TracingConfig())  # off
        self.decision_log = (decisionlog.DecisionLog(config.decision_log)
                             if config.decision_log else None)
        self._pools = {p.name: p for p in config.pools}
        self.gateway = uuid.uuid4().hex[:12]  # this process, to the ledger (``Ledger.wait``)
        self.holding = Holding(config, metrics, self._decide_held, self.settle, self._publish,
                               lambda pool: capacity.capacity(pool).replicas, clock)
        for pool in config.pools:
            if not self.pricing.counters[pool.name].exact:
                log.warning("pool %s has no tokenizer: prompt tokens are estimated at %.1f bytes"
                            " per token", pool.name, pool.bytes_per_token)

    def learn_lengths(self, pool: str, finished: Sequence[Bucket]) -> None:
        """One scrape round of the pool's engines: the outputs that finished since the last
        round (``EngineStats.on_lengths``)."""
        if pool not in self._learns_lengths:
            return
        learning = self.learning[pool]
        for low, high, count in finished:
            learning.finished_bucket(low, high, count)

    def learn_speed(self, pool: str, ttft_ms: float, itl_ms: float) -> None:
        """One scrape round's measured speed of the pool's engines (``EngineStats.on_speed``):
        what a cancelled stream's answer is estimated at (``PoolLearning.engine_speed``)."""
        if pool in self._learns_lengths:
            self.learning[pool].engine_speed(ttft_ms, itl_ms, self._clock())

    def learn_round(self, pool: str, samples: Sequence[EngineSample]) -> None:
        """One scrape round of the pool's engines (``EngineStats.on_round``): whether one of
        them holds requests waiting for compute, for the measured level's climb
        (``PoolLearning.engines_round``)."""
        self.learning[pool].engines_round(samples, self._pools[pool].engine, self._clock())

    def forget(self) -> None:
        """Decay what the pools learned by the time since the last call (``decay_factor``:
        the same memory in seconds however often it is called; the sweeper calls it)."""
        now = self._clock()
        factor = decay_factor(max(0.0, now - self._forgotten_at))
        self._forgotten_at = now
        for learning in self.learning.values():
            learning.decay(factor)
            learning.resolve(now)  # the requests whose deadline came, while none asks

    def _outstanding_s(self, pool: str) -> float:
        return self.leases.local(pool).outstanding_ms / 1000.0

    async def check(self, route: Route, path: str, headers: Mapping[str, str],
                    body: bytes, trace: Mapping[str, str] | None = None,
                    tenant: Tenant | None = None,
                    on_hold: Callable[[float], None] | None = None,
                    destination: str | None = None) -> Verdict:
        """Decide one request. ``trace``: the gRPC call's W3C trace context (Envoy's span);
        ``tenant``: who is charged, as the server resolved it from what Envoy vouches for;
        ``on_hold``: told the longest it may be held (seconds) when the gate holds it
        (``extproc.decision.defer``), before it waits; ``destination``: the replica an endpoint
        picker chose for it, from Envoy's metadata (``extproc.fleet.enginestats``)."""
        with self.tracing.span(trace or {}, headers) as span:
            started = time.perf_counter()
            self.pricing.deciding += 1  # where prompts are counted (extproc.tokens.pricing)
            try:
                verdict = await self._check(route, path, headers, body, tenant, on_hold,
                                            destination)
            finally:
                self.pricing.deciding -= 1
            if verdict.tenant is not tenant:  # a refusal before the decision
                verdict = dataclasses.replace(verdict, tenant=tenant)
            elapsed = time.perf_counter() - started
            self.metrics.observe(verdict, self.config.mode, elapsed)
            for listener in self.listeners:
                listener.decided(verdict)
            if self.tracing.enabled:
                annotate(span, verdict, elapsed, self.config.mode.value)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("decision", extra={
                    "pool": verdict.pool, "class": verdict.service_class,
                    "outcome": verdict.outcome.value, "reason": verdict.reason.value,
                    "prompt_tokens": verdict.prompt_tokens,
                    "decision_ms": round(elapsed * 1000.0, 3)})
        return verdict

    async def _check(self, route: Route, path: str, headers: Mapping[str, str],
                     body: bytes, tenant: Tenant | None = None,
                     on_hold: Callable[[float], None] | None = None,
                     destination: str | None = None) -> Verdict:
        service_class = route.service_class
        try:
            stated_ms = deadline_ms(headers, self.config.deadline_header)
            request = parse(route.api, body, path=path)
        except RequestError as exc:
            return invalid(exc, None, service_class)
        pool = self.config.pool_for(request.model)
        if pool is None:
            return Verdict(Answer(Outcome.PASS, Reason.UNMANAGED, service_class))
        replicas = self.capacity.capacity(pool.name).replicas
        stats = self.engines.get(pool.name)
        engines = stats.latest(pool.name) if stats is not None else None  # once per decision
        pool = with_reported_kv(pool, engines, self._reported)
        try:
            ask, uncounted = await self.pricing.ask(request, pool, service_class, stated_ms,
                                                    self._close(pool, replicas, engines))
        except RequestError as exc:
            return invalid(exc, pool.name, service_class)
        who = tenant.name if tenant is not None else None
        ask = dataclasses.replace(ask, tenant=who, destination=destination, priority=priority_of(
            self.rules, service_class, who, self._stated_priority(headers)))
        arrived = self._clock()
        self.learning[pool.name].arrived(service_class, self.rules.classes[service_class].batch,
                                         arrived, ask.prompt_tokens, ask.groups)
        started = time.perf_counter()
        holds = self.config.defer.enabled and self.config.mode is Mode.ENFORCE
        if holds:
            await self.holding.first(pool.name)  # what is held has its turn first
        verdict = await self._admit(pool, ask, replicas, engines)
        if holds and verdict.outcome is Outcome.REJECT and verdict.reason in DEFERRABLE:
            verdict = await self.holding.hold(pool.name, ask, verdict, arrived, on_hold)
        if verdict.admission is not None:  # once per request, whatever was asked again
            adm = verdict.admission
            self.learning[pool.name].decided(adm.limit, adm.load_ms, self._clock())
        if destination is not None and verdict.ticket is not None and stats is not None:
            stats.sent(pool.name, destination)  # its engine's last report is out of date
        if uncounted is not None and verdict.ticket is not None and self.pricing.claim():
            verdict.ticket.correction = asyncio.create_task(
                self._recount(verdict.ticket, request, pool, uncounted, ask, replicas))
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

    def _close(self, pool: Pool, replicas: int,
               engines: PoolStats | None) -> Callable[[Ask, Ask], bool]:
        """Whether a decision is close: it comes out differently at a prompt estimate's low
        and high ends (``extproc.tokens.pricing``), on the local view of the ledger."""
        def close(low: Ask, high: Ask) -> bool:
            local = self.leases.local(pool.name)
            fix = self._engine_correction(pool, local, engines)
            now, learning = self._clock(), self.learning[pool.name]
            a, b = (admit(x, pool, self.rules, learning, local, replicas, now, fix)
                    for x in (low, high))
            return (a.outcome, a.reason) != (b.outcome, b.reason)
        return close

    def _engine_correction(self, pool: Pool, snapshot: Snapshot, engines: PoolStats | None,
                           destination: str | None = None) -> Correction:
        """The work the pool's engines hold that the ledger does not know about
        (``extproc.fleet.enginestats.correction``; nothing while their scrapes are stale). An unseen
        request is charged the ledger's mean, or the pool's mean request on an empty ledger.
        And what the replica the request goes to reports (``EngineStats.where``: the one an
        endpoint picker chose, ``destination``, or the least-waiting one): nothing to do, or
        a queue (``extproc.decision.step.reported``)."""
        settings = pool.engine_metrics
        if engines is None or settings is None:
            return NO_CORRECTION
        mix = self.learning[pool.name].mix()
        fix = correction(snapshot, engines,
                         fallback_request_ms=pool.engine.request_ms(mix.prompt_tokens,
                                                                    mix.output_tokens),
                         tolerance=settings.tolerance, slack=settings.slack)
        self.metrics.engine_correction.labels(pool.name).set(fix.extra_inflight)
        fix = dataclasses.replace(fix, reported=engines.kv_reported())
        stats = self.engines.get(pool.name)
        if stats is None:
            return fix
        named = destination if settings.idle_destination else None
        return reported(fix, stats.where(pool.name, named), pool.engine,
                        mix.prompt_tokens + mix.output_tokens, named=named is not None)

    async def _recount(self, ticket: Ticket, request: InferenceRequest, pool: Pool,
                       uncounted: Uncounted, ask: Ask, replicas: int) -> None:
        """Count a prompt admitted on an estimate exactly, off the event loop, and charge its
        ledger entry the exact cost (``Leases.recharge``: the estimate stays if the ledger
        does not answer)."""
        tokens = await self.pricing.count(pool.name, uncounted)
        if tokens is None or ticket.settled:  # None: the text cannot be tokenized
            return
        exact_ask = dataclasses.replace(
            ask, prompt_tokens=prompt_tokens(request, pool, uncounted.known + tokens))
        learning = self.learning[pool.name]
        await self.leases.recharge(ticket, charge_of(exact_ask, pool, learning, replicas),
                                   kv_of(exact_ask, pool, learning))

    def _log_decision(self, verdict: Verdict) -> None:
        """One line for ``extproc replay`` (``extproc.observability.decisionlog``): written now, or
        when the request's stream ends if it runs (the line then carries its measured duration)."""
        assert self.decision_log is not None and verdict.admission is not None
        adm = verdict.admission
        d = adm.decision
        record = decisionlog.Record(
            time.time(), verdict.pool or "", verdict.service_class or "",
            adm.cost.prompt_tokens, adm.cost.max_output_tokens, adm.policy.deadline_ms,
            verdict.outcome.value, verdict.reason.value, self.config.mode.value,
            d.completion_ms if d else None, d.wait_ms if d else None,
            tenant=verdict.tenant.name if verdict.tenant is not None else None,
            promised_tokens=round(adm.cost.promised, 1), priority=adm.priority)
        if verdict.ticket is not None:
            verdict.ticket.log = decisionlog.Pending(record, self._clock())
        else:
            self.decision_log.write(record)

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
        leases = self.leases
        began = time.monotonic()  # a snapshot sent for after this is current (module docstring)
        try:
            async with asyncio.timeout(self.config.ledger.decision_deadline_ms / 1000.0):
                if leases.owed():
                    await leases.reconcile()
                read, attempts = False, 0  # read: call ``snapshot``, reuse none
                while True:
                    snapshot, sent_at = await self._snapshot(pool.name, read)
                    current = sent_at >= began
                    leases.saw(pool.name, snapshot, sent_at)
                    self.metrics.groups(pool.name, snapshot, ask.groups, self._labels.label)
                    fix = self._engine_correction(pool, snapshot, engines, ask.destination)
                    verdict = self._verdict(admit(ask, pool, self.rules, learning, snapshot,
                                                  replicas, self._clock(), fix), pool.name)
                    if not current and not (verdict.enforced
                                            and verdict.outcome is Outcome.ADMIT):
                        read = True  # the reserve would not check it again: decide on a read
                        continue
                    if verdict.blocks:
                        return verdict
                    if verdict.enforced and self.holding.blocks(pool.name, ask.priority):
                        return contended(verdict, Reason.PRIORITY)  # a higher band is held
                    entry = self._entry(request_id, pool.name, verdict)
                    # Shadow mode and infeasible-but-passed requests run whatever the ledger
                    # holds: they are recorded without a ceiling.
                    assert verdict.admission is not None
                    enforced = verdict.enforced
                    ceiling = verdict.admission.ceiling_ms if enforced else None
                    most = verdict.admission.max_inflight if enforced else None
                    caps = verdict.admission.caps if enforced else ()
                    sent, reserved_at = True, time.monotonic()
                    reserved = await leases.call("reserve", self.ledger.reserve(
                        entry, ceiling, most, caps))
                    if reserved:
                        return dataclasses.replace(
                            verdict, ticket=self._ticket(entry, verdict, reserved_at=reserved_at))
                    if reserved is Reserved.YIELDED:  # another gateway holds a higher band
                        return contended(verdict, Reason.PRIORITY)
                    # Refused: another gateway took the room since our snapshot. Again, on the
                    # pool as the refusal found it (its answer) or a fresh read.
                    if current:
                        attempts += 1
                    if attempts >= RESERVE_ATTEMPTS:
                        return contended(verdict)
                    read = False  # the refusal's answer is current
        except (LedgerUnavailable, TimeoutError) as exc:
            return self._unavailable(exc, request_id if sent else None, pool, ask, replicas,
                                     engines)
        except asyncio.CancelledError:
            if sent:  # the stream went away mid-decision: undo a reserve that may have landed
                leases.defer_release(request_id, pool.name)
            raise

    async def _decide_held(self, name: str, ask: Ask) -> Verdict:
        """A held request decided again (``extproc.gateway.holding``), on the pool as it is now."""
        replicas = self.capacity.capacity(name).replicas
        stats = self.engines.get(name)
        engines = stats.latest(name) if stats is not None else None
        pool = with_reported_kv(self._pools[name], engines, self._reported)
        return await self._admit(pool, ask, replicas, engines)

    async def _snapshot(self, pool: str, read: bool) -> tuple[Snapshot, float]:
        """The snapshot to decide on, and when its call was sent (time.monotonic; after the
        decision began, it is current): the recent one if there is one and ``read`` is off,
        else a read."""
        recent = None if read else self.leases.recent(pool)
        if recent is None:
            sent_at = time.monotonic()
            return await self.leases.call("snapshot", self.ledger.snapshot(pool)), sent_at
        snapshot, age = recent
        return snapshot, time.monotonic() - age

    def _verdict(self, adm: Admission, pool: str) -> Verdict:
        return Verdict(adm, pool, enforced=self.config.mode is Mode.ENFORCE)

    async def _publish(self, pool: str, level: int | None) -> None:
        """Tell the ledger the highest priority this gateway holds (``Ledger.wait``), so
        other gateways' lower priorities yield to it. Best effort: a ledger that does not
        answer leaves the order across gateways unkept until it does (``docs/defer.md``)."""
        try:
            async with asyncio.timeout(self.config.ledger.decision_deadline_ms / 1000.0):
                await self.leases.call("wait", self.ledger.wait(
                    pool, self.gateway, level, self.config.ledger.liveness_ms))
        except (LedgerUnavailable, TimeoutError) as exc:
            log.debug("could not publish the held requests of pool %s: %s", pool, exc)

    def _unavailable(self, exc: Exception, sent: str | None, pool: Pool, ask: Ask,
                     replicas: int, engines: PoolStats | None) -> Verdict:
        """The fault policy. The decision is always made on the local view (fail-closed
        refuses it, keeping its prediction for metrics and the Retry-After hint, and for
        shadow mode)."""
        on_unavailable = self.config.ledger.on_unavailable
        self.leases.away(exc, on_unavailable)
        self.metrics.ledger_fallbacks.labels(pool.name, on_unavailable.value).inc()
        local = self.leases.local(pool.name)
        fix = self._engine_correction(pool, local, engines, ask.destination)
        verdict = self._verdict(admit(ask, pool, self.rules, self.learning[pool.name], local,
                                      replicas, self._clock(), fix), pool.name)
        if on_unavailable is OnUnavailable.FAIL_CLOSED and verdict.outcome is not Outcome.INVALID:
            # Fail-closed: we cannot record the request, so we do not let it run.
            assert verdict.admission is not None
            verdict = dataclasses.replace(
                verdict, answer=verdict.admission.refused(Reason.LEDGER_UNAVAILABLE))
        if verdict.blocks:
            if sent is not None:
                self.leases.defer_release(sent, pool.name)
            return verdict
        # Fail-open (or shadow mode): it runs, so it is counted locally and recorded later.
        entry = self._entry(sent or uuid.uuid4().hex, pool.name, verdict)
        return dataclasses.replace(verdict, ticket=self._ticket(entry, verdict, recorded=False))

    def _entry(self, request_id: str, pool: str, verdict: Verdict) -> Entry:
        """Every request that reaches the backend is in the ledger, admitted or not (shadow
        mode, infeasible-but-passed): it occupies the GPUs. Its lease: the gateway's liveness
        (``extproc.gateway.leases``), renewed by the heartbeat while it runs."""
        assert verdict.decision is not None and verdict.admission is not None
        return Entry(request_id, pool, verdict.decision.charge_ms,
                     self.config.ledger.liveness_ms, verdict.admission.kv_tokens,
                     verdict.admission.groups, verdict.admission.priority, self.gateway)

    def _ticket(self, entry: Entry, verdict: Verdict, *, recorded: bool = True,
                reserved_at: float | None = None) -> Ticket:
        adm = verdict.admission
        assert adm is not None
        running = running_of(adm, self._clock())
        ticket = Ticket(entry.request_id, entry.pool, entry.lease_ms, running,
                        charge_ms=entry.charge_ms, kv_tokens=entry.kv_tokens, recorded=recorded)
        self.leases.hold(ticket, reserved_at)
        self.learning[entry.pool].admitted(running, key=ticket.request_id)
        return ticket

    async def settle(self, ticket: Ticket, completed: bool = True) -> None:
        """Release a ticket's entry; shielded, so a cancelled stream still releases.
        ``completed``: the request ended normally (not cancelled, not failed)."""
        ticket.settled = True
        now = self._clock()
        self.learning[ticket.pool].settled(ticket.running, completed=completed, now=now,
                                           key=ticket.request_id)
        if completed:  # as far as the stream says: Envoy may tell otherwise (``left``)
            self._ended[ticket.request_id] = (ticket.pool, ticket.running, now)
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
        for listener in self.listeners:
            listener.settled(ticket, completed)
        self.leases.drop(ticket)
        if ticket.log is not None and self.decision_log is not None:
            self.decision_log.end(ticket.log, self._clock())
            ticket.log = None
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(self.leases.release(ticket))
        self.holding.released(ticket.pool)  # capacity came back: a pass, if any is held

    def left(self, request_id: str) -> None:
        """Envoy's access log says the client of a request that ran here left before its
        answer ended (``extproc.gateway.accesslog``); its stream's end read as a completion.
        Its pool learns what the stream showed (``PoolLearning.abandoned``)."""
        ended = self._ended.pop(request_id, None)
        if ended is not None:
            pool, running, at = ended
            self.learning[pool].abandoned(running, at - running.started, at)

    async def heartbeat(self) -> None:
        """Renew the entries of every request running here (``Leases.heartbeat``). Raises
        ``LedgerUnavailable``; the next beat retries."""
        await self.leases.heartbeat()

    async def probe(self, check: Awaitable[object]) -> None:
        """The ledger's health probe (``Leases.probe``): it answered ``check`` and holds what
        this gateway owes it. Raises ``LedgerUnavailable``."""
        await self.leases.probe(check)

    async def sweep(self) -> int:
        """Retry releases the ledger did not take, then expire entries whose lease ended (the
        backstop for lost streams: ``Leases.expire``). Raises ``LedgerUnavailable``; the next
        sweep retries. The pools' learning forgets a sweep's worth first."""
        self.forget()
        return await self.leases.expire()

    def refuse(self, error: RequestError, service_class: str,
               tenant: Tenant | None = None) -> Verdict:
        """A verdict for a request refused before it could be checked (e.g. too large)."""
        verdict = dataclasses.replace(invalid(error, None, service_class), tenant=tenant)
        self.metrics.observe(verdict, self.config.mode, 0.0)
        return verdict

    def shed(self, service_class: str, tenant: Tenant | None = None) -> Verdict:
        """A 429 without a decision: the processor itself is behind (``extproc.gateway.server``)."""
        verdict = Verdict(Answer(Outcome.REJECT, Reason.PROCESSOR_OVERLOADED, service_class),
                          tenant=tenant, enforced=self.config.mode is Mode.ENFORCE)
        self.metrics.observe(verdict, self.config.mode, 0.0)
        return verdict
