"""Workload families (extproc.sim.families): drawn parameters, lengths, prefixes, sizes."""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path

import pytest

from extproc.sim import families, scenarios
from extproc.sim.workload import Job

AVAILABLE = [f for f in families.FAMILIES if families.missing(f) is None]
SMALL = 0.3  # run size: enough jobs to check, quick to draw
# depend on the fleet (its capacity sizes the run)
DERIVED = {"span_s", "window_s", "burst_from_s", "burst_to_s"}


def draw(name: str, seed: int = 0, load: float = 1.5, fleet: str = "70b-16",
         size: float = SMALL) -> families.Drawn:
    return families.draw(name, seed, load, fleet, size)


@pytest.mark.parametrize("name", AVAILABLE)
def test_jobs_are_sorted_and_well_formed(name: str) -> None:
    sc = draw(name).scenario
    jobs = sc.jobs
    assert len(jobs) > 50
    arrivals = [j.arrival_s for j in jobs]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] >= 0.0
    for j in jobs:
        assert j.prompt_tokens >= 1 and j.output_tokens >= 1
        assert j.prompt_tokens + min(j.output_tokens, j.max_tokens or j.output_tokens) \
            <= sc.engine.max_model_len
        assert j.service_class in sc.config.classes
        assert 0 <= j.prefix_tokens < j.prompt_tokens or j.prefix_tokens == 0


@pytest.mark.parametrize("name", AVAILABLE)
def test_the_same_seed_gives_the_same_jobs(name: str) -> None:
    a, b = draw(name), draw(name)
    assert a.params == b.params
    assert list(a.scenario.jobs) == list(b.scenario.jobs)


@pytest.mark.parametrize("name", AVAILABLE)
def test_two_seeds_draw_different_parameters(name: str) -> None:
    a, b = draw(name, seed=0), draw(name, seed=1)
    assert a.params.keys() == b.params.keys()
    drawn = [k for k in a.params.keys() - DERIVED if isinstance(a.params[k], float)]
    assert drawn
    assert all(a.params[k] != b.params[k] for k in drawn)


@pytest.mark.parametrize("name", AVAILABLE)
def test_parameters_do_not_depend_on_load_or_fleet(name: str) -> None:
    a = draw(name, load=0.8, fleet="70b-16")
    b = draw(name, load=3.0, fleet="8b-vllm", size=0.1)
    assert {k: v for k, v in a.params.items() if k not in DERIVED} == {
        k: v for k, v in b.params.items() if k not in DERIVED}


RANGES = {
    "long-context": {"prompt_median": (3000, 10_000), "deadline_s": (90, 150),
                     "ttft_s": (10, 30), "output_median": (150, 400)},
    "flash-crowd": {"base_x": (0.4, 0.8), "peak_x": (4, 8), "spike_s": (90, 150),
                    "deadline_s": (20, 40), "ttft_s": (1.5, 3)},
    "diurnal": {"trough_x": (0.2, 0.4), "peak_x": (1.8, 3.2), "peak_frac": (0.35, 0.65)},
    "bimodal": {"short_share": (0.7, 0.9), "short_median": (10, 30),
                "long_median": (1000, 2000), "deadline_s": (60, 120)},
    "class-mix": {"latency_share": (0.6, 0.8), "batch_output_median": (600, 1500)},
    "noisy-neighbour": {"a_x": (0.3, 0.45), "b_x": (0.2, 0.4), "burst_s": (60, 120),
                        "start_frac": (0.3, 0.45)},
    "priority": {"critical_from": (0.03, 0.08), "critical_to": (0.15, 0.25),
                 "standard_share": (0.3, 0.5)},
    "summarisation": {"prompt_median": (10_000, 20_000), "deadline_s": (60, 120)},
    "multi-turn": {"max_turns": (4, 8), "think_s": (10, 60)},
    "azure-conv": {"window_start_frac": (0, 1), "deadline_s": (20, 40)},
    "azure-code": {"window_start_frac": (0, 1), "timeout_s": (10, 60)},
    "incident": {"minutes": (24, 36)},
    "output-tail": {"short_share": (0.75, 0.85), "long_median": (1000, 2000),
                    "deadline_x": (0.5, 0.8), "nominal_min": (40, 50)},
    "reasoning": {"output_median": (1000, 2000), "output_sigma": (0.7, 1.1),
                  "deadline_s": (200, 400), "nominal_min": (40, 50)},
    "agentic": {"system_tokens": (3000, 8000), "context_tokens": (50_000, 100_000),
                "deadline_s": (60, 120), "nominal_min": (40, 50)},
}


@pytest.mark.parametrize("name", AVAILABLE)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parameters_fall_in_their_documented_ranges(name: str, seed: int) -> None:
    params = draw(name, seed=seed, size=0.1).params
    for key, (low, high) in RANGES[name].items():
        assert low <= params[key] <= high, (key, params[key])


def test_long_context_lengths_stay_in_their_ranges() -> None:
    d = draw("long-context")
    cap = d.scenario.engine.max_model_len - 1024
    assert all(j.prompt_tokens <= cap and j.output_tokens <= 1024 for j in d.scenario.jobs)
    prompts = sorted(j.prompt_tokens for j in d.scenario.jobs)
    median = prompts[len(prompts) // 2]
    assert 0.6 * d.params["prompt_median"] <= median <= 1.5 * d.params["prompt_median"]
    latency = d.scenario.config.classes["latency"]
    assert latency.deadline_ms == pytest.approx(1000 * d.params["deadline_s"])
    assert latency.ttft_ms == pytest.approx(1000 * d.params["ttft_s"])


def test_summarisation_lengths_stay_in_their_ranges() -> None:
    jobs = draw("summarisation").scenario.jobs
    assert all(8000 <= j.prompt_tokens <= 32_000 for j in jobs)
    assert all(200 <= j.output_tokens <= 600 for j in jobs)
    assert draw("summarisation").scenario.config.classes["latency"].ttft_ms is None


def test_bimodal_outputs_have_two_modes_and_one_max_tokens() -> None:
    d = draw("bimodal", size=1.0)
    jobs = d.scenario.jobs
    assert {j.max_tokens for j in jobs} == {4096}
    short = sum(1 for j in jobs if j.output_tokens < 200) / len(jobs)
    assert abs(short - d.params["short_share"]) < 0.05
    assert all(j.output_tokens < 200 or j.output_tokens > 300 for j in jobs[:200])


def test_the_output_tail_cannot_finish_in_time_even_alone() -> None:
    """The long answers need more than their budget on an idle replica of any fleet: no
    admission level saves them (the misses the measured level must not tighten on)."""
    for fleet in ("70b-16", "8b-vllm"):
        d = draw("output-tail", fleet=fleet, size=0.1)
        sc = d.scenario
        latency = sc.config.classes["latency"]
        budget_ms = latency.deadline_ms * latency.safety_factor
        alone_ms = d.params["long_median"] * sc.engine.itl_ms(1, 1000.0)
        assert alone_ms > budget_ms
        long = sum(1 for j in sc.jobs if j.output_tokens > 300) / len(sc.jobs)
        assert abs(long - (1 - d.params["short_share"])) < 0.05


def test_the_long_families_run_for_forty_minutes_where_their_budget_allows() -> None:
    for name in ("output-tail", "reasoning", "agentic"):
        d = draw(name, fleet="70b-16", size=1.0)
        assert d.scenario.span_s >= 2400.0, (name, d.scenario.span_s)


def test_agentic_sessions_grow_their_context_on_a_cached_prefix() -> None:
    jobs = draw("agentic", size=0.2).scenario.jobs
    sessions: dict[str, list] = {}
    for j in jobs:
        sessions.setdefault(j.prefix_key, []).append(j)
    longest = max(sessions.values(), key=len)
    assert len(longest) >= 5
    for earlier, later in itertools.pairwise(longest):
        assert later.prefix_tokens == earlier.prompt_tokens + earlier.output_tokens
        assert later.prompt_tokens > later.prefix_tokens
    assert max(j.prompt_tokens for j in jobs) > 30_000


def test_class_mix_has_both_classes_in_the_drawn_shares() -> None:
    d = draw("class-mix", size=1.0)
    jobs = d.scenario.jobs
    latency = sum(1 for j in jobs if j.service_class == "latency") / len(jobs)
    assert abs(latency - d.params["latency_share"]) < 0.05
    batch = d.scenario.config.classes["throughput"]
    assert batch.deadline_ms == 600_000 and batch.ttft_ms is None


def test_multi_turn_prefixes_are_the_conversation_so_far() -> None:
    jobs = draw("multi-turn", size=1.0).scenario.jobs
    turns: dict[str, list[Job]] = defaultdict(list)
    for j in jobs:
        assert j.prefix_key is not None
        assert j.prefix_tokens < j.prompt_tokens  # a new message always follows the history
        turns[j.prefix_key].append(j)
    repeated = [ts for ts in turns.values() if len(ts) > 1]
    assert len(repeated) > 10  # keys repeat across turns
    for ts in repeated:
        for prev, nxt in itertools.pairwise(ts):
            assert nxt.arrival_s > prev.arrival_s
            # the next turn's history is this turn's prompt and its answer
            assert nxt.prefix_tokens == prev.prompt_tokens + prev.output_tokens


def test_streaming_families_abort_on_disconnect_and_the_others_do_not() -> None:
    quiet = {"summarisation", "azure-code", "incident"}
    for name in AVAILABLE:
        assert draw(name, size=0.1).scenario.engine_aborts == (name not in quiet), name


@pytest.mark.parametrize("name", ["bimodal", "long-context", "summarisation"])
def test_a_stationary_family_offers_load_times_capacity(name: str) -> None:
    for load in (0.8, 3.0):
        sc = draw(name, load=load, size=1.0).scenario
        cap = scenarios.capacity_rps(sc.engine, sc.replicas, sc.jobs)
        offered = len(sc.jobs) / sc.span_s
        assert offered == pytest.approx(load * cap, rel=0.15)


def test_a_trace_family_replays_a_window_at_load_times_capacity() -> None:
    if "azure-conv" not in AVAILABLE:
        pytest.skip("no trace")
    sc = draw("azure-conv", load=2.0, size=1.0).scenario
    cap = scenarios.capacity_rps(sc.engine, sc.replicas, sc.jobs)
    assert len(sc.jobs) / sc.span_s == pytest.approx(2.0 * cap, rel=0.05)


def test_shaped_families_scale_with_load() -> None:
    for name in ("flash-crowd", "diurnal", "incident"):
        low = len(draw(name, load=0.8).scenario.jobs)
        high = len(draw(name, load=2.4).scenario.jobs)
        assert high == pytest.approx(3 * low, rel=0.15), name


def test_runs_are_sized_in_requests_on_fast_fleets() -> None:
    slow = draw("bimodal", fleet="70b-16", size=1.0).scenario
    fast = draw("bimodal", fleet="8b-vllm", size=1.0).scenario
    assert fast.span_s < slow.span_s  # the fast fleet's run is shorter ...
    assert fast.span_s >= families.FLOOR_S - 1  # ... but never under the floor


def test_every_fleet_runs_every_family() -> None:
    for fleet, shape in families.FLEETS.items():
        for name in AVAILABLE:
            sc = draw(name, fleet=fleet, size=0.05).scenario
            assert sc.engine == shape.engine and sc.replicas == shape.replicas
            assert sc.pool.engine == shape.engine


def test_fleet_shapes() -> None:
    f = families.FLEETS
    assert (f["70b-16"].replicas, f["70b-16"].engine.max_num_seqs) == (4, 16)
    assert (f["70b-vllm"].replicas, f["70b-vllm"].engine.max_num_seqs) == (4, 1024)
    assert f["8b-vllm"].replicas == 2


def test_a_missing_trace_is_a_note_not_an_error(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setattr(families, "TRACES", tmp_path)
    assert "skipped" in (families.missing("azure-conv") or "")
    assert families.missing("bimodal") is None


def test_an_unknown_family_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown family"):
        families.draw("nope", 0, 1.0, "70b-16")
