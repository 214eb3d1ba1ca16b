"""The measured level: how many requests per replica the pool has been *seen* to serve in time.

The admission model (``extproc.decision.admission.decide``, held to its target by the promise,
``extproc.decision.learning.Promise``) predicts; this measures. Every admitted request is resolved
when its deadline comes (``PoolLearning.resolve``): a hit or a miss, at the level it was admitted
at (a hit raises the level already when it completes), ``at = (outstanding work, its own
included) / ready replicas`` from the ledger's snapshot (every gateway's requests, so each
gateway replica measures the same pool). The step
(``extproc.decision.step.admit``) admits a feasible request the model refused whenever the pool
holds less work than ``level x replicas`` (or a replica has nothing to do) and a replica has a free
slot for it (its sequence limit and its KV cache): the model may admit more than the measured
level, never less. The level is in the ledger's unit, outstanding work per replica (each
request's charge, ``Decision.charge_ms``): a count would let a long request in wherever a
short one was seen to fit.

The invariants (``docs/admission.md``):

- **Work conservation.** While a replica has nothing to do (fewer requests in flight than
  ready replicas), a feasible request is admitted, whatever the learned state, and no room is
  kept for higher priorities (``extproc.decision.step``).
- **Cold start.** A fresh level is 0: the model decides, and the idle replicas are used
  (work conservation). A burst that reaches a fresh gateway before anything has ended gets
  what the model admits, not every free slot: the level is what was *seen*, and nothing was.
- **Recovery.** A request admitted at the top of the level (``at >= FRONTIER x level``) that
  completes within its deadline is evidence that the pool serves ``at`` in time: the level rises
  at once (``completed``: clocked by completions, as TCP's slow start is by acknowledgements,
  not by deadlines) to what that supports if it is higher. If the level admitted it (the model
  had refused), that is ``PROBE x at`` (slow start), or ``CREEP x at`` within ``CLEAN`` top
  resolutions of a back-off; if the model admitted it, ``at`` plus its own charge (one request
  more): the level follows the model's admissions closely, and probes past them only where the
  model refuses and measurement says it need not. So refusals that measurement does not back
  loosen by themselves, as fast as the pool's answers end: from nothing, a 16-slot pool whose
  answers end in a second is full within a dozen seconds of a 20 s deadline
  (``tests/test_no_harm.py``). Completions of requests admitted before a back-off do not undo it
  (``PoolLearning``).
- **Congestion.** While the engines' last scrape round found a replica holding requests waiting with
  a free slot and KV room for a typical request (waiting for compute, the step's token budget, which
  neither the slots nor the KV check the level makes can see: ``waits_for_compute``), a completion
  at the top supports one request more, not a multiple: the misses of an overshoot come a deadline
  after it, the queue at once (the level probes the way TCP's congestion avoidance does after a
  delay signal). A queue for slots or memory is the admission's own checks' business; on a
  prefix-aware router's busy replica, with the KV cache full, it read as congestion and cost agentic
  traffic 0.73-0.83x its goodput (docs/admission.md).
- **Back-off.** Misses of requests admitted at the top beyond what the baseline allows, by more
  than a Poisson deviation (``over``), resolved at their deadline (``settled``: a long answer
  may still miss after the short ones beside it ended), cut the level by ``BACKOFF``; the
  evidence starts again. One overload cuts once per step down: a request admitted above where
  the level now is (before a cut) is not evidence against it, hit or miss. Counted one by one,
  an overshoot's misses, which all come a deadline after it, cut the level to nothing
  (measured: ~400 in flight to ~10 on priority/70b-vllm at 0.8x, refusing while replicas sat
  idle); counting only those admitted after the cut instead kept the level up through
  overloads (azure-code/70b-vllm 1.5x: attainment 77 % to 42 %).
- **A tail is not a slow pool.** A miss at the top counts toward a back-off in proportion to
  how much of their deadlines the top's hits used (``weight``), in full from ``SLOW_SHARE``
  up. Where the answers served in time take a few percent of their budgets and a tenth of
  the answers, far longer, miss (a long tail that fits alone but not in a busy batch), the
  pool is not slow for its requests: a back-off saves the tail only by refusing most of what
  it would serve, and the cuts cascaded into refusing half the traffic a plain limit serves
  (bimodal/70b-vllm, seed 1: the hits used 2.7 % of their deadlines). Where the pool is slow
  for everyone, its hits take a good share of their deadlines too (a quarter and more on every
  other family measured), and its misses count in full; a brake too weak makes the hits slower,
  and their weight rises with them (the share of hits close to the deadline, by contrast,
  empties as an overload deepens: measured, docs/admission.md).
- **What the level lets in, it answers for.** A request the level admitted below its top (the
  model had refused it, so the promise leaves it to the level) counts as the top's evidence,
  wherever the pool stood, while the pool is slow for everyone (``weight`` at 1). Read at the
  top only, such requests were read by nobody: where the sequence slots, the KV cache or a
  first-token prediction bind below the level, no request reaches its top, and 40-96 % of
  what ran on the cells short of attainment went unread (azure-code/70b-vllm 1.5x seed 1:
  1,718 requests, 24 % of them missed). Beside fast hits (a tail), they count at the top
  only: counted wherever, bimodal's tail misses at every load cut the level where a back-off
  cannot help. The way up stays the top's: a completion below it raises nothing (climbing on
  what never tested it, the level overshot a steady tenant's share: docs/admission.md).
  The weight that decides it reads every request the level answers for (the top's and its
  own below it), not only those it let count: read from those alone it froze, just under 1,
  wherever nothing reached the top again (azure-code/70b-16 1.5x: from the first minute on,
  3,375 of the level's own admissions unread, 5.4 % of them missed).
- **Unavoidable misses never tighten.** The baseline is the miss rate measured at low load
  (requests admitted while a replica had nothing to do), with the model's chance of
  missing even alone (``extproc.decision.step.unavoidable``) as its prior for ``PRIOR_REQUESTS``
  requests: misses that happen at low load too are what the top may also have, plus the target's
  1%. A workload where one answer in five cannot finish in time at any load keeps its level.

- **What it cannot see, it does not overrule.** The level is measured on each admitted stream's
  end against its deadline; the gateway sees no first token. So a request the model predicts
  to start too late for its class's first-token objective (a crowd's prompts still to prefill
  ahead of it) is not let in by the level, however high it stands; only a replica with nothing
  to do admits it (work conservation). Overruling that too, the level let in 245 requests the
  model had predicted to start late on flash-crowd/70b-vllm 0.8x; 203 of them missed their
  first-token objective, and nothing the level measures said so (docs/admission.md).

Requests the level admitted against the model's prediction do not move the promise (their
chance of missing, as the model predicts it, is high by construction, and counting them would
tighten the model for what the measurement already governs).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from extproc.decision.admission import Capacity, Cost, Decision, Outcome, Reason, Snapshot

if TYPE_CHECKING:
    from extproc.fleet.enginestats import EngineSample

FRONTIER = 0.8  # a request admitted at this share of the level or more tests the level
PROBE = 1.5  # until the first back-off, a hit at the top the level admitted supports this ...
CREEP = 1.1  # ... and this after it (at least one request more for the fleet)
BACKOFF = 0.8  # the level's cut when the top misses more than the baseline allows
MEMORY = 0.98  # each top resolution's weight decays by this per later one (~50 resolutions)
CLEAN = 50  # top resolutions after a back-off without another: probing again (``PROBE``)
PRIOR_REQUESTS = 20.0  # the model's unavoidable chance counts as this many low-load requests
SLOW_SHARE = 1.0 - BACKOFF  # hits using this share of their deadlines: the misses count in full


@dataclass
class Level:
    """The measured level of one pool (module docstring), in the ledger's unit: outstanding
    work (ms of GPU time, ``Decision.charge_ms`` each) per ready replica."""

    level_ms: float = 0.0  # unmeasured: the model and the idle replicas decide
    probing: bool = True  # no back-off in the last ``CLEAN`` top resolutions (else ``CREEP``)
    _since: int = 0  # top resolutions since the last back-off
    target: float = 0.99  # of admitted requests in time (``extproc.decision.learning``'s target)
    _low: float = 0.0  # resolutions of requests admitted while a replica had nothing to do
    _low_missed: float = 0.0  # ... and their misses
    _prior: float = 0.0  # the model's mean unavoidable chance over resolutions, decayed
    _priors: float = 0.0
    _top: float = 0.0  # resolutions at the top since the last back-off, decayed
    _top_missed: float = 0.0
    _top_allowed: float = 0.0  # ... and the misses the baseline allows them
    # Decayed per resolution the level answers for (the top's, and its own admissions below
    # it), never reset by a back-off (``weight``): the shares of their deadlines its hits
    # used, summed; those hits; and its misses.
    _used: float = 0.0
    _hits: float = 0.0
    _misses: float = 0.0

    @property
    def baseline(self) -> float:
        """The miss rate at low load: measured, with the model's unavoidable chance as prior."""
        prior = self._prior / self._priors if self._priors else 0.0
        return (self._low_missed + PRIOR_REQUESTS * prior) / (self._low + PRIOR_REQUESTS)

    @property
    def weight(self) -> float:
        """What a miss at the top counts (module docstring, "A tail is not a slow pool"): the
        mean share of their deadlines the hits the level answers for used (the top's, and its
        own admissions below it), over ``SLOW_SHARE``, at most 1; 1 before any hit, and while
        they miss as often as they hit (a pool that misses most of what it serves is slow,
        whatever its few hits say)."""
        if self._hits <= 0.0 or self._misses >= self._hits:
            return 1.0
        return min(1.0, self._used / self._hits / SLOW_SHARE)

    @property
    def over(self) -> bool:
        """The top misses more than the baseline allows, by more than two Poisson deviations."""
        allowed = self._top_allowed
        return self._top_missed > allowed + 2.0 * math.sqrt(allowed) + 1.0

    def settled(self, missed: bool, at_ms: float, level_ms: float, *, alone: bool = False,
                unavoidable: float = 0.0, used: float | None = None,
                measured: bool = False) -> None:
        """A request admitted with ``at_ms`` of work per replica outstanding (its own
        included), when the level was ``level_ms``, was resolved at its deadline: ``missed``
        it or not. ``alone``: a replica had nothing to do when it was admitted;
        ``unavoidable``: the model's chance that it misses even alone; ``used``: a hit's time
        in flight over its deadline (None: not known); ``measured``: the level admitted it
        against the model. Misses at the top beyond the baseline, each counting ``weight``,
        cut the level; a hit raised it already, when it completed (``completed``). The level's
        own admissions count wherever the pool stood while it is slow for everyone (module
        docstring, "What the level lets in, it answers for")."""
        self._prior += unavoidable
        self._priors += 1.0
        if alone:
            self._low += 1.0
            self._low_missed += 1.0 if missed else 0.0
        top = at_ms >= FRONTIER * level_ms
        if not (top or measured):
            return  # below the top, the model's admission: the promise's
        share = None if missed else used  # a hit's share of its deadline, if known
        self._used = self._used * MEMORY + (share or 0.0)
        self._hits = self._hits * MEMORY + (0.0 if share is None else 1.0)
        self._misses = self._misses * MEMORY + (1.0 if missed else 0.0)
        if not top and self.weight < 1.0:
            return  # the level's own below its top, beside fast hits
        if at_ms > self.level_ms:
            return  # admitted above where a back-off has put the level since: not its evidence
        self._since += 1
        if self._since >= CLEAN:
            self.probing = True
        self._top = self._top * MEMORY + 1.0
        self._top_missed = self._top_missed * MEMORY + (self.weight if missed else 0.0)
        base = self.baseline
        self._top_allowed = self._top_allowed * MEMORY + base + (1.0 - base) * (1.0 - self.target)
        if missed and self.over:
            self.level_ms *= BACKOFF
            self.probing, self._since = False, 0
            self._top = self._top_missed = self._top_allowed = 0.0

    def completed(self, at_ms: float, level_ms: float, step_ms: float, *,
                  measured: bool = False, queued: bool = False) -> None:
        """A request admitted at ``at_ms`` (the level ``level_ms`` then) completed within its
        deadline: if it ran at the top, the pool served ``at_ms`` in time, and the level rises
        to what that supports at once (its statistics wait for its deadline: ``settled``).
        ``measured``: the level admitted it (the model had refused); ``queued``: the engines
        hold requests waiting for compute (module docstring, "Congestion"), and it supports
        one request more, not a multiple."""
        if at_ms < FRONTIER * level_ms:
            return
        factor = (PROBE if self.probing else CREEP) if measured and not queued else 1.0
        self.level_ms = max(self.level_ms, at_ms * factor, at_ms + step_ms)

    def decay(self, factor: float) -> None:
        """Forget a round's worth of the low-load baseline (as the lengths are forgotten)."""
        self._low *= factor
        self._low_missed *= factor
        self._prior *= factor
        self._priors *= factor


MEASURABLE = (Reason.DEADLINE, Reason.TTFT, Reason.KV_CACHE)  # what the level overrules


def waits_for_compute(sample: EngineSample, max_num_seqs: int, kv_tokens: int,
                      need_tokens: float) -> bool:
    """Whether a replica's engine (one scrape's ``sample``) holds requests waiting while it has
    a free sequence slot and KV cache room for ``need_tokens`` (a typical request's prompt and
    answer): they wait for compute, the step's token budget, not for the slots or memory the
    admission checks (module docstring, "Congestion"). ``kv_tokens``: the configured cache
    (0: not bounded), the engine's own report when it made one; no KV usage reported: room."""
    if sample.waiting <= 0 or sample.running >= max_num_seqs:
        return False
    free = sample.kv_free(kv_tokens)
    return free is None or free >= need_tokens


def waiting_for_room(sample: EngineSample, max_num_seqs: int, kv_tokens: int,
                     need_tokens: float) -> int:
    """How many of the requests a replica's engine (one scrape's ``sample``) holds waiting
    wait for a sequence slot or KV memory: all of them, unless they wait for compute
    (``waits_for_compute``: a slot and room for ``need_tokens`` are free)."""
    if sample.waiting <= 0 or waits_for_compute(sample, max_num_seqs, kv_tokens, need_tokens):
        return 0
    return sample.waiting


class Replica(enum.Enum):
    """What the engine of the replica a request goes to last reported, after the last request
    sent there (``extproc.fleet.enginestats.Correction``)."""

    UNSEEN = "unseen"  # no fresh report of it
    IDLE = "idle"  # nothing running or waiting
    QUEUED = "queued"  # requests waiting (for a slot, KV memory or compute)


def measured(decision: Decision, cost: Cost, snapshot: Snapshot, capacity: Capacity,
             level: Level, left: float = 1.0, replica: Replica = Replica.UNSEEN,
             ttft_budget_ms: float | None = None) -> Decision | None:
    """The model refused a feasible request (``MEASURABLE``); it is admitted (``MEASURED``)
    if a replica has a free slot for it (its sequence limit and its KV cache) and either a
    replica has nothing to do or the pool's work, with it, is within the measured level (and
    its first token is predicted within ``ttft_budget_ms``). The
    ledger's atomic checks: that work and those slots. None: it stays as decided.

    ``replica`` IDLE: the replica the request goes to has nothing to do, as its own engine reported
    after the last request this gateway sent there (``extproc.fleet.enginestats``: an endpoint
    picker in front of the gateway named it). Then it is admitted (``IDLE``) if it fits that
    replica's KV cache alone, whatever the pool as a whole holds: the ledger sees the pool's
    work and KV only in sum, and behind a prefix-aware router, which keeps sessions on the
    replica holding their history, one replica can empty while the sum reads full; refusing
    its sessions then keeps it empty (measured: agentic/70b-vllm refused work an idle replica
    would have done in 27-35 % of the run). No ledger check: the engine's report is the
    check, and one request per report is what it covers.

    ``replica`` QUEUED: the replica the request goes to reports requests waiting: that one is
    not a replica with nothing to do, whatever the pool's sum says.

    ``ttft_budget_ms``: its class's first-token budget (None: no objective): the level, which
    sees only deadlines, does not admit a request predicted to start past it (module
    docstring, "What it cannot see"); a replica with nothing to do still does.

    ``left``: the share of its budget a request the gateway held still has
    (``extproc.decision.defer``). What the level saw served in time had its whole deadline; work
    drains in proportion to time, so such a request is held to that share of the level."""
    if decision.reason not in MEASURABLE:
        return None
    n, replicas = snapshot.inflight, capacity.replicas
    fits_alone = cost.kv <= (capacity.engine.kv_tokens or math.inf)  # (0: not bounded)
    if replica is Replica.IDLE and fits_alone:
        return dataclasses.replace(
            decision, outcome=Outcome.ADMIT, reason=Reason.IDLE, retry_after_ms=None,
            ceiling_ms=None, max_inflight=None)
    free = capacity.slots_with(snapshot, cost)
    work = snapshot.outstanding_ms + decision.charge_ms
    room = level.level_ms * replicas * min(1.0, max(0.0, left))
    within_level = (replicas > 0 and work <= room
                    and (ttft_budget_ms is None or decision.ttft_ms <= ttft_budget_ms))
    spare = n < replicas and replica is not Replica.QUEUED  # a replica with nothing to do
    if n + cost.sequences > free or not (spare or within_level):
        return None
    return dataclasses.replace(
        decision, outcome=Outcome.ADMIT, reason=Reason.MEASURED, retry_after_ms=None,
        ceiling_ms=max(work, room), max_inflight=free)
