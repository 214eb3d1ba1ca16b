"""A steady tenant beside a neighbour's burst: what it keeps of its goodput alone.

The noisy-neighbour family (``extproc.sim.families``): tenant ``a`` steady, tenant ``b``
bursting to about 10x. For each fleet, load and seed, the default policy runs the cell twice,
with both tenants and with ``a`` alone, and counts ``a``'s requests that arrived during the
burst and were served in time, over the same count alone. Two counts: served in time on any
attempt (a request refused and served on its client's retry counts, as the simulator's
goodput does), and served within its deadline of its first attempt (what its user saw).
The figures ``docs/admission.md`` ("The fair share's room") and the README give.

Usage::

    python benchmarks/steady_tenant.py [--fleets 70b-16,8b-vllm,70b-vllm]
        [--loads 0.8,1.5,3] [--seeds 0,1,2,3,4] [--size 1.0]

About 5 CPU-minutes for the whole table at full length; two processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor

from extproc.sim import families, policies
from extproc.sim.run import simulate
from extproc.sim.scenarios import Scenario

Cell = tuple[str, float, int, float]


def served(scenario: Scenario, start_s: float, end_s: float) -> tuple[int, int]:
    """Tenant ``a``'s jobs arriving in ``[start_s, end_s)``: how many were served in time on
    any attempt, and how many within their deadline of their first attempt."""
    good = simulate(scenario, policies.make("default")).tally("t:a").good_jobs
    inside = [first for arrival, first in good if start_s <= arrival < end_s]
    return len(inside), sum(inside)


def kept(cell: Cell) -> tuple[float, float]:
    """``a``'s two counts beside the burst over alone."""
    fleet, load, seed, size = cell
    drawn = families.draw("noisy-neighbour", seed, load, fleet, size)
    window = float(drawn.params["burst_from_s"]), float(drawn.params["burst_to_s"])
    both = served(drawn.scenario, *window)
    alone = served(dataclasses.replace(
        drawn.scenario, jobs=[j for j in drawn.scenario.jobs if j.tenant == "a"]), *window)
    return both[0] / max(alone[0], 1), both[1] / max(alone[1], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleets", default="70b-16,8b-vllm,70b-vllm")
    parser.add_argument("--loads", default="0.8,1.5,3")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--size", type=float, default=1.0)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = [(fleet, float(load)) for fleet in args.fleets.split(",")
            for load in args.loads.split(",")]
    cells = [(fleet, load, seed, args.size) for fleet, load in rows for seed in seeds]
    with ProcessPoolExecutor(2) as pool:
        results = dict(zip(cells, pool.map(kept, cells), strict=True))
    print(f"{'fleet, load':16s} {'any attempt: mean (lowest)':>28s}"
          f" {'first attempt: mean (lowest)':>30s}")
    every = []
    for fleet, load in rows:
        got = [results[(fleet, load, seed, args.size)] for seed in seeds]
        every += got
        print(f"{fleet + ' ' + format(load, 'g') + 'x':16s} {_column(g[0] for g in got)}"
              f" {_column(g[1] for g in got)}")
    print(f"{'all':16s} {_column(g[0] for g in every)} {_column(g[1] for g in every)}")


def _column(values: Iterable[float]) -> str:
    got = list(values)
    return f"{statistics.mean(got):20.3f} ({min(got):.3f})"


if __name__ == "__main__":
    main()
