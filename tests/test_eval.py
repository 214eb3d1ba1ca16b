"""The evaluation matrix (extproc.sim.evaluate): the reduced run end to end, the sweep, the
scoring, the KEDA baseline. Nothing here asserts what the default wins: only that the matrix
measures and reports it faithfully, whatever the default does."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest

from extproc import cli
from extproc.sim import evaluate, families
from extproc.sim.autoscaler import KedaWaiting, Observation

pytestmark = pytest.mark.slow  # simulations of more than a few seconds

AVAILABLE = [f for f in families.FAMILIES if families.missing(f) is None]


@pytest.fixture(scope="module")
def reduced(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("eval")
    stream = io.StringIO()
    assert evaluate.main(evaluate.Selection(reduced=True), workers=2, out=str(out),
                         progress=False, stream=stream) == 0
    return stream.getvalue(), json.loads((out / "matrix.json").read_text()), out


def test_every_available_family_ran_once(reduced: tuple[str, dict[str, Any], Path]) -> None:
    _, data, _ = reduced
    ran = [c["family"] for c in data["cells"]]
    assert sorted(ran) == sorted(AVAILABLE)
    assert {(c["load"], c["seed"], c["fleet"]) for c in data["cells"]} == {
        (evaluate.REDUCED_LOAD, 0, evaluate.REDUCED_FLEET)}


def test_the_json_holds_every_cell_and_policy(reduced: tuple[str, dict[str, Any], Path]
                                              ) -> None:
    _, data, _ = reduced
    for cell in data["cells"]:
        assert set(cell["policies"]) == set(evaluate.POLICIES)
        assert cell["params"] and cell["jobs"] > 0
        for figures in cell["policies"].values():
            for key in ("goodput", "attainment", "admitted", "rejected", "p99_latency_s"):
                assert key in figures
            assert 0.0 <= figures["attainment"] <= 1.0
            assert figures["goodput"] == pytest.approx(figures["good"] / cell["span_s"],
                                                       rel=1e-3, abs=1e-5)


def test_tuned_is_the_best_limit_it_tried(reduced: tuple[str, dict[str, Any], Path]) -> None:
    _, data, _ = reduced
    for cell in data["cells"]:
        tuned = cell["policies"]["tuned"]
        tried = {int(n): g for n, g in cell["tuned"]["tried"].items()}
        assert len(tried) >= 2
        assert tuned["limit"] == cell["tuned"]["limit"] in tried
        assert tuned["goodput"] == max(tried.values())
        assert all(tuned["goodput"] >= g for g in tried.values())
        assert max(tried) <= cell["tuned"]["upper"]


def _ratio(a: float, b: float) -> float | None:
    if b > 0:
        return round(a / b, 4)
    return 1.0 if a <= 0 else None


def test_ratios_and_losses_follow_from_the_numbers(reduced: tuple[str, dict[str, Any], Path]
                                                   ) -> None:
    _, data, _ = reduced
    for cell in data["cells"]:
        pol = cell["policies"]
        d = pol["default"]
        for base in ("naive", "saturation", "tuned", "oracle"):
            assert cell["ratios"][f"default/{base}"] == _ratio(d["goodput"],
                                                               pol[base]["goodput"])
        losses = set()
        if d["goodput"] < pol["naive"]["goodput"]:
            losses.add("naive")
        if d["goodput"] < pol["saturation"]["goodput"]:
            losses.add("saturation")
        if d["goodput"] < 0.95 * pol["tuned"]["goodput"]:
            losses.add("tuned")
        if pol["oracle"]["attainment"] >= 0.99 and d["attainment"] < 0.99:
            losses.add("attainment")
        assert set(cell["losses"]) == losses


def test_the_summary_counts_the_cells(reduced: tuple[str, dict[str, Any], Path]) -> None:
    text, data, _ = reduced
    cells, s = data["cells"], data["summary"]
    assert s["cells"] == len(cells)
    assert s[">= naive"] == sum(1 for c in cells if "naive" not in c["losses"])
    assert s[">= 0.95 x tuned"] == sum(1 for c in cells if "tuned" not in c["losses"])
    assert s["all targets"] == sum(1 for c in cells if not c["losses"])
    ratios = sorted(c["ratios"]["default/oracle"] for c in cells)
    assert s["median default/oracle"] == pytest.approx(
        (ratios[(len(ratios) - 1) // 2] + ratios[len(ratios) // 2]) / 2, abs=1e-4)
    assert "median default/oracle" in text and "elapsed:" in text
    assert s["no harm cells"] == len(cells)
    assert s["no harm: all three"] == sum(1 for c in cells if not c["harm"])
    assert s["no harm: goodput"] == sum(1 for c in cells if "goodput" not in c["harm"])
    assert f"all three: {s['no harm: all three']}/{len(cells)}" in text


def _cell(default: tuple[float, float, float], naive: tuple[float, float],
          saturation: tuple[float, float]) -> dict[str, Any]:
    """A record's policies: the default's (goodput, attainment, refused_idle_share), each
    peer's (goodput, attainment)."""
    g, a, idle = default
    return {"default": {"goodput": g, "attainment": a, "refused_idle_share": idle},
            "naive": {"goodput": naive[0], "attainment": naive[1]},
            "saturation": {"goodput": saturation[0], "attainment": saturation[1]}}


def test_do_no_harm_is_judged_against_the_better_peer() -> None:
    # goodput: 0.97x the better peer's (saturation's here), not the worse one's
    assert evaluate.harm(_cell((9.7, 0.99, 0.0), (5.0, 0.99), (10.0, 0.99))) == []
    assert evaluate.harm(_cell((9.69, 0.99, 0.0), (5.0, 0.99), (10.0, 0.99))) == ["goodput"]
    # attainment: half a point under the better peer's, which counts up to 99 % only
    assert evaluate.harm(_cell((10, 0.955, 0.0), (5, 0.96), (5, 0.90))) == []
    assert evaluate.harm(_cell((10, 0.954, 0.0), (5, 0.96), (5, 0.90))) == ["attainment"]
    assert evaluate.harm(_cell((10, 0.986, 0.0), (5, 1.0), (5, 1.0))) == []
    assert evaluate.harm(_cell((10, 0.984, 0.0), (5, 1.0), (5, 1.0))) == ["attainment"]
    # refusing while a replica is idle: more than 2 % of the run
    assert evaluate.harm(_cell((10, 1.0, 0.02), (5, 1.0), (5, 1.0))) == []
    assert evaluate.harm(_cell((10, 1.0, 0.021), (5, 1.0), (5, 1.0))) == ["idle"]
    assert evaluate.harm({"default": {"goodput": 0.0, "attainment": 0.0}}) == []  # no peer ran


def test_the_table_lists_losing_cells_first(reduced: tuple[str, dict[str, Any], Path]) -> None:
    text, data, _ = reduced
    losing = {c["cell"] for c in data["cells"] if c["losses"]}
    rows = [line.split()[0] for line in text.splitlines()
            if line.split() and line.split()[0] in {c["cell"] for c in data["cells"]}]
    assert len(rows) == len(data["cells"])
    flags = [row in losing for row in rows]
    assert flags == sorted(flags, reverse=True)  # every losing row before every other
    assert [c["cell"] for c in data["cells"]] == rows  # the JSON in the table's order


def test_the_heatmap_and_the_table_are_written(reduced: tuple[str, dict[str, Any], Path]
                                               ) -> None:
    _, _, out = reduced
    png = out / "matrix.png"
    assert png.stat().st_size > 5000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "matrix.txt").read_text().startswith("cell")


def test_a_cell_is_deterministic() -> None:
    cell = evaluate.Cell("bimodal", 1.5, 3, "70b-16", size=0.1)
    a = evaluate.run_cell(cell, ("naive", "default", "tuned"))
    b = evaluate.run_cell(cell, ("naive", "default", "tuned"))
    for timing in ("wall_s", "cpu_s"):
        a.pop(timing)
        b.pop(timing)
    assert a == b


def test_a_limit_that_never_binds_ends_the_sweep() -> None:
    sc = families.draw("bimodal", 0, 0.2, "70b-16", size=0.1).scenario
    best, tried = evaluate.tune(sc, 16)
    top = max(tried)
    assert tried[top]["rejected"] == 0 or top == 16
    assert tried[best]["goodput"] == max(t["goodput"] for t in tried.values())


def test_scores_without_a_baseline_goodput() -> None:
    zero = {"goodput": 0.0, "attainment": 1.0}
    some = {"goodput": 2.0, "attainment": 1.0}
    rec = {"policies": {"default": some, "naive": zero, "oracle": zero}}
    assert evaluate.score(rec) == {"ratios": {"default/naive": None, "default/oracle": None},
                                   "losses": [], "harm": []}
    rec = {"policies": {"default": zero, "naive": zero}}
    assert evaluate.score(rec)["ratios"] == {"default/naive": 1.0}


def test_a_missing_trace_is_skipped_with_a_note(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setattr(families, "TRACES", tmp_path)
    stream = io.StringIO()
    evaluate.main(evaluate.Selection(["azure-code", "bimodal"], reduced=True), workers=1,
                  out=None, policies=("default",), progress=False, stream=stream)
    text = stream.getvalue()
    assert "azure-code: skipped" in text
    assert "bimodal/70b-16" in text and "azure-code/" not in text


def test_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["eval", "--reduced", "--families", "bimodal", "--policies", "naive,default",
                   "--jobs", "1", "--quiet", "--out", str(tmp_path)])
    assert rc == 0
    assert "bimodal/70b-16/1.5x/s0" in capsys.readouterr().out
    assert json.loads((tmp_path / "matrix.json").read_text())["cells"][0]["family"] == "bimodal"
    assert cli.main(["eval", "--families", "nope", "--quiet"]) == 2


def test_size_scales_each_run_up_to_its_family_s_nominal_length(tmp_path: Path) -> None:
    """``--size``: each run's request budget scaled; a run never outgrows its family's
    nominal length, so a large size runs the nominal length (where a latch would show)."""
    spans = {}
    for size in ("0.25", "100"):
        out = tmp_path / size
        assert cli.main(["eval", "--families", "priority", "--fleets", "70b-16", "--loads",
                         "1.5", "--policies", "naive,default", "--size", size, "--jobs", "1",
                         "--quiet", "--out", str(out)]) == 0
        data = json.loads((out / "matrix.json").read_text())
        [cell] = data["cells"]
        assert data["size"] == cell["size"] == float(size)
        spans[size] = (cell["span_s"], 60.0 * cell["params"]["nominal_min"])
    (short, nominal), (long, same) = spans["0.25"], spans["100"]
    assert nominal == same
    assert long == pytest.approx(nominal, rel=1e-3)
    assert short < nominal / 2
    with pytest.raises(SystemExit) as refused:  # argparse's usage error, naming the flag
        cli.main(["eval", "--size", "0", "--quiet"])
    assert refused.value.code == 2


def test_size_scales_the_autoscaling_section_s_runs_too(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    runs: list[evaluate.ScaleRun] = []

    def collect(fn: Any, todo: list[evaluate.ScaleRun], *rest: Any) -> list[Any]:
        runs.extend(todo)
        return []

    monkeypatch.setattr(evaluate, "_pool_map", collect)
    evaluate.autoscale(["diurnal"], 1, autoscalers=("hpa",), size=0.5)
    assert [r.size for r in runs] == [evaluate.AUTOSCALE_SIZE * 0.5]


def test_an_autoscaled_run_reports_goodput_and_replica_minutes() -> None:
    run = evaluate.ScaleRun("flash-crowd", 0, "70b-16", "keda", size=0.3)
    row = evaluate.run_scaled(run)
    assert row["replica_min"] > 0 and row["peak_replicas"] >= 1
    assert row["good_per_replica_min"] == pytest.approx(row["good"] / row["replica_min"],
                                                        rel=1e-2)


def _obs(waiting: int, ready: int = 4, starting: int = 0, now: float = 0.0) -> Observation:
    return Observation(now_s=now, window_s=15.0, ready=ready, starting=starting, draining=0,
                       arrivals=0, admitted=0, rejected=0, completed=0, good=0, load=0.0,
                       utilization=0.0, occupancy=0.0, busy=0.0, waiting=waiting,
                       oldest_waiting_s=0.0, inflight=0, oldest_inflight_s=0.0)


def test_keda_asks_for_the_waiting_requests_over_the_target() -> None:
    assert KedaWaiting(max_replicas=50).recommend(_obs(waiting=31)) == math.ceil(31 / 5)


def test_keda_holds_within_the_tolerance() -> None:
    assert KedaWaiting().recommend(_obs(waiting=21)) == 4  # 21 / (5 x 4) = 1.05


def test_keda_scales_up_at_most_double_or_four_more() -> None:
    assert KedaWaiting(max_replicas=100).recommend(_obs(waiting=500, ready=4)) == 8
    assert KedaWaiting(max_replicas=100).recommend(_obs(waiting=500, ready=1)) == 5


def test_keda_scales_down_only_after_its_window() -> None:
    k = KedaWaiting(max_replicas=20)
    assert k.recommend(_obs(waiting=40, ready=4, now=0.0)) == 8
    assert k.recommend(_obs(waiting=0, ready=8, now=100.0)) == 8  # the window remembers 8
    assert k.recommend(_obs(waiting=0, ready=8, now=400.0)) == 1  # ... for 300 s


# ---- the decision's targets (issue 14), on the reduced matrix -------------------------------
# Every family once (70b-16, 1.5x, a quarter of a full cell's length). Where the default
# misses a target today, a strict xfail states the measured gap: it turns into a failure,
# asking for the mark to go, the day the decision meets it. The full matrix's figures, every
# cell, are in docs/simulator.md.

TARGETS = ("naive", "saturation", "tuned", "attainment")
GAPS = {
    ("summarisation", "tuned"): "0.70x the tuned limit of 10: KV-bound documents whose"
                                " prefill stalls the decodes beside them",
    ("priority", "naive"): "0.93x naive: the room kept for critical arrivals while the level"
                           " climbs on a quarter-length run",
    ("priority", "attainment"): "97.6% (the oracle's 100%): 15 of 638 admitted missed on a"
                                " quarter-length run",
    ("priority", "tuned"): "0.93x the tuned limit (16, naive's)",
    ("noisy-neighbour", "naive"): "0.965x naive: fair shares keep room for the steady tenant"
                                  " that the burst could have used",
    ("azure-conv", "naive"): "0.971x naive on a two-minute slice of the trace",
    ("flash-crowd", "attainment"): "98.1% (naive's 98.7%) at 1.05x naive's goodput",
    ("multi-turn", "naive"): "0.98x naive: the level climbs a request at a time while a"
                             " replica waits for compute (long conversations' prefill)",
    ("bimodal", "naive"): "0.96x naive on a quarter-length run: first tokens refused on"
                          " the queue their replica reports, which the pool's average"
                          " queue admitted (the full-length run: 0.994x)",
    ("class-mix", "attainment"): "98.75%: TTFT misses of the latency class,"
                                 " which the gateway does not measure",
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("family", AVAILABLE)
def test_the_default_meets_the_target(reduced: tuple[str, dict[str, Any], Path], family: str,
                                      target: str, request: pytest.FixtureRequest) -> None:
    gap = GAPS.get((family, target))
    if gap is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=gap))
    _, data, _ = reduced
    cell = next(c for c in data["cells"] if c["family"] == family)
    assert target not in cell["losses"], (cell["ratios"],
                                          cell["policies"]["default"]["attainment"])
