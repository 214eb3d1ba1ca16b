"""The admission step: from what a request asks to a verdict, the same in gateway and simulator.

``admit`` is everything between a parsed, counted request and its verdict that is policy and
not I/O: the class policy and the client's deadline header, the model's context length, the
request's cost from the pool's learned output lengths and its promise, the capacity the
decision sees (the engine, the learned mix, the interactive headroom for batch classes), the
engines' correction, ``decide`` itself, what becomes of an infeasible request, the Retry-After
hint, the lease and the ledger's ceiling. The gateway (``extproc.gateway.gate``) adds the I/O around
it (counting tokens, the ledger's snapshot and atomic reserve, metrics, logs, traces); the
simulator (``extproc.sim.run``) calls it with its own ledger and clock. A parity test drives
both with the same requests (``tests/test_step_parity.py``).

What becomes of a request, beyond ``decide``:

- **longer than the model's context** (``prompt + max_tokens`` past ``max_model_len``, each
  choice's as vLLM counts it, or the prompt alone when ``max_tokens`` is not sent): 400
  ``context_length_exceeded``, as vLLM answers it, but at once instead of after a wait in the
  engine's queue;
- **its cost**: charged ``(max_tokens or the pool default) x choices``, each choice a
  sequence (``Cost.sequences``), typically the mean of its class's learned lengths (capped
  there) and at least what it asked to be written (``min_tokens``; all of ``max_tokens``
  with ``ignore_eos``), its longest promised their ``q ** (1 / choices)``-quantile, ``q`` the
  class's promise (``extproc.decision.learning``); until the lengths hold ``PRIOR_SAMPLES`` observed
  outputs, the first ``PRIOR_SAMPLES`` requests in flight are promised the typical length
  (optimistic until measured, for a few: a prior's tail alone could refuse every request of a
  class whose answers are shorter than assumed, and teach nothing);
- **infeasible** (its typical length would miss its budget even on an idle replica):
  - if the client's deadline header made it so: 400 ``deadline_infeasible`` (a client-tightened
    deadline can get a request refused, never let it through unmanaged);
  - with ``infeasible: reject``: 400 ``deadline_infeasible``;
  - either only if alone it would miss the deadline (or first-token objective) itself, not
    only the safety factor's share of it (``misses_alone``); otherwise, as under pass:
  - with ``infeasible: pass`` (the default): it runs if a slot is free now and a typical
    interactive request after it would still be admitted (as for batch work, below; recorded
    in the ledger like any request), and otherwise gets a 429: it never waits in a queue in
    front of admitted work, nor slows the interactive classes past their objectives.
- **batch work** (a class with ``batch: true``) is admitted only into a free slot beyond the
  interactive classes' headroom (their measured demand in flight,
  ``extproc.decision.learning.Demand``, less the interactive requests running now, which the pool's
  count already holds), and only if a typical request of each interactive class the pool serves,
  arriving after it and after the headroom, would still be admitted: batch work takes only the
  capacity the interactive classes do not need for their objectives, slots and step time alike;
- **priorities, fair shares and tenant caps** (``extproc.decision.contention``): a tenant at a hard
  cap is refused; an admitted request of a lower priority, or of a tenant over its share of a
  contended pool, must still fit after the room kept for the traffic it must not crowd out;
- every request that runs is recorded, with a lease of its predicted completion plus
  ``ledger.lease_grace_ms``, and reserved against the decision's ceiling less the engines'
  correction (work the ledger does not know about must not widen the room other gateways get).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from extproc.config import Infeasible, Pool
from extproc.decision import contention
from extproc.decision.admission import (
    Capacity,
    Cost,
    Decision,
    Outcome,
    Policy,
    Reason,
    Reported,
    Snapshot,
    decide,
    release_quantile,
)
from extproc.decision.lengths import PRIOR_SAMPLES
from extproc.decision.level import Replica, measured, waiting_for_room
from extproc.decision.running import Running
from extproc.decision.share import priority_group, tenant_group
from extproc.errors import BadRequest, RequestError
from extproc.fleet.enginestats import Correction, kv_reported

if TYPE_CHECKING:
    from extproc.decision.learning import PoolLearning
    from extproc.decision.rules import Rules
    from extproc.fleet.engine import EngineModel
    from extproc.fleet.enginestats import EngineSample
    from extproc.ledger import Cap

NO_CORRECTION = Correction()


def reported(fix: Correction, sample: EngineSample | None, engine: EngineModel,
             need_tokens: float, *, named: bool) -> Correction:
    """``fix`` with what the engine of the replica a request goes to last reported
    (``sample``; None: no fresh report): how many wait there for a slot or KV memory and how
    many for compute (``level.waiting_for_room``, a typical request needing ``need_tokens``),
    or, with nothing running or waiting on a replica ``named`` for the request (by an endpoint
    picker, or the simulator's router), that it has nothing to do. The gate and the simulator
    both build the step's correction here."""
    if sample is None:
        return fix
    if named and (kv := kv_reported(sample, engine.kv_tokens)) is not None:
        fix = dataclasses.replace(fix, reported=kv)
    if sample.waiting > 0:
        room = waiting_for_room(sample, engine.max_num_seqs, engine.kv_tokens, need_tokens)
        return dataclasses.replace(fix, queued=room, prefilling=sample.waiting - room)
    if named and not sample.running:
        return dataclasses.replace(fix, idle=True)
    return fix


@dataclass(frozen=True, slots=True)
class Ask:
    """What the step needs to know of one request."""

    service_class: str
    prompt_tokens: int
    max_tokens: int | None  # as sent; None: the pool's default is charged
    choices: int = 1
    deadline_ms: float | None = None  # the client's deadline header, if any (validated)
    prefill_only: bool = False  # embeddings: no output
    # The simulator's oracle knows each answer's length and is promised exactly that; the
    # gateway never does (None).
    known_output_tokens: int | None = None
    tenant: str | None = None  # who is charged (extproc.gateway.tenant); None: attribution off
    priority: int = 0  # its priority level (extproc.decision.share)
    waited_ms: float = 0.0  # held this long by the gateway (decision.defer): off its deadline
    # The replica an endpoint picker in front of the gateway chose for it (``host:port``, from
    # Envoy's metadata: ``extproc.fleet.enginestats``), if one did; the gate asks its engine.
    destination: str | None = None
    # Its answer streams: a client that leaves aborts it at the engine, so its answer never
    # finishes there (``extproc.decision.learning``, "Answers nobody waited for"). A non-streaming
    # answer may be finished and thrown away, and then the engines count it themselves.
    streaming: bool = True
    # vLLM's sampling parameters that set what each sequence writes at least (the engine
    # stops no earlier): ``min_tokens``, or all it may with ``ignore_eos``.
    min_tokens: int = 0
    ignore_eos: bool = False
    # A digest of its body (the gateway's; the simulator's job): an earlier attempt of the same
    # request whose client left shows how long its answer is at least (``decision.retries``).
    # Never logged or exported.
    fingerprint: str | None = field(default=None, repr=False)

    @property
    def groups(self) -> tuple[str, ...]:
        """The ledger groups it counts in: its priority and its tenant."""
        if self.tenant is None:
            return (priority_group(self.priority),)
        return priority_group(self.priority), tenant_group(self.tenant)


@dataclass(frozen=True, slots=True)
class Admission:
    outcome: Outcome
    reason: Reason
    service_class: str
    policy: Policy
    cost: Cost
    decision: Decision | None = None
    error: RequestError | None = None
    lease_ms: float = 0.0  # when the request runs: its ledger entry's lease
    ceiling_ms: float | None = None  # ... and the reserve's atomic checks (None: no check)
    max_inflight: int | None = None  # ... the most requests in flight it tolerates
    unavoidable: float = 0.0  # chance it misses even alone (the promise's feedback)
    chance: float = 0.0  # predicted chance it misses its deadline (the promise's feedback)
    prefill_rate: float = 0.0  # the fleet's prompt tokens a second (``PoolLearning.admitted``)
    groups: tuple[str, ...] = ()  # its ledger groups (``Ask.groups``)
    priority: int = 0  # its priority level (``Ask.priority``)
    caps: tuple[Cap, ...] = ()  # its tenant's hard caps, for the reserve's atomic check
    at_ms: float = 0.0  # work per replica outstanding with it (the measured level's evidence)
    level_ms: float = 0.0  # the measured level it was decided at (``extproc.decision.level``)
    own_ms: float = 0.0  # its own work per replica (its charge over the ready replicas)
    alone: bool = False  # a replica had nothing to do
    limit: int = 0  # the admission limit its contention check met (0: none checked)
    alone_ms: float = 0.0  # its typical completion alone on an idle replica ...
    first_alone_ms: float = 0.0  # ... and its first token (``extproc.decision.defer``'s hold)
    share: float = 1.0  # this gateway's share of the pool's requests in flight (``admit``)
    streaming: bool = True  # ``Ask.streaming``
    fingerprint: str | None = field(default=None, repr=False)  # ``Ask.fingerprint``

    @property
    def kv_tokens(self) -> int:
        """The KV cache its ledger entry holds (``Cost.kv``)."""
        return round(self.cost.kv)

    def refused(self, reason: Reason, retry_after_ms: float | None = None) -> Admission:
        """This admission refused after all, for ``reason`` (a 429: held higher bands, a ledger
        that keeps refusing the reserve, a hold that ended): no ledger checks, and its decision
        refused with it (its Retry-After ``retry_after_ms`` when given)."""
        d = self.decision
        if d is not None:
            d = dataclasses.replace(d, outcome=Outcome.REJECT, reason=reason, ceiling_ms=None,
                                    retry_after_ms=(d.retry_after_ms if retry_after_ms is None
                                                    else retry_after_ms))
        return dataclasses.replace(self, outcome=Outcome.REJECT, reason=reason, decision=d,
                                   ceiling_ms=None, max_inflight=None)

    @property
    def runs(self) -> bool:
        """It goes to the engines (admitted, or passed as infeasible into a free slot)."""
        return self.outcome in (Outcome.ADMIT, Outcome.PASS)

    @property
    def load_ms(self) -> float | None:
        """The pool's outstanding work per replica it was decided on, its own not included
        (``PoolLearning.decided``); None: it was refused before the pool was looked at."""
        return self.at_ms - self.own_ms if self.decision is not None else None

    @property
    def retry_after_ms(self) -> float | None:
        return self.decision.retry_after_ms if self.decision is not None else None


def class_policy(rules: Rules, service_class: str, stated_ms: float | None) -> Policy:
    """The class's budget, its deadline tightened (never loosened) by the one the client
    stated in its header (``stated_ms``; None: none)."""
    cls = rules.classes[service_class]
    deadline_ms = cls.deadline_ms if stated_ms is None else min(cls.deadline_ms, stated_ms)
    return Policy(deadline_ms=deadline_ms, safety_factor=cls.safety_factor, ttft_ms=cls.ttft_ms,
                  batch=cls.batch)


def priority_of(rules: Rules, service_class: str, tenant: str | None,
                stated: int | None = None) -> int:
    """A request's priority: as stated (a header Envoy sets), else its tenant's, else its
    class's, else ``priority.default``."""
    if stated is not None:
        return stated
    if tenant is not None and (level := rules.tenant.policy(tenant).priority) is not None:
        return level
    cls = rules.classes.get(service_class)
    if cls is not None and cls.priority is not None:
        return cls.priority
    return rules.default_priority


def cost_of(ask: Ask, pool: Pool, learning: PoolLearning) -> Cost:
    """The charge rule ``(max_tokens or the pool default) x choices``, with the typical length
    and the promised one from the pool's learned lengths and the class's promise."""
    if ask.prefill_only:
        return Cost(ask.prompt_tokens, 0, 0.0, 0.0)
    most = ask.max_tokens or max(pool.default_max_tokens, ask.min_tokens)
    sequences = max(1, ask.choices)
    least = most if ask.ignore_eos else min(ask.min_tokens, most)  # it asked to be written
    lengths = learning.lengths_for(ask.service_class)
    typical = max(lengths.mean(most), least)
    if ask.known_output_tokens is not None:
        promised = float(ask.known_output_tokens)
    elif (lengths.seen < PRIOR_SAMPLES
          and learning.inflight.get(ask.service_class, 0) < PRIOR_SAMPLES):
        # Optimistic until measured, for a few: a quantile of a prior alone could refuse every
        # request of a class whose answers are shorter than assumed, and then nothing is
        # learned; promising everyone the typical length would fill a cold fleet far past its
        # objectives before the first answer ends.
        promised = typical
    else:
        # Its longest sequence: of ``s`` independent answers, all are within the ``q``-quantile
        # of one only with probability ``q ** s``; so the longest is promised ``q ** (1 / s)``.
        q = learning.promise(ask.service_class).quantile
        promised = max(lengths.quantile(q ** (1.0 / sequences)), least)
    return Cost(ask.prompt_tokens, most * sequences, typical, promised,
                max(lengths.held(most), least), sequences=sequences, least_tokens=least)


def capacity_for(pool: Pool, replicas: int, learning: PoolLearning,
                 headroom: float = 0.0, reported: Reported | None = None) -> Capacity:
    """What ``decide`` sees of the pool: its replicas, their engine, the learned mix, and the
    KV cache its engines last reported free where the request may go."""
    return Capacity(replicas=replicas, engine=pool.engine, mix=learning.mix(),
                    wait_quantile=pool.wait_quantile, headroom=headroom, reported=reported)


def prefill_rate(capacity: Capacity, inflight: int) -> float:
    """Prompt tokens the fleet prefills a second, steps full of chunks beside the decodes of
    ``inflight`` requests (at most a full batch a replica) (``Backlog``)."""
    if capacity.replicas <= 0:
        return 0.0
    batch = min(float(capacity.batch), inflight / capacity.replicas)
    return 1000.0 * capacity.replicas * capacity.batch_tokens_per_ms(batch)


def charge_of(ask: Ask, pool: Pool, learning: PoolLearning, replicas: int) -> float:
    """The ledger charge of ``ask`` (its GPU share in a full batch)."""
    return capacity_for(pool, replicas, learning).charge_ms(cost_of(ask, pool, learning))


def kv_of(ask: Ask, pool: Pool, learning: PoolLearning) -> int:
    """The KV tokens the ledger entry of ``ask`` holds (``Admission.kv_tokens``)."""
    return round(cost_of(ask, pool, learning).kv)


def admit(ask: Ask, pool: Pool, rules: Rules, learning: PoolLearning, snapshot: Snapshot,
          replicas: int, now: float, correction: Correction = NO_CORRECTION) -> Admission:
    """Decide one request (module docstring)."""
    whole = class_policy(rules, ask.service_class, ask.deadline_ms)
    policy = waited(whole, ask.waited_ms)
    cost = cost_of(ask, pool, learning)
    limit = pool.engine.max_model_len
    asked = ask.prompt_tokens + (ask.max_tokens or 0)  # each sequence's context
    if asked > limit or ask.prompt_tokens >= limit:
        too_long = BadRequest(
            f"This model's maximum context length is {limit} tokens; the request asks for"
            f" {asked} ({ask.prompt_tokens} in the prompt). Shorten the prompt or lower"
            " max_tokens.", code="context_length_exceeded")
        return Admission(Outcome.INVALID, Reason.CONTEXT_LENGTH, ask.service_class, policy, cost,
                         error=too_long)

    capacity = capacity_for(pool, replicas, learning,
                            learning.headroom(rules, now) if policy.batch else 0.0,
                            correction.reported)
    cost = _shown(cost, learning.shown.least(ask.fingerprint), capacity, policy)
    # The prefill backlog is this gateway's; behind several gateways it is the share of the
    # ledger's requests this one holds: the fleet's is that scaled up, draining at the
    # fleet's rate (this one's share of it drains at the same share of the rate).
    mine = sum(learning.inflight.values())
    share = min(1.0, mine / snapshot.inflight) if mine and snapshot.inflight else 1.0
    rate = prefill_rate(capacity, snapshot.inflight) * share  # this gateway's backlog's drain
    snapshot = dataclasses.replace(correction.apply(snapshot),
                                   prefill_tokens=learning.backlog.level(now, rate) / share)
    decision = decide(cost, snapshot, capacity, policy, now)
    if _replica(correction) is Replica.QUEUED:
        decision = _behind_queue(decision, correction, snapshot, policy, capacity)
    if not policy.batch and ask.known_output_tokens is None:  # (the oracle needs no measuring)
        decision = measured(decision, cost, snapshot, capacity, learning.level,
                            _left(whole, policy), _replica(correction),
                            policy.ttft_budget_ms) or decision
    outcome, reason = decision.outcome, decision.reason
    error: RequestError | None = None
    if reason is Reason.INFEASIBLE and ask.waited_ms > 0:
        # Held until too little of its deadline is left: overload's doing, not the ask's.
        outcome, reason = Outcome.REJECT, Reason.QUEUE_DEADLINE
        decision = dataclasses.replace(decision, outcome=outcome, reason=reason)
    elif reason is Reason.INFEASIBLE:
        tightened = policy.deadline_ms < rules.classes[ask.service_class].deadline_ms
        if (tightened or rules.infeasible is Infeasible.REJECT) and misses_alone(decision, policy):
            error = BadRequest(
                "request cannot finish within its deadline even on an idle fleet; lower"
                " max_tokens or raise the deadline", code="deadline_infeasible")
            outcome = Outcome.INVALID
        elif decision.position + capacity.headroom > 0 and not correction.idle:
            # Passing it would queue it in front of admitted work: only a free slot will do
            # (its own replica idle, as its engine reported, is one:
            # ``extproc.decision.level.measured``).
            slot_ms = (snapshot.outstanding_ms / snapshot.inflight if snapshot.inflight
                       else decision.charge_ms) / max(capacity.batch, 1)
            decision = dataclasses.replace(decision, outcome=Outcome.REJECT,
                                           retry_after_ms=max(slot_ms, 1.0))
            outcome = Outcome.REJECT
    scene = contention.Scene(rules, learning, snapshot, capacity, share, now)
    # A request that alone meets its objectives (only not their safety share), bound for a
    # replica its engine reports idle, is feasible work for idle capacity: it runs, whatever
    # it would leave the interactive classes (work conservation, docs/admission.md).
    conserved = (outcome is Outcome.PASS and correction.idle
                 and not misses_alone(decision, policy))
    if ((outcome is Outcome.ADMIT and policy.batch) or outcome is Outcome.PASS) and not conserved:
        crowded = _crowds_out(ask, cost, decision, pool, scene)
        if crowded is not None:
            decision, outcome = crowded, crowded.outcome
            reason = reason if reason is Reason.INFEASIBLE else crowded.reason
    caps = contention.caps(ask.tenant, rules)
    limit = 0
    if outcome in (Outcome.ADMIT, Outcome.PASS):
        changed = contention.at_cap(caps, decision, snapshot)
        if (changed is None and outcome is Outcome.ADMIT and snapshot.inflight >= replicas
                and not correction.idle):
            # (while a replica has nothing to do, no room is kept: ``extproc.decision.level``;
            # the replica this request goes to, as its engine reported, is one, whether the
            # model admitted it there or the level did, ``Reason.IDLE``)
            changed, limit = contention.room_for_others(
                ask.tenant, ask.priority, cost, decision, policy, scene)
        if changed is not None:
            decision, outcome, reason = changed, changed.outcome, changed.reason
    runs = outcome in (Outcome.ADMIT, Outcome.PASS)
    alone = (1.0 if outcome is Outcome.PASS  # infeasible: it misses, whatever load
             else unavoidable(cost, capacity, policy, learning, ask.service_class)
             if runs else 0.0)
    first = capacity.prefill_ms(cost.prompt_tokens, 0.0)
    ceiling, most = decision.ceiling_ms, decision.max_inflight
    if ceiling is not None:
        ceiling -= correction.extra_ms
    if most is not None:
        most -= correction.extra_inflight
    return Admission(
        outcome, reason, ask.service_class, policy, cost, decision, error,
        lease_ms=decision.completion_ms + rules.lease_grace_ms if runs else 0.0,
        ceiling_ms=ceiling if outcome is Outcome.ADMIT else None,
        max_inflight=most if outcome is Outcome.ADMIT else None,
        unavoidable=alone,
        chance=(max(alone, miss_chance(cost, decision, policy, learning, ask.service_class))
                if outcome is Outcome.ADMIT else alone),
        prefill_rate=rate, groups=ask.groups, priority=ask.priority, caps=caps,
        at_ms=(snapshot.outstanding_ms + decision.charge_ms) / max(replicas, 1),
        level_ms=learning.level.level_ms, own_ms=decision.charge_ms / max(replicas, 1),
        alone=snapshot.inflight < replicas, limit=limit,
        alone_ms=first + cost.typical * pool.engine.itl_ms(1, cost.prompt_tokens),
        first_alone_ms=first, share=share, streaming=ask.streaming,
        fingerprint=ask.fingerprint)


def _shown(cost: Cost, shown: float, capacity: Capacity, policy: Policy) -> Cost:
    """``cost``, or, where an earlier attempt of the request showed an answer of about
    ``shown`` tokens, more than its budget lets it write even alone, ``cost`` writing at least
    that: it is infeasible (``extproc.decision.retries``). A shorter showing changes nothing:
    read at the pool's mean step, it overstates what a request of a long context, or one that
    waited for KV memory or was preempted, wrote, and would price a retry that fits as one
    that does not."""
    shown = min(shown, cost.most)
    if shown <= longest_alone(cost, capacity, policy):
        return cost
    return dataclasses.replace(cost, typical_tokens=max(cost.typical, shown),
                               promised_tokens=max(cost.promised, shown),
                               least_tokens=max(cost.least_tokens, shown))


def _replica(correction: Correction) -> Replica:
    if correction.idle:
        return Replica.IDLE
    return Replica.QUEUED if correction.queued or correction.prefilling else Replica.UNSEEN


def _behind_queue(decision: Decision, correction: Correction, snapshot: Snapshot,
                  policy: Policy, capacity: Capacity) -> Decision:
    """The decision for a request bound for a replica whose engine reports requests waiting
    (``Correction``): it starts after them, and its first token and completion move by that
    wait. The ledger sees the pool's requests in sum, and a replica out of KV memory, or the
    one a prefix-aware router keeps a session on, holds a queue the sum does not show.

    - Waiting for a slot or KV memory (``queued``): ``queued + 1`` of the replica's releases,
      the ledger's mean charge each, at the model's quantile (as ``decide`` prices a queue
      for slots).
    - Waiting for compute (``prefilling``): their prompts (the traffic's mean each) prefilled
      first on that replica.

    That wait replaces the one ``decide`` priced for the pool's average queue (its slots and
    its prefill backlog) where it is longer; it is never added to it (the waiting requests
    are in the ledger's sum too).

    An admission the wait takes past its deadline or first-token budget is refused; a refusal
    comes back no sooner than the wait; and the measured level, which cannot see first
    tokens, does not let in what now starts too late (``extproc.decision.level``)."""
    if decision.reason is Reason.INFEASIBLE:
        return decision
    n = snapshot.inflight
    mean_ms = snapshot.outstanding_ms / n if n else decision.charge_ms
    slots_ms = (release_quantile(correction.queued + 1, capacity.wait_z) * mean_ms
                if correction.queued else 0.0)
    batch = min(float(capacity.batch), n / max(capacity.replicas, 1))
    prompts_ms = (correction.prefilling * capacity.mix.prompt_tokens
                  / capacity.batch_tokens_per_ms(batch))
    wait_ms = slots_ms + prompts_ms - decision.wait_ms  # (the pool's queue, on average)
    if wait_ms <= 0:
        return decision
    moved = dataclasses.replace(
        decision, wait_ms=decision.wait_ms + wait_ms, ttft_ms=decision.ttft_ms + wait_ms,
        completion_ms=decision.completion_ms + wait_ms,
        finish_at=decision.finish_at + wait_ms / 1000.0)
    if decision.outcome is Outcome.REJECT:
        return dataclasses.replace(moved, retry_after_ms=max(decision.retry_after_ms or 0.0,
                                                             wait_ms))
    budget = policy.ttft_budget_ms
    late_first = budget is not None and moved.ttft_ms > budget
    if decision.outcome is not Outcome.ADMIT or not (
            late_first or moved.completion_ms > policy.budget_ms):
        return moved
    return dataclasses.replace(moved, outcome=Outcome.REJECT,
                               reason=Reason.TTFT if late_first else Reason.DEADLINE,
                               ceiling_ms=None, max_inflight=None,
                               retry_after_ms=max(wait_ms, 1.0))


def misses_alone(decision: Decision, policy: Policy) -> bool:
    """Whether an infeasible request (``decision``: its typical length alone on an idle
    replica) would miss its deadline or first-token objective themselves, not only the
    safety factor's share of them (the margin for predictions under load): only then is it
    refused with a 400."""
    return decision.completion_ms > policy.deadline_ms or (
        policy.ttft_ms is not None and decision.ttft_ms > policy.ttft_ms)


def _left(whole: Policy, now: Policy) -> float:
    """The share of its budget (its deadline, and its first-token objective if it has one) a
    request the gateway held still has (1: not held)."""
    left = now.deadline_ms / whole.deadline_ms
    if whole.ttft_ms and now.ttft_ms is not None:
        left = min(left, now.ttft_ms / whole.ttft_ms)
    return left


def waited(policy: Policy, waited_ms: float) -> Policy:
    """The budget left to a request the gateway held ``waited_ms``: its deadline and its
    first-token objective count from its arrival."""
    if waited_ms <= 0:
        return policy
    return dataclasses.replace(
        policy, deadline_ms=policy.deadline_ms - waited_ms,
        ttft_ms=None if policy.ttft_ms is None else policy.ttft_ms - waited_ms)


def running_of(adm: Admission, now: float) -> Running:
    """The record of an admitted request (``extproc.decision.running``), made once, at ``now``."""
    d = adm.decision
    return Running(adm.service_class, now, deadline_s=adm.policy.deadline_ms / 1000.0,
                   batch=adm.policy.batch, groups=adm.groups,
                   expected_s=d.completion_ms / 1000.0 if d else 0.0,
                   prefill_rate=adm.prefill_rate,
                   ttft_ms=d.ttft_ms if d else 0.0, step_ms=d.step_ms if d else 0.0,
                   chance=adm.chance, unavoidable=adm.unavoidable,
                   prompt_tokens=adm.cost.prompt_tokens,
                   at_ms=adm.at_ms,
                   level_ms=(adm.level_ms if adm.outcome is Outcome.ADMIT
                             and adm.reason is not Reason.IDLE else -1.0),
                   own_ms=adm.own_ms, alone=adm.alone,
                   measured=adm.reason in (Reason.MEASURED, Reason.IDLE), share=adm.share,
                   streaming=adm.streaming, fingerprint=adm.fingerprint)


def _crowds_out(ask: Ask, cost: Cost, decision: Decision, pool: Pool,
                scene: contention.Scene) -> Decision | None:
    """A batch request (or an infeasible one passed) is admitted only if the interactive
    classes' own requests would still be: for each interactive class the pool serves, a
    request of its typical size arriving after this one (its prompt prefilled first) and after
    the headroom (its measured demand in flight) must pass its own decision. Otherwise it is
    refused (``NO_CAPACITY``): the room is the interactive classes'. Returns the refusal, or
    None."""
    rules, learning, snapshot, capacity, now = (
        scene.rules, scene.learning, scene.snapshot, scene.capacity, scene.now)
    n = snapshot.inflight
    # A slot is held once: the interactive requests running now hold theirs in ``n``, and the
    # batch headroom is what they need beyond it (``PoolLearning.headroom``). Their work
    # and KV count in full: what runs now grows as it decodes, and the headroom's share of it
    # is the margin (without it, on a KV-bound fleet, batch work filled the KV cache the
    # latency class needed: docs/admission.md).
    headroom = math.ceil(capacity.headroom)
    batch = rules.classes[ask.service_class].batch  # (else: an infeasible request passed)
    grows = math.ceil(learning.demand.needed(now)) if batch else 0
    mean_ms = (snapshot.outstanding_ms / n) if n else decision.charge_ms
    mean_kv = (snapshot.kv_tokens / n) if n else cost.kv
    after = Snapshot(n + cost.sequences + headroom,
                     snapshot.outstanding_ms + decision.charge_ms + grows * mean_ms,
                     round(snapshot.kv_tokens + cost.kv + grows * mean_kv),
                     snapshot.prefill_tokens + cost.prompt_tokens)
    plain = dataclasses.replace(capacity, headroom=0.0)
    prompt = round(capacity.mix.prompt_tokens)
    for other in learning.interactive_classes(rules):
        probe = cost_of(Ask(other, prompt, None), pool, learning)
        seen = decide(probe, after, plain, class_policy(rules, other, None), now)
        if not seen.admitted and seen.reason is not Reason.INFEASIBLE:  # (ours to prevent)
            return dataclasses.replace(decision, outcome=Outcome.REJECT,
                                       reason=Reason.NO_CAPACITY, ceiling_ms=None,
                                       retry_after_ms=max(mean_ms / max(plain.batch, 1), 1.0))
    return None


def miss_chance(cost: Cost, decision: Decision, policy: Policy, learning: PoolLearning,
                service_class: str) -> float:
    """The chance the admitted request misses its deadline as predicted: its answer longer
    than what its deadline leaves after its predicted first token at its predicted step."""
    if cost.max_output_tokens <= 0 or decision.step_ms <= 0:
        return 0.0
    fits = (policy.deadline_ms - decision.ttft_ms) / decision.step_ms
    if fits >= cost.most:
        return 0.0
    if fits < cost.least_tokens:
        return 1.0
    return learning.lengths_for(service_class).survival(max(0.0, fits))


def longest_alone(cost: Cost, capacity: Capacity, policy: Policy) -> float:
    """The longest answer the request could write within its budget alone on an idle
    replica: its prefill, then a decode step of one sequence a token."""
    room_ms = policy.budget_ms - capacity.prefill_ms(cost.prompt_tokens, 0.0)
    return room_ms / capacity.engine.itl_ms(1, cost.prompt_tokens)


def unavoidable(cost: Cost, capacity: Capacity, policy: Policy, learning: PoolLearning,
                service_class: str) -> float:
    """The chance the request's answer is too long for its budget even alone on an idle
    replica (``extproc.decision.learning``: such misses do not tighten the promise)."""
    if cost.max_output_tokens <= 0:
        return 0.0
    longest = longest_alone(cost, capacity, policy)
    if longest >= cost.most:
        return 0.0
    if not math.isfinite(longest):
        return 0.0
    if longest < cost.least_tokens:
        return 1.0
    return learning.unavoidable_lengths(service_class).survival(max(0.0, longest))

