"""The discrete-event loop: jobs in, a fleet of replicas, a gateway, clients; a ``Result`` out.

Virtual time, one heap of events (O(log n) each), no threads, no clock reads: the same scenario,
policy and seed give the same result on any machine. First arrivals are read from the sorted
job list and client timeouts from a FIFO (they all last the same) instead of being pushed, so
the heap only holds a replica's next step boundary, retries, readiness and the periodic
samples.

The gateway does what ``extproc.gateway.gate.Gate`` does, minus parsing and I/O: it reads the ledger
snapshot (the production ``LedgerCore``) and the ready capacity, asks the policy (for
``default``, ``none`` and ``oracle`` the production ``admission.decide``), and either answers
429 with the production ``Retry-After`` rule, refuses an infeasible request (when configured)
or records the entry and forwards the request to the least-loaded ready replica (a turn of a
conversation to its last turn's replica, unless that one is much busier: ``target``). The entry is
released when the request's stream ends: its last token, or its client giving up. Leases never
expire in the simulator: no stream is ever lost, so the lease backstop has nothing to do.
With ``defer`` on (the scenario's configuration, or the ``defer`` policy) a refused request is
held as the gate holds it (``extproc.decision.defer``'s queue, decided again by the same step with
what it waited taken from its deadline): a pass runs at each release, each arrival that finds
requests held, a replica made ready, and each held request's hold end.

What a run is given (``extproc.sim.scenarios.Scenario``) and what it gives back
(``extproc.sim.result``) live beside it.

Length: past the house's ~400 lines for one event loop, ``Simulation``, whose handlers share
its heap, replicas and tallies.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from extproc.config import TenantSource
from extproc.decision.admission import Outcome, Policy, Reason, Snapshot
from extproc.decision.defer import DEFERRABLE, Queue, Refused, Waiter, enter
from extproc.decision.learning import PoolLearning
from extproc.decision.lengths import Prior, decay_factor
from extproc.decision.rules import Rules
from extproc.decision.running import Running
from extproc.decision.step import (
    NO_CORRECTION,
    Admission,
    Ask,
    admit,
    capacity_for,
    class_policy,
    cost_of,
    priority_of,
    reported,
    running_of,
)
from extproc.fleet.enginestats import Correction, EngineSample, kv_between
from extproc.gateway.retry import retry_delay_ms
from extproc.ledger import Entry
from extproc.ledger.memory import LedgerCore
from extproc.sim.autoscaler import Fixed, Observation, Recommender
from extproc.sim.clients import Attempt
from extproc.sim.engine import INF, Replica
from extproc.sim.policies import AdmissionPolicy, EngineView
from extproc.sim.result import Result, quantile

if TYPE_CHECKING:
    from extproc.sim.scenarios import Scenario
    from extproc.sim.workload import Job

_REPLICA, _SEND, _READY, _SAMPLE, _CONTROL, _EXPIRE, _PASS, _ROUND = range(8)
AFFINITY_SLACK = 0.25  # a prefix's replica is kept while at most this share of a batch busier
SCRAPE_S = 0.05  # how often a saturation detector's view of the engines is refreshed
METRICS_S = 2.0  # the gateway's own scrape of the engines' metrics (``EngineStats.start``)


def feasible_alone(a: Attempt, replica: Replica) -> bool:
    """Whether ``a`` would meet its deadline and first-token objective alone on ``replica``,
    idle, timed by the simulated engine itself (its true output length, no prefix cached): a
    request whose refusal while that replica has nothing to do is work lost
    (``Result.refused_idle_s``), unlike one no admission could have served in time."""
    if not replica.sched.fits_alone(a):
        return False
    engine = replica.model
    first_ms = engine.step_base_ms + engine.prefill_ms(a.prompt_tokens)
    whole_ms = first_ms + a.output_tokens * engine.itl_ms(1, a.prompt_tokens + a.output_tokens / 2)
    return whole_ms <= a.deadline_s * 1000.0 and (
        a.ttft_objective_s is None or first_ms <= a.ttft_objective_s * 1000.0)


class Simulation:
    """One run of one policy on one scenario; ``run()`` once."""

    def __init__(self, scenario: Scenario, policy: AdmissionPolicy,
                 on_decision: Callable[[Job, Snapshot, Admission], None] | None = None
                 ) -> None:
        self.scenario = scenario
        self.policy = policy
        self.on_decision = on_decision  # sees each step decision and the snapshot it read
        self.pool = scenario.pool
        self.config = scenario.config
        if policy.uses_step and policy.defers is not None:  # the policy says, not the config
            self.config = dataclasses.replace(self.config, defer=dataclasses.replace(
                self.config.defer, enabled=policy.defers))
        self.rules = Rules.of(self.config)  # what the step reads of it
        self.now = 0.0
        self.ledger = LedgerCore(clock=lambda: self.now)
        self.heap: list[tuple[float, int, int, Any, int]] = []
        self._seq = 0
        self.replicas: list[Replica] = []
        self.ready: list[Replica] = []
        self.rng_clients = random.Random(scenario.seed * 7919 + 1)
        self.rng_gateway = random.Random(scenario.seed * 7919 + 2)
        self.result = Result(scenario.name, policy.name, scenario.span_s)
        self.recommender: Recommender = (scenario.autoscaler() if scenario.autoscaler
                                         else Fixed(scenario.replicas))
        self._policies = {name: Policy(c.deadline_ms, c.safety_factor, c.ttft_ms)
                          for name, c in self.config.classes.items()}
        self._inflight: deque[Attempt] = deque()  # admitted, in admission order
        self._keys = 0
        self._window = _Window()
        self._sample = _Window()
        self._sample_latencies: list[float] = []
        self._last_control = 0.0
        self._marks: dict[int, tuple[float, float, float]] = {}  # replica -> integrals seen
        self._pending_sends = 0
        self._view = EngineView()
        self._view_at = -INF
        # The engines' latency histograms since the gateway's last scrape round: first-token
        # seconds and count, inter-token seconds and count (``_timed``).
        self._timings = [0.0, 0.0, 0.0, 0.0]
        self._timed_at = 0.0
        self._sent_at: dict[int, float] = {}  # replica -> when the gateway last sent it a request
        self._affinity: dict[str, Replica] = {}  # prefix key -> the replica of its last turn
        self._refused_idle_at = -1  # the last second counted in ``refused_idle_s``
        # Every client waits the same timeout, so timeouts come due in the order they were
        # set: a FIFO instead of the heap (stale ones, for finished attempts, are skipped).
        self._timeouts: deque[tuple[float, Attempt]] = deque()
        # What the gateway learns: output lengths (each completion), promises, demand, mix.
        self.learning = PoolLearning(Prior(self.pool.expected_output_tokens or Prior.mean,
                                           self.pool.long_output_tokens or Prior.p99))
        # What the gateway holds (``decision.defer``), with the product's step and ``defer``.
        defer = self.config.defer
        self._defers = policy.uses_step and policy.enforce and defer.enabled
        self.queue = Queue(defer.max_waiting, defer.max_waiting_per_tenant, self._displaced)
        self._pass_due = False  # a pass is pushed for now
        self._held_idle_at = -1  # the last second counted in ``held_idle_s``
        for _ in range(scenario.replicas):
            self._add_replica(ready=True)


    # ---- plumbing ----
    def _push(self, t: float, kind: int, obj: Any, aux: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, self._seq, kind, obj, aux))

    def _schedule_replica(self, t: float, replica: Replica) -> None:
        self._push(t, _REPLICA, replica, replica.version)

    def _add_replica(self, ready: bool) -> Replica:
        r = Replica(len(self.replicas), self.scenario.engine, self._schedule_replica)
        r.started_at = self.now
        r.last_t = self.now
        self.replicas.append(r)
        if ready:
            self._make_ready(r)
        else:
            r.ready_at = self.now + self.scenario.provisioning_s
            self._push(r.ready_at, _READY, r)
        return r

    def _make_ready(self, r: Replica) -> None:
        r.state = "ready"
        r.ready_at = self.now
        r.last_t = self.now
        self.ready.append(r)
        self._wake()

    def _stop(self, r: Replica) -> None:
        r.accrue(self.now)
        r.state = "stopped"
        r.stopped_at = self.now

    # ---- the run ----
    def run(self, progress: Callable[[float, float], None] | None = None) -> Result:
        sc = self.scenario
        jobs = sc.jobs
        n = len(jobs)
        self.result.jobs = n
        heap = self.heap
        self._push(sc.sample_s, _SAMPLE, None)
        if sc.autoscaler is not None:
            self._push(sc.control_period_s, _CONTROL, None)
        if self.policy.uses_step:  # (the gateway's scrape rounds: only the product learns)
            self._push(METRICS_S, _ROUND, None)
        finished: list[Attempt] = []
        timeouts = self._timeouts
        ji = 0
        events = 0
        horizon = self._horizon()
        while True:
            # the next event of three sources: the job list, the timeout FIFO, the heap
            t_job = jobs[ji].arrival_s if ji < n else INF
            t_out = timeouts[0][0] if timeouts else INF
            t_heap = heap[0][0] if heap else INF
            if min(t_out, t_heap, t_job) > horizon:
                self.now = horizon
                self._abandon_leftovers()
                break
            if t_out <= t_heap and t_out <= t_job:
                _, a = timeouts.popleft()
                self.now = t_out
                events += 1
                if a.finished_at < 0.0:
                    self._timeout(a)
            elif t_heap <= t_job:
                t, _, kind, obj, aux = heapq.heappop(heap)
                self.now = t
                events += 1
                if kind == _REPLICA:
                    if aux != obj.version:
                        continue
                    obj.plan(t, finished)
                    if finished:
                        self._finish(finished)
                        finished.clear()
                    if obj.state == "draining" and obj.idle:
                        self._stop(obj)
                elif kind == _SEND:
                    self._pending_sends -= 1
                    self._send(obj[0], obj[1])
                elif kind == _READY:
                    if obj.state == "starting":
                        self._make_ready(obj)
                elif kind == _PASS:
                    self._pass()
                elif kind == _EXPIRE:
                    if obj.payload.outcome == "held":
                        self._decide(obj.payload, obj)
                elif kind == _SAMPLE:
                    self._take_sample(progress)
                    if ji < n or self._busy():
                        self._push(t + sc.sample_s, _SAMPLE, None)
                elif kind == _CONTROL:
                    self._control()
                    if ji < n or self._busy():
                        self._push(t + sc.control_period_s, _CONTROL, None)
                elif kind == _ROUND:
                    self._engines_round(t)
                    if ji < n or self._busy():
                        self._push(t + METRICS_S, _ROUND, None)
            else:
                job = jobs[ji]
                ji += 1
                self.now = t_job
                events += 1
                self._send(job, 0)
        self._close(events)
        return self.result

    def _horizon(self) -> float:
        """When no client can still be waiting: the last arrival, then every retry's timeout
        and longest backoff, plus a minute. Work still queued then is abandoned work."""
        c = self.scenario.clients
        tries = c.max_retries + 1
        return self.scenario.span_s + tries * (c.timeout_s + max(
            c.backoff_max_s, c.honor_retry_after_s, float(self.config.retry_after.max_s))) + 60.0

    def _abandon_leftovers(self) -> None:
        """At the horizon: what engines still hold never finished (latency: infinite)."""
        res = self.result
        for r in self.replicas:
            for a in (*r.running, *r.waiting):
                if a.finished_at < 0.0 and not a.aborted:
                    res.latencies_s.append(INF)
                    res.ttfts_s.append(INF if a.started_at < 0.0 else a.first_token_at
                                       - a.arrival)
                    res.abandoned += 1

    def _busy(self) -> bool:
        """Anything left to happen besides the periodic samples?"""
        return (self._pending_sends > 0 or bool(self.queue)
                or any(not r.idle for r in self.replicas)
                or any(r.state == "starting" for r in self.replicas))

    # ---- gateway ----
    def _send(self, job: Job, number: int) -> None:
        """A client's send reaches the gateway: what the gateway holds goes first (a pass:
        ``extproc.decision.defer``), then this request is decided (``_decide``)."""
        now = self.now
        res = self.result
        res.attempts += 1
        self._window.arrivals += 1
        self._sample.arrivals += 1
        pool, config, learning = self.pool, self.config, self.learning
        batch = config.classes[job.service_class].batch
        most = job.max_tokens or pool.default_max_tokens
        room = self.scenario.engine.max_model_len - job.prompt_tokens
        output = min(job.output_tokens, job.max_tokens or job.output_tokens, max(1, room))
        tenant = job.tenant if config.tenant.source is not TenantSource.NONE else None
        ask = Ask(job.service_class, job.prompt_tokens, job.max_tokens, 1, job.deadline_ms,
                  known_output_tokens=output if self.policy.clairvoyant else None,
                  tenant=tenant,
                  priority=priority_of(self.rules, job.service_class, tenant, job.priority),
                  streaming=self.scenario.engine_aborts, fingerprint=f"{id(job):x}")
        learning.arrived(job.service_class, batch, now, job.prompt_tokens, ask.groups)
        for g in ask.groups:
            res.tally(g).attempts += 1
        self._keys += 1
        policy = class_policy(self.rules, job.service_class, job.deadline_ms)
        a = Attempt(job, number, now, str(self._keys), output, most,
                    policy.deadline_ms / 1000.0,
                    None if policy.ttft_ms is None else policy.ttft_ms / 1000.0)
        a.batch, a.ask = batch, ask
        if self.queue:
            self._pass()
        self._decide(a)

    def _pass(self) -> None:
        """Decide again what the gateway holds, in its order (``extproc.decision.defer``)."""
        self._pass_due = False
        for waiter in self.queue.pass_order():
            self._decide(waiter.payload, waiter)
        second = math.floor(self.now)
        if (self.queue and second != self._held_idle_at
                and any(r.idle for r in self.ready)):
            self._held_idle_at = second  # holding while a replica has nothing to do
            self.result.held_idle_s += 1

    def _decide(self, a: Attempt, held: Waiter | None = None) -> None:
        """The gateway decides ``a`` (again, if it is ``held``): the admission step
        (``extproc.decision.step.admit``) for the product's policies, the baseline's own rule for
        the others; then held, 400, 429 or the engines."""
        now = self.now
        res = self.result
        job = a.job
        pool, learning = self.pool, self.learning
        ask = a.ask if held is None else dataclasses.replace(
            a.ask, waited_ms=(now - a.arrival) * 1000.0)
        snapshot = self.ledger.snapshot(pool.name)
        adm = None
        if self.policy.uses_step:
            view = self._engine_view(now)
            routed = self._routed(job.prefix_key)
            i = self.ready.index(routed) if routed is not None else -1
            fresh = (self.scenario.engines_scraped and 0 <= i < len(view.running)
                     and self._view_at > self._sent_at.get(id(routed), -INF))
            fix, e = NO_CORRECTION, self.scenario.engine
            if self.scenario.engines_scraped and e.num_gpu_blocks and view.kv_usage:
                fix = Correction(reported=kv_between(  # as the gate's PoolStats.kv_reported
                    max(view.kv_usage), min(view.kv_usage), e.kv_tokens,
                    sum(view.waiting) + sum(view.running), len(view.running)))
            if fresh:  # (the mix is read only for a report: this runs at every decision)
                mix = learning.mix()
                sample = EngineSample(view.waiting[i], view.running[i],
                                      view.kv_usage[i] if e.num_gpu_blocks else None)
                fix = reported(fix, sample, e, mix.prompt_tokens + mix.output_tokens,
                               named=True)
            adm = admit(ask, pool, self.rules, learning, snapshot, len(self.ready), now, fix)
            if self._defers and adm.outcome is Outcome.ADMIT and self.queue.blocks(adm.priority):
                adm = adm.refused(Reason.PRIORITY)  # a higher band is held (extproc.decision.defer)
            outcome, retry_ms = adm.outcome, adm.retry_after_ms
            charge_ms = adm.decision.charge_ms if adm.decision is not None else 0.0
            kv = adm.kv_tokens
            if self._defers and outcome is Outcome.REJECT and adm.reason in DEFERRABLE:
                if held is not None and now < held.until:
                    return  # held on
                if held is None:
                    refused = self._hold(a, adm)
                    if refused is None:
                        return  # held
                    adm = adm.refused(refused.reason or adm.reason)
                    retry_ms = refused.retry_ms
                else:
                    adm = adm.refused(Reason.QUEUE_DEADLINE)
            learning.decided(adm.limit, adm.load_ms, now)
            if self.on_decision is not None:
                self.on_decision(job, snapshot, adm)
        else:
            policy = class_policy(self.rules, job.service_class, job.deadline_ms)
            capacity = capacity_for(pool, len(self.ready), learning)
            decision = self.policy.decide(cost_of(ask, pool, learning), a.output_tokens,
                                          snapshot, capacity, policy, now,
                                          self._engine_view(now))
            outcome, retry_ms = decision.outcome, decision.retry_after_ms
            charge_ms, kv = decision.charge_ms, job.prompt_tokens
        if held is not None:
            self.queue.sent(held) if outcome is not Outcome.REJECT else self.queue.remove(held)
        if outcome is Outcome.REJECT:
            res.would_reject += 1
        if outcome is Outcome.INVALID:
            a.outcome = "refused"
            res.refused += 1
            res.jobs_failed += 1
            return
        if outcome is Outcome.REJECT and self.policy.enforce:
            self._reject(a, retry_ms)
            return
        if not self.ready:
            a.outcome = "unavailable"
            res.unavailable += 1
            self._retry_or_fail(a)
            return
        if job.prompt_tokens >= self.scenario.engine.max_model_len:
            a.outcome = "refused"  # the engine's own 400: longer than the model's context
            res.refused += 1
            res.jobs_failed += 1
            return
        a.outcome = "admitted"
        res.admitted += 1
        a.groups = ask.groups
        for g in ask.groups:
            res.tally(g).admitted += 1
        self._window.admitted += 1
        self._sample.admitted += 1
        if adm is not None:
            a.record = running_of(adm, now)
        else:  # a baseline's: nothing predicted, resolved when its stream ends
            a.record = Running(job.service_class, now, deadline_s=a.deadline_s, batch=a.batch,
                               groups=ask.groups, prompt_tokens=job.prompt_tokens)
        learning.admitted(a.record, key=a.key if adm is not None else None)
        # No stream is lost here, so no lease needs to end one: every entry outlives its
        # client's patience (the gateway's leases are ``Admission.lease_ms``, renewed).
        lease_ms = (self.scenario.clients.timeout_s + 60.0) * 1000.0
        self.ledger.reserve(Entry(a.key, pool.name, charge_ms, lease_ms, kv, ask.groups))
        self._inflight.append(a)
        target = self.target(job.prefix_key)
        assert target is not None
        target.submit(a, now)
        self._sent_at[id(target)] = now
        self._timeouts.append((now + self.scenario.clients.timeout_s, a))

    def _hold(self, a: Attempt, adm: Admission) -> Refused | None:
        """Hold a refused request as the gate does (``extproc.decision.defer.enter``): None, held;
        else why not, and its 429's Retry-After."""
        tenant = a.ask.tenant
        weight = self.config.tenant.policy(tenant).weight if tenant is not None else 1.0
        waiter = enter(self.queue, adm, tenant, weight, arrived=a.arrival, now=self.now,
                       replicas=len(self.ready), payload=a)
        if isinstance(waiter, Refused):
            return waiter
        a.outcome = "held"
        self._push(waiter.until, _EXPIRE, waiter)
        return None

    def _displaced(self, waiter: Waiter, refused: Refused) -> None:
        """A held request a higher priority took the place of: its 429 (``queue_full``)."""
        self.result.would_reject += 1
        self._reject(waiter.payload, refused.retry_ms)

    def _reject(self, a: Attempt, retry_ms: float | None) -> None:
        """A 429: the client retries after its Retry-After, or gives up."""
        now, res = self.now, self.result
        a.outcome = "rejected"
        res.rejected += 1
        second = math.floor(now)
        if second != self._refused_idle_at and now < res.span_s:
            routed = self._routed(a.job.prefix_key)
            if routed is not None and routed.idle and feasible_alone(a, routed):
                self._refused_idle_at = second  # work a replica with nothing to do would do
                res.refused_idle_s += 1
        for g in a.ask.groups:
            res.tally(g).rejected += 1
        self._window.rejected += 1
        self._sample.rejected += 1
        clients = self.scenario.clients
        if a.number < clients.max_retries:
            hint = retry_delay_ms(retry_ms, self.config.retry_after, self.rng_gateway) / 1000.0
            delay = clients.after_429_s(hint, a.number, self.rng_clients)
            self._push(now + delay, _SEND, (a.job, a.number + 1))
            self._pending_sends += 1
        else:
            res.jobs_shed += 1

    def _engines_round(self, now: float) -> None:
        """The gateway's scrape round of the engines' queues (``Gate.learn_round``), every
        ``METRICS_S``: whether one holds requests waiting for compute, for the measured
        level's climb."""
        e = self.scenario.engine
        self.learning.engines_round(
            (EngineSample(len(r.sched.waiting), len(r.sched.running),
                          r.sched.kv_used_blocks / e.num_gpu_blocks if e.num_gpu_blocks else None)
             for r in self.ready), e, now)

    def _engine_view(self, now: float) -> EngineView:
        """The engines' metrics as last scraped: refreshed at a decision once 50 ms old (a
        scraper polling every 50 ms, as GIE's does)."""
        view = self._view
        if now - self._view_at >= SCRAPE_S:
            kv_total = self.scenario.engine.num_gpu_blocks
            view = self._view = EngineView(
                waiting=tuple(len(r.sched.waiting) for r in self.ready),
                running=tuple(len(r.sched.running) for r in self.ready),
                kv_usage=tuple(r.sched.kv_used_blocks / kv_total if kv_total else 0.0
                               for r in self.ready))
            self._view_at = now
        return dataclasses.replace(view, age_s=now - self._view_at)

    def target(self, prefix_key: str | None = None) -> Replica | None:
        """Where a request goes: the least-loaded ready replica (running + waiting), unless it
        continues a prefix (a conversation, an agent's session) whose last turn went to a
        replica not more than ``AFFINITY_SLACK`` of a batch busier: there, as a prefix-aware
        router (llm-d's prefix scorer beside its load scorer) sends it, its history is
        probably still cached."""
        target = self._routed(prefix_key)
        if target is not None and prefix_key is not None:
            self._affinity[prefix_key] = target
        return target

    def _routed(self, prefix_key: str | None) -> Replica | None:
        """``target``'s choice, remembering nothing."""
        if not self.ready:
            return None
        target = self.ready[0]
        best = target.load
        for r in self.ready:
            if r.load < best:
                target, best = r, r.load
        if prefix_key is None:
            return target
        last = self._affinity.get(prefix_key)
        slack = max(1.0, AFFINITY_SLACK * self.scenario.engine.max_num_seqs)
        if last is not None and last.state == "ready" and last.load <= best + slack:
            target = last
        return target

    def _release(self, a: Attempt, completed: bool) -> None:
        """The attempt's stream ended (its answer, or its client gone): the ledger entry goes
        and the pool learns whether it met its deadline, as ``Gate.settle`` does."""
        if a.released:
            return
        a.released = True
        self.ledger.release(a.key, self.pool.name)
        self._wake()
        assert a.record is not None
        self.learning.settled(a.record, completed=completed, now=self.now,
                              key=a.key)

    def _wake(self) -> None:
        """Capacity came back: a pass over what is held, once the event at hand is done."""
        if self.queue and not self._pass_due:
            self._pass_due = True
            self._push(self.now, _PASS, None)

    def _retry_or_fail(self, a: Attempt) -> None:
        clients = self.scenario.clients
        if a.number < clients.max_retries:
            delay = clients.backoff_s(a.number, self.rng_clients)
            self._push(self.now + delay, _SEND, (a.job, a.number + 1))
            self._pending_sends += 1
        else:
            self.result.jobs_failed += 1

    def _timeout(self, a: Attempt) -> None:
        if a.finished_at >= 0.0:
            return
        a.abandoned = True
        self._release(a, completed=False)  # the stream ends with a cancellation
        if self.scenario.engine_aborts and a.replica is not None and a.replica.abort(a, self.now):
            self._finish([a])  # dropped from the engine's queue at once
        if self.scenario.clients.retry_on_timeout:
            self._retry_or_fail(a)
        else:
            self.result.jobs_failed += 1

    def _finish(self, done: list[Attempt]) -> None:
        res = self.result
        sample = self._sample
        for a in done:
            replica_left = a.finished_at if a.finished_at >= 0.0 else self.now
            if a.started_at >= 0.0:
                res.queue_delay_s += a.started_at - a.queued_at
            else:
                res.queue_delay_s += replica_left - a.queued_at
            res.gpu_s += a.gpu_s
            self._timed(a, replica_left)
            if a.finished_at >= 0.0:
                self.learning.finished(a.output_tokens, cut=a.output_tokens >= a.max_output_tokens)
                res.completed += 1
                self._window.completed += 1
                self._release(a, completed=True)
                latency = a.finished_at - a.arrival
                res.latencies_s.append(latency)
                res.ttfts_s.append(a.first_token_at - a.arrival)
                self._sample_latencies.append(latency)
                if a.good:
                    res.good += 1
                    if a.finished_at <= res.span_s:
                        res.good_in_span += 1
                    for g in a.groups:
                        res.tally(g).good += 1
                        res.tally(g).good_jobs.append(
                            (a.job.arrival_s, a.finished_at - a.job.arrival_s <= a.deadline_s))
                        if a.finished_at <= res.span_s:
                            res.tally(g).good_in_span += 1
                    res.jobs_good += 1
                    self._window.good += 1
                    sample.good += 1
                else:  # late: served past its deadline, or finished for a client gone
                    res.gpu_wasted_s += a.gpu_s
                    sample.late += 1
                if a.abandoned:
                    res.abandoned += 1
            else:  # dropped by the engine after its client left
                res.abandoned += 1
                res.gpu_wasted_s += a.gpu_s
                res.latencies_s.append(INF)
                res.ttfts_s.append(a.first_token_at - a.arrival if a.first_token_at >= 0.0
                                   and a.first_token_at <= self.now else INF)
                sample.dropped += 1

    def _timed(self, a: Attempt, left: float) -> None:
        """What the engines' latency histograms count of an attempt that left them (vLLM's
        count each token as it comes, finished or abandoned; counted here when it leaves); and
        every ``METRICS_S``, the round's means to the pool's learning, as ``Gate.learn_speed``
        hands them on."""
        t = self._timings
        if 0.0 <= a.first_token_at <= left:
            t[0] += a.first_token_at - a.queued_at
            t[1] += 1.0
            if a.generated > 1:
                t[2] += left - a.first_token_at
                t[3] += a.generated - 1
        if self.now - self._timed_at >= METRICS_S:
            if t[1] > 0 and t[3] > 0:
                self.learning.engine_speed(1000.0 * t[0] / t[1], 1000.0 * t[2] / t[3], self.now)
            self._timings, self._timed_at = [0.0, 0.0, 0.0, 0.0], self.now

    # ---- observation and control ----
    def _observe(self) -> Observation:
        now = self.now
        window = now - self._last_control
        d_busy = d_occ = d_work = ready_time = 0.0
        marks = self._marks
        for r in self.ready:
            r.accrue(now)
            seen_busy, seen_occ, seen_work = marks.get(r.index, (0.0, 0.0, 0.0))
            d_busy += r.busy_s - seen_busy
            d_occ += r.occupancy_s - seen_occ
            d_work += r.work_s - seen_work
            marks[r.index] = (r.busy_s, r.occupancy_s, r.work_s)
            ready_time += now - max(r.ready_at, self._last_control)
        oldest_wait = min((r.oldest_waiting() for r in self.ready), default=INF)
        held_since = self.queue.oldest()  # what the gateway holds (extproc.decision.defer)
        inflight = self._inflight
        while inflight and inflight[0].released:
            inflight.popleft()
        w = self._window
        obs = Observation(
            now_s=now, window_s=window, ready=len(self.ready),
            starting=sum(1 for r in self.replicas if r.state == "starting"),
            draining=sum(1 for r in self.replicas if r.state == "draining"),
            arrivals=w.arrivals, admitted=w.admitted, rejected=w.rejected,
            completed=w.completed, good=w.good,
            load=min(float(len(self.ready)), d_work / window) if window > 0 else 0.0,
            utilization=min(1.0, d_work / ready_time) if ready_time > 0 else 0.0,
            occupancy=min(1.0, d_occ / ready_time) if ready_time > 0 else 0.0,
            busy=min(1.0, d_busy / ready_time) if ready_time > 0 else 0.0,
            waiting=sum(len(r.waiting) for r in self.ready), held=len(self.queue),
            oldest_waiting_s=0.0 if oldest_wait == INF else now - oldest_wait,
            inflight=self.ledger.snapshot(self.pool.name).inflight,
            # (the gate's autoscaling window counts the held requests' age the same way)
            oldest_inflight_s=max(now - inflight[0].arrival if inflight else 0.0,
                                  now - held_since if held_since is not None else 0.0),
        )
        self._window = _Window()
        self._last_control = now
        return obs

    def _control(self) -> None:
        obs = self._observe()
        desired = max(0, self.recommender.recommend(obs))
        starting = [r for r in self.replicas if r.state == "starting"]
        have = len(self.ready) + len(starting)
        if desired > have:
            for _ in range(desired - have):
                self._add_replica(ready=False)
        elif desired < have:
            surplus = have - desired
            for r in reversed(starting):  # cancel what is not ready yet, newest first
                if surplus == 0:
                    break
                self._stop(r)
                surplus -= 1
            while surplus > 0 and len(self.ready) > 1:
                r = min(reversed(self.ready), key=lambda x: x.load)
                self.ready.remove(r)
                r.state = "draining"
                surplus -= 1
                if r.idle:
                    self._stop(r)
        self.result.peak_replicas = max(self.result.peak_replicas,
                                        len(self.ready) + len(starting))

    def _take_sample(self, progress: Callable[[float, float], None] | None) -> None:
        s, series = self._sample, self.result.series
        series.t.append(self.now)
        series.arrivals.append(s.arrivals)
        series.rejected.append(s.rejected)
        series.admitted.append(s.admitted)
        series.good.append(s.good)
        series.late.append(s.late)
        series.dropped.append(s.dropped)
        lat = self._sample_latencies
        series.p95_s.append(quantile(lat, 0.95) if lat else math.nan)
        series.ready.append(len(self.ready))
        series.starting.append(sum(1 for r in self.replicas if r.state == "starting"))
        series.waiting.append(sum(len(r.waiting) for r in self.ready))
        series.inflight.append(self.ledger.snapshot(self.pool.name).inflight)
        self.result.peak_replicas = max(self.result.peak_replicas,
                                        series.ready[-1] + series.starting[-1])
        self._sample = _Window()
        self._sample_latencies = []
        self.learning.decay(decay_factor(self.scenario.sample_s))
        self.ledger.expire()  # the sweeper: drops stale lease records (never a live entry)
        if progress is not None:
            progress(self.now, self.scenario.span_s)

    def _close(self, events: int) -> None:
        res = self.result
        res.events = events
        end = self.now
        for r in self.replicas:
            stop = min(r.stopped_at, end)
            if r.state in ("ready", "draining"):
                r.accrue(stop)
            res.replica_s += max(0.0, stop - r.started_at)
            if r.state != "starting" and r.ready_at <= stop:
                res.ready_replica_s += stop - r.ready_at
            res.idle_replica_s += max(0.0, stop - r.started_at) - r.busy_s
        res.final_replicas = len(self.ready)


@dataclass
class _Window:
    arrivals: int = 0
    admitted: int = 0
    rejected: int = 0
    completed: int = 0
    good: int = 0
    late: int = 0
    dropped: int = 0


def simulate(scenario: Scenario, policy: AdmissionPolicy,
             progress: Callable[[float, float], None] | None = None) -> Result:
    return Simulation(scenario, policy).run(progress)


