import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.admission import Capacity, Cost, Outcome, Policy, Reason, Snapshot, decide

CAP = Capacity(replicas=2, max_running=4, prefill_ms_per_token=0.1, itl_ms_at_1=20.0,
               itl_ms_per_running=1.0)
LATENCY = Policy(deadline_ms=10_000, safety_factor=0.8, ttft_ms=1_000)  # budgets 8000 / 800
BATCH = Policy(deadline_ms=60_000, safety_factor=0.9)
IDLE = Snapshot(inflight=0, outstanding_ms=0.0)

# name, cost, snapshot, policy, outcome, reason, wait_ms, completion_ms
TABLE = [
    ("idle fleet admits", Cost(1000, 100), IDLE, LATENCY, Outcome.ADMIT, Reason.FITS,
     0.0, 100 + 100 * 20.0),
    # 5 in flight + this one over 2 replicas: batch 3 per replica -> itl 22
    ("free slot, batch grows itl", Cost(1000, 100), Snapshot(5, 9_000), LATENCY,
     Outcome.ADMIT, Reason.FITS, 0.0, 100 + 100 * 22.0),
    # 8 slots full: wait = 4000 / 8 = 500; ttft 600 <= 800; completion 500+100+100*23 = 2900
    ("queued but fits", Cost(1000, 100), Snapshot(8, 4_000), LATENCY, Outcome.ADMIT,
     Reason.FITS, 500.0, 2900.0),
    # wait = 8000 / 8 = 1000: ttft 1100 > 800 while completion 3400 fits
    ("ttft objective missed", Cost(1000, 100), Snapshot(8, 8_000), LATENCY, Outcome.REJECT,
     Reason.TTFT, 1000.0, 3400.0),
    # wait 500, ttft 600 fits; completion 500 + 100 + 340*23 = 8420 > 8000
    ("deadline missed", Cost(1000, 340), Snapshot(8, 4_000), LATENCY, Outcome.REJECT,
     Reason.DEADLINE, 500.0, 8420.0),
    # both missed: the reason is the larger excess (ttft 6100 vs 800 beats 13000 vs 8000)
    ("both missed, ttft worse", Cost(1000, 300), Snapshot(20, 48_000), LATENCY,
     Outcome.REJECT, Reason.TTFT, 6000.0, 13_000.0),
    # the same load is fine for a class without a TTFT objective and a long deadline
    ("throughput class queues deep", Cost(1000, 300), Snapshot(20, 48_000), BATCH,
     Outcome.ADMIT, Reason.FITS, 6000.0, 13_000.0),
    # 1000 output tokens x 20 ms = 20 s > 8 s even idle: not overload
    ("infeasible even idle", Cost(10, 1000), Snapshot(20, 48_000), LATENCY, Outcome.PASS,
     Reason.INFEASIBLE, 0.0, 1 + 1000 * 20.0),
    ("prefill alone past ttft", Cost(9000, 1), IDLE, LATENCY, Outcome.PASS,
     Reason.INFEASIBLE, 0.0, 900 + 20.0),
]


@pytest.mark.parametrize("name, cost, snap, policy, outcome, reason, wait, completion", TABLE,
                         ids=[t[0] for t in TABLE])
def test_policy_table(name: str, cost: Cost, snap: Snapshot, policy: Policy, outcome: Outcome,
                      reason: Reason, wait: float, completion: float) -> None:
    d = decide(cost, snap, CAP, policy, now=100.0)
    assert (d.outcome, d.reason) == (outcome, reason)
    assert d.wait_ms == pytest.approx(wait)
    assert d.completion_ms == pytest.approx(completion)
    assert d.finish_at == pytest.approx(100.0 + completion / 1000.0)
    assert d.budget_ms == pytest.approx(policy.budget_ms)


def test_rejection_says_when_it_would_fit() -> None:
    d = decide(Cost(1000, 340), Snapshot(8, 4_000), CAP, LATENCY, now=0.0)
    # completion 8420 vs budget 8000: the wait must shrink by 420 ms
    assert d.retry_after_ms == pytest.approx(420.0)
    # the TTFT excess is larger here: wait 1000 + prefill 100 vs 800
    t = decide(Cost(1000, 100), Snapshot(8, 8_000), CAP, LATENCY, now=0.0)
    assert t.retry_after_ms == pytest.approx(300.0)


def test_no_ready_replica_rejects_with_a_hint() -> None:
    d = decide(Cost(10, 10), IDLE, Capacity(0, 4, 0.1, 20.0, 1.0), LATENCY, now=0.0)
    assert (d.outcome, d.reason) == (Outcome.REJECT, Reason.NO_CAPACITY)
    assert d.retry_after_ms == LATENCY.budget_ms


def test_serial_replicas_reduce_to_the_articles_formula() -> None:
    """With one sequence per replica: outstanding / replicas + own vs SLO x 0.8."""
    serial = Capacity(replicas=4, max_running=1, prefill_ms_per_token=0.9, itl_ms_at_1=18.0,
                      itl_ms_per_running=5.0)
    slo = Policy(deadline_ms=2000, safety_factor=0.8)
    cost = Cost(prompt_tokens=100, output_tokens=30)
    own = 100 * 0.9 + 30 * 18.0
    for outstanding in (0.0, 1000.0, 4000.0, 8000.0):
        d = decide(cost, Snapshot(4, outstanding), serial, slo, now=0.0)
        article = outstanding / 4 + own
        assert d.completion_ms == pytest.approx(article)
        assert d.admitted == (article <= 2000 * 0.8)


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
