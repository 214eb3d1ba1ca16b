"""``extproc replay`` end to end, and the decision log from the gateway to the replay."""

from __future__ import annotations

import asyncio
import io
import json
import random
from pathlib import Path

import pytest

from extproc import cli, config
from extproc.decision.admission import Outcome
from extproc.errors import ConfigError
from extproc.fleet.capacity import StaticCapacity
from extproc.gateway.gate import Gate
from extproc.ledger.memory import MemoryLedger
from extproc.observability import decisionlog
from extproc.observability.metrics import Metrics
from extproc.sim import replay, workload
from extproc.sim.scenarios import Rate


def small_trace(path: Path, n: int = 1500, rate: float = 40.0) -> None:
    rng = random.Random(5)
    arrivals = workload.poisson_arrivals(rate, n / rate, rng)
    mix = workload.Mix(workload.LogNormal(6.0, 0.6), workload.LogNormal(4.0, 0.6),
                       max_tokens=256)
    workload.write_jsonl(workload.synthetic(arrivals, mix, rng), path)


def test_replay_prints_the_table_and_writes_summary_and_plot(tmp_path: Path) -> None:
    trace = tmp_path / "jobs.jsonl"
    small_trace(trace)
    out = io.StringIO()
    rc = replay.run(replay.Trace(str(trace), replicas=2), rate=Rate(load=2.0),
                    out=str(tmp_path / "out"), policies=["none", "naive", "default"],
                    progress=False, stream=out)
    assert rc == 0
    text = out.getvalue()
    for word in ("goodput", "SLO attainment", "TTFT", "GPU-s wasted", "none", "default"):
        assert word in text
    assert "inf%" not in text  # no oracle in the set: nothing to compare with
    data = json.loads((tmp_path / "out" / "jobs.json").read_text())
    assert [p["policy"] for p in data["policies"]] == ["none", "naive", "default"]
    assert data["policies"][2]["queue_delay_min_avoided"] >= 0
    png = (tmp_path / "out" / "jobs.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_the_cli_runs_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    small_trace(trace, n=300)
    assert cli.main(["replay", "--trace", str(trace), "--rate-x", "3", "--replicas", "1",
                     "--policies", "naive,default", "--quiet"]) == 0
    assert "goodput" in capsys.readouterr().out
    assert cli.main(["replay", "--trace", str(trace), "--policies", "nope"]) == 2
    assert "unknown nope" in capsys.readouterr().err


def test_replay_refuses_contradictory_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="at most one"):
        Rate(load=2.0, rate_x=2.0)
    with pytest.raises(SystemExit):  # argparse: one of --trace and --scenario, at most one rate
        cli.main(["replay", "--scenario", "bursty", "--scale", "2", "--rate-x", "2"])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["replay"])
    assert "one of the arguments --trace --scenario is required" in capsys.readouterr().err


def test_replay_keeps_every_key_of_the_gateways_configuration(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    small_trace(trace, n=200)
    mine = config.from_mapping({
        "infeasible": "reject", "retry_after": {"min_s": 2, "max_s": 9, "jitter": 0.1},
        "classes": {"latency": {"deadline_ms": 7_000, "ttft_ms": 900, "safety_factor": 0.7}},
        "pools": [{"name": "gpu", "replicas": 3, "expected_output_tokens": 40,
                   "engine": {"max_num_seqs": 8, "num_gpu_blocks": 999}}]})
    sc = replay.from_file(replay.Trace(str(trace), config=mine, timeout_s=30.0),
                          rate=Rate(load=2.0))
    assert sc.config.infeasible is config.Infeasible.REJECT
    assert sc.config.retry_after == mine.retry_after
    assert sc.config.classes["latency"] == mine.classes["latency"]
    assert sc.config.pools == mine.pools and sc.engine == mine.pools[0].engine
    assert sc.replicas == 3


def test_replay_refuses_what_it_cannot_simulate(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    small_trace(trace, n=50)
    two = config.from_mapping({"pools": [{"name": "a"}, {"name": "b"}]})
    with pytest.raises(ConfigError, match="replay simulates one pool"):
        replay.run(replay.Trace(str(trace), config=two), progress=False)
    other_class = config.from_mapping({"classes": {"gold": {"deadline_ms": 1000}},
                                       "routes": [{"path": "/v1/x", "class": "gold"}]})
    jobs = tmp_path / "batch.jsonl"
    workload.write_jsonl([workload.Job(0.0, 10, 10, service_class="bronze")], jobs)
    with pytest.raises(ConfigError, match="class 'bronze' is not configured"):
        replay.run(replay.Trace(str(jobs), config=other_class), progress=False)


def gate_with_log(path: Path, mode: str) -> tuple[Gate, config.Config]:
    c = config.from_mapping({
        "mode": mode, "decision_log": str(path),
        "pools": [{"name": "llama", "replicas": 1, "engine": {"max_num_seqs": 2}}],
    })
    return Gate(c, MemoryLedger(), StaticCapacity(c.pools), Metrics()), c


def test_the_gateway_logs_each_decision_without_prompt_text(tmp_path: Path) -> None:
    log = tmp_path / "decisions.jsonl"
    gate, c = gate_with_log(log, "shadow")
    route = c.route("/v1/chat/completions")
    assert route is not None
    secret = "the patient's name is " + "x" * 400
    body = json.dumps({"model": "m", "max_tokens": 64,
                       "messages": [{"role": "user", "content": secret}]}).encode()

    async def run() -> None:
        verdicts = [await gate.check(route, "/v1/chat/completions", {}, body) for _ in range(5)]
        await asyncio.sleep(0.01)
        for v in verdicts:
            assert v.ticket is not None  # shadow mode: everything runs
            await gate.settle(v.ticket)
        assert gate.decision_log is not None
        gate.decision_log.close()

    asyncio.run(run())
    text = log.read_text()
    assert "patient" not in text and "xxxx" not in text
    records = list(decisionlog.read(log))
    assert len(records) == 5
    assert {r.mode for r in records} == {"shadow"}
    assert all(r.max_output_tokens == 64 and r.prompt_tokens > 50 for r in records)
    assert all(r.duration_ms is not None and r.duration_ms >= 5 for r in records)
    assert any(r.decision == Outcome.REJECT.value for r in records)  # what enforcing would do


def test_a_rejected_request_is_logged_at_once_without_duration(tmp_path: Path) -> None:
    log = tmp_path / "decisions.jsonl"
    gate, c = gate_with_log(log, "enforce")
    route = c.route("/v1/chat/completions")
    assert route is not None
    body = json.dumps({"model": "m", "max_tokens": 64,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()

    async def run() -> list[Outcome]:
        verdicts = [await gate.check(route, "/v1/chat/completions", {}, body) for _ in range(6)]
        assert gate.decision_log is not None
        gate.decision_log.flush()
        return [v.outcome for v in verdicts]

    outcomes = asyncio.run(run())
    assert Outcome.REJECT in outcomes
    written = list(decisionlog.read(log))
    assert len(written) == outcomes.count(Outcome.REJECT)  # the admitted end later
    assert all(r.duration_ms is None and r.decision == "reject" for r in written)


def test_a_decision_log_replays_as_a_workload(tmp_path: Path) -> None:
    log = tmp_path / "decisions.jsonl"
    writer = decisionlog.DecisionLog(log)  # no event loop: each line is written at once
    for i in range(400):
        writer.write(decisionlog.Record(
            1_700_000_000.0 + i * 0.05, "default", "latency", 500 + i, 256, 30_000.0, "admit",
            "fits", "shadow", 1000.0, 0.0, duration_ms=None if i % 10 == 0 else 900.0 + i))
    writer.close()
    assert workload.sniff(log) == "decisions"
    jobs = workload.read_decision_log(log)
    assert len(jobs) == 400 and jobs[0].arrival_s == 0.0
    assert jobs[1].output_tokens == round((901 - 501 * 0.08) / 31.2)  # from the duration
    assert jobs[0].output_tokens == 256  # no duration: the most it may write
    out = io.StringIO()
    assert replay.run(replay.Trace(str(log)), policies=["none", "default"], progress=False,
                      stream=out) == 0
    assert "default" in out.getvalue()


def test_a_decision_log_from_before_the_rename_still_reads(tmp_path: Path) -> None:
    # the most output a request may write was logged as charged_tokens before it was
    # max_output_tokens; old logs replay the same
    old = tmp_path / "old.jsonl"
    line = {"time": 1.0, "pool": "llama", "class": "latency", "prompt_tokens": 500,
            "charged_tokens": 96, "deadline_ms": 30000.0, "decision": "admit",
            "reason": "fits", "mode": "shadow", "duration_ms": 900.0}
    old.write_text(json.dumps(line) + "\n" + json.dumps({**line, "time": 2.0}) + "\n")
    [job, _] = workload.read_decision_log(old)
    assert job.max_tokens == 96 and job.prompt_tokens == 500
    del line["charged_tokens"]
    old.write_text(json.dumps(line) + "\n")
    with pytest.raises(ConfigError, match=r"old\.jsonl"):
        workload.read_decision_log(old)


def test_decision_log_config_names_the_key() -> None:
    with pytest.raises(ConfigError, match="decision_log"):
        config.from_mapping({"decision_log": "/no/such/dir/log.jsonl"})
