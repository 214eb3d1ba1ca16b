"""What priorities and fair shares cost in issue 27's goodput rule, and what they buy.

The do-no-harm rule (``extproc.sim.evaluate.harm``) sets the default's goodput against the
better of naive slot counting and the saturation detector, and neither of those knows a
priority or a tenant. On the ``priority`` and ``noisy-neighbour`` families the default keeps
room for critical requests and for the tenant under its share (``extproc.decision.share``); this
runs each cell as drawn and again with every request's priority and tenant cleared (the same jobs,
the same seed), side by side, so a loss that is the protection's price shows as the gap between
the two, and what it buys as the protected group's completions in time.

Usage::

    python benchmarks/protection.py [--cells priority/70b-16/1.5,...]

The default cells are the family cells that fail the goodput rule on the landed decision
(``docs/admission.md``); about a minute on two processes.
"""

from __future__ import annotations

import argparse
import dataclasses
from concurrent.futures import ProcessPoolExecutor

from extproc.sim import families, policies
from extproc.sim.run import simulate

CELLS = ("priority/70b-16/0.8,priority/70b-16/1.5,priority/70b-16/3,priority/70b-vllm/0.8,"
         "noisy-neighbour/70b-16/1.5,noisy-neighbour/70b-vllm/1.5,noisy-neighbour/70b-vllm/3")
PROTECTED = {"priority": "p:1", "noisy-neighbour": "t:a"}  # critical; the steady tenant
PEERS = ("naive", "saturation")


def run(job: tuple[str, str, float, str, bool]) -> tuple[float, float, int]:
    """(goodput, attainment, the protected group's completions in time) of one policy."""
    family, fleet, load, policy, blind = job
    scenario = families.draw(family, 0, load, fleet).scenario
    if blind:
        scenario = dataclasses.replace(scenario, jobs=[
            dataclasses.replace(j, priority=None, tenant=None) for j in scenario.jobs])
    result = simulate(scenario, policies.make(policy))
    group = result.groups.get(PROTECTED[family])
    return result.goodput, result.attainment, group.good if group else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", default=CELLS, help="family/fleet/load, comma-separated")
    args = parser.parse_args()
    cells = [(f, fl, float(load)) for f, fl, load in (c.split("/") for c in args.cells.split(","))]
    runs = [(*cell, policy, blind) for cell in cells
            for policy, blind in (*((p, False) for p in PEERS), ("default", False),
                                  ("default", True))]
    with ProcessPoolExecutor(2) as pool:
        out = dict(zip(runs, pool.map(run, runs), strict=True))
    print("default goodput / the better peer's, as drawn and with priorities and tenants"
          " cleared; the protected group's completions in time (critical, or the steady tenant)")
    print(f"{'cell':28} {'as drawn':>16} {'cleared':>16} {'protected: default':>19}"
          f" {'naive':>6}")
    for cell in cells:
        peers = [out[(*cell, p, False)] for p in PEERS]
        better = max(g for g, _, _ in peers)
        drawn, cleared = out[(*cell, "default", False)], out[(*cell, "default", True)]
        name = "/".join((cell[0], cell[1], f"{cell[2]:g}x"))
        print(f"{name:30} {drawn[0] / better:6.3f} ({drawn[1]:6.1%}) "
              f"{cleared[0] / better:6.3f} ({cleared[1]:6.1%}) {drawn[2]:>19} "
              f"{out[(*cell, 'naive', False)][2]:>6}")


if __name__ == "__main__":
    main()
