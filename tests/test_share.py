"""Priorities and fair shares: the pure rules (extproc.decision.share), the admission step's use of
them (extproc.decision.step), and what they do to simulated traffic (extproc.sim)."""

import dataclasses
import math
import random
from types import SimpleNamespace

import pytest

from extproc import config as config_mod
from extproc.config import TenantConfig
from extproc.decision.admission import Capacity, Decision, Mix, Outcome, Reason, Snapshot
from extproc.decision.contention import Scene, _kept, _under_their_share
from extproc.decision.learning import learning_for
from extproc.decision.rules import Rules
from extproc.decision.running import Running
from extproc.decision.share import (
    CRITICAL,
    SHEDDABLE,
    STANDARD,
    over_share,
    parse_priority,
    places,
    priority_label,
    tenant_group,
    tenant_of,
    water_level,
)
from extproc.decision.step import Admission, Ask, admit, priority_of
from extproc.fleet.enginestats import Correction
from extproc.sim import policies
from extproc.sim.families import draw
from extproc.sim.run import Simulation, simulate
from extproc.sim.workload import Job


@pytest.mark.parametrize(("raw", "level"), [
    ("critical", 1), ("Standard", 0), (" sheddable ", -1), (7, 7), ("-3", -3), (100, 100),
    (101, None), ("urgent", None), (True, None), (1.5, None), (None, None)])
def test_priorities_are_names_or_bounded_levels(raw: object, level: int | None) -> None:
    assert parse_priority(raw) == level


def test_labels_and_groups_round_trip() -> None:
    assert [priority_label(v) for v in (CRITICAL, STANDARD, SHEDDABLE, 5)] == [
        "critical", "standard", "sheddable", "5"]
    name = "acme corp/ü"
    assert " " not in tenant_group(name) and tenant_of(tenant_group(name)) == name


def test_water_level_is_max_min_by_weight() -> None:
    # a small demand is met in full; the rest split by weight
    demands = {"a": (10.0, 1.0), "b": (100.0, 1.0), "c": (100.0, 3.0)}
    level = water_level(demands, 90.0)
    assert 10.0 + level + 3 * level == pytest.approx(90.0)
    assert not over_share("a", demands, 90.0)
    assert over_share("b", demands, 90.0) and over_share("c", demands, 90.0)
    # every demand fits: nobody is over, whatever the weights
    assert water_level(demands, 210.0) == math.inf
    assert not over_share("b", demands, 210.0)


def test_the_reserve_follows_the_protected_traffic_and_the_pool_s_turnover() -> None:
    assert places(0.0, 10.0, 20.0) == 0.0  # nothing to protect
    small, large = places(1.0, 10.0, 20.0), places(8.0, 10.0, 20.0)
    assert 1.0 <= small < large  # a trickle needs a place or two, a stream far more
    assert small == pytest.approx(math.log(0.01) / math.log(0.1))
    # never more than the arrivals expected while the request runs (two deviations)
    busy = places(20.0, 10.0, 5.0)
    assert busy == pytest.approx(100.0 + 2.0 * 10.0)
    assert places(8.0, 10.0, 0.1) <= 0.8 + 2.0 * math.sqrt(0.8)


def settings(**tenant: object) -> config_mod.Config:
    return config_mod.from_mapping({
        "pools": [{"name": "p", "engine": {"max_num_seqs": 16}}],
        "classes": {"latency": {"priority": "standard"}},
        "tenant": {"source": "header", **tenant},
        "priority": {"default": "sheddable"}})


def test_priority_comes_from_the_header_then_the_tenant_then_the_class() -> None:
    rules = Rules.of(settings(tenants={"gold": {"priority": "critical"}}))
    assert priority_of(rules, "latency", "gold", stated=SHEDDABLE) == SHEDDABLE
    assert priority_of(rules, "latency", "gold") == CRITICAL
    assert priority_of(rules, "latency", "someone") == STANDARD
    assert priority_of(rules, "throughput", None) == SHEDDABLE  # the default


def busy_pool(config: config_mod.Config, critical_rate: float) -> tuple[object, Snapshot]:
    """A pool whose 64 slots hold 62 requests, with critical traffic measured arriving."""
    pool = config.pools[0]
    learning = learning_for(pool)
    for i in range(600):
        now = i * 0.1
        learning.arrived("latency", False, now, 500, ("p:0",))
        learning.settled(Running("latency", now - 8.0, deadline_s=30.0, groups=("p:0",)),
                         completed=True, now=now)
        for _ in range(round(critical_rate * 0.1 * 10)):
            if i % 10 == 0:
                learning.arrived("latency", False, now, 500, ("p:1",))
                learning.settled(Running("latency", now - 8.0, deadline_s=30.0,
                                         groups=("p:1",)), completed=True, now=now)
    snapshot = Snapshot(62, 62 * 1500.0, 62 * 800, groups={"p:0": (62, 62 * 1500.0)})
    return learning, snapshot


def test_a_lower_priority_leaves_room_for_the_higher_one_s_expected_arrivals() -> None:
    config = settings()
    pool, rules = config.pools[0], Rules.of(config)
    ask = Ask("latency", 500, 100, tenant="t", priority=STANDARD)
    quiet, snapshot = busy_pool(config, critical_rate=0.0)
    assert admit(ask, pool, rules, quiet, snapshot, 4, 60.0).outcome is Outcome.ADMIT
    busy, snapshot = busy_pool(config, critical_rate=4.0)
    refused = admit(ask, pool, rules, busy, snapshot, 4, 60.0)
    assert (refused.outcome, refused.reason) == (Outcome.REJECT, Reason.PRIORITY)
    assert refused.retry_after_ms is not None and refused.retry_after_ms > 0
    # work conservation: no room is kept on the replica it goes to when that replica's engine
    # reports nothing to do (the endpoint picker's pick; before, such refusals let a replica
    # of priority/70b-vllm at 0.8x sit idle 4-6 % of the run on two seeds of three)
    own_idle = admit(ask, pool, rules, busy, snapshot, 4, 60.0, Correction(idle=True))
    assert own_idle.outcome is Outcome.ADMIT
    # the critical request itself is decided on the pool alone
    top = admit(dataclasses.replace(ask, priority=CRITICAL), pool, rules, busy, snapshot, 4, 60.0)
    assert top.outcome is Outcome.ADMIT
    assert top.groups == ("p:1", "t:t")


def test_a_flood_of_refused_sheddable_requests_keeps_no_more_room_for_critical_ones() -> None:
    """The room a standard request leaves to critical arrivals is sized on the pool's
    departures: what runs (the ledger's count per priority over its time in flight), never
    what asks. Sheddable requests arriving at 50 a second, none admitted, change nothing
    (before, their arrivals weighed the pool's time in flight with this request's own
    predicted one, 20 s here against the 2 s measured: 3 places kept became 101)."""
    config = settings()
    learning = learning_for(config.pools[0])
    for i in range(600):
        now = i * 0.1
        for group in ("p:0",) + (("p:1",) if i % 2 == 0 else ()):
            flow = learning.flow(group)
            flow.arrived(now)
            flow.served(2.0, now)
    snapshot = Snapshot(60, 60 * 1500.0, 60 * 800,
                        groups={"p:0": (50, 50 * 1500.0), "p:1": (10, 10 * 1500.0)})
    horizon = SimpleNamespace(completion_ms=20_000.0)  # this request's predicted time
    calm = _kept(["p:1"], horizon, learning, snapshot, 64, 0.0, 1.0, 60.0)
    for i in range(3000):
        learning.flow("p:-1").arrived(i * 0.02)
    assert _kept(["p:1"], horizon, learning, snapshot, 64, 0.0, 1.0, 60.0) == calm
    assert 0 < calm < 10  # five critical arrivals a second, 32 departures at the limit


def test_no_room_is_kept_for_a_priority_there_is_no_evidence_of() -> None:
    """The room kept for the limit's own swing is for protected arrivals that may come while
    the request runs: with none in evidence (one critical request, long ago), nothing is kept
    however far the limit swings (before, two deviations of it were kept regardless: 47 of a
    limit of 21 places while a fresh 16-slot pool learned its limit, refusing standard and
    sheddable traffic alike with no critical request in sight)."""
    config = settings()
    learning = learning_for(config.pools[0])
    learning.flow("p:1").arrived(0.0)
    snapshot = Snapshot(20, 20 * 1500.0, 20 * 800, groups={"p:0": (20, 20 * 1500.0)})
    horizon = SimpleNamespace(completion_ms=20_000.0)
    assert _kept(["p:1"], horizon, learning, snapshot, 21, 20.0, 1.0, 600.0) == 0
    for i in range(600):  # critical arrivals at 5 a second: the swing is kept for them
        learning.flow("p:1").arrived(600.0 + i * 0.2)
    assert _kept(["p:1"], horizon, learning, snapshot, 21, 20.0, 1.0, 720.0) >= 40


def test_a_tenant_s_demand_is_its_arrivals_at_the_pool_s_pace_now() -> None:
    """A tenant's requests took a second each while the pool was quiet; its neighbour's burst
    has since slowed every request to ~10 s. Counted at the durations its ended requests
    showed, the steady tenant (10 a second) needs 10 places, so the burst's next request,
    its 51st of a 64-place room, reads within its share and the steady tenant's arrivals
    find the cache full (before: on 8b-vllm at 0.8x it kept 0.86x of its goodput alone).
    Counted at the pace a typical request runs at now, it needs ~100: the burst is over its
    half and must leave the steady tenant room."""
    config = settings()
    rules, learning = Rules.of(config), learning_for(config.pools[0])
    for i in range(600):
        learning.flow("t:a").arrived(i * 0.1)
        learning.flow("t:a").served(1.0, i * 0.1)
    mean_ms = 1500.0
    snapshot = Snapshot(60, 60 * mean_ms, groups={"t:a": (10, 10 * mean_ms),
                                                  "t:b": (50, 50 * mean_ms)})
    capacity = Capacity(replicas=4, mix=Mix(prompt_tokens=500.0, output_tokens=300.0))
    scene = Scene(rules, learning, snapshot, capacity, share=1.0, now=60.0)

    def next_of_b(ttft_ms: float, step_ms: float) -> list[str] | None:
        decision = Decision(Outcome.ADMIT, Reason.FITS, charge_ms=mean_ms, wait_ms=0.0,
                            ttft_ms=ttft_ms, completion_ms=ttft_ms + 300 * step_ms,
                            budget_ms=30_000.0, finish_at=60.0, step_ms=step_ms)
        return _under_their_share("b", decision, scene, 64 * mean_ms, mean_ms)

    assert next_of_b(ttft_ms=100.0, step_ms=2.0) is None  # quiet: 0.7 s a request
    assert next_of_b(ttft_ms=1000.0, step_ms=30.0) == ["t:a"]  # now: 10 s a request


def test_a_tenant_at_its_cap_is_refused_on_the_snapshot_and_the_cap_goes_to_the_ledger() -> None:
    config = settings(tenants={"acme": {"max_inflight": 3, "max_outstanding_s": 100}})
    pool, rules = config.pools[0], Rules.of(config)
    learning = learning_for(pool)
    ask = Ask("latency", 500, 100, tenant="acme", priority=STANDARD)
    free = Snapshot(3, 900.0, groups={"t:acme": (2, 600.0)})
    admitted = admit(ask, pool, rules, learning, free, 4, 0.0)
    assert admitted.outcome is Outcome.ADMIT
    assert [(c.group, c.max_inflight, c.max_ms) for c in admitted.caps] == [
        ("t:acme", 3, 100_000.0)]
    full = Snapshot(3, 900.0, groups={"t:acme": (3, 900.0)})
    refused = admit(ask, pool, rules, learning, full, 4, 0.0)
    assert (refused.outcome, refused.reason) == (Outcome.REJECT, Reason.TENANT_CAP)
    other = admit(dataclasses.replace(ask, tenant="beta"), pool, rules, learning, full, 4, 0.0)
    assert other.outcome is Outcome.ADMIT and other.caps == ()


# --- simulated traffic -------------------------------------------------------------------------

def noisy(fleet: str, load: float, seeds: int = 1) -> tuple[float, float, float, float]:
    """(A's goodput during B's burst / A's alone, A's attainment, B's goodput with tenants /
    without, total goodput with fair shares / without), each the mean over ``seeds``."""
    runs = [_noisy(fleet, load, seed) for seed in range(seeds)]
    a, b, c, d = (sum(column) / seeds for column in zip(*runs, strict=True))
    return a, b, c, d


def _noisy(fleet: str, load: float, seed: int) -> tuple[float, float, float, float]:
    drawn = draw("noisy-neighbour", seed, load, fleet, 0.5)
    sc, p = drawn.scenario, drawn.params
    start, end = float(p["burst_from_s"]), float(p["burst_to_s"])
    plain_config = dataclasses.replace(sc.config, tenant=TenantConfig())
    mixed = simulate(sc, policies.make("default"))
    alone = simulate(dataclasses.replace(sc, jobs=[j for j in sc.jobs if j.tenant == "a"]),
                     policies.make("default"))
    plain = simulate(dataclasses.replace(sc, config=plain_config), policies.make("default"))
    only_b = [j for j in sc.jobs if j.tenant == "b"]
    b_t = simulate(dataclasses.replace(sc, jobs=only_b), policies.make("default"))
    b_p = simulate(dataclasses.replace(sc, jobs=only_b, config=plain_config),
                   policies.make("default"))
    a = mixed.groups["t:a"]
    return (a.goodput_between(start, end) / alone.groups["t:a"].goodput_between(start, end),
            a.attainment, b_t.goodput / b_p.goodput, mixed.goodput / plain.goodput)


NOISY_GAPS = {  # measured: A's goodput during the burst / alone
    ("8b-vllm", 1.5): "A keeps 0.94x: on a 1024-sequence fleet the deadline bounds the batch,"
                      " and the limit it sets swings with the learned prompt mean",
    ("70b-vllm", 1.5): "A keeps 0.90x, at 93.9% attainment on this half-length run (KV- and"
                       " deadline-bound)",
}
# The 16-slot fleet at 3x: A alone fills the fleet, so its count during a half-length burst
# swings from seed to seed (0.935-1.048 of alone on seeds 0-5 before A's demand was read at
# the pool's pace now, 0.917-1.069 after): that cell is read as the mean of six.
NOISY_SEEDS = {("70b-16", 3.0): 6}


@pytest.mark.slow
@pytest.mark.parametrize(("fleet", "load"), [("70b-16", 0.8), ("70b-16", 1.5), ("70b-16", 3.0),
                                             ("8b-vllm", 0.8), ("8b-vllm", 1.5),
                                             ("70b-vllm", 1.5)])
def test_a_steady_tenant_keeps_its_goodput_through_a_neighbour_s_burst(
        fleet: str, load: float, request: pytest.FixtureRequest) -> None:
    if (gap := NOISY_GAPS.get((fleet, load))) is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=gap))
    kept, attainment, conserving, total = noisy(fleet, load, NOISY_SEEDS.get((fleet, load), 1))
    assert conserving >= 0.98  # alone, B uses the whole fleet, tenants or not
    assert total >= 0.95  # fairness costs the pool little
    assert attainment >= 0.99
    assert kept >= 0.95


@pytest.mark.slow
@pytest.mark.parametrize("seed", [3, 4])
def test_tenants_share_what_measurement_allows_not_a_cold_model_s_room(seed: int) -> None:
    """Two tenants at a third of a 16-slot fleet each before a burst, on a fresh gateway whose
    model admits ~14 requests while the measured level allows ~35 and the slots 64: shared out
    of the model's room, each tenant read over its share and kept room for the other's
    expected arrivals (260-330 places), so both were refused with the pool at 12-14 requests
    for the first 20 s: 0.75x naive's goodput, 301 and 594 refusals for the fair share while
    fewer than half the slots were busy before the burst. Shared out of the lesser of the level
    and the slots: 0.98-0.99x naive's, 20 and 31 such refusals (the level's own cold start)."""
    drawn = draw("noisy-neighbour", seed, 3.0, "70b-16", 1.0)
    idle_refusals = 0  # for the fair share, before the burst, fewer than half the slots busy

    def hook(job: Job, snapshot: Snapshot, adm: Admission) -> None:
        nonlocal idle_refusals
        idle_refusals += (job.arrival_s < drawn.params["burst_from_s"]
                          and adm.reason is Reason.FAIR_SHARE and snapshot.inflight < 32)

    shared = Simulation(drawn.scenario, policies.make("default"), on_decision=hook).run()
    naive = simulate(drawn.scenario, policies.make("naive"))
    assert shared.goodput >= 0.97 * naive.goodput
    assert idle_refusals < 100


def served(fleet: str, load: float) -> dict[int, tuple[float, float]]:
    """The priority family: per level, (completions in time / jobs offered, attainment)."""
    sc = draw("priority", 0, load, fleet, 0.5).scenario
    result = simulate(sc, policies.make("default"))
    return {level: (result.groups[f"p:{level}"].good
                    / sum(1 for j in sc.jobs if j.priority == level),
                    result.groups[f"p:{level}"].attainment)
            for level in (CRITICAL, STANDARD, SHEDDABLE)}


@pytest.mark.slow
@pytest.mark.parametrize("fleet", ["70b-16", "8b-vllm", "70b-vllm"])
def test_critical_traffic_is_served_first(fleet: str) -> None:
    """The priority family at 3x: critical requests are served before the others, within
    their deadlines."""
    levels = served(fleet, 3.0)
    assert levels[CRITICAL][0] > max(levels[STANDARD][0], levels[SHEDDABLE][0])


PRIORITY_GAPS = {  # measured at 3x: critical completions in time / critical jobs offered
    "70b-16": "95% served, 95% attainment: the 16-slot fleet's cold start (optimistic first"
              " promises, then a strict one) hits every priority alike",
    "70b-vllm": "87% served, 87% attainment (90% before requests started after their"
                " replica's queue): critical traffic alone gets 47% on this draw (a 22 s"
                " deadline on a KV-bound fleet)",
}


@pytest.mark.slow
@pytest.mark.parametrize("fleet", ["70b-16", "8b-vllm", "70b-vllm"])
def test_critical_goodput_under_3x_overload_is_its_offered_load(fleet: str,
                                                                request: pytest.FixtureRequest,
                                                                ) -> None:
    if (gap := PRIORITY_GAPS.get(fleet)) is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=gap))
    share, attainment = served(fleet, 3.0)[CRITICAL]
    assert share >= 0.99 and attainment >= 0.99


def test_the_limit_s_spread_is_measured_not_assumed() -> None:
    from extproc.decision.learning import Spread

    rng = random.Random(7)
    steady, swinging, learning = Spread(), Spread(), Spread()
    for i in range(2000):
        steady.add(100.0)
        swinging.add(rng.gauss(100.0, 20.0))
        # a fresh pool's limit climbing from 20 to 90 while it learns, arrivals moving it by 3
        learning.add(20.0 + 70.0 * min(1.0, i / 300) + rng.gauss(0.0, 3.0))
        if i == 290:
            assert learning.std == pytest.approx(3.0, rel=0.25)  # the climb is no swing
    assert steady.add(100.0) == 0.0
    assert swinging.add(100.0) == pytest.approx(20.0, rel=0.15)


@pytest.mark.parametrize("n", [0, 5, 40, 120])
def test_the_admission_limit_is_found_from_any_hint(n: int) -> None:
    from extproc.decision.admission import Cost
    from extproc.decision.contention import admission_limit
    from extproc.decision.step import capacity_for, class_policy

    config = settings()
    pool, rules = config.pools[0], Rules.of(config)
    capacity = capacity_for(pool, 4, learning_for(pool))
    cost = Cost(800, 256, 200.0, 400.0)
    snapshot = Snapshot(n, n * 900.0, n * 1200)
    policy = class_policy(rules, "latency", None)
    exact = admission_limit(cost, snapshot, capacity, policy, 0.0)
    assert exact > 1
    for hint in (None, 1.0, exact - 3.0, float(exact), exact + 1.0, exact * 10.0):
        assert admission_limit(cost, snapshot, capacity, policy, 0.0, hint) == exact, hint
