"""What the priority room costs and what it buys: the priority family with and without it.

The room is the headroom a lower priority's request leaves for the higher priorities' expected
arrivals (``extproc.decision.contention.room_for_others``, ``_kept``). Without it is a what-if,
not a setting: in this process only, ``_kept`` keeps no place. For each cell of the priority
family (``extproc.sim.families.priority``: critical, standard and sheddable chat traffic) the
default policy runs twice, and the table gives its goodput without the room over with it, and
the critical jobs served in time each way, of those that arrived. The figures
``docs/admission.md`` ("Brakes, floors and the priority room's price") and the README give.

Usage::

    python benchmarks/priority_room.py [--fleets 70b-16,70b-vllm,8b-vllm]
        [--loads 0.8,1.5,3] [--seeds 0,1,2]

About 2 CPU-minutes for the whole table; two processes.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor

from extproc.decision import contention
from extproc.decision.share import CRITICAL, priority_group
from extproc.sim import families, policies
from extproc.sim.run import simulate

Cell = tuple[str, float, int]
Run = tuple[float, int]  # goodput, critical jobs served in time


def run(cell: Cell, room: bool) -> Run:
    fleet, load, seed = cell
    scenario = families.draw("priority", seed, load, fleet).scenario
    kept = contention._kept
    if not room:
        contention._kept = lambda *args, **kwargs: 0
    try:
        result = simulate(scenario, policies.make("default"))
    finally:
        contention._kept = kept
    return result.goodput, result.tally(priority_group(CRITICAL)).good


def both(cell: Cell) -> tuple[Run, Run, int]:
    """The cell with the room and without it, and its critical jobs."""
    scenario = families.draw("priority", cell[2], cell[1], cell[0]).scenario
    critical = sum(1 for j in scenario.jobs if j.priority == CRITICAL)
    return run(cell, True), run(cell, False), critical


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleets", default="70b-16,70b-vllm,8b-vllm")
    parser.add_argument("--loads", default="0.8,1.5,3")
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    cells = [(fleet, float(load), int(seed)) for fleet in args.fleets.split(",")
             for load in args.loads.split(",") for seed in args.seeds.split(",")]
    with ProcessPoolExecutor(2) as pool:
        results = list(pool.map(both, cells))
    print(f"{'cell':24s} {'goodput with':>12s} {'without':>8s} {'ratio':>6s}"
          f" {'critical in time with / without / jobs':>40s}")
    for (fleet, load, seed), ((good, crit), (bare, crit_bare), jobs) in zip(
            cells, results, strict=True):
        print(f"{fleet + ' ' + format(load, 'g') + 'x s' + str(seed):24s} {good:12.2f}"
              f" {bare:8.2f} {bare / good:6.3f} {crit:>24d} / {crit_bare:5d} / {jobs:5d}")
    gains = sum(1 for (g, _), (b, _), _ in results if b > 1.03 * g)
    losses = sum(1 for (g, _), (b, _), _ in results if b < 0.97 * g)
    print(f"without the room: goodput more than 3 % higher in {gains} of {len(cells)} cells,"
          f" more than 3 % lower in {losses}")


if __name__ == "__main__":
    main()
