"""What pools learn (decision.learning): the promise's feedback loop and interactive demand."""

import math
import random

import pytest

from extproc.decision.learning import Q_HIGH, Q_LOW, Q_START, Demand, PoolLearning, Promise
from extproc.decision.running import Running


def run(promise: Promise, rounds: int, rng: random.Random, told: float = 1.0,
        true: float = 1.0, unavoidable_share: float = 0.0) -> tuple[float, float]:
    """Admit and resolve ``rounds`` requests: an avoidable one misses with chance ``true x
    (1 - q)`` (a longer promise admits less and misses less) and is predicted to with chance
    ``told x (1 - q)``; a share of them would miss even alone (predicted and unavoidable).
    Returns the avoidable ones' measured miss rate and the mean quantile, second half."""
    misses = seen = 0
    quantiles = 0.0
    for i in range(rounds):
        if rng.random() < unavoidable_share:
            promise.admitted(1.0, unavoidable=1.0)
            promise.settled(True, 1.0, unavoidable=1.0)
            continue
        q = promise.quantile
        chance = told * (1.0 - q)
        promise.admitted(chance)
        missed = rng.random() < true * (1.0 - q)
        promise.settled(missed, chance)
        if i >= rounds // 2:
            misses += missed
            seen += 1
            quantiles += q
    return misses / seen, quantiles / seen


def test_it_starts_strict() -> None:
    assert Promise().quantile == pytest.approx(Q_START)


def test_the_loop_holds_attainment_at_the_target() -> None:
    promise = Promise()
    rate, quantile = run(promise, 100_000, random.Random(1), told=0.5, true=0.5)
    assert rate == pytest.approx(0.01, abs=0.002)
    assert quantile == pytest.approx(0.98, abs=0.005)  # where 0.5 (1 - q) = 1%


def test_a_model_that_underestimates_misses_is_corrected_by_what_is_measured() -> None:
    # Predictions say half of what happens: the calibration learns it, and the promise holds
    # the measured rate at the target, not the predicted one.
    promise = Promise()
    rate, quantile = run(promise, 200_000, random.Random(2), told=0.25, true=0.5)
    assert promise.calibration == pytest.approx(0.5, rel=0.15)
    assert rate == pytest.approx(0.01, abs=0.002)
    assert quantile == pytest.approx(0.98, abs=0.005)


def test_a_looser_fleet_lets_the_promise_loosen() -> None:
    strict, loose = Promise(), Promise()
    _, strict_q = run(strict, 50_000, random.Random(3), told=1.0, true=1.0)
    _, loose_q = run(loose, 50_000, random.Random(3), told=0.1, true=0.1)
    assert loose_q < strict_q - 0.05


def test_misses_no_promise_could_prevent_do_not_tighten_it() -> None:
    # One answer in five is too long for its deadline even alone: no promise helps them.
    # The loop still holds the others at the target instead of running to its strict bound.
    promise = Promise()
    rate, quantile = run(promise, 100_000, random.Random(4), told=0.5, true=0.5,
                         unavoidable_share=0.2)
    assert rate == pytest.approx(0.01, abs=0.003)
    assert quantile == pytest.approx(0.98, abs=0.006)


def test_the_promise_stays_within_its_bounds() -> None:
    always, never = Promise(), Promise()
    for _ in range(100_000):
        always.admitted(0.5)
        never.admitted(0.0)
    assert always.quantile == pytest.approx(Q_HIGH)
    assert never.quantile == pytest.approx(Q_LOW)


def test_measured_misses_tighten_the_next_admissions() -> None:
    calm, burst = Promise(), Promise()
    for p in (calm, burst):
        for _ in range(2_000):
            p.admitted(0.005)
            p.settled(False, 0.005)
    for _ in range(30):
        burst.settled(True, 0.005)  # thirty misses the model did not see coming
    for p in (calm, burst):
        for _ in range(200):
            p.admitted(0.005)
    assert burst.calibration < 0.5 * calm.calibration
    assert burst.quantile > calm.quantile + 0.005


def test_a_model_blind_to_the_misses_cannot_loosen_past_them() -> None:
    # Every admission is predicted sure to make it, yet one in twenty misses: the predicted
    # loop alone would loosen to its bound; measured misses running over the target stop it
    # and tighten the promise instead.
    promise = Promise()
    rng = random.Random(7)
    for _ in range(5_000):
        promise.admitted(0.0)
        promise.settled(rng.random() < 0.05, 0.0)
    assert promise.over
    assert promise.quantile > Q_START


def test_each_request_counts_for_its_promise_when_its_deadline_comes() -> None:
    # Short answers end first: counting them when they end and misses only once known
    # would loosen the promise on the short ones before the long ones could miss.
    learning = PoolLearning()
    promise = learning.promise("chat")
    records = [Running("chat", 0.0, deadline_s=30.0, ttft_ms=100.0, step_ms=20.0, chance=0.01,
                       prompt_tokens=100) for _ in range(10)]
    for i, running in enumerate(records):
        learning.admitted(running, key=f"r{i}")
    for i in range(5):  # half end in 2 s
        learning.settled(records[i], completed=True, now=2.0, key=f"r{i}")
    learning.refresh(2.0)
    assert (promise.hits, promise.misses) == (0, 0)  # not yet: their deadline has not come
    learning.refresh(31.0)  # the rest are still running past their deadline: misses
    assert (promise.hits, promise.misses) == (5, 5)
    for i in range(5, 10):  # they end late: already counted
        learning.settled(records[i], completed=True, now=40.0, key=f"r{i}")
    learning.refresh(45.0)
    assert (promise.hits, promise.misses) == (5, 5)


def test_demand_is_littles_law_plus_two_deviations() -> None:
    demand = Demand(memory_s=60.0)
    rng = random.Random(4)
    t = 0.0
    while t < 600.0:
        t += rng.expovariate(10.0)  # 10 a second, 2 s each: 20 in flight
        demand.arrived(t)
        demand.served(2.0, t)
    assert demand.needed(t) == pytest.approx(20 + 2 * math.sqrt(20), rel=0.1)
    assert demand.needed(t + 600) < 1.0  # forgotten once it stops


def test_a_pool_learns_its_mix_and_feeds_its_promises_per_class() -> None:
    learning = PoolLearning()
    for t in range(500):
        learning.arrived("latency", False, float(t), 2000)  # the mix is what asks
        learning.finished(30)
    mix = learning.mix()
    assert mix.prompt_tokens == pytest.approx(2000, rel=0.01)
    assert mix.output_tokens < 40
    learning.settled(Running("latency", -4.0, deadline_s=2.0), completed=True, now=1.0)
    learning.settled(Running("batch", 0.0, deadline_s=600.0, batch=True), completed=False,
                     now=1.0)  # cancelled in time: no news
    assert learning.promise("latency").misses == 1
    assert (learning.promise("batch").hits, learning.promise("batch").misses) == (0, 0)


def test_each_class_learns_its_own_lengths_once_the_pool_serves_several() -> None:
    learning = PoolLearning()
    for t in range(200):
        learning.arrived("chat", False, float(t))
        learning.finished(100)  # the engines' histogram: everything, exact
    assert learning.lengths_for("chat") is learning.lengths  # one class: the exact one
    for t in range(200):
        learning.arrived("batch", True, float(t))
        # a batch answer: 20 s of decoding at 20 ms a step after a 1 s first token
        learning.settled(Running("batch", t - 21.0, deadline_s=600.0, batch=True,
                                 ttft_ms=1000.0, step_ms=20.0), completed=True, now=float(t))
        learning.settled(Running("chat", t - 2.5, deadline_s=30.0, ttft_ms=500.0, step_ms=20.0),
                         completed=True, now=float(t))
    assert learning.lengths_for("batch").mean() == pytest.approx(1000, rel=0.1)
    assert learning.lengths_for("chat").mean() == pytest.approx(100, rel=0.1)
    # a stream cancelled early says the answer was at least that long (censored)
    learning.settled(Running("chat", 240.0, deadline_s=30.0, ttft_ms=500.0, step_ms=20.0),
                     completed=False, now=300.0)
    assert learning.lengths_for("chat").quantile(0.999) > 2500


def test_requests_in_flight_count_in_the_lengths_until_they_end() -> None:
    learning = PoolLearning()
    for _ in range(300):
        learning.finished(20)  # the short answers, which end first
    before = learning.lengths_for("chat").mean()
    records = [Running("chat", 0.0, ttft_ms=500.0, step_ms=20.0, prompt_tokens=500)
               for _ in range(100)]  # long answers admitted at t=0: 20 ms steps after 0.5 s
    for i, running in enumerate(records):
        learning.admitted(running, key=f"r{i}")
    learning.refresh(10.5)  # each is ~500 tokens in: at least that long
    during = learning.lengths_for("chat")
    assert during.mean() > 5 * before
    assert during.quantile(0.8) > 400  # a quarter of the answers are long
    learning.refresh(10.7)  # refreshed at most once a second: the same view
    assert learning.lengths_for("chat") is during
    for i, running in enumerate(records):
        learning.settled(running, completed=True, now=30.0, key=f"r{i}")
    learning.refresh(30.0)
    assert learning.lengths_for("chat") is learning.lengths  # nothing in flight: no view


def test_a_prompt_leaves_the_backlog_when_its_stream_ends() -> None:
    learning = PoolLearning()
    big = Running("chat", 0.0, deadline_s=30.0, prefill_rate=10_000.0, prompt_tokens=100_000)
    learning.admitted(big, key="big")
    assert learning.backlog.level(1.0, 10_000.0) == pytest.approx(90_000)
    # the engine was faster than its model: the answer is back after a second
    learning.settled(big, completed=True, now=1.0, key="big")
    assert learning.backlog.level(1.0, 10_000.0) == 0.0
