"""What pools learn (extproc.learning): the promise's feedback loop and interactive demand."""

import math
import random

import pytest

from extproc.learning import Q_HIGH, Q_LOW, Q_START, Demand, PoolLearning, Promise


def run(promise: Promise, rounds: int, rng: random.Random, miss_at: float = 1.0,
        unavoidable_share: float = 0.0) -> tuple[float, float]:
    """Feed ``rounds`` settled requests: an avoidable one misses with chance ``miss_at x
    (1 - q)`` (a longer promise admits less and misses less); a share of them would miss even
    alone. Returns the avoidable ones' measured miss rate and the mean quantile over the
    second half."""
    misses = seen = 0
    quantiles = 0.0
    for i in range(rounds):
        if rng.random() < unavoidable_share:
            promise.settled(True, unavoidable=1.0)
            continue
        missed = rng.random() < miss_at * (1.0 - promise.quantile)
        promise.settled(missed)
        if i >= rounds // 2:
            misses += missed
            seen += 1
            quantiles += promise.quantile
    return misses / seen, quantiles / seen


def test_it_starts_strict() -> None:
    assert Promise().quantile == pytest.approx(Q_START)


def test_the_loop_holds_measured_attainment_at_the_target() -> None:
    promise = Promise()
    rate, quantile = run(promise, 200_000, random.Random(1), miss_at=0.5)
    assert rate == pytest.approx(0.01, abs=0.002)
    assert quantile == pytest.approx(0.98, abs=0.005)  # where 0.5 (1 - q) = 1%


def test_a_looser_fleet_lets_the_promise_loosen() -> None:
    strict, loose = Promise(), Promise()
    _, strict_q = run(strict, 100_000, random.Random(2), miss_at=1.0)
    _, loose_q = run(loose, 100_000, random.Random(2), miss_at=0.1)
    assert loose_q < strict_q - 0.05


def test_misses_no_promise_could_prevent_do_not_tighten_it() -> None:
    # One answer in five is too long for its deadline even alone: no promise helps them.
    # The loop still holds the others at the target instead of running to its strict bound.
    promise = Promise()
    rate, quantile = run(promise, 200_000, random.Random(3), miss_at=0.5,
                         unavoidable_share=0.2)
    assert rate == pytest.approx(0.01, abs=0.003)
    assert quantile == pytest.approx(0.98, abs=0.006)


def test_the_promise_stays_within_its_bounds() -> None:
    always, never = Promise(), Promise()
    for _ in range(100_000):
        always.settled(True)
        never.settled(False)
    assert always.quantile == pytest.approx(Q_HIGH)
    assert never.quantile == pytest.approx(Q_LOW)


def test_a_burst_of_misses_tightens_at_once_and_loosening_takes_evidence() -> None:
    promise = Promise()
    for _ in range(5_000):
        promise.settled(False)
    loose = promise.quantile
    for _ in range(20):
        promise.settled(True)
    tightened = promise.quantile
    assert tightened > loose + 0.1
    for _ in range(100):
        promise.settled(False)  # a hundred hits undo about one miss
    assert promise.quantile > tightened - 0.05


def test_demand_is_littles_law_plus_two_deviations() -> None:
    demand = Demand(memory_s=60.0)
    rng = random.Random(4)
    t = 0.0
    while t < 600.0:
        t += rng.expovariate(10.0)  # 10 a second, 2 s each: 20 in flight
        demand.arrived(t)
        demand.served(2.0, t)
    assert demand.reserve(t) == pytest.approx(20 + 2 * math.sqrt(20), rel=0.1)
    assert demand.reserve(t + 600) < 1.0  # forgotten once it stops


def test_a_pool_learns_its_mix_and_feeds_its_promises_per_class() -> None:
    learning = PoolLearning()
    for t in range(500):
        learning.arrived("latency", False, float(t), 2000)  # the mix is what asks
        learning.lengths.observe(30)
    mix = learning.mix()
    assert mix.prompt_tokens == pytest.approx(2000, rel=0.01)
    assert mix.output_tokens < 40
    learning.settled("latency", batch=False, seconds=5.0, deadline_s=2.0, completed=True,
                     unavoidable=0.0, now=1.0)
    learning.settled("batch", batch=True, seconds=1.0, deadline_s=600.0, completed=False,
                     unavoidable=0.0, now=1.0)  # cancelled in time: no news
    assert learning.promise("latency").misses == 1
    assert (learning.promise("batch").hits, learning.promise("batch").misses) == (0, 0)


def test_each_class_learns_its_own_lengths_once_the_pool_serves_several() -> None:
    learning = PoolLearning()
    for t in range(200):
        learning.arrived("chat", False, float(t))
        learning.lengths.observe(100)  # the engines' histogram: everything, exact
    assert learning.lengths_for("chat") is learning.lengths  # one class: the exact one
    for t in range(200):
        learning.arrived("batch", True, float(t))
        # a batch answer: 20 s of decoding at 20 ms a step after a 1 s first token
        learning.settled("batch", batch=True, seconds=21.0, deadline_s=600.0, completed=True,
                         unavoidable=0.0, now=float(t), ttft_ms=1000.0, step_ms=20.0)
        learning.settled("chat", batch=False, seconds=2.5, deadline_s=30.0, completed=True,
                         unavoidable=0.0, now=float(t), ttft_ms=500.0, step_ms=20.0)
    assert learning.lengths_for("batch").mean() == pytest.approx(1000, rel=0.1)
    assert learning.lengths_for("chat").mean() == pytest.approx(100, rel=0.1)
    # a stream cancelled early says the answer was at least that long (censored)
    learning.settled("chat", batch=False, seconds=60.0, deadline_s=30.0, completed=False,
                     unavoidable=0.0, now=300.0, ttft_ms=500.0, step_ms=20.0)
    assert learning.lengths_for("chat").quantile(0.999) > 2500


def test_requests_in_flight_count_in_the_lengths_until_they_end() -> None:
    learning = PoolLearning()
    for _ in range(300):
        learning.lengths.observe(20)  # the short answers, which end first
    before = learning.lengths_for("chat").mean()
    for i in range(100):  # long answers admitted at t=0: 20 ms steps after a 0.5 s TTFT
        learning.admitted("chat", 500, now=0.0, key=f"r{i}", ttft_ms=500.0, step_ms=20.0)
    learning.refresh(10.5)  # each is ~500 tokens in: at least that long
    during = learning.lengths_for("chat")
    assert during.mean() > 5 * before
    assert during.quantile(0.8) > 400  # a quarter of the answers are long
    learning.refresh(10.7)  # refreshed at most once a second: the same view
    assert learning.lengths_for("chat") is during
    for i in range(100):
        learning.settled("chat", batch=False, seconds=30.0, deadline_s=60.0, completed=True,
                         unavoidable=0.0, now=30.0, key=f"r{i}")
    learning.refresh(30.0)
    assert learning.lengths_for("chat") is learning.lengths  # nothing in flight: no view
