import itertools
import json
import math
import random
import statistics
from pathlib import Path

import pytest

from extproc.errors import ConfigError
from extproc.sim import workload

TRACES = Path(__file__).resolve().parent / "data" / "traces"
CONV = TRACES / "azure-llm-2023-conv.csv.gz"


def test_azure_trace_reads_every_row_in_order_from_zero() -> None:
    jobs = workload.read_azure(CONV)
    assert len(jobs) == 19_366
    assert jobs[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(jobs))
    assert 3490 < jobs[-1].arrival_s < 3510  # one hour
    assert statistics.median(j.output_tokens for j in jobs) == 129
    assert all(j.max_tokens is None for j in jobs)


def test_azure_rate_x_compresses_time_and_keeps_the_requests() -> None:
    base = workload.read_azure(CONV, duration_s=600)
    fast = workload.read_azure(CONV, duration_s=600, rate_x=4.0, max_tokens=1024)
    assert len(fast) == len(base)
    assert fast[-1].arrival_s == pytest.approx(base[-1].arrival_s / 4)
    assert fast[10].prompt_tokens == base[10].prompt_tokens
    assert {j.max_tokens for j in fast} == {1024}


def test_azure_window_cuts_the_original_timeline(tmp_path: Path) -> None:
    jobs = workload.read_azure(CONV, start_s=600, duration_s=60)
    assert jobs and jobs[0].arrival_s == 0.0 and jobs[-1].arrival_s < 60
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ConfigError, match="not an Azure"):
        workload.read_azure(bad)


def test_jsonl_round_trip(tmp_path: Path) -> None:
    jobs = [workload.Job(0.5, 800, 97, 256, "latency", "a"),
            workload.Job(1.25, 12, 3, None, "throughput", "b", deadline_ms=5000.0),
            workload.Job(2.0, 12, 3, None, "latency", "b", priority=-1),
            workload.Job(2.5, 12, 3, None, "latency", "b", priority=7)]
    path = tmp_path / "jobs.jsonl"
    workload.write_jsonl(jobs, path)
    assert workload.read_jsonl(path) == jobs
    assert workload.sniff(path) == "jsonl"
    assert [j.arrival_s for j in workload.read_jsonl(path, rate_x=2.0)] == [0.25, 0.625, 1.0,
                                                                         1.25]
    assert '"priority": "sheddable"' in path.read_text()  # as a header would name it


def test_jsonl_names_every_bad_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"arrival_s": -1, "prompt_tokens": "x", "priority": "urgent"})
                    + "\n")
    with pytest.raises(ConfigError) as err:
        workload.read_jsonl(path)
    text = str(err.value)
    for key in ("arrival_s", "prompt_tokens", "output_tokens", "priority"):
        assert key in text


def test_synthetic_lengths_follow_the_fitted_lognormals() -> None:
    rng = random.Random(1)
    jobs = workload.synthetic([0.0] * 20_000, workload.CONVERSATION, rng)
    logs = [math.log(j.output_tokens) for j in jobs]
    assert statistics.fmean(logs) == pytest.approx(5.02, abs=0.03)
    assert statistics.stdev(logs) == pytest.approx(0.86, abs=0.03)
    assert statistics.fmean(math.log(j.prompt_tokens) for j in jobs) == pytest.approx(6.63,
                                                                                       abs=0.03)


def test_poisson_and_on_off_arrivals_have_the_asked_rates() -> None:
    rng = random.Random(2)
    poisson = list(workload.poisson_arrivals(50.0, 200.0, rng))
    assert len(poisson) == pytest.approx(10_000, rel=0.05)
    bursty = list(workload.on_off_arrivals(40.0, 2.0, 10.0, 30.0, 4000.0, rng))
    # ON a quarter of the time: mean rate 0.25 x 40 + 0.75 x 2 = 11.5 per second
    assert len(bursty) / 4000.0 == pytest.approx(11.5, rel=0.15)
    per_second = [0] * 4000
    for t in bursty:
        per_second[int(t)] += 1
    assert statistics.variance(per_second) / statistics.fmean(per_second) > 5  # bursty


def test_a_step_spike_raises_the_rate_only_while_it_lasts() -> None:
    rng = random.Random(3)
    curve = workload.step_spike(base=10.0, peak=100.0, start_s=100.0, length_s=50.0,
                                duration_s=300.0)
    times = list(workload.piecewise_arrivals(curve, rng))
    before = sum(1 for t in times if t < 100)
    during = sum(1 for t in times if 100 <= t < 150)
    after = sum(1 for t in times if t >= 150)
    assert before == pytest.approx(1000, rel=0.15)
    assert during == pytest.approx(5000, rel=0.1)
    assert after == pytest.approx(1500, rel=0.15)
