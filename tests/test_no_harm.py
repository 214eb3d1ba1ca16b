"""Do no harm (docs/admission.md, "The invariants"): the decision cannot latch into refusing.

Each test drives the one admission protocol the gateway and the simulator share: ``arrived``,
the read-only ``admit``, ``admitted`` for what runs, ``settled`` when its stream ends and
``refresh`` when deadlines come (``extproc.decision.learning``, ``extproc.decision.step``), on a
pool whose learned lengths are bimodal (four answers in five of 20 tokens, one of 1,500): the
promise's quantile is the long answer, which the model says cannot finish beside others.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import pickle
import random

import pytest

from extproc import config as config_mod
from extproc.decision import contention
from extproc.decision.admission import Outcome, Reason, Snapshot
from extproc.decision.learning import SPEED_MAX_AGE_S, PoolLearning, learning_for
from extproc.decision.level import BACKOFF, Level
from extproc.decision.rules import Rules
from extproc.decision.running import Running
from extproc.decision.share import CRITICAL, SHEDDABLE
from extproc.decision.step import (
    Admission,
    Ask,
    admit,
    capacity_for,
    cost_of,
    longest_alone,
    running_of,
)
from extproc.fleet.enginestats import Correction, EngineSample
from extproc.sim import evaluate, families, policies
from extproc.sim.run import Simulation
from extproc.sim.workload import Job

R = 4  # replicas
SLOTS = 16
DEADLINE_S = 20.0
CONFIG = config_mod.from_mapping({
    "pools": [{"name": "llm", "replicas": R,
               "engine": {"max_num_seqs": SLOTS, "max_model_len": 32768, "num_gpu_blocks": 0},
               "expected_output_tokens": 200, "long_output_tokens": 1500}],
    "classes": {"latency": {"deadline_ms": DEADLINE_S * 1000, "ttft_ms": 3000}},
})
RULES = Rules.of(CONFIG)
POOL = CONFIG.pools[0]


def bimodal() -> PoolLearning:
    learning = learning_for(POOL)
    for i in range(500):
        learning.finished(1500 if i % 5 == 0 else 20)
    return learning


def ask(priority: int = 0) -> Ask:
    return Ask("latency", 500, 2048, priority=priority)


def at(n: int, learning: PoolLearning) -> Snapshot:
    """``n`` requests like ``ask()`` in flight."""
    charge = admit(ask(), POOL, RULES, learning, Snapshot(0, 0.0), R, 0.0).decision
    assert charge is not None
    return Snapshot(n, n * charge.charge_ms)


def decide_at(learning: PoolLearning, n: int, now: float, a: Ask | None = None) -> Admission:
    a = a or ask()
    learning.arrived(a.service_class, False, now, a.prompt_tokens, a.groups)
    adm = admit(a, POOL, RULES, learning, at(n, learning), R, now)
    learning.decided(adm.limit, adm.load_ms, now)
    return adm


def fill(learning: PoolLearning, now: float, deadline_s: float | None = None
         ) -> list[Running]:
    """Requests arrive at one pool until one is refused; those admitted run (their records;
    ``deadline_s``: each given that deadline instead of its class's)."""
    admitted: list[Running] = []
    while len(admitted) < R * SLOTS:
        adm = decide_at(learning, len(admitted), now)
        if not adm.runs:
            break
        running = running_of(adm, now)
        if deadline_s is not None:
            running = dataclasses.replace(running, deadline_s=deadline_s)
        learning.admitted(running, key=f"{now}/{len(admitted)}")
        admitted.append(running)
    return admitted


def generation(learning: PoolLearning, now: float, missed: float = 0.0) -> tuple[int, float]:
    """Fill the pool; its requests end (a share ``missed`` of them late, spread over every
    level) and are resolved at their deadline. Returns (admitted, the time after)."""
    admitted = fill(learning, now)
    rng = random.Random(f"{now}")
    for i, running in enumerate(admitted):
        late = rng.random() < missed
        seconds = DEADLINE_S * (1.5 if late else 0.5)
        learning.settled(running, completed=True, now=now + seconds, key=f"{now}/{i}")
    later = now + 2 * DEADLINE_S
    learning.refresh(later)
    return len(admitted), later


def end(learning: PoolLearning, admitted: list[Running], started: float, seconds: float
        ) -> None:
    """The requests ``fill`` admitted at ``started`` end, completed, after ``seconds``."""
    for i, running in enumerate(admitted):
        learning.settled(running, completed=True, now=started + seconds, key=f"{started}/{i}")


def strictest() -> PoolLearning:
    """The bimodal pool with its level at the bottom: one request per replica."""
    learning = bimodal()
    learning.level.level_ms = 0.0
    return learning


def test_the_model_alone_is_strict_here() -> None:
    """The premise: without measurement, the strict promise lets one request per replica in."""
    assert decide_at(strictest(), R, 0.0).reason is Reason.DEADLINE


def test_cold_start_a_burst_on_a_fresh_gateway_is_not_let_past_the_model() -> None:
    """Unmeasured, the level trusts the model and the idle replicas: a burst that arrives at
    once, before anything has ended, gets what the model admits, not every free slot."""
    admitted = fill(bimodal(), 0.0)
    assert R <= len(admitted) <= 2 * R, len(admitted)


def test_cold_start_the_level_climbs_as_requests_complete_not_as_deadlines_come() -> None:
    """The way up is clocked by completions in time (as TCP's slow start is by
    acknowledgements): short answers that end in a second raise the level within seconds
    of a 20 s deadline, before any deadline has come."""
    learning = bimodal()
    now, seen = 0.0, []
    for _ in range(12):  # each round: fill, every request ends in time after 1 s
        admitted = fill(learning, now)
        seen.append(len(admitted))
        end(learning, admitted, now, 1.0)
        now += 1.0
    assert now < DEADLINE_S  # no deadline has come
    assert seen[0] <= 2 * R and seen[-1] == R * SLOTS, seen


def test_while_the_engines_queue_for_compute_the_level_climbs_a_request_at_a_time() -> None:
    """Congestion (docs/admission.md): while the engines' last scrape round found requests
    waiting for compute, a completion at the top supports one request more, not a multiple;
    a round without the queue, or none for longer than a stale scrape counts, and the level
    probes again. The same climb as the cold start's, two ways."""

    def climb(queued: bool, every_round: bool = True) -> list[int]:
        """The cold start's climb, the engines scraped each second (or only at its start)."""
        learning = bimodal()
        now, seen = 0.0, []
        for _ in range(12):
            if every_round or now == 0.0:
                learning.engines_round([EngineSample(1 if queued else 0, 1, 0.0)], POOL.engine, now)
            admitted = fill(learning, now)
            seen.append(len(admitted))
            end(learning, admitted, now, 1.0)
            now += 1.0
        return seen

    probing = climb(False)  # every round: no queue
    queued = climb(True)  # every round: a compute queue
    assert probing[-1] == R * SLOTS and queued[-1] < probing[-1] / 2, (probing, queued)
    assert queued[-1] > queued[0]  # it still climbs, a request at a time
    assert climb(True, every_round=False) == queued  # the last round counts while fresh
    stale = bimodal()
    stale.engines_round([EngineSample(1, 1, 0.0)], POOL.engine, 0.0)
    assert stale.queued(SPEED_MAX_AGE_S) and not stale.queued(SPEED_MAX_AGE_S + 1.0)
    stale.engines_round([EngineSample(0, 1, 0.0)], POOL.engine, 1.0)
    assert not stale.queued(1.0)


def test_two_gateways_on_one_ledger_each_climb_on_their_own_share_of_completions() -> None:
    """Behind several gateways each sees the shared ledger's work (``at``) but only its own
    completions: requests alternate between two, and both levels still climb to the pool."""
    gateways = [bimodal(), bimodal()]
    now, seen = 0.0, []
    for _ in range(16):
        mine: list[list[Running]] = [[], []]
        n = 0
        while n < R * SLOTS:  # one ledger: the count is both gateways' requests
            g, t = n % 2, now + n * 0.001  # arrivals a millisecond apart
            adm = decide_at(gateways[g], n, t)
            if not adm.runs:
                break
            running = running_of(adm, t)
            gateways[g].admitted(running, key=f"{now}/{len(mine[g])}")
            mine[g].append(running)
            n += 1
        seen.append(n)
        for learning, admitted in zip(gateways, mine, strict=True):
            end(learning, admitted, now, 1.0)
        now += 1.0
    assert seen[0] <= 2 * R and seen[-1] == R * SLOTS, seen
    assert all(g.level.level_ms > 0.0 for g in gateways)


def test_cold_start_misses_after_the_climb_back_it_off() -> None:
    """Evidence the other way: requests run at the top that miss beyond the low-load
    baseline cut the level below the work they were run at, and completions of requests
    admitted before that cut do not undo it. (The pool's hits take half their deadlines: it
    is slow for everyone. Beside hits that take a few percent of theirs, misses weigh little:
    ``test_a_tail_beside_fast_hits_does_not_cut_the_level``.)"""
    learning = bimodal()
    now = 0.0
    for _ in range(8):
        end(learning, fill(learning, now), now, DEADLINE_S * 0.5)
        now += 1.0
    climbed = learning.level.level_ms
    assert climbed > 0.0
    late = fill(learning, now)  # these all miss ...
    # ... and these, admitted beside them, end in time (their deadline is longer)
    early = fill(learning, now + 0.5, deadline_s=DEADLINE_S * 3)
    end(learning, late, now, DEADLINE_S * 1.5)
    learning.refresh(now + DEADLINE_S * 2)
    cut = learning.level.level_ms
    assert cut < climbed
    end(learning, early, now + 0.5, DEADLINE_S * 2)
    assert learning.level.level_ms == cut


def test_cold_start_a_fresh_gateway_on_an_idle_fleet_admits_every_priority() -> None:
    learning = learning_for(POOL)
    for _ in range(50):  # critical traffic is known to arrive: its room is kept ...
        learning.arrived("latency", False, 0.0, 500, ask(CRITICAL).groups)
    for n in range(R):  # ... but not while a replica has nothing to do
        adm = decide_at(learning, n, 0.0, ask(SHEDDABLE))
        assert adm.runs, (n, adm.reason)


def test_work_conservation_free_slots_at_a_measured_level_are_used() -> None:
    learning = strictest()
    for n in range(R):  # a replica with nothing to do: admitted, whatever the promise
        assert decide_at(learning, n, 0.0).runs
    now = 0.0
    for _ in range(10):  # the pool is seen to serve its requests in time ...
        _, now = generation(learning, now)
    adm = decide_at(learning, 5 * R, now)  # ... so its free slots are used
    assert (adm.outcome, adm.reason) == (Outcome.ADMIT, Reason.MEASURED)
    assert adm.max_inflight is not None and adm.max_inflight >= 5 * R + 1
    assert adm.ceiling_ms is not None and adm.ceiling_ms >= at(5 * R + 1, learning).outstanding_ms
    full = decide_at(learning, R * SLOTS, now)  # no free slot: the model's refusal stands
    assert full.outcome is Outcome.REJECT


def test_the_level_does_not_overrule_a_first_token_it_cannot_see() -> None:
    """The level is measured on each admitted stream's end against its deadline; the gateway
    sees no first token. A request the model refuses because a crowd's prompts are still to be
    prefilled ahead of it is not let in by the level, however high it stands, unless a replica
    has nothing to do (work conservation)."""
    learning = strictest()
    now = 0.0
    for _ in range(10):  # the pool is seen to serve its requests in time
        _, now = generation(learning, now)
    assert decide_at(learning, 5 * R, now).reason is Reason.MEASURED
    learning.backlog.add(2e6, now, 0.0)  # prompt tokens admitted, not prefilled yet
    refused = decide_at(learning, 5 * R, now)
    budget = refused.policy.ttft_budget_ms
    assert refused.decision is not None and budget is not None
    assert refused.decision.ttft_ms > budget
    assert refused.outcome is Outcome.REJECT
    idle = decide_at(learning, R - 1, now)
    assert (idle.outcome, idle.reason) == (Outcome.ADMIT, Reason.MEASURED)


def test_the_room_kept_for_a_higher_priority_applies_the_same_first_token_rule() -> None:
    """The second place the level overrules the model: a lower priority must still be
    admitted with room kept for the critical requests in evidence
    (``contention.room_for_others``). There too, the level does not admit a request predicted
    to start past its first-token budget. The same request with no first-token objective is
    admitted, with the room kept."""
    learning = strictest()
    now = 0.0
    for _ in range(10):
        _, now = generation(learning, now)
    sheddable = ask(SHEDDABLE)
    snapshot = at(5 * R, learning)
    alone = admit(sheddable, POOL, RULES, learning, snapshot, R, now).decision
    assert alone is not None and alone.max_inflight is not None  # nothing kept: no critical
    for i in range(100):  # critical requests in evidence: 5 a second
        learning.arrived("latency", False, now - 20.0 + i * 0.2, 500, ask(CRITICAL).groups)
    admitted = admit(sheddable, POOL, RULES, learning, snapshot, R, now)
    assert (admitted.outcome, admitted.reason) == (Outcome.ADMIT, Reason.MEASURED)
    assert admitted.decision is not None
    cost, capacity = cost_of(sheddable, POOL, learning), capacity_for(POOL, R, learning)
    behind = dataclasses.replace(snapshot, prefill_tokens=200_000)  # prompts still to prefill
    scene = contention.Scene(RULES, learning, behind, capacity, 1.0, now)
    refused, _ = contention.room_for_others(None, SHEDDABLE, cost, admitted.decision,
                                            admitted.policy, scene)
    assert refused is not None
    assert (refused.outcome, refused.reason) == (Outcome.REJECT, Reason.PRIORITY)
    budget = admitted.policy.ttft_budget_ms
    assert budget is not None and refused.ttft_ms > budget
    no_objective = dataclasses.replace(admitted.policy, ttft_ms=None)
    kept, _ = contention.room_for_others(None, SHEDDABLE, cost, admitted.decision,
                                         no_objective, scene)
    assert kept is not None and kept.outcome is Outcome.ADMIT
    assert kept.max_inflight is not None and kept.max_inflight < alone.max_inflight  # kept


def test_work_conservation_a_request_whose_own_replica_is_idle_is_admitted() -> None:
    """Behind a prefix-aware router one replica can empty while the pool's sum reads full
    (every slot taken): a request whose replica, named by the endpoint picker, reports nothing
    to do is admitted anyway, without the ledger's checks (the engine's report is the check),
    and is no evidence for the measured level: it ran where the pool's load was not."""
    learning = strictest()
    full = at(R * SLOTS, learning)
    refused = admit(ask(), POOL, RULES, learning, full, R, 0.0)
    assert refused.outcome is Outcome.REJECT
    idle = admit(ask(), POOL, RULES, learning, full, R, 0.0, Correction(idle=True))
    assert (idle.outcome, idle.reason) == (Outcome.ADMIT, Reason.IDLE)
    assert (idle.ceiling_ms, idle.max_inflight) == (None, None)
    assert admit(ask(CRITICAL), POOL, RULES, learning, full, R, 0.0,
                 Correction(idle=True)).reason is Reason.IDLE
    # longer than one replica's KV cache: no idle replica can take it
    small = dataclasses.replace(POOL, engine=dataclasses.replace(
        POOL.engine, num_gpu_blocks=64, block_size=16))  # 1,024 tokens
    assert admit(ask(), small, RULES, learning, full, R, 0.0,
                 Correction(idle=True)).outcome is Outcome.REJECT

    running = running_of(idle, 0.0)
    learning.admitted(running, key="idle")
    learning.settled(running, completed=True, now=1.0, key="idle")
    learning.refresh(2 * DEADLINE_S)
    assert learning.level.level_ms == 0.0


def test_a_request_bound_for_a_replica_with_a_queue_starts_after_it() -> None:
    """The ledger counts requests in flight, not where they wait: a replica out of KV memory
    holds requests waiting while the ledger's estimate leaves slots free. A request whose own
    replica reports a queue is predicted to start after it; past its first-token budget it
    is refused, and the measured level does not overrule that (it cannot see first tokens);
    nor does the pool's sum saying a replica has nothing to do, when this one holds a queue."""
    learning = strictest()
    now = 0.0
    for _ in range(10):
        _, now = generation(learning, now)
    snapshot = at(5 * R, learning)
    free = admit(ask(), POOL, RULES, learning, snapshot, R, now)
    assert (free.outcome, free.reason) == (Outcome.ADMIT, Reason.MEASURED)
    assert free.decision is not None
    short = admit(ask(), POOL, RULES, learning, snapshot, R, now, Correction(queued=1))
    assert short.decision is not None and short.decision.ttft_ms > free.decision.ttft_ms
    budget = short.policy.ttft_budget_ms
    assert budget is not None
    long = admit(ask(), POOL, RULES, learning, snapshot, R, now, Correction(queued=40))
    assert long.decision is not None and long.decision.ttft_ms > budget
    assert long.outcome is Outcome.REJECT
    assert long.retry_after_ms is not None and long.retry_after_ms >= budget
    idle = admit(ask(), POOL, RULES, learning, snapshot, R, now, Correction(idle=True))
    assert (idle.outcome, idle.reason) == (Outcome.ADMIT, Reason.IDLE)
    # The replica's queue replaces the pool's average one where longer, never adds to it:
    # with every slot taken and five more waiting a replica, one waiting there moves nothing.
    deep = at(SLOTS * R + 5 * R, learning)
    pooled = admit(ask(), POOL, RULES, learning, deep, R, now)
    own = admit(ask(), POOL, RULES, learning, deep, R, now, Correction(queued=1))
    assert pooled.decision is not None and own.decision is not None
    assert pooled.decision.wait_ms > 0
    assert own.decision.ttft_ms == pooled.decision.ttft_ms
    # Waiting for compute: their prompts are prefilled first on that replica.
    prompts = admit(ask(), POOL, RULES, learning, snapshot, R, now, Correction(prefilling=400))
    assert prompts.decision is not None and prompts.decision.ttft_ms > budget
    assert prompts.outcome is Outcome.REJECT
    # With fewer requests in flight than replicas, one has nothing to do, but not this one.
    few = at(R - 1, learning)
    assert admit(ask(), POOL, RULES, learning, few, R, now).outcome is Outcome.ADMIT
    assert admit(ask(), POOL, RULES, learning, few, R, now,
                 Correction(queued=40)).outcome is Outcome.REJECT


def test_recovery_from_the_strictest_state_in_a_few_deadlines() -> None:
    learning = strictest()
    promise = learning.promise("latency")
    promise.x = math.log(0.005 / 0.995)  # the strictest promise ...
    for _ in range(100):
        promise.settled(True)  # ... with measured misses far over the target
    assert promise.over
    now, seen = 0.0, []
    for _ in range(10):
        admitted, now = generation(learning, now)
        seen.append(admitted)
    assert seen[0] <= 2 * R  # it starts strict ...
    assert seen[-1] >= 12 * R, seen  # ... refusals nothing backs loosen by themselves ...
    assert all(b >= a for a, b in itertools.pairwise(seen))  # ... steadily, deadline by deadline


def test_unavoidable_misses_do_not_tighten_the_level() -> None:
    """One request in four misses at every level, alone or in a full pool: no admission
    level prevents it, so the level still climbs to the slots."""
    learning = strictest()
    now, seen = 0.0, []
    for _ in range(16):
        admitted, now = generation(learning, now, missed=0.25)
        seen.append(admitted)
    assert seen[-1] == R * SLOTS, seen


def abandoned_tail(speed: tuple[float, float] | None) -> PoolLearning:
    """A pool whose engines finish four answers in five (20 tokens each) and whose clients
    abandon the fifth, each after 30 s (1.5 deadlines): long answers, which the engines' length
    histogram never counts. ``speed``: the engines' measured first-token and inter-token ms,
    reported just before each cancellation (None: no engine metrics)."""
    learning = learning_for(POOL)
    for _ in range(400):
        learning.finished(20)
    now = 0.0
    for i in range(100):
        adm = decide_at(learning, 0, now)
        key = f"long/{i}"
        running = running_of(adm, now)
        learning.admitted(running, key=key)
        now += 1.5 * DEADLINE_S
        if speed is not None:
            learning.engine_speed(*speed, now)
        learning.settled(running, completed=False, now=now, key=key)
        now += 1.0
    return learning


def test_answers_abandoned_for_their_length_are_unavoidable_misses() -> None:
    """Invariant (c), measured: a stream cancelled after 30 s, at the 15 ms a token the engines
    measured, had some 2,000 tokens, more than fit a 20 s deadline alone; one answer in five
    like it is what the level's baseline and the promise must expect. From the finished
    answers alone the chance reads as the prior's tail. And slow is not long: at the 300 ms a
    token of an overloaded engine the same streams had about 100 tokens each, and the chance
    barely moves (a predicted step would read every late stream as a long answer, and the
    misses of overload as unavoidable)."""
    fast = decide_at(abandoned_tail((500.0, 15.0)), 0, 4000.0).unavoidable
    slow = decide_at(abandoned_tail((500.0, 300.0)), 0, 4000.0).unavoidable
    unmeasured = decide_at(abandoned_tail(None), 0, 4000.0).unavoidable
    assert 0.12 <= fast <= 0.3, fast
    assert unmeasured < 0.05, unmeasured
    assert slow < 0.05, slow


def predicted_and_true(monkeypatch: pytest.MonkeyPatch, measured: bool) -> tuple[float, float]:
    """A quarter-length output-tail run on 8b-vllm at 0.8x (a fifth of the answers too long to
    finish in time even alone, most of them abandoned by their clients), simulated: the
    admitted requests' mean predicted chance of missing even alone, and the share of them
    whose answer was too long to finish within its budget alone. ``measured``: the engines
    report their speed (else, as without engine metrics, nothing is counted)."""
    if not measured:
        monkeypatch.setattr(PoolLearning, "engine_speed", lambda *_: None)
    sim = Simulation(families.draw("output-tail", 0, 0.8, "8b-vllm", 0.25).scenario,
                     policies.make("default"))
    predicted, truth, n = 0.0, 0, 0

    def record(job: Job, _: Snapshot, adm: Admission) -> None:
        nonlocal predicted, truth, n
        if adm.outcome is Outcome.ADMIT:
            capacity = capacity_for(sim.pool, len(sim.ready), sim.learning)
            n += 1
            predicted += adm.unavoidable
            truth += job.output_tokens > longest_alone(adm.cost, capacity, adm.policy)

    sim.on_decision = record
    sim.run()
    return predicted / n, truth / n


def test_in_the_simulator_abandoned_answers_are_read_as_unavoidable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant (c) end to end: the gateway's chance of missing even alone, from answers the
    engines finished and streams their clients left at the speed the engines measured, is
    near the truth; from the finished answers alone, it reads the long tail as rare."""
    predicted, truth = predicted_and_true(monkeypatch, measured=True)
    assert 0.7 * truth <= predicted <= 1.2 * truth, (predicted, truth)  # (0.32 of 0.39)
    predicted, truth = predicted_and_true(monkeypatch, measured=False)
    assert predicted < 0.5 * truth, (predicted, truth)  # (0.13 of 0.34)


def test_a_stale_measurement_counts_nothing() -> None:
    """The engines' speed counts ``SPEED_MAX_AGE_S`` after it was read, not forever: a
    scraper that stopped leaves cancelled streams uncounted."""
    learning = learning_for(POOL)
    learning.engine_speed(500.0, 15.0, 0.0)
    adm = decide_at(learning, 0, 100.0)
    running = running_of(adm, 100.0)
    learning.admitted(running, key="k")
    seen = learning.begun.seen
    learning.settled(running, completed=False, now=130.0, key="k")
    assert learning.begun.seen == seen
    learning.engine_speed(500.0, 15.0, 131.0)  # fresh again: the next one counts
    adm = decide_at(learning, 0, 131.0)
    running = running_of(adm, 131.0)
    learning.admitted(running, key="k2")
    learning.settled(running, completed=False, now=161.0, key="k2")
    assert learning.begun.seen == pytest.approx(seen + 1)


def test_behind_two_gateways_a_cancelled_stream_stands_for_two() -> None:
    """The engines' finished answers are every gateway's, a gateway's cancelled streams only
    its own: one admitted while it held half the pool's requests counts as two."""
    learning = learning_for(POOL)
    learning.engine_speed(500.0, 15.0, 0.0)
    for key, share in (("alone", 1.0), ("half", 0.5)):
        running = Running("latency", 0.0, deadline_s=DEADLINE_S, prompt_tokens=500,
                          share=share)
        learning.admitted(running, key=key)
        seen = learning.begun.seen
        learning.settled(running, completed=False, now=25.0, key=key)
        assert learning.begun.seen == pytest.approx(seen + 1.0 / share)


def test_a_non_streaming_answer_cancelled_counts_nothing() -> None:
    """A client that leaves a non-streaming request may leave its answer running to the end
    (thrown away when finished): the engines then count it in their histogram, and counting
    the cancellation too would count one long answer twice."""
    learning = learning_for(POOL)
    learning.engine_speed(500.0, 15.0, 0.0)
    for key, streaming in (("whole", False), ("streamed", True)):
        running = Running("latency", 0.0, deadline_s=DEADLINE_S, prompt_tokens=500,
                          streaming=streaming)
        learning.admitted(running, key=key)
        seen = learning.begun.seen
        learning.settled(running, completed=False, now=25.0, key=key)
        assert learning.begun.seen == pytest.approx(seen + (1.0 if streaming else 0.0))


def test_misses_that_only_load_causes_cut_the_level() -> None:
    """The other side: misses at the top and none at low load back the level off."""
    level = Level()
    for _ in range(40):  # alone: always in time
        level.settled(False, 1000.0, 0.0, alone=True)
    level.level_ms, level.probing = 10_000.0, False  # past its slow start
    seen = []
    for i in range(30):  # every other request at the top misses
        level.settled(i % 2 == 0, 10_000.0, 10_000.0)
        seen.append(level.level_ms)
    assert min(seen) <= max(seen) * 0.8
    assert max(seen) <= 10_000.0 * 1.1  # never far past what was measured


def test_an_overshoots_misses_cut_the_level_once_not_once_each() -> None:
    """Recovery's other half: the misses of an overshoot arrive together, a deadline after
    the requests were admitted. Those admitted above where the first cut put the level are
    not evidence against the new level, so one overload cuts once; counted one by one, two
    hundred misses would cut it 0.8^100 times, to nothing, and nothing would be admitted to
    learn that it could be raised again (the latch, issue 27: ~400 in flight to ~10)."""
    level = Level()
    for _ in range(40):  # alone: always in time
        level.settled(False, 1000.0, 0.0, alone=True)
    level.level_ms, level.probing = 10_000.0, False
    for _ in range(200):  # every request admitted at the overshoot's top misses
        level.settled(True, 10_000.0, 10_000.0)
    assert level.level_ms == pytest.approx(10_000.0 * BACKOFF)
    for _ in range(20):  # misses admitted at the new level are its evidence: cut again
        level.settled(True, 7_000.0, level.level_ms)
    assert level.level_ms == pytest.approx(10_000.0 * BACKOFF ** 2)


def test_a_tail_beside_fast_hits_does_not_cut_the_level() -> None:
    """A tail is not a slow pool: a tenth of the answers at the top miss, while those served
    in time took 2 % of their deadlines (bimodal/70b-vllm seed 1: 2.7 %). A back-off would
    save the tail only by refusing most of what the pool serves, so the level holds. Counted
    in full, the same misses cut it (the next test); in the simulator's cold start, counted in
    full, they cut it eight times, to a sixth (0.52 of naive's goodput)."""
    level = Level()
    for _ in range(4):  # alone: in time
        level.settled(False, 400.0, 0.0, alone=True)
    level.level_ms, level.probing = 10_000.0, False
    for i in range(200):
        missed = i % 10 == 0
        level.settled(missed, 10_000.0, 10_000.0, used=None if missed else 0.02)
    assert level.level_ms == 10_000.0


def test_the_same_misses_beside_slow_hits_cut_the_level() -> None:
    """The other side: the same tenth missing while the hits used half their deadlines is a
    pool slow for everyone, and the misses count in full."""
    level = Level()
    for _ in range(4):
        level.settled(False, 400.0, 0.0, alone=True)
    level.level_ms, level.probing = 10_000.0, False
    for i in range(200):
        missed = i % 10 == 0
        level.settled(missed, 10_000.0, 10_000.0, used=None if missed else 0.5)
    assert level.level_ms <= 10_000.0 * BACKOFF


def test_what_the_level_admits_below_its_top_it_answers_for() -> None:
    """Where the slots or the KV cache bind below the level, nothing reaches its top: the
    requests the level let in against the model (``measured``) miss, and the promise leaves
    them to the level. Counted wherever the pool stood, their misses cut it; the model's own
    admissions there stay the promise's, and cut nothing."""
    def run(measured: bool) -> float:
        level = Level()
        for _ in range(40):  # alone: always in time
            level.settled(False, 1000.0, 0.0, alone=True)
        level.level_ms, level.probing = 10_000.0, False
        for i in range(60):  # admitted at 4,000 ms a replica, far below the top; half miss
            level.settled(i % 2 == 0, 4_000.0, 10_000.0, measured=measured)
        return level.level_ms

    assert run(measured=True) <= 10_000.0 * BACKOFF
    assert run(measured=False) == 10_000.0


def test_beside_fast_hits_what_the_level_admits_below_its_top_counts_at_the_top_only() -> None:
    """The other side: where the top's hits use a few percent of their deadlines (a tail,
    not a slow pool), the level's admissions below its top are not its evidence: a tail
    misses at every load, and a back-off would only refuse what the pool serves."""
    level = Level()
    for _ in range(4):
        level.settled(False, 400.0, 0.0, alone=True)
    level.level_ms, level.probing = 10_000.0, False
    for _ in range(50):  # the top's hits: 2 % of their deadlines
        level.settled(False, 10_000.0, 10_000.0, used=0.02)
    assert level.weight < 1.0
    for i in range(60):  # a tenth miss below the top, its hits as fast as the top's
        missed = i % 10 == 0
        level.settled(missed, 4_000.0, 10_000.0, used=None if missed else 0.02, measured=True)
    assert level.level_ms == 10_000.0


def test_the_weight_reads_every_request_the_level_answers_for() -> None:
    """Latching, the evidence's way: the weight says whether the pool is slow for everyone,
    and it decides whether the level's own admissions below its top count. Read only from
    the requests it let count, it froze: a top whose hits once used just under a fifth of
    their deadlines kept it under 1 for good once the slots bound below the level (nothing
    reached the top again), and what the level went on letting in, slower and missing, was
    read by nobody (azure-code/70b-16 1.5x: weight 0.996 from the run's first minute, 3,375
    such requests unread, 5.4 % of them missed). Read from every one it answers for, their
    speed lifts the weight to 1 and their misses cut the level."""
    level = Level()
    for _ in range(4):
        level.settled(False, 400.0, 0.0, alone=True)
    level.level_ms, level.probing = 10_000.0, False
    for _ in range(50):  # the top's hits: just under a fifth of their deadlines
        level.settled(False, 10_000.0, 10_000.0, used=0.19)
    assert level.weight < 1.0
    for i in range(200):  # below the top, the level's own: half their deadlines, a tenth miss
        missed = i % 10 == 0
        level.settled(missed, 4_000.0, 10_000.0, used=None if missed else 0.5, measured=True)
    assert level.weight == 1.0
    assert level.level_ms <= 10_000.0 * BACKOFF


@pytest.mark.xfail(strict=True, reason=(
    "the cold start's cascade (docs/admission.md, 'Tried since, not landed'): misses of"
    " requests admitted at the top of a level a sixth of today's each cut today's level"))
def test_the_cold_starts_misses_do_not_cut_a_level_they_were_never_admitted_at() -> None:
    """A cold start's requests, admitted at the top of a small level (2,000 ms a replica),
    whose short answers' completions then raised it six-fold: a tenth of them miss, resolved
    together a deadline later. That is evidence against the load they ran at, once; counted
    one by one, each pair cuts the grown level again, and eight cuts take it to a sixth. (The
    hits here say nothing of their speed: beside fast hits the misses weigh little, above;
    beside slow ones the cascade stands.)"""
    level = Level()
    for _ in range(4):  # alone: in time
        level.settled(False, 400.0, 0.0, alone=True)
    level.level_ms = 12_000.0  # climbed on completions before any deadline came
    for i in range(200):  # the cold start's requests resolve: one in ten missed
        level.settled(i % 10 == 0, 2_000.0, 2_000.0)
    assert level.level_ms >= 12_000.0 * BACKOFF


def test_in_the_simulator_a_long_tail_does_no_harm() -> None:
    """The cell the tail's test above stands for: bimodal/70b-vllm at 1.5x, seed 1 (off the
    matrix's seed), where the long tenth fits its deadline alone but not in a busy batch.
    Issue 27's rule: the default's goodput at least 0.97x the better peer's (misses counted
    in full: 12.92 good/s against naive's 25.03)."""
    drawn = families.draw("bimodal", 1, 1.5, "70b-vllm", 1.0)
    goodput = {name: Simulation(drawn.scenario, policies.make(name)).run().goodput
               for name in ("default", "naive", "saturation")}
    assert goodput["default"] >= 0.97 * max(goodput["naive"], goodput["saturation"])


@pytest.mark.slow
def test_in_the_simulator_long_contexts_at_half_load_do_no_harm() -> None:
    """Work conservation for memory: long-context/70b-vllm at half load (seed 0, off the
    matrix's loads). Whole slots of the mean footprint refused short prompts beside long
    documents while the engines' caches had room for them (0.963 of naive's goodput,
    attainment 93.3 % against its 94.5 %); a request that fits the cache its replica reports
    free is admitted (``Capacity.fits_reported``). Issue 27's three rules."""
    record = evaluate.run_cell(evaluate.Cell("long-context", 0.5, 0, "70b-vllm"),
                               ("naive", "saturation", "default"))
    assert evaluate.harm(record["policies"]) == []


def mean_weight(family: str, seed: int) -> float:
    """What a miss at the top weighed, on average over the default's decisions, on the
    family's 70b-vllm cell at 1.5x."""
    sim = Simulation(families.draw(family, seed, 1.5, "70b-vllm", 1.0).scenario,
                     policies.make("default"))
    weights: list[float] = []
    sim.on_decision = lambda job, snapshot, adm: weights.append(sim.learning.level.weight)
    sim.run()
    return sum(weights) / len(weights)


def test_in_the_simulator_the_tails_misses_weigh_less_and_a_slow_pools_in_full() -> None:
    """The weight reads the traffic, not a family's name: beside bimodal's fast hits a miss
    weighs about 0.45 on average (0.448 measured), on azure-conv/70b-vllm, a pool slow for
    everyone, about 1 (0.996). Without the weight both would read 1."""
    assert mean_weight("bimodal", 1) < 0.6
    assert mean_weight("azure-conv", 0) > 0.95


def test_the_decision_only_reads() -> None:
    """``admit`` changes no learned state, so the gateway's re-asks (an estimate then the
    exact count, a refused reserve's retry) learn what the simulator's single ask does."""
    learning = bimodal()
    now = 0.0
    for _ in range(3):
        _, now = generation(learning, now)
    before = pickle.dumps(learning)
    for n in (0, R, 5 * R, R * SLOTS):
        admit(ask(), POOL, RULES, learning, Snapshot(n, n * 2000.0), R, now + 0.5)
        admit(ask(CRITICAL), POOL, RULES, learning, Snapshot(n, n * 2000.0), R, now + 7.0)
        admit(ask(SHEDDABLE), POOL, RULES, learning, Snapshot(n, n * 2000.0), R, now + 9.0)
    assert pickle.dumps(learning) == before


def test_a_request_refused_before_the_pool_was_looked_at_records_no_load() -> None:
    """A 400 for its context length saw no snapshot: its load is not the pool's (recorded,
    a 0 would wipe the loads running requests are judged at)."""
    learning = bimodal()
    too_long = admit(Ask("latency", 40_000, 16), POOL, RULES, learning, at(R, learning), R, 0.0)
    assert too_long.outcome is Outcome.INVALID and too_long.load_ms is None
    seen = decide_at(learning, 2 * R, 0.0)
    assert seen.load_ms is not None and seen.load_ms > 0.0
