"""The reference incident's story, and the simulator's speed and determinism, on seeded
deterministic runs (virtual time).

The incident runs at a quarter of its fleet (3 replicas, same per-replica load) for its first
30 minutes, which holds the whole story; ``extproc replay --scenario incident`` runs it in
full. Its policies run once, spread over two processes (module fixture). The decision's
targets against the baselines are the evaluation matrix's (``tests/test_eval.py``, and
``extproc eval`` for every cell).
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from extproc.sim import policies, scenarios
from extproc.sim.result import Result
from extproc.sim.run import simulate
from extproc.sim.scenarios import Scenario
from extproc.sim.workload import read_azure

pytestmark = pytest.mark.slow  # simulations of more than a few seconds

TRACES = Path(__file__).resolve().parent / "data" / "traces"
KEYS = ("incident",)
POLICIES = ("none", "naive", "article", "default")


def scenario(key: str) -> Scenario:
    return scenarios.incident(fleet_scale=0.25, minutes=30)


def _run(job: tuple[str, str]) -> tuple[str, str, Result]:
    key, name = job
    return key, name, simulate(scenario(key), policies.make(name))


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Result]]:
    jobs = [(k, p) for k in KEYS for p in POLICIES]
    out: dict[str, dict[str, Result]] = {k: {} for k in KEYS}
    # spawn, not fork: a fork of the test process inherits its threads and patched state
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=2, mp_context=spawn) as pool:
        for key, name, result in pool.map(_run, jobs):
            out[key][name] = result
    return out


# ---- the reference incident's story --------------------------------------------------------

def minute(r: Result, sc: Scenario, hh: int, mm: int) -> int:
    """Index of the sample at a wall-clock minute of the incident."""
    t = (hh * 3600 + mm * 60) - sc.clock_origin_s
    return min(range(len(r.series.t)), key=lambda i: abs(r.series.t[i] - t))


def test_without_admission_the_queue_eats_the_morning(runs: dict[str, dict[str, Result]]
                                                      ) -> None:
    sc = scenario("incident")
    none, default = runs["incident"]["none"], runs["incident"]["default"]
    # p95 far beyond the 30 s client timeout: most requests never finish in time
    assert none.latency(0.50) > 300 and none.latency(0.95) > 600
    # goodput collapses from minutes after the spike to the end of the window (20+ minutes)
    a, b = minute(none, sc, 8, 5), minute(none, sc, 8, 25)
    assert sum(none.series.good[a:b]) < 0.02 * sum(default.series.good[a:b])
    # while replicas pile up: HPA doubles the fleet (12 -> 24 at full scale)
    assert none.peak_replicas == 2 * sc.replicas
    assert none.gpu_wasted_s > 0.5 * none.gpu_s


def test_with_admission_a_small_shed_keeps_p95_near_the_slo(runs: dict[str, dict[str, Result]]
                                                            ) -> None:
    sc = scenario("incident")
    default, none = runs["incident"]["default"], runs["incident"]["none"]
    spike = minute(default, sc, 8, 1), minute(default, sc, 8, 8)
    assert sum(default.series.rejected[spike[0]:spike[1]]) > 0  # 429s during the spike
    calm = minute(default, sc, 8, 12), len(default.series.t)
    after = sum(default.series.rejected[calm[0]:calm[1]])
    assert after < 0.01 * sum(default.series.arrivals[calm[0]:calm[1]])  # hardly after it
    assert default.shed_share < 0.10  # jobs that gave up after their retries
    assert default.latency(0.95) < 3.2  # within the admission budget (4 s deadline x 0.8)
    assert max(p for p in default.series.p95_s if p == p) < 4.0
    assert default.peak_replicas == 4 < none.peak_replicas  # 16 instead of 24 at full scale
    assert default.goodput > 5 * none.goodput  # none keeps only its pre-spike minutes


def test_admission_beats_slot_counting_and_the_articles_formula(
        runs: dict[str, dict[str, Result]]) -> None:
    r = runs["incident"]
    assert r["default"].goodput > r["naive"].goodput
    assert r["default"].goodput > 2 * r["article"].goodput
    assert r["default"].attainment >= 0.99


# ---- speed and determinism -----------------------------------------------------------------

def test_an_hour_of_the_conversation_trace_runs_in_seconds() -> None:
    jobs = read_azure(TRACES / "azure-llm-2023-conv.csv.gz", max_tokens=1024)
    sc = scenarios.replay("conv-hour", jobs)
    started = time.process_time()
    result = simulate(sc, policies.make("default"))
    elapsed = time.process_time() - started
    assert result.attempts >= 19_366 and result.completed >= 19_000
    assert elapsed < 20.0, f"{elapsed:.1f} s of CPU for the hour"


def test_the_same_seed_gives_the_same_run() -> None:
    a = simulate(scenarios.bursty(duration_s=120, seed=7), policies.make("default")).summary()
    b = simulate(scenarios.bursty(duration_s=120, seed=7), policies.make("default")).summary()
    c = simulate(scenarios.bursty(duration_s=120, seed=8), policies.make("default")).summary()
    assert a == b
    assert a != c
