import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.admission import (
    Capacity,
    Cost,
    Outcome,
    Policy,
    Reason,
    Snapshot,
    decide,
    release_quantile,
)

CAP = Capacity(replicas=2, max_running=4, prefill_ms_per_token=0.1, itl_ms_at_1=20.0,
               itl_ms_per_running=1.0)  # S = 8 slots; itl(4) = 23, so a full batch's step
LATENCY = Policy(deadline_ms=10_000, safety_factor=0.8, ttft_ms=1_000)  # budgets 8000 / 800
BATCH = Policy(deadline_ms=60_000, safety_factor=0.9)
IDLE = Snapshot(inflight=0, outstanding_ms=0.0)


def spec(cost: Cost, snap: Snapshot, cap: Capacity) -> dict[str, float]:
    """The module docstring's formula, written out again line by line."""
    o = cost.output_tokens if cost.expected_output_tokens is None \
        else min(cost.output_tokens, cost.expected_output_tokens)
    big_o = cost.output_tokens if cost.long_output_tokens is None \
        else min(cost.output_tokens, cost.long_output_tokens)
    b_full = cap.max_running
    prefill = cost.prompt_tokens * cap.prefill_ms_per_token
    gpu = prefill + o * cap.itl_ms(b_full) / b_full
    g = snap.outstanding_ms / snap.inflight if snap.inflight else gpu
    # the fleet's mean decode: the prediction, not this request's own clipped length
    fleet = cost.output_tokens if cost.expected_output_tokens is None \
        else cost.expected_output_tokens
    share = min(0.9, max(0.0, 1 - fleet * cap.itl_ms(b_full) / (b_full * g))) if g > 0 else 0.0
    b = min(b_full, (snap.inflight + 1) / cap.replicas)
    step = cap.itl_ms(b) / (1 - share * b / b_full)
    p = snap.inflight + 1 - cap.slots
    wait = 0.0 if p <= 0 else release_quantile(math.ceil(p / cap.replicas), cap.wait_z) * g
    return {"gpu": gpu, "wait": wait, "ttft": wait + prefill,
            "completion": wait + prefill + big_o * step}


def q(k: int) -> float:
    return release_quantile(k, CAP.wait_z)


# name, cost, snapshot, policy, outcome, reason, wait_ms
TABLE = [
    ("idle fleet admits", Cost(1000, 100), IDLE, LATENCY, Outcome.ADMIT, Reason.FITS, 0.0),
    # 5 in flight + this one on 8 slots: a slot is free, it starts at once
    ("free slot starts at once", Cost(1000, 100), Snapshot(5, 3_000), LATENCY, Outcome.ADMIT,
     Reason.FITS, 0.0),
    # 8 in flight of mean charge 50: first in its replica's queue, waits q(1) x 50
    ("queued but fits", Cost(1000, 100), Snapshot(8, 400), LATENCY, Outcome.ADMIT,
     Reason.FITS, q(1) * 50),
    # mean charge 500: the wait q(1) x 500 plus 100 of prefill passes the 800 TTFT budget
    ("ttft objective missed", Cost(1000, 100), Snapshot(8, 4_000), LATENCY, Outcome.REJECT,
     Reason.TTFT, q(1) * 500),
    # a free slot, but 340 tokens at a full batch's stretched step take longer than 8000
    ("deadline missed", Cost(1000, 340), Snapshot(7, 7 * 2_055), LATENCY, Outcome.REJECT,
     Reason.DEADLINE, 0.0),
    # 20 in flight: 13th in the fleet queue, 7th in its replica's; a class without a TTFT
    # objective and a long deadline still takes it
    ("throughput class queues deep", Cost(1000, 100), Snapshot(20, 20 * 300), BATCH,
     Outcome.ADMIT, Reason.FITS, q(7) * 300),
    # 1000 output tokens x 20 ms = 20 s > 8 s even idle: not overload
    ("infeasible even idle", Cost(10, 1000), Snapshot(20, 48_000), LATENCY, Outcome.PASS,
     Reason.INFEASIBLE, 0.0),
    ("prefill alone past ttft", Cost(9000, 1), IDLE, LATENCY, Outcome.PASS,
     Reason.INFEASIBLE, 0.0),
]


@pytest.mark.parametrize("name, cost, snap, policy, outcome, reason, wait", TABLE,
                         ids=[t[0] for t in TABLE])
def test_policy_table(name: str, cost: Cost, snap: Snapshot, policy: Policy, outcome: Outcome,
                      reason: Reason, wait: float) -> None:
    d = decide(cost, snap, CAP, policy, now=100.0)
    assert (d.outcome, d.reason) == (outcome, reason)
    assert d.wait_ms == pytest.approx(wait)
    assert d.finish_at == pytest.approx(100.0 + d.completion_ms / 1000.0)
    assert d.budget_ms == pytest.approx(policy.budget_ms)
    if reason is not Reason.INFEASIBLE:
        assert d.completion_ms == pytest.approx(spec(cost, snap, CAP)["completion"])


@given(inflight=st.integers(0, 400), mean=st.floats(1.0, 1e5), prompt=st.integers(0, 8000),
       output=st.integers(1, 4000), expected=st.none() | st.floats(1, 4000),
       long=st.none() | st.floats(1, 8000), replicas=st.integers(1, 12),
       quantile=st.floats(0.5, 0.999))
def test_decide_follows_the_docstring_formula(inflight: int, mean: float, prompt: int,
                                              output: int, expected: float | None,
                                              long: float | None, replicas: int,
                                              quantile: float) -> None:
    cap = Capacity(replicas, 16, 0.08, 18.6, 0.84, wait_quantile=quantile)
    cost = Cost(prompt, output, expected, long)
    snap = Snapshot(inflight, inflight * mean)
    d = decide(cost, snap, cap, BATCH, now=0.0)
    if d.reason is Reason.INFEASIBLE:
        return
    want = spec(cost, snap, cap)
    assert d.service_ms == pytest.approx(want["gpu"])
    assert d.wait_ms == pytest.approx(want["wait"])
    assert d.ttft_ms == pytest.approx(want["ttft"])
    assert d.completion_ms == pytest.approx(want["completion"])


def test_rejection_says_when_it_would_fit() -> None:
    d = decide(Cost(1000, 100), Snapshot(8, 4_000), CAP, LATENCY, now=0.0)
    assert d.outcome is Outcome.REJECT
    # the TTFT excess: wait + prefill - 800; the wait shrinks 1 ms per ms
    assert d.retry_after_ms == pytest.approx(d.ttft_ms - 800.0)
    # no wait to shrink: at least the time a replica takes to free a slot
    full = decide(Cost(1000, 340), Snapshot(7, 7 * 2_055), CAP, LATENCY, now=0.0)
    assert full.retry_after_ms == pytest.approx(
        max(full.completion_ms - LATENCY.budget_ms, 2_055.0))


def test_no_ready_replica_rejects_with_a_hint() -> None:
    d = decide(Cost(10, 10), IDLE, Capacity(0, 4, 0.1, 20.0, 1.0), LATENCY, now=0.0)
    assert (d.outcome, d.reason) == (Outcome.REJECT, Reason.NO_CAPACITY)
    assert d.retry_after_ms == LATENCY.budget_ms


def test_the_ledger_is_charged_expected_gpu_time_not_max_tokens() -> None:
    in_full = decide(Cost(1000, 2000), IDLE, CAP, BATCH, now=0.0)
    predicted = decide(Cost(1000, 2000, expected_output_tokens=200), IDLE, CAP, BATCH, now=0.0)
    assert in_full.service_ms == pytest.approx(100 + 2000 * 23 / 4)
    assert predicted.service_ms == pytest.approx(100 + 200 * 23 / 4)
    # never more than max_tokens, whatever the prediction says
    capped = decide(Cost(1000, 50, expected_output_tokens=200), IDLE, CAP, BATCH, now=0.0)
    assert capped.service_ms == pytest.approx(100 + 50 * 23 / 4)


def test_the_long_length_is_what_the_deadline_promises() -> None:
    snap = Snapshot(7, 7 * 700.0)
    typical_only = decide(Cost(1000, 2000, expected_output_tokens=200), snap, CAP, LATENCY, 0.0)
    with_tail = decide(Cost(1000, 2000, expected_output_tokens=200, long_output_tokens=300),
                       snap, CAP, LATENCY, 0.0)
    # without a long length the request is promised its max_tokens: 2000 tokens never fit
    assert typical_only.outcome is Outcome.PASS
    assert with_tail.admitted
    step = with_tail.completion_ms - with_tail.ttft_ms
    assert step == pytest.approx(spec(Cost(1000, 2000, 200, 300), snap, CAP)["completion"]
                                 - with_tail.ttft_ms)


def test_the_wait_counts_slots_ahead_not_the_backlog() -> None:
    cost = Cost(100, 10)
    # a free slot: no wait, however much work is in flight
    assert decide(cost, Snapshot(7, 1e6), CAP, BATCH, now=0.0).wait_ms == 0.0
    # queued: the wait is the slot-release quantile times the mean charge
    first = decide(cost, Snapshot(8, 8 * 100.0), CAP, BATCH, now=0.0)
    third = decide(cost, Snapshot(12, 12 * 100.0), CAP, BATCH, now=0.0)
    assert first.wait_ms == pytest.approx(q(1) * 100.0)
    assert third.wait_ms == pytest.approx(q(3) * 100.0)
    assert q(1) < q(3) < 3 * q(1)


def test_a_surer_wait_is_a_longer_wait() -> None:
    snap, cost = Snapshot(10, 10 * 100.0), Cost(100, 10)
    waits = [decide(cost, snap, Capacity(2, 4, 0.1, 20.0, 1.0, wait_quantile=p), BATCH,
                    0.0).wait_ms for p in (0.5, 0.9, 0.98, 0.999)]
    assert waits == sorted(waits) and waits[0] < waits[-1]


def test_release_quantile_matches_the_gamma_distribution() -> None:
    # exact quantiles of Gamma(k, 1): k=1 is exponential, -ln(1 - p)
    assert release_quantile(1, 2.326) == pytest.approx(-math.log(0.01), rel=0.01)
    assert release_quantile(1, 1.2816) == pytest.approx(-math.log(0.10), rel=0.01)
    assert release_quantile(4, 2.326) == pytest.approx(10.045, rel=0.01)  # chi2(8)/2 at 0.99


def test_prefill_heavy_work_in_flight_stretches_decode_steps() -> None:
    cost = Cost(100, 100, expected_output_tokens=100)
    decode_only = decide(cost, Snapshot(5, 5 * (10 + 575)), CAP, BATCH, now=0.0)
    prefill_heavy = decide(cost, Snapshot(5, 5 * 3000.0), CAP, BATCH, now=0.0)
    assert prefill_heavy.completion_ms > decode_only.completion_ms
    assert prefill_heavy.wait_ms == decode_only.wait_ms == 0.0


def test_serial_replicas_wait_for_their_place_in_line() -> None:
    """With B = 1 (the article's serial replica) the requests in service are not queued
    ahead: the first in line waits for one release of its replica, the fifth (queues kept
    even over four replicas) for two."""
    serial = Capacity(replicas=4, max_running=1, prefill_ms_per_token=0.9, itl_ms_at_1=18.0,
                      itl_ms_per_running=5.0)
    slo = Policy(deadline_ms=60_000, safety_factor=0.8)
    cost = Cost(prompt_tokens=100, output_tokens=30)
    first = decide(cost, Snapshot(4, 4 * 630.0), serial, slo, now=0.0)
    fifth = decide(cost, Snapshot(8, 8 * 630.0), serial, slo, now=0.0)
    assert first.wait_ms == pytest.approx(release_quantile(1, serial.wait_z) * 630.0)
    assert fifth.wait_ms == pytest.approx(release_quantile(2, serial.wait_z) * 630.0)


def test_an_unchanged_ledger_satisfies_the_ceiling() -> None:
    for snap in (IDLE, Snapshot(5, 3_000), Snapshot(8, 400), Snapshot(20, 6_000)):
        d = decide(Cost(1000, 100), snap, CAP, BATCH, now=0.0)
        assert d.admitted and d.ceiling_ms is not None
        assert snap.outstanding_ms + d.service_ms <= d.ceiling_ms


@given(inflight=st.integers(0, 500), outstanding=st.floats(0, 1e7), extra=st.floats(0, 1e7),
       prompt=st.integers(0, 8000), output=st.integers(0, 2000))
def test_more_outstanding_work_never_turns_a_rejection_into_an_admission(
        inflight: int, outstanding: float, extra: float, prompt: int, output: int) -> None:
    cost = Cost(prompt, output)
    light = decide(cost, Snapshot(inflight, outstanding), CAP, LATENCY, now=0.0)
    heavy = decide(cost, Snapshot(inflight, outstanding + extra), CAP, LATENCY, now=0.0)
    if not light.admitted:
        assert not heavy.admitted
    if heavy.outcome is Outcome.REJECT:
        assert heavy.retry_after_ms is not None and heavy.retry_after_ms > 0


@given(deadline=st.floats(100, 1e6), tighter=st.floats(0.01, 1.0))
def test_a_tighter_deadline_never_admits_more(deadline: float, tighter: float) -> None:
    cost, snap = Cost(500, 200), Snapshot(9, 20_000)
    loose = decide(cost, snap, CAP, Policy(deadline, 0.8), now=0.0)
    tight = decide(cost, snap, CAP, Policy(deadline * tighter, 0.8), now=0.0)
    assert loose.admitted or not tight.admitted


def test_the_prefill_share_is_the_fleets_not_the_requests_own() -> None:
    """Two requests differing only in their own lengths see the same busy fleet: the same
    stretched step. (Read from the request's own decode, one whose ``max_tokens`` is under the
    pool's mean output saw more prefill than there is, and one told its true long length, as
    the simulator's oracle is, saw none.)"""
    busy = Snapshot(inflight=7, outstanding_ms=7 * 400.0)  # mean charge 400: mostly prefill
    short = Cost(2000, 10, expected_output_tokens=30, long_output_tokens=10)
    long = Cost(2000, 600, expected_output_tokens=30, long_output_tokens=600)
    steps = [(d.completion_ms - d.ttft_ms) / c.long_tokens
             for c in (short, long) for d in [decide(c, busy, CAP, BATCH, now=0.0)]]
    assert steps[0] == pytest.approx(steps[1])
    assert steps[0] > CAP.itl_ms(CAP.max_running)  # stretched by the fleet's prefills
