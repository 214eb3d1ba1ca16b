"""The simulator's small parts: the HPA baseline and the SDK-like clients."""

import dataclasses
import random

from extproc.decision.admission import Reason
from extproc.sim import families, policies
from extproc.sim.autoscaler import HpaUtilization, Observation
from extproc.sim.clients import ClientModel
from extproc.sim.run import simulate


def obs(now: float, ready: int, load: float, starting: int = 0) -> Observation:
    return Observation(now_s=now, window_s=15.0, ready=ready, starting=starting, draining=0,
                       arrivals=0, admitted=0, rejected=0, completed=0, good=0, load=load,
                       utilization=load / ready if ready else 0.0, occupancy=0.0, busy=1.0,
                       waiting=0, oldest_waiting_s=0.0, inflight=0, oldest_inflight_s=0.0)


def test_hpa_asks_for_load_over_target_and_counts_what_is_starting() -> None:
    hpa = HpaUtilization(target=0.75, min_replicas=12, max_replicas=24)
    assert hpa.recommend(obs(0, 12, 12.0)) == 16  # saturated: 12 / 0.75
    assert hpa.recommend(obs(15, 12, 12.0, starting=4)) == 16  # already requested
    assert hpa.recommend(obs(600, 16, 11.0)) == 16  # 11 / (16 x 0.75) = 0.92: tolerated
    assert hpa.recommend(obs(615, 16, 16.0)) == 22
    assert hpa.recommend(obs(630, 22, 22.0)) == 24  # capped at max


def test_hpa_scales_down_only_after_its_stabilization_window() -> None:
    hpa = HpaUtilization(target=0.75, min_replicas=2, max_replicas=24, scale_down_window_s=300)
    assert hpa.recommend(obs(0, 16, 12.0)) == 16
    assert hpa.recommend(obs(100, 16, 3.0)) == 16  # the window still remembers 16
    assert hpa.recommend(obs(301, 16, 3.0)) == 4


def test_clients_honor_retry_after_within_the_sdk_limit() -> None:
    client = ClientModel()
    rng = random.Random(0)
    assert client.after_429_s(4.0, 0, rng) == 4.0
    waited = client.after_429_s(90.0, 1, rng)  # beyond 60 s the SDK uses its own backoff
    assert 0.75 <= waited <= 1.0
    assert all(0.5 * 0.75 <= client.backoff_s(0, rng) <= 0.5 for _ in range(100))
    assert client.backoff_s(10, rng) <= 8.0


def test_refusing_while_a_replica_is_idle_is_counted_in_seconds_of_the_run() -> None:
    """``refused_idle_s``: a policy that refuses everything refuses while the fleet is idle
    nearly every second it is asked; slot counting on a lightly loaded fleet never does; and
    refusing requests that no idle replica could serve in time (a deadline of 50 ms) is not
    work lost."""
    class RefuseAll(policies.NaiveSlots):
        def decide(self, cost, true_output, snapshot, capacity, policy, now, view):  # type: ignore[no-untyped-def]
            admit = policies._admit(cost, capacity, policy, now)
            return policies._refuse(admit, Reason.NO_CAPACITY)

    sc = families.draw("diurnal", 0, 0.3, "70b-16", 0.1).scenario
    nothing = simulate(sc, RefuseAll(name="refuse-all"))
    slots = simulate(sc, policies.make("naive"))
    arrived = {int(j.arrival_s) for j in sc.jobs}
    assert nothing.refused_idle_s >= 0.9 * len(arrived)
    assert slots.refused_idle_s == 0 and slots.rejected == 0
    hopeless = dataclasses.replace(sc, jobs=[dataclasses.replace(j, deadline_ms=50.0)
                                             for j in sc.jobs])
    refused = simulate(hopeless, RefuseAll(name="refuse-all"))
    assert refused.rejected >= len(arrived) and refused.refused_idle_s == 0


def test_a_job_served_on_a_retry_past_its_first_deadline_is_good_but_not_first() -> None:
    """``Tally.good_jobs``: each good job's arrival, and whether its answer came within the
    deadline of its first attempt. A steady tenant refused during a neighbour's burst and
    served on a retry is good, not first; on a lightly loaded fleet nothing is refused, and
    every good job is first."""
    burst = simulate(families.draw("noisy-neighbour", 0, 3.0, "70b-16", 0.5).scenario,
                     policies.make("default")).tally("t:a")
    assert len(burst.good_jobs) == burst.good
    assert 0 < sum(first for _, first in burst.good_jobs) < burst.good
    light = simulate(families.draw("diurnal", 0, 0.3, "70b-16", 0.1).scenario,
                     policies.make("naive"))
    good = [first for tally in light.groups.values() for _, first in tally.good_jobs]
    assert good and all(good)
