"""The replica recommender: table tests of each rule and guard, property tests of its promises."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.errors import ConfigError
from extproc.scaling.autoscale import (
    Direction,
    Reading,
    Reason,
    Recommender,
    ScalingPolicy,
    Window,
    classify,
    drain_step,
    lost_share,
)

W = 15.0  # seconds per control window
# Clients that never retry a 429: every rejected attempt is a lost request, so the rejection
# rule reads the attempt ratio as is (the article's ``1 / (1 - r)``). The rules' mechanics are
# tested with it; the default (clients retry twice) has its own tests under rule (a).
NO_RETRY = ScalingPolicy(client_retries=0)


def window(now: float, **kw: Any) -> Window:
    """A calm window: 8 ready replicas, 10 req/s all admitted and served, nothing waiting."""
    base: dict[str, Any] = dict(now=now, duration_s=W, arrivals=150, admitted=150, rejected=0,
                                departures=150, oldest_age_s=1.0, queue_depth=0, ready=8)
    return Window(**{**base, **kw})


def run(rec: Recommender, windows: list[Window]) -> list[int]:
    return [rec.observe(w).desired for w in windows]


def busy(now: float, ready: int, rejected: int, decided: int = 1000, **kw: Any) -> Window:
    return window(now, ready=ready, arrivals=decided, admitted=decided - rejected,
                  rejected=rejected, departures=decided - rejected, **kw)


# --- rule (b): the queue-age controller ------------------------------------------------------

def test_drain_step_is_the_notes_worked_example() -> None:
    # 360 requests waiting, drained within 60 s, 2.5 successful req/s per replica: 2.4 -> 3
    assert drain_step(360, 60.0, 2.5) == 3
    assert drain_step(0, 60.0, 2.5) == 0


def test_queue_age_rule_adds_three_replicas_in_the_worked_example() -> None:
    # 8 ready replicas serve 20 req/s (2.5 each, measured); 32 req/s arrive for 30 s; the backlog
    # reaches 360 with the oldest request past its threshold in both windows. (The article's
    # queue-per-replica arm is switched off: without admission control it would double.)
    rec = Recommender(ScalingPolicy(queue_per_replica_high=1e9, max_replicas=40))
    first = rec.observe(window(15, arrivals=480, admitted=480, departures=300, queue_depth=180,
                               oldest_age_s=25.0))
    assert first.direction is Direction.HOLD  # one window is not yet two
    second = rec.observe(window(30, arrivals=480, admitted=480, departures=300, queue_depth=360,
                                oldest_age_s=40.0))
    assert (second.desired, second.direction, second.reason) == (11, Direction.UP,
                                                                 Reason.QUEUE_AGE)
    assert second.service_rate == pytest.approx(2.5)


def test_queue_age_needs_arrivals_above_departures_in_consecutive_windows() -> None:
    rec = Recommender(ScalingPolicy(queue_per_replica_high=1e9))
    old = dict(queue_depth=100, oldest_age_s=60.0)
    desired = run(rec, [
        window(15, arrivals=400, departures=300, **old),
        window(30, arrivals=300, departures=300, **old),  # draining as fast as it fills
        window(45, arrivals=400, departures=300, **old),
    ])
    assert desired == [8, 8, 8]


def test_queue_age_step_without_a_known_rate_is_one_replica() -> None:
    rec = Recommender(ScalingPolicy(queue_per_replica_high=1e9))
    # nothing departs while work waits would be a stall; a trickle is not
    ws = [window(t, arrivals=400, admitted=400, departures=0, queue_depth=3000, oldest_age_s=60.0,
                 ready=0, starting=0) for t in (15, 30)]
    assert run(rec, ws)[-1] == 1  # activation from no replica at all, not a big guess


def test_requested_replicas_count_before_asking_again() -> None:
    rec = Recommender(ScalingPolicy(queue_per_replica_high=1e9, max_replicas=40))
    grow = dict(arrivals=480, admitted=480, departures=300, oldest_age_s=40.0)
    rec.observe(window(15, queue_depth=180, **grow))
    assert rec.observe(window(30, queue_depth=360, **grow)).desired == 11
    # the three are starting; the backlog they were sized for has not grown: no second ask
    again = rec.observe(window(45, queue_depth=360, starting=3, **grow))
    assert (again.desired, again.reason) == (11, Reason.PENDING)
    # pods not yet visible at all still count: the previous ask covers them
    hidden = rec.observe(window(60, queue_depth=360, starting=0, **grow))
    assert (hidden.desired, hidden.reason) == (11, Reason.PENDING)
    # the backlog doubled: now the ask exceeds what was requested
    more = rec.observe(window(75, queue_depth=720, starting=3, **grow))
    assert (more.desired, more.reason) == (8 + 5, Reason.QUEUE_AGE)


def test_near_zero_departures_enter_the_failure_state_instead_of_scaling() -> None:
    rec = Recommender(ScalingPolicy(service_rate_hint=2.5))
    stuck = dict(arrivals=300, admitted=100, rejected=200, departures=0, queue_depth=300,
                 oldest_age_s=120.0)
    first = rec.observe(window(15, **stuck))
    assert first.direction is Direction.UP  # one window: the rejections rule still acts
    second = rec.observe(window(30, **stuck))
    assert (second.desired, second.reason) == (first.desired, Reason.STALLED)
    third = rec.observe(window(45, **{**stuck, "departures": 1}))  # 1 in 15 s: still ~zero
    assert third.reason is Reason.STALLED and third.direction is Direction.HOLD


def test_a_quiet_window_in_a_slow_pool_is_not_a_stall() -> None:
    # one replica finishing a 60 s generation per minute: no departure in 15 s proves nothing
    rec = Recommender(ScalingPolicy(service_rate_hint=1 / 60, queue_per_replica_high=1e9))
    slow = dict(ready=1, arrivals=1, admitted=1, departures=0, queue_depth=2, oldest_age_s=45.0)
    reasons = [rec.observe(window(t, **slow)).reason for t in (15, 30, 45)]
    assert Reason.STALLED not in reasons


def test_the_service_rate_is_measured_only_while_the_replicas_are_saturated() -> None:
    rec = Recommender(ScalingPolicy(rate_smoothing=1.0))
    rec.observe(window(15, departures=60))  # idle fleet: departures are demand, not capacity
    assert rec.state.rate is None
    # a little work waiting (1.25 per replica, under the target of 4) is still demand: a rate
    # learnt there drifts down to the demand per replica and blocks every scale-down
    rec.observe(window(30, departures=240, queue_depth=10))
    assert rec.state.rate is None
    # engines far from busy while work waits: a dispatch problem, not their capacity
    rec.observe(window(45, departures=240, queue_depth=40, utilization=0.4))
    assert rec.state.rate is None
    rec.observe(window(60, departures=240, queue_depth=40))  # 5 per replica: saturated
    assert rec.state.rate == pytest.approx(240 / 15 / 8)
    rec.observe(window(75, departures=60))  # quiet again: the estimate is kept
    assert rec.state.rate == pytest.approx(240 / 15 / 8)


# --- rule (a): rejections and queue depth ----------------------------------------------------

@pytest.mark.parametrize(("ready", "rejected", "desired"), [
    (12, 70, 13),  # 7 % shed: offered / served = 1 / 0.93 -> 12.9 -> 13
    (12, 400, 20),  # 40 % -> 12 / 0.6 = 20
    (12, 500, 24),  # 50 % -> 2x, the cap
    (12, 900, 24),  # 90 % -> still 2x
    (100, 30, 104),  # 3 % on 100 -> 103.1 -> 104
    (1, 30, 2),  # always at least one more
])
def test_rejections_scale_up_in_proportion_up_to_twice(ready: int, rejected: int,
                                                       desired: int) -> None:
    rec = Recommender(ScalingPolicy(max_replicas=500, client_retries=0))
    got = rec.observe(busy(15, ready, rejected))
    assert (got.desired, got.direction, got.reason) == (desired, Direction.UP, Reason.REJECTIONS)
    assert got.reject_ratio == pytest.approx(rejected / 1000)


def test_an_exact_ratio_is_not_rounded_up_by_a_float_artefact() -> None:
    # 100 of 1,100 rejected: 10 x 1100 / 1000 is 11, which floats compute as 11.000000000000002
    got = Recommender(NO_RETRY).observe(busy(15, 10, 100, decided=1100))
    assert got.desired == 11


@pytest.mark.parametrize(("ready", "rejected", "desired"), [
    (3, 640, 4),  # 64 %, read as 50 %: 12.5 % of requests lost -> 3 x 8/7 = 3.4 -> 4
    (3, 400, 4),  # 40 %: 6.4 % lost -> 3.2 -> 4
    (12, 500, 14),  # 50 %: 12.5 % lost -> 13.7 -> 14
    (100, 300, 103),  # 30 %: 2.7 % lost -> 102.8 -> 103
])
def test_rejections_count_by_the_requests_they_cost_when_clients_retry(
        ready: int, rejected: int, desired: int) -> None:
    # the default: clients retry a 429 twice, so a request is lost only when all three of its
    # attempts are (r^3), and most of a high reject ratio is the same requests coming back
    rec = Recommender(ScalingPolicy(max_replicas=500))
    got = rec.observe(busy(15, ready, rejected))
    assert (got.desired, got.direction, got.reason) == (desired, Direction.UP, Reason.REJECTIONS)


def test_a_few_retried_rejections_do_not_scale() -> None:
    # 10 % of attempts rejected loses 0.1 % of requests after two retries: under the 2 %
    assert Recommender().observe(busy(15, 4, 100)).reason is Reason.STEADY
    assert lost_share(0.1, 2) == pytest.approx(0.001)
    assert lost_share(0.9, 2) == pytest.approx(0.125)  # read as one half
    assert lost_share(0.3, 0) == pytest.approx(0.3)  # no retries: the attempt ratio


def test_a_window_in_which_replicas_turned_ready_is_not_judged() -> None:
    rec = Recommender(ScalingPolicy(rate_smoothing=1.0))
    assert rec.observe(busy(15, 3, 500, utilization=0.9)).desired == 4
    rate = rec.state.rate
    # the fourth turned ready mid-window: its rejections and departures predate it
    grew = rec.observe(busy(30, 4, 400, utilization=0.9))
    assert (grew.desired, grew.reason) == (4, Reason.STEADY)
    assert rec.state.rate == rate
    assert rec.observe(busy(45, 4, 400, utilization=0.9)).desired == 5


def test_rejections_under_the_threshold_or_too_few_decisions_do_nothing() -> None:
    rec = Recommender()
    assert rec.observe(busy(15, 8, 20)).reason is Reason.STEADY  # 2.0 % is not over 2 %
    assert rec.observe(busy(30, 8, 9, decided=10)).reason is Reason.STEADY  # 10 decisions: noise


def test_a_deep_queue_per_replica_doubles() -> None:
    got = Recommender().observe(window(15, ready=4, queue_depth=40, oldest_age_s=30.0))
    assert (got.desired, got.reason) == (8, Reason.QUEUE_DEPTH)  # 10 per replica, target 4
    unknown = Recommender().observe(window(15, ready=4, queue_depth=40, oldest_age_s=None))
    assert unknown.desired == 8  # an age not known cannot prove the queue young


def test_a_deep_queue_that_loses_nothing_and_does_not_age_is_admissions_plan() -> None:
    """Under enforced admission the engines' queue holds what finishes within its deadlines:
    ten a replica whose oldest request is a second old, nothing refused, is not demand the
    replicas cannot meet (the simulated incident: 4 -> 6 replicas where 4 carry it). The same
    queue with requests refused, or grown old, is."""
    young = dict(ready=4, queue_depth=40, oldest_age_s=1.0)
    assert Recommender().observe(window(15, **young)).reason is Reason.STEADY
    shedding = Recommender().observe(busy(15, 4, 600, queue_depth=40, oldest_age_s=1.0))
    assert shedding.direction is Direction.UP


def test_held_requests_are_backlog_for_the_drain_not_a_deep_engine_queue() -> None:
    """Requests the gateway holds (defer) wait to be sent as room frees, within their
    deadlines: ten a replica held is not the engines' deep queue that doubles the fleet. They
    are backlog: old and growing, the drain rule sizes them against the measured rate; and
    while any is held the pool is not quiet."""
    rec = Recommender()
    assert rec.observe(window(15, ready=4, held=40)).reason is Reason.STEADY
    grow = dict(ready=4, arrivals=480, admitted=480, departures=240, oldest_age_s=60.0)
    rec = Recommender(ScalingPolicy(service_rate_hint=4.0))
    rec.observe(window(15, held=240, **grow))
    got = rec.observe(window(30, held=360, **grow))
    assert got.reason is Reason.QUEUE_AGE and got.desired > 4
    calm = Recommender(ScalingPolicy(down_quiet_s=600))
    assert quiet_run(calm, 0, 1200, held=1) == [8] * 80  # quiet but for one held: no step


def test_the_larger_ask_of_the_two_rules_wins() -> None:
    rec = Recommender(ScalingPolicy(queue_per_replica_high=1e9, max_replicas=40,
                                    client_retries=0))
    grow = dict(arrivals=1000, admitted=900, rejected=100, departures=300, oldest_age_s=40.0)
    first = rec.observe(window(15, queue_depth=60, **grow))
    assert (first.desired, first.reason) == (9, Reason.REJECTIONS)  # (a): 8 / 0.9 -> 9
    # (b) confirmed: 900 waiting at 2.5 req/s per replica over 60 s is 6 more: 14 beats 9
    second = rec.observe(window(30, queue_depth=900, **grow))
    assert (second.desired, second.reason) == (14, Reason.QUEUE_AGE)


# --- scaling down ----------------------------------------------------------------------------

def quiet_run(rec: Recommender, start: float, seconds: float, **kw: Any) -> list[int]:
    n = int(seconds // W)
    return run(rec, [window(start + W * (i + 1), **kw) for i in range(n)])


def test_scale_down_is_one_replica_after_a_long_quiet_period() -> None:
    rec = Recommender(ScalingPolicy(down_quiet_s=600))
    desired = quiet_run(rec, 0, 1200)
    assert desired[:39] == [8] * 39  # 585 s of quiet
    assert desired[39] == 7  # 600 s
    assert desired[40:79] == [7] * 39  # the clock restarted
    assert desired[79] == 6
    assert rec.last is not None and rec.last.reason is Reason.QUIET


@pytest.mark.parametrize("noise", [
    dict(rejected=30, admitted=120, departures=300),  # 20 %: 0.8 % of requests lost, not quiet
    dict(queue_depth=20, departures=300),  # 2.5 waiting per replica
    dict(oldest_age_s=5.0),  # above 20 % of the 20 s threshold
    dict(oldest_age_s=None),  # unknown: cannot prove quiet
    dict(utilization=0.9),  # efficient operation: leave it be
])
def test_a_noisy_window_restarts_the_quiet_clock(noise: dict[str, Any]) -> None:
    rec = Recommender(ScalingPolicy(down_quiet_s=600))
    quiet_run(rec, 0, 300)
    rec.observe(window(315, **noise))
    desired = quiet_run(rec, 315, 585)
    assert set(desired) == {8}
    assert rec.observe(window(915)).desired == 7


def test_no_scale_down_when_the_rest_could_not_carry_the_load() -> None:
    rec = Recommender(ScalingPolicy(down_quiet_s=60, service_rate_hint=2.5))
    # 4 ready at 2.5 req/s; 7 req/s arrive: 3 replicas at 80 % carry only 6
    desired = quiet_run(rec, 0, 300, ready=4, arrivals=105, admitted=105, departures=105)
    assert set(desired) == {4}
    desired = quiet_run(rec, 300, 300, ready=4, arrivals=75, admitted=75, departures=75)
    assert desired[-1] < 4


def test_never_below_min_and_down_to_zero_only_without_traffic() -> None:
    rec = Recommender(ScalingPolicy(min_replicas=0, down_quiet_s=60, service_rate_hint=2.5))
    desired = quiet_run(rec, 0, 120, ready=1, arrivals=3, admitted=3, departures=3)
    assert set(desired) == {1}  # 0.2 req/s does not fit on zero replicas
    desired = quiet_run(rec, 120, 120, ready=1, arrivals=0, admitted=0, departures=0,
                        oldest_age_s=0.0)
    assert desired[-1] == 0 and rec.last is not None and not rec.last.active
    floor = Recommender(ScalingPolicy(min_replicas=2, down_quiet_s=60))
    assert set(quiet_run(floor, 0, 900, ready=2)) == {2}


def test_activation_from_zero_replicas() -> None:
    rec = Recommender(ScalingPolicy(min_replicas=0))
    got = rec.observe(window(15, ready=0, arrivals=3, admitted=0, rejected=3, departures=0,
                             oldest_age_s=0.0))
    assert (got.desired, got.reason, got.active) == (1, Reason.ACTIVATE, True)
    waiting = rec.observe(window(30, ready=0, starting=1, arrivals=3, admitted=0, rejected=3,
                                 departures=0, oldest_age_s=0.0))
    assert (waiting.desired, waiting.reason) == (1, Reason.PENDING)


# --- guards ----------------------------------------------------------------------------------

def test_stale_inputs_hold_and_count_for_nothing() -> None:
    rec = Recommender(ScalingPolicy(down_quiet_s=60))
    assert rec.observe(busy(15, 8, 300, stale=True)).reason is Reason.STALE
    assert rec.last is not None and rec.last.desired == 8
    quiet_run(rec, 15, 45)
    rec.observe(window(75, stale=True))  # a gap in the data is not quiet
    assert quiet_run(rec, 75, 45) == [8, 8, 8]


def test_a_reversal_waits_for_the_cooldown() -> None:
    rec = Recommender(ScalingPolicy(down_quiet_s=60, cooldown_s=300, max_replicas=40,
                                    client_retries=0))
    assert quiet_run(rec, 0, 60)[-1] == 7  # down at t=60
    held = rec.observe(busy(75, 7, 100))  # rejections 15 s later
    assert (held.desired, held.reason) == (7, Reason.COOLDOWN)
    assert rec.observe(busy(359, 7, 100)).desired == 7
    assert rec.observe(busy(360, 7, 100)).desired == 8  # 300 s after the move


def test_max_replicas_reports_unmet_demand() -> None:
    rec = Recommender(ScalingPolicy(max_replicas=10, client_retries=0))
    got = rec.observe(busy(15, 8, 500))
    assert (got.desired, got.unmet, got.reason) == (10, 6, Reason.REJECTIONS)
    rec.observe(busy(30, 10, 500))  # the two turned ready in this window: not judged
    again = rec.observe(busy(45, 10, 500))
    assert (again.desired, again.unmet, again.reason) == (10, 10, Reason.BOUNDS)


def test_replicas_that_never_become_ready_pause_scale_out() -> None:
    rec = Recommender(ScalingPolicy(readiness_timeout_s=120, max_replicas=40, client_retries=0))
    assert rec.observe(busy(15, 8, 100)).desired == 9
    rec.observe(busy(30, 8, 100, starting=1))
    assert rec.observe(busy(140, 8, 300, starting=1)).desired == 12  # 110 s: still patient
    paused = rec.observe(busy(160, 8, 400, starting=4))  # 130 s and nothing became ready
    assert (paused.desired, paused.reason) == (12, Reason.NOT_READY)
    rec.observe(busy(175, 9, 300, starting=3))  # one became ready: progress, clock restarts
    assert rec.observe(busy(190, 9, 500, starting=3)).desired == 18


def test_the_first_window_starts_from_what_exists_within_bounds() -> None:
    assert Recommender(ScalingPolicy(min_replicas=3)).observe(
        window(15, ready=1)).desired == 3
    rec = Recommender(ScalingPolicy(max_replicas=4))
    assert rec.observe(window(15, ready=8)).desired == 4


def test_time_must_not_run_backwards() -> None:
    rec = Recommender()
    rec.observe(window(100))
    with pytest.raises(ValueError, match="backwards"):
        rec.observe(window(99))


@pytest.mark.parametrize(("age_high", "util", "reading"), [
    (True, 0.9, Reading.CAPACITY_PRESSURE),
    (True, 0.2, Reading.DISPATCH_PROBLEM),
    (False, 0.9, Reading.EFFICIENT),
    (False, 0.2, Reading.NORMAL),
    (True, None, Reading.UNKNOWN),
    (None, 0.9, Reading.UNKNOWN),
])
def test_three_way_reading(age_high: bool | None, util: float | None, reading: Reading) -> None:
    assert classify(age_high, util, 0.75) is reading


def test_each_recommendation_carries_its_reading() -> None:
    rec = Recommender(NO_RETRY)
    got = rec.observe(busy(15, 8, 100, oldest_age_s=30.0, utilization=0.2))
    assert (got.reason, got.reading) == (Reason.REJECTIONS, Reading.DISPATCH_PROBLEM)


def test_policy_validation_names_every_bad_field() -> None:
    with pytest.raises(ConfigError) as err:
        ScalingPolicy(min_replicas=-1, max_replicas=0, reject_ratio_high=2.0, drain_s=0,
                      max_up_factor=1.0, service_rate_hint=0.0)
    text = str(err.value)
    for name in ("min_replicas", "max_replicas", "reject_ratio_high", "drain_s",
                 "max_up_factor", "service_rate_hint"):
        assert f"autoscale.{name}" in text
    assert "(got 2.0)" in text


# --- properties ------------------------------------------------------------------------------

# Calm stretches, bursts, wild windows and gaps, so that sequences both scale up and down.
calm = st.fixed_dictionaries({
    "arrivals": st.integers(0, 50), "rejected_share": st.just(0.0),
    "departures": st.integers(0, 50), "oldest_age_s": st.floats(0, 3),
    "queue_depth": st.just(0), "ready": st.integers(0, 40), "starting": st.just(0),
    "utilization": st.none() | st.floats(0, 0.5), "stale": st.just(False)})
burst = st.fixed_dictionaries({
    "arrivals": st.integers(100, 2000), "rejected_share": st.floats(0.03, 0.6),
    "departures": st.integers(50, 500), "oldest_age_s": st.floats(0, 100),
    "queue_depth": st.integers(0, 500), "ready": st.integers(1, 40),
    "starting": st.integers(0, 10), "utilization": st.none() | st.floats(0.5, 1),
    "stale": st.just(False)})
wild = st.fixed_dictionaries({
    "arrivals": st.integers(0, 2000), "rejected_share": st.floats(0, 1),
    "departures": st.integers(0, 2000), "oldest_age_s": st.none() | st.floats(0, 600),
    "queue_depth": st.integers(0, 5000), "ready": st.integers(0, 60),
    "starting": st.integers(0, 10), "utilization": st.none() | st.floats(0, 1),
    "stale": st.booleans()})
step = st.tuples(st.sampled_from([0.5, 5.0, 15.0, 15.0, 60.0, 200.0]),
                 st.sampled_from([calm] * 4 + [burst] * 2 + [wild]).flatmap(lambda s: s))
windows = st.lists(step.map(lambda t: {"dt": t[0], **t[1]}), min_size=1, max_size=60)

policies = st.builds(
    lambda lo, span, cooldown, quiet, hint: ScalingPolicy(
        min_replicas=lo, max_replicas=max(1, lo + span), cooldown_s=cooldown,
        down_quiet_s=quiet, service_rate_hint=hint, confirm_windows=1),
    st.integers(0, 5), st.integers(0, 30), st.sampled_from([0.0, 30.0, 300.0]),
    st.sampled_from([0.0, 15.0, 120.0]), st.none() | st.floats(0.1, 10))


def replay(policy: ScalingPolicy, steps: list[dict[str, Any]]) -> list[tuple[float, Any]]:
    rec, now, out = Recommender(policy), 0.0, []
    for step in steps:
        now += step["dt"]
        rejected = int(step["arrivals"] * step["rejected_share"])
        w = Window(now=now, duration_s=step["dt"], arrivals=step["arrivals"],
                   admitted=step["arrivals"] - rejected, rejected=rejected,
                   departures=step["departures"], oldest_age_s=step["oldest_age_s"],
                   queue_depth=step["queue_depth"], ready=step["ready"],
                   starting=step["starting"], utilization=step["utilization"],
                   stale=step["stale"])
        out.append((now, rec.observe(w)))
    return out


@settings(max_examples=300, deadline=None)
@given(policies, windows)
def test_property_never_outside_min_and_max(policy: ScalingPolicy,
                                            steps: list[dict[str, Any]]) -> None:
    for _, rec in replay(policy, steps):
        assert policy.min_replicas <= rec.desired <= policy.max_replicas
        assert rec.unmet >= 0


@settings(max_examples=300, deadline=None)
@given(policies, windows)
def test_property_direction_changes_at_most_once_per_cooldown(
        policy: ScalingPolicy, steps: list[dict[str, Any]]) -> None:
    last_dir, reversals = None, []
    for now, rec in replay(policy, steps):
        if rec.direction is Direction.HOLD:
            assert rec.desired == rec.previous
            continue
        if last_dir is not None and rec.direction is not last_dir:
            reversals.append(now)
        last_dir = rec.direction
    for earlier, later in itertools.pairwise(reversals):
        assert later - earlier >= policy.cooldown_s


@settings(max_examples=200, deadline=None)
@given(policies, windows)
def test_property_stale_inputs_never_move_the_recommendation(
        policy: ScalingPolicy, steps: list[dict[str, Any]]) -> None:
    for _, rec in replay(policy, steps):
        if rec.reason is Reason.STALE:
            assert rec.direction is Direction.HOLD
    stale = [dataclasses.replace(rec) for _, rec in replay(
        policy, [{**s, "stale": True} for s in steps])]
    assert len({r.desired for r in stale}) == 1
