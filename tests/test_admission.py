"""The decision (decision.admission): the docstring's formula, case by case and as properties."""

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.decision.admission import (
    Capacity,
    Cost,
    Mix,
    Outcome,
    Policy,
    Reason,
    Reported,
    Snapshot,
    decide,
    release_quantile,
)
from extproc.decision.step import prefill_rate
from extproc.fleet.engine import LLAMA_8B_1XH100, EngineModel, Scheduler, Sequence

ENGINE = EngineModel(max_num_seqs=4, max_num_batched_tokens=512, block_size=16,
                     num_gpu_blocks=0, step_base_ms=20.0, ms_per_token=0.1, ms_per_seq=1.0,
                     ms_per_kv_token=0.0, ms_per_prefill_pair=0.0)
MIX = Mix(prompt_tokens=200.0, output_tokens=50.0)
CAP = Capacity(replicas=2, engine=ENGINE, mix=MIX)  # 8 slots; itl(b) = 20 + 1.1 b
LATENCY = Policy(deadline_ms=10_000, safety_factor=0.8, ttft_ms=1_000)  # budgets 8000 / 800
LONG = Policy(deadline_ms=60_000, safety_factor=0.9)
IDLE = Snapshot(inflight=0, outstanding_ms=0.0)


def spec(cost: Cost, snap: Snapshot, cap: Capacity, policy: Policy) -> dict[str, float]:
    """The module docstring's formula, written out again line by line."""
    e, mix = cap.engine, cap.mix
    s = min(e.max_num_seqs, int(e.kv_tokens / (mix.prompt_tokens + mix.output_tokens))) \
        if e.kv_tokens else e.max_num_seqs
    context = mix.prompt_tokens + mix.output_tokens / 2

    def itl(b: float, c: float = context) -> float:
        return e.step_base_ms + b * (e.ms_per_token + e.ms_per_seq + e.ms_per_kv_token * c)

    def prefill(p: float, before: float = 0.0) -> float:
        return p * (e.ms_per_token + e.ms_per_prefill_pair * (before + p / 2))

    def ttft_at(p: float, b: float) -> float:
        chunks = max(1, math.ceil(p / max(1.0, e.max_num_batched_tokens - b)))
        return prefill(p) + chunks * itl(b)

    def step(b: float) -> float:
        return itl(b) + b / mix.output_tokens * prefill(mix.prompt_tokens)

    o = min(cost.max_output_tokens, cost.typical_tokens if cost.typical_tokens is not None
            else cost.max_output_tokens)
    big_l = min(cost.max_output_tokens, cost.promised_tokens if cost.promised_tokens is not None
                else cost.max_output_tokens)
    charge = prefill(cost.prompt_tokens) + o * itl(s) / s
    n, w = snap.inflight, snap.outstanding_ms
    b = min(s, (n + 1) / cap.replicas)
    p = n + 1 - cap.replicas * s
    mean = w / n if n else charge
    wait = 0.0 if p <= 0 else release_quantile(math.ceil(p / cap.replicas), cap.wait_z) * mean
    ttft = wait + ttft_at(cost.prompt_tokens, b)
    alone = (policy.budget_ms - ttft_at(cost.prompt_tokens, 1.0)) / step(1.0)
    return {"charge": charge, "wait": wait, "ttft": ttft,
            "completion": ttft + min(big_l, max(0.0, alone)) * step(b)}


def q(k: int) -> float:
    return release_quantile(k, CAP.wait_z)


# name, cost, snapshot, policy, outcome, reason
TABLE = [
    ("idle fleet admits", Cost(1000, 100, 50.0, 100.0), IDLE, LATENCY, Outcome.ADMIT,
     Reason.FITS),
    ("free slot starts at once", Cost(1000, 100, 50.0, 100.0), Snapshot(5, 3_000), LATENCY,
     Outcome.ADMIT, Reason.FITS),
    ("queued behind short work fits", Cost(100, 100, 50.0, 100.0), Snapshot(8, 400), LATENCY,
     Outcome.ADMIT, Reason.FITS),
    ("queued behind long work misses its first token", Cost(100, 100, 50.0, 100.0),
     Snapshot(8, 8 * 3_000), LATENCY, Outcome.REJECT, Reason.TTFT),
    ("a long promise misses the deadline in a full batch", Cost(100, 400, 50.0, 320.0),
     Snapshot(7, 7 * 100), LATENCY, Outcome.REJECT, Reason.DEADLINE),
    ("a class without a TTFT objective queues deep", Cost(100, 100, 50.0, 100.0),
     Snapshot(20, 20 * 300), LONG, Outcome.ADMIT, Reason.FITS),
    ("typical past the deadline even idle", Cost(10, 2000, 500.0, 900.0),
     Snapshot(20, 48_000), LATENCY, Outcome.PASS, Reason.INFEASIBLE),
    ("prefill alone past the ttft objective", Cost(9000, 1, 1.0, 1.0), IDLE, LATENCY,
     Outcome.PASS, Reason.INFEASIBLE),
]


@pytest.mark.parametrize("name, cost, snap, policy, outcome, reason", TABLE,
                         ids=[t[0] for t in TABLE])
def test_policy_table(name: str, cost: Cost, snap: Snapshot, policy: Policy, outcome: Outcome,
                      reason: Reason) -> None:
    d = decide(cost, snap, CAP, policy, now=100.0)
    assert (d.outcome, d.reason) == (outcome, reason)
    if reason is not Reason.INFEASIBLE:
        want = spec(cost, snap, CAP, policy)
        assert d.wait_ms == pytest.approx(want["wait"])
        assert d.completion_ms == pytest.approx(want["completion"])
        assert d.finish_at == pytest.approx(100.0 + d.completion_ms / 1000.0)


@given(st.integers(0, 40), st.floats(1.0, 5_000.0), st.integers(1, 3000),
       st.integers(1, 500), st.floats(1.0, 500.0), st.floats(1.0, 600.0),
       st.sampled_from([LATENCY, LONG]))
def test_decide_follows_the_docstring_formula(inflight: int, mean: float, prompt: int,
                                              output: int, typical: float, promised: float,
                                              policy: Policy) -> None:
    cost = Cost(prompt, output, typical, promised)
    snap = Snapshot(inflight, inflight * mean)
    d = decide(cost, snap, CAP, policy, now=0.0)
    if d.reason is Reason.INFEASIBLE:
        return
    want = spec(cost, snap, CAP, policy)
    assert d.charge_ms == pytest.approx(want["charge"])
    assert d.wait_ms == pytest.approx(want["wait"])
    assert d.ttft_ms == pytest.approx(want["ttft"])
    assert d.completion_ms == pytest.approx(want["completion"])
    fits = d.completion_ms <= policy.budget_ms and (
        policy.ttft_budget_ms is None or d.ttft_ms <= policy.ttft_budget_ms)
    assert d.admitted == fits


def test_the_ledger_is_charged_the_typical_length_not_max_tokens() -> None:
    d = decide(Cost(100, 4000, 40.0, 40.0), IDLE, CAP, LONG, now=0.0)
    assert d.charge_ms == pytest.approx(100 * 0.1 + 40 * ENGINE.itl_ms(4, MIX.context) / 4)


def test_the_promised_length_is_what_the_deadline_is_held_to() -> None:
    busy = Snapshot(7, 700)
    short = decide(Cost(100, 400, 50.0, 100.0), busy, CAP, LATENCY, now=0.0)
    long = decide(Cost(100, 400, 50.0, 320.0), busy, CAP, LATENCY, now=0.0)
    assert short.admitted and not long.admitted
    assert long.completion_ms > short.completion_ms


def test_a_promise_longer_than_fits_alone_still_fits_an_idle_replica() -> None:
    # A pessimistic prior promises 1,500 tokens: past the 8 s budget even alone. An idle
    # replica takes the request (so the pool can learn); a busy one refuses it.
    cost = Cost(200, 2048, 256.0, 1500.0)
    assert decide(cost, IDLE, CAP, LATENCY, now=0.0).admitted
    assert not decide(cost, Snapshot(4, 400), CAP, LATENCY, now=0.0).admitted


def test_the_kv_cache_bounds_the_batch_before_max_num_seqs_does() -> None:
    kv = dataclasses.replace(ENGINE, max_num_seqs=64, num_gpu_blocks=50)  # 800 tokens
    cap = Capacity(replicas=1, engine=kv, mix=Mix(prompt_tokens=150.0, output_tokens=50.0))
    cost = Cost(150, 50, 50.0, 50.0)
    assert cap.batch_with(Snapshot(3, 300.0, 3 * 200), cost) == 4  # 800 / 200
    fits = decide(cost, Snapshot(3, 300.0, 3 * 200), cap, LONG, now=0.0)
    assert fits.admitted and fits.position == 0
    # a fifth would wait for memory, not for a slot: refused, never queued (the engine
    # would take it in on its first chunk and preempt when the batch grows)
    full = decide(cost, Snapshot(4, 400.0, 4 * 200), cap, LONG, now=0.0)
    assert (full.outcome, full.reason, full.position) == (Outcome.REJECT, Reason.KV_CACHE, 1)
    assert full.retry_after_ms is not None and full.retry_after_ms > 0
    # a few huge documents fill the cache that a mean of small ones would call empty
    big = Snapshot(2, 200.0, 2 * 390)
    assert cap.batch_with(big, cost) == 2
    assert decide(cost, big, cap, LONG, now=0.0).reason is Reason.KV_CACHE
    # sequences wait for a slot (max_num_seqs), never for memory
    slots = Capacity(replicas=1, engine=dataclasses.replace(kv, max_num_seqs=2), mix=MIX)
    queued = decide(cost, Snapshot(2, 200.0, 2 * 200), slots, LONG, now=0.0)
    assert queued.admitted and queued.position == 1 and queued.wait_ms > 0


def test_the_kv_cache_the_engines_report_free_decides_before_the_mean_footprint() -> None:
    # Four replicas of 800 KV tokens; eight 350-token documents in flight. Their mean
    # footprint (with a 100-token request: 322) makes two whole slots a replica, eight in
    # all, so by the mean a ninth request waits for memory; but even the fullest replica
    # reports 450 tokens free, 400 once its one request in flight writes what one holds of
    # its answer (50 tokens, as this one's footprint counts it).
    kv = dataclasses.replace(ENGINE, max_num_seqs=64, num_gpu_blocks=50)  # 800 tokens
    blind = Capacity(replicas=4, engine=kv, mix=Mix(prompt_tokens=300.0, output_tokens=50.0))
    docs = Snapshot(8, 800.0, 8 * 350)
    small = Cost(50, 50, 50.0, 50.0)  # 100 KV tokens
    assert int(800 / ((8 * 350 + small.kv) / 9)) == 2
    assert blind.batch_with(docs, small) == 2
    assert decide(small, docs, blind, LONG, now=0.0).reason is Reason.KV_CACHE
    seen = dataclasses.replace(blind, reported=Reported(450.0, 600.0, requests=1))
    assert seen.batch_with(docs, small) == 3  # nine, spread over four
    fits = decide(small, docs, seen, LONG, now=0.0)
    assert fits.admitted and fits.position <= 0
    # what the answers there will still write, and prompts admitted but not prefilled yet,
    # are not free: refused for memory as before
    busy = dataclasses.replace(blind, reported=Reported(450.0, 450.0, requests=8))
    assert decide(small, docs, busy, LONG, now=0.0).reason is Reason.KV_CACHE
    backlog = dataclasses.replace(docs, prefill_tokens=400.0)
    assert seen.batch_with(backlog, small) == 2
    # one larger than a replica's share of what the ledger leaves free (800 - 2,800 / 4)
    large = Cost(150, 50, 50.0, 50.0)  # 200 KV tokens
    assert seen.batch_with(docs, large) == 2
    assert decide(large, docs, seen, LONG, now=0.0).reason is Reason.KV_CACHE
    # And the other way: six short prompts in flight leave five whole slots of their mean a
    # replica, but not even the emptiest replica has room for this one's prompt (traffic the
    # ledger does not see, or answers longer than it holds): refused for memory, not sent to
    # wait there.
    six = Snapshot(6, 600.0, 6 * 150)
    assert blind.batch_with(six, large) == 5
    assert decide(large, six, blind, LONG, now=0.0).admitted
    full = dataclasses.replace(blind, reported=Reported(100.0, 140.0, requests=1))
    assert full.batch_with(six, large) == 0
    assert decide(large, six, full, LONG, now=0.0).reason is Reason.KV_CACHE
    # ... an empty ledger too (the engines hold what it never saw)
    assert decide(large, Snapshot(0, 0.0), full, LONG, now=0.0).reason is Reason.KV_CACHE
    assert decide(large, dataclasses.replace(six, prefill_tokens=100.0),
                  dataclasses.replace(blind, reported=Reported(100.0, 240.0, requests=1)),
                  LONG, now=0.0).reason is Reason.KV_CACHE  # 150 > 240 - 100 not prefilled
    # between the fullest and the emptiest, the mean's slots decide
    some = dataclasses.replace(blind, reported=Reported(100.0, 240.0, requests=1))
    assert some.batch_with(six, large) == 5


def test_a_burst_of_prompts_not_prefilled_yet_delays_the_first_token() -> None:
    quiet = decide(Cost(100, 100, 50.0, 80.0), Snapshot(2, 200.0), CAP, LATENCY, now=0.0)
    burst = decide(Cost(100, 100, 50.0, 80.0), Snapshot(2, 200.0, 0, 5_000.0), CAP, LATENCY,
                   now=0.0)
    # 5,000 tokens over 2 replicas, 512 - 1.5 tokens a step of 20 + 512 x 0.1 + 1.5 x ... ms
    assert burst.ttft_ms - quiet.ttft_ms == pytest.approx(CAP.backlog_ms(5_000.0, 1.5))
    assert CAP.backlog_ms(5_000.0, 1.5) > 300


@pytest.mark.parametrize(("decodes", "prompt", "crowd"), [(64, 1500, 20), (8, 20_000, 4)])
def test_a_backlog_drains_at_the_engines_pace_beside_a_busy_batch(decodes: int, prompt: int,
                                                                   crowd: int) -> None:
    """A crowd's prompts prefilled beside ``decodes`` running requests that read ``prompt``
    tokens each: the model's ``backlog_ms`` against the simulated engine's own steps (each of
    which carries the decodes, the context they read and the chunks' attention). Counting
    only the decodes' share of the token budget read the 20,000-token case at half the
    engine's time."""
    engine = Scheduler(LLAMA_8B_1XH100)

    def prefill(seqs: list[Sequence]) -> float:
        """Step the engine until ``seqs`` are prefilled; the steps' time."""
        for seq in seqs:
            engine.add(seq)
        elapsed = 0.0
        while any(s.computed < s.prompt_tokens for s in seqs):
            step = engine.schedule()
            assert step is not None
            elapsed += step.duration_ms
            engine.complete(step)
        return elapsed

    prefill([Sequence(prompt, 10**6) for _ in range(decodes)])  # the running batch
    elapsed = prefill([Sequence(prompt, 10**6) for _ in range(crowd)])
    # the mix's context (prompt + output / 2) is what the running requests read
    cap = Capacity(replicas=1, engine=LLAMA_8B_1XH100,
                   mix=Mix(prompt_tokens=float(prompt), output_tokens=1.0))
    assert cap.backlog_ms(crowd * prompt, decodes) == pytest.approx(elapsed, rel=0.05)
    # ... and the gateway's backlog (``Backlog``) drains at that pace too
    drained_ms = 1000.0 * crowd * prompt / prefill_rate(cap, decodes)
    assert drained_ms == pytest.approx(elapsed, rel=0.05)


def test_prefill_joining_a_busy_batch_stretches_its_steps() -> None:
    light = Capacity(replicas=2, engine=ENGINE, mix=Mix(prompt_tokens=10.0, output_tokens=50.0))
    heavy = Capacity(replicas=2, engine=ENGINE,
                     mix=Mix(prompt_tokens=4000.0, output_tokens=50.0))
    assert heavy.step_ms(4) - light.step_ms(4) == pytest.approx(4 / 50 * 3990 * 0.1)


def test_a_long_prompt_is_prefilled_in_chunks_beside_the_decodes() -> None:
    one_chunk = CAP.prefill_ms(500, 4)
    two_chunks = CAP.prefill_ms(600, 4)  # 512 - 4 = 508 tokens a step
    assert two_chunks - one_chunk == pytest.approx(100 * 0.1 + ENGINE.itl_ms(4, MIX.context))


def test_batch_work_takes_only_free_slots_beyond_the_interactive_reserve() -> None:
    batch = Policy(deadline_ms=600_000, safety_factor=0.9, batch=True)
    cost = Cost(100, 100, 50.0, 100.0)
    held = dataclasses.replace(CAP, headroom=3.0)
    assert decide(cost, Snapshot(4, 400), held, batch, now=0.0).admitted  # 5 + 3 <= 8
    refused = decide(cost, Snapshot(5, 500), held, batch, now=0.0)  # 6 + 3 > 8
    assert (refused.outcome, refused.reason) == (Outcome.REJECT, Reason.NO_CAPACITY)
    assert refused.retry_after_ms is not None and refused.retry_after_ms > 0
    # an interactive request is not held back by the headroom
    assert decide(cost, Snapshot(5, 500), held, LATENCY, now=0.0).admitted


def test_rejection_says_when_it_would_fit() -> None:
    d = decide(Cost(100, 100, 50.0, 100.0), Snapshot(8, 8 * 3_000), CAP, LATENCY, now=0.0)
    assert d.retry_after_ms == pytest.approx(d.ttft_ms - LATENCY.ttft_budget_ms)


def test_no_ready_replica_rejects_with_a_hint() -> None:
    d = decide(Cost(100, 10, 5.0, 10.0), IDLE, dataclasses.replace(CAP, replicas=0), LATENCY,
               now=0.0)
    assert (d.outcome, d.reason) == (Outcome.REJECT, Reason.NO_CAPACITY)
    assert d.retry_after_ms == LATENCY.budget_ms


def test_a_surer_wait_is_a_longer_wait() -> None:
    snap = Snapshot(10, 10 * 500)
    cost = Cost(100, 50, 20.0, 40.0)
    loose = decide(cost, snap, dataclasses.replace(CAP, wait_quantile=0.5), LONG, now=0.0)
    sure = decide(cost, snap, dataclasses.replace(CAP, wait_quantile=0.99), LONG, now=0.0)
    assert sure.wait_ms > loose.wait_ms


def test_release_quantile_matches_the_gamma_distribution() -> None:
    assert release_quantile(1, 0.0) == pytest.approx(0.693, abs=0.01)  # exp median: ln 2
    assert release_quantile(10, 0.0) == pytest.approx(9.67, rel=0.01)  # gamma(10) median
    assert release_quantile(4, 1.645) == pytest.approx(7.75, rel=0.02)  # gamma(4) p95


def test_an_unchanged_ledger_satisfies_the_ceiling() -> None:
    for snap in (IDLE, Snapshot(5, 2_000), Snapshot(9, 900)):
        d = decide(Cost(100, 100, 50.0, 80.0), snap, CAP, LONG, now=0.0)
        assert d.admitted and d.ceiling_ms is not None
        assert snap.outstanding_ms + d.charge_ms <= d.ceiling_ms


@given(st.integers(0, 30), st.floats(0.0, 10_000.0), st.floats(0.0, 10_000.0))
def test_more_outstanding_work_never_turns_a_rejection_into_an_admission(
        inflight: int, a: float, b: float) -> None:
    cost = Cost(200, 100, 50.0, 100.0)
    lo, hi = sorted((a, b))
    if decide(cost, Snapshot(inflight, hi), CAP, LATENCY, now=0.0).admitted:
        assert decide(cost, Snapshot(inflight, lo), CAP, LATENCY, now=0.0).admitted


@given(st.floats(100.0, 60_000.0), st.floats(100.0, 60_000.0))
def test_a_tighter_deadline_never_admits_more(deadline: float, tighter: float) -> None:
    cost, snap = Cost(200, 100, 50.0, 100.0), Snapshot(6, 600)
    loose, tight = Policy(max(deadline, tighter), 0.8), Policy(min(deadline, tighter), 0.8)
    if decide(cost, snap, CAP, tight, now=0.0).admitted:
        assert decide(cost, snap, CAP, loose, now=0.0).admitted


def test_an_admission_counts_the_places_its_slack_affords() -> None:
    """Two gateways that both saw the last free slot must not both take it: the admission
    says how many requests in flight it tolerates (``max_inflight``), besides the work."""
    fast = EngineModel(max_num_seqs=2, num_gpu_blocks=0, step_base_ms=1.1, ms_per_seq=0.82)
    cap = Capacity(replicas=1, engine=fast)
    cost = Cost(100, 300, typical_tokens=100.0, promised_tokens=150.0)
    tight = Policy(deadline_ms=1200.0, safety_factor=0.8, ttft_ms=None)
    one = decide(cost, Snapshot(1, 500.0), cap, tight, 0.0)
    assert one.admitted and one.position == 0
    assert one.max_inflight == 2  # the last slot: a wait behind it would not fit 0.96 s
    loose = Policy(deadline_ms=600_000.0, safety_factor=0.8, ttft_ms=None)
    queued = decide(cost, Snapshot(1, 500.0), cap, loose, 0.0)
    assert queued.admitted and queued.max_inflight is not None and queued.max_inflight > 100
    kv = Capacity(replicas=1, engine=dataclasses.replace(fast, max_num_seqs=64,
                                                         num_gpu_blocks=16))
    small = Cost(100, 60, typical_tokens=40.0, promised_tokens=60.0)
    bound = decide(small, Snapshot(0, 0.0), kv, loose, 0.0)
    assert bound.admitted and bound.max_inflight == kv.batch_with(Snapshot(0, 0.0), small)
