"""The gateway and the simulator take the same decisions: the same requests, clock and capacity
through ``Gate`` (in-process ledger) and through the simulator's gateway give identical verdicts,
Retry-After hints and ledger states (extproc.decision.step is the one place they come from)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from extproc import config as config_mod
from extproc.decision.admission import Outcome, Reason, Snapshot
from extproc.decision.learning import PoolLearning
from extproc.decision.step import Admission
from extproc.fleet.capacity import StaticCapacity
from extproc.gateway.gate import Gate
from extproc.ledger.memory import MemoryLedger
from extproc.observability.metrics import Metrics
from extproc.sim.clients import ClientModel
from extproc.sim.policies import make
from extproc.sim.run import Simulation
from extproc.sim.scenarios import Scenario
from extproc.sim.workload import Job

SETTINGS: dict[str, Any] = {
    "pools": [{"name": "llm", "replicas": 2, "bytes_per_token": 4.0,
               "engine": {"max_num_seqs": 3, "num_gpu_blocks": 2000, "block_size": 16,
                          "max_model_len": 32768}}],
    "classes": {"latency": {"deadline_ms": 8_000, "ttft_ms": 1_500},
                "throughput": {"deadline_ms": 120_000, "batch": True}},
    "routes": [{"path": "/v1/completions", "api": "openai_completions", "class": "latency"},
               {"path": "/batch/completions", "api": "openai_completions",
                "class": "throughput"}],
}


def jobs(seed: int, n: int = 40) -> list[Job]:
    rng = random.Random(seed)
    return [Job(arrival_s=0.005 * i, prompt_tokens=rng.choice((50, 400, 1500, 6000, 30000)),
                output_tokens=100_000, max_tokens=rng.choice((None, 16, 256, 4096)),
                service_class=rng.choice(("latency", "latency", "throughput")))
            for i in range(n)]


def through_the_simulator(config: config_mod.Config, work: list[Job]
                          ) -> list[tuple[Snapshot, Admission]]:
    seen: list[tuple[Snapshot, Admission]] = []
    firsts: set[float] = set()

    def record(job: Job, snapshot: Snapshot, adm: Admission) -> None:
        if job.arrival_s not in firsts:  # retries come a second later: leave them out
            firsts.add(job.arrival_s)
            seen.append((snapshot, adm))

    pool = config.pools[0]
    scenario = Scenario(name="parity", jobs=work, config=config, engine=pool.engine,
                        replicas=pool.replicas, clients=ClientModel(timeout_s=60.0),
                        engines_scraped=False)  # as the gate: no engine_metrics
    Simulation(scenario, make("default"), on_decision=record).run()
    return seen


async def ask_gate(gate: Gate, config: config_mod.Config, job: Job) -> Any:
    """``job`` as an HTTP request through ``gate``: its verdict."""
    path = "/v1/completions" if job.service_class == "latency" else "/batch/completions"
    route = config.route(path)
    assert route is not None
    body: dict[str, Any] = {"model": "m", "prompt": "x" * (4 * job.prompt_tokens)}
    if job.max_tokens is not None:
        body["max_tokens"] = job.max_tokens
    return await gate.check(route, path, {}, json.dumps(body).encode())


async def through_the_gate(config: config_mod.Config, work: list[Job]
                           ) -> list[tuple[Snapshot, Any]]:
    now = [0.0]
    ledger = MemoryLedger(clock=lambda: now[0])
    gate = Gate(config, ledger, StaticCapacity(config.pools), Metrics(), clock=lambda: now[0])
    seen = []
    for job in work:
        now[0] = job.arrival_s
        snapshot = await ledger.snapshot("llm")
        verdict = await ask_gate(gate, config, job)
        seen.append((snapshot, verdict))
    for _, verdict in seen:
        if verdict.ticket is not None:
            await gate.settle(verdict.ticket)
    return seen


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("infeasible", ["pass", "reject"])
async def test_gate_and_simulator_decide_alike(seed: int, infeasible: str) -> None:
    config = config_mod.from_mapping({**SETTINGS, "infeasible": infeasible})
    work = jobs(seed)
    simulated = through_the_simulator(config, work)
    gated = await through_the_gate(config, work)
    assert len(simulated) == len(gated) == len(work)
    outcomes = set()
    for (sim_snap, adm), (gate_snap, verdict) in zip(simulated, gated, strict=True):
        assert sim_snap == gate_snap  # the ledger each decision read
        assert (verdict.outcome, verdict.reason) == (adm.outcome, adm.reason)
        assert verdict.prompt_tokens == adm.cost.prompt_tokens
        got = verdict.admission
        assert got is not None
        assert got.cost == adm.cost
        assert got.decision == adm.decision  # every predicted time, the ceiling, the hint
        assert got.retry_after_ms == adm.retry_after_ms
        assert got.lease_ms == adm.lease_ms and got.unavoidable == adm.unavoidable
        outcomes.add((adm.outcome, adm.reason))
    # the sequences exercise admissions, overload and the refusals of the step
    assert (Outcome.ADMIT, Reason.FITS) in outcomes
    assert any(o is Outcome.REJECT for o, _ in outcomes)
    assert any(o is Outcome.INVALID for o, _ in outcomes)


def learned(learning: PoolLearning) -> tuple[Any, ...]:
    """What a pool learned: promises, the measured level, the admission limit's spread,
    demand, the requests it holds running, the prefill backlog, the classes it serves."""
    return (sorted((c, round(p.x, 12), p.hits, p.misses) for c, p in learning.promises.items()),
            round(learning.level.level_ms, 9), learning.level.probing,
            learning.limit.mean, round(learning.limit.variance, 9),
            round(learning.demand.rate(learning.demand._at or 0.0), 9),
            dict(learning.inflight), round(learning.backlog.tokens, 6), learning.backlog.at,
            sorted((c, round(n, 9)) for c, n in learning._asked.items()))


@pytest.mark.parametrize("seed", range(3))
async def test_gate_and_simulator_learn_alike(seed: int) -> None:
    """The same requests teach the gate what they teach the simulator: the learned state
    before each request is the same in both. (The gate may ask again, an estimate then the
    exact count or after a refused reserve, where the simulator asks once: the step only
    reads, ``tests/test_no_harm.py::test_the_decision_only_reads``, and the records are
    made once per request.)"""
    config = config_mod.from_mapping(SETTINGS)
    work = jobs(seed)
    before_sim: list[tuple[Any, ...]] = []
    firsts: set[float] = set()
    pool = config.pools[0]
    scenario = Scenario(name="parity", jobs=work, config=config, engine=pool.engine,
                        replicas=pool.replicas, clients=ClientModel(timeout_s=60.0),
                        engines_scraped=False)  # as the gate: no engine_metrics
    simulation = Simulation(scenario, make("default"))

    def record(job: Job, snapshot: Snapshot, adm: Admission) -> None:
        if job.arrival_s not in firsts:
            firsts.add(job.arrival_s)
            before_sim.append(learned(simulation.learning))

    simulation.on_decision = record
    simulation.run()

    now = [0.0]
    ledger = MemoryLedger(clock=lambda: now[0])
    gate = Gate(config, ledger, StaticCapacity(config.pools), Metrics(), clock=lambda: now[0])
    before_gate: list[tuple[Any, ...]] = []
    learning = gate.learning["llm"]
    original = learning.arrived

    def arrived(*args: Any, **kwargs: Any) -> None:  # the state the decision then reads
        original(*args, **kwargs)
        before_gate.append(learned(learning))

    learning.arrived = arrived  # type: ignore[method-assign]
    for job in work:
        now[0] = job.arrival_s
        await ask_gate(gate, config, job)
    assert len(before_gate) == len(before_sim) == len(work)
    assert before_gate == before_sim
