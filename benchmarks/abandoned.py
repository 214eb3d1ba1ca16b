"""Answers nobody waited for: the default with the engines' measured speed and without it.

A stream whose client gave up counts, censored, in the lengths a request's chance of missing
even alone is read from, at the speed the engines measured (``extproc.decision.learning``, "Answers
nobody waited for"). Without engine metrics there is no measured speed and nothing is counted:
that is the "off" column here (``PoolLearning.engine_speed`` ignored), the same draws side by
side. Per cell: the default's goodput on over off, each against the better of naive and
saturation, the attainments, and the admitted requests' mean predicted unavoidable chance
against the share of them whose answer was in fact too long to finish within its budget alone.

Usage::

    python benchmarks/abandoned.py [--families output-tail,reasoning,bimodal]
        [--fleets 70b-16,70b-vllm,8b-vllm] [--loads 0.8,1.5,3] [--seeds 1]

About 20 CPU-seconds a cell (output-tail's 900 s runs on 8b-vllm the longest); two processes.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor

from extproc.decision.admission import Outcome
from extproc.decision.learning import PoolLearning
from extproc.decision.step import Admission, capacity_for, longest_alone
from extproc.sim import families, policies
from extproc.sim.run import Simulation, simulate
from extproc.sim.workload import Job

MEASURED = PoolLearning.engine_speed
PEERS = ("naive", "saturation")
Cell = tuple[str, str, float, int]


def _unmeasured(self: PoolLearning, ttft_ms: float, itl_ms: float, now: float) -> None:
    """No engine metrics: no measured speed, so no cancelled stream counts."""


def default(cell: Cell, measured: bool) -> tuple[float, float, float, float]:
    """(goodput, attainment, mean predicted unavoidable chance, true share) of the default."""
    family, fleet, load, seed = cell
    PoolLearning.engine_speed = MEASURED if measured else _unmeasured  # type: ignore[method-assign]
    sim = Simulation(families.draw(family, seed, load, fleet).scenario, policies.make("default"))
    seen = [0, 0.0, 0]

    def record(job: Job, _: object, adm: Admission) -> None:
        if adm.outcome is not Outcome.ADMIT:
            return
        capacity = capacity_for(sim.pool, max(1, len(sim.ready)), sim.learning)
        seen[0] += 1
        seen[1] += adm.unavoidable
        seen[2] += job.output_tokens > longest_alone(adm.cost, capacity, adm.policy)

    sim.on_decision = record
    result = sim.run()
    n = max(seen[0], 1)
    return result.goodput, result.attainment, seen[1] / n, seen[2] / n


def peer(cell: Cell, policy: str) -> float:
    family, fleet, load, seed = cell
    return simulate(families.draw(family, seed, load, fleet).scenario,
                    policies.make(policy)).goodput


def run(job: tuple[Cell, str]) -> object:
    cell, what = job
    if what in PEERS:
        return peer(cell, what)
    return default(cell, what == "on")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default="output-tail,reasoning,bimodal")
    parser.add_argument("--fleets", default="70b-16,70b-vllm,8b-vllm")
    parser.add_argument("--loads", default="0.8,1.5,3")
    parser.add_argument("--seeds", default="1")
    args = parser.parse_args()
    cells = [(f, fl, float(load), int(seed)) for f in args.families.split(",")
             for fl in args.fleets.split(",") for load in args.loads.split(",")
             for seed in args.seeds.split(",")]
    jobs = [(cell, what) for cell in cells for what in ("on", "off", *PEERS)]
    with ProcessPoolExecutor(2) as pool:
        out = dict(zip(jobs, pool.map(run, jobs), strict=True))
    print("default with the engines' measured speed (on) and without (off): goodput / the"
          " better peer's, attainment, the admitted requests' predicted unavoidable chance /"
          " the share of them too long to finish alone")
    print(f"{'cell':32} {'on/off':>7} {'d/peer off -> on':>17} {'attainment off -> on':>21}"
          f" {'unavoidable/true off -> on':>27}")
    for cell in cells:
        on, off = out[(cell, "on")], out[(cell, "off")]
        assert isinstance(on, tuple) and isinstance(off, tuple)
        better = max(float(out[(cell, p)]) for p in PEERS)  # type: ignore[arg-type]
        name = f"{cell[0]}/{cell[1]}/{cell[2]:g}x/s{cell[3]}"
        print(f"{name:32} {on[0] / max(off[0], 1e-9):7.3f} {off[0] / better:8.3f} ->"
              f"{on[0] / better:6.3f} {100 * off[1]:9.1f} % ->{100 * on[1]:5.1f} %"
              f"   {off[2]:.3f}/{off[3]:.3f} -> {on[2]:.3f}/{on[3]:.3f}")


if __name__ == "__main__":
    main()
