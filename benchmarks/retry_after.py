"""The Retry-After the default sends, beside how far the pool stood above its measured level.

For each cell (``family/fleet/load/seed``), the default policy runs once and every 429 its step
decides is read: the hint it carries (the decision's ``retry_after_ms``, before the gateway's
floor, jitter and cap), and the pool's outstanding work with the request, less the measured
level's room, per ready replica (``extproc.decision.level``): the work that has to end before the
level would let the request in, and how long that work takes to end at the rate the replicas'
batch retires it (a request's charge is its share of a full batch: a batch of ``b`` sequences
of ``S`` retires ``b x step(S) / (S x step(b))`` ms of charge a ms). Printed per refusal
reason: p10, p50 and p90 of the hint and of that time (negative: the pool stood below the
level; another check refused). The figures ``docs/admission.md`` ("Retry-After where the
level admits") gives.

Usage::

    python benchmarks/retry_after.py [CELL ...]

One cell takes a few CPU-seconds; the defaults are four.
"""

from __future__ import annotations

import sys
from collections import defaultdict

from extproc.decision.admission import Snapshot
from extproc.decision.step import Admission, capacity_for
from extproc.sim import families, policies
from extproc.sim.result import quantile
from extproc.sim.run import Simulation
from extproc.sim.workload import Job

CELLS = ("multi-turn/70b-vllm/0.8/0", "priority/70b-vllm/0.8/0", "bimodal/70b-vllm/1.5/2",
         "class-mix/70b-vllm/0.8/0")


def refusals(cell: str) -> dict[str, list[tuple[float, float]]]:
    """Per reason: each 429's hint and the time the pool's work above the level takes to end
    (ms)."""
    family, fleet, load, seed = cell.split("/")
    drawn = families.draw(family, int(seed), float(load), fleet, 1.0)
    sim: Simulation | None = None
    seen: dict[str, list[tuple[float, float]]] = defaultdict(list)

    def record(job: Job, snapshot: Snapshot, admission: Admission) -> None:
        decision = admission.decision
        if admission.runs or decision is None or sim is None:
            return
        replicas = max(1, len(sim.ready))
        capacity = capacity_for(sim.pool, replicas, sim.learning)
        full = float(capacity.batch)
        batch = min(full, max(1.0, snapshot.inflight / replicas))
        retired = batch * capacity.step_ms(full) / (full * capacity.step_ms(batch))
        above = (snapshot.outstanding_ms + decision.charge_ms
                 - sim.learning.level.level_ms * replicas) / replicas
        seen[admission.reason.value].append((decision.retry_after_ms or 0.0, above / retired))

    sim = Simulation(drawn.scenario, policies.make("default"), on_decision=record)
    sim.run()
    return seen


def main(cells: list[str]) -> None:
    print(f"{'cell':28} {'reason':12} {'429s':>6}  hint ms p10 / p50 / p90"
          "       to the level, ms p10 / p50 / p90")
    for cell in cells:
        for reason, rows in sorted(refusals(cell).items()):
            hints = [h for h, _ in rows]
            above = [a for _, a in rows]
            print(f"{cell:28} {reason:12} {len(rows):6d}  "
                  + " / ".join(f"{quantile(hints, q):7.0f}" for q in (0.1, 0.5, 0.9))
                  + "   " + " / ".join(f"{quantile(above, q):7.0f}" for q in (0.1, 0.5, 0.9)))


if __name__ == "__main__":
    main(sys.argv[1:] or list(CELLS))
