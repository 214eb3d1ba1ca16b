"""The evaluation matrix: the product against its baselines on workloads nobody tuned it to.

**Cells** are family x load x seed x fleet (``families.FAMILIES``, ``LOADS``, seeds ``0..n-1``,
``families.FLEETS``). A family's parameters are drawn per seed (``extproc.sim.families``), so
no constant of the policy can be fitted to one draw. In each cell the same scenario runs under
each policy of ``extproc.sim.policies``: ``naive``, ``saturation``, ``default``, ``oracle``
(``none`` only when asked), and ``tuned``, the best static concurrency limit for that very
cell in hindsight::

    tuned = limit-N*   with   N* = argmax over N of goodput(limit-N)

found by a sweep (``tune``): a geometric grid ``1, 2, 4, ...`` up to the engine's limit ``U``
(``min(max_num_seqs, KV tokens / mean prompt)``: the sequences its slots, or its cache at the
cell's prompt lengths, can hold), then one round of refinement at the geometric midpoints
between the best N and its tried neighbours. The grid stops early where a limit never bound
(no 429: every larger N runs the very same simulation) or after two points in a row that do
not beat the best so far (past the peak, or on its plateau). ``tuned`` is the largest
goodput of every N tried; the record keeps them all.

**Targets** the default is held to in every cell; a cell that misses one is a *loss*::

    goodput(default) >= goodput(naive)
    goodput(default) >= goodput(saturation)
    goodput(default) >= 0.95 x goodput(tuned)
    attainment(default) >= 99%              wherever attainment(oracle) >= 99%

**Do no harm** (issue 27; ``harm``): the rules an operator's plain limit holds the default
to, against the better of the untuned peers, naive and saturation, in every cell::

    goodput(default)    >= 0.97 x max(goodput(naive), goodput(saturation))
    attainment(default) >= min(99%, max(attainment(naive), attainment(saturation))) - 0.5 pt
    refusing work an idle replica would do (``Result.refused_idle_s``) <= 2% of the run

**Output**: a table on stdout, one row per cell (each policy's goodput, the default's
attainment, its goodput over each baseline's, the targets it loses and the do-no-harm rules it
breaks), losses first, worst first; a summary (how many cells meet each target and each
do-no-harm rule, the median of default/oracle, the elapsed time); ``matrix.json``
(every cell: drawn parameters, each policy's goodput, attainment, admitted, rejected, p99
latency, the sweep); ``matrix.png`` (a heatmap of the ratios and the attainment, rows in the
table's order). The ratios, losses and harms in the JSON are ``score``'s, computed from the
goodputs and attainments stored next to them.

**Cost.** Cells run in worker processes (``spawn``, one per core by default); a cell is one
process's work, deterministic (the scenario depends only on the cell, the simulator only on the
scenario). ``--reduced`` runs each family once (load 1.5, seed 0, the 16-slot fleet, runs at a
quarter of the usual size): about 20-45 s on 2 cores. The full matrix (10 families x 3 loads x
3 fleets x 1 seed, 90 cells, ~11 simulations each) took 925 s on the 2-core machine, 1,834
CPU-seconds: 8b-vllm's cells are the most of it (its batches are the largest, so each request
costs the most to simulate), then the incident's. Families size their runs for that budget
(``families.BUDGET``); a second seed doubles it.

**Autoscaling** (``autoscale``, ``extproc eval --autoscale``): the time-varying families
(``families.TIME_VARYING``) at load 1 on the 16-slot fleet, behind the default admission
policy, with each autoscaler of ``autoscaler.AUTOSCALERS`` between 1 and 3x the fleet's
replicas (starting at the fleet's), replicas ready ``AUTOSCALE_PROVISIONING_S`` after the ask
(the incident keeps its own, compressed with its timeline); scored on goodput and
replica-minutes together (good completions per replica-minute).

Length: past the house's ~400 lines with the matrix's three stages in one place (cells and
the tuned sweep, scoring against the targets, the report and plots); the autoscaling runs at
the end are the first to move out if it grows.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from extproc.sim import autoscaler as autoscaler_mod
from extproc.sim import families, report, scenarios
from extproc.sim.policies import make
from extproc.sim.run import simulate

if TYPE_CHECKING:
    from extproc.sim.result import Result
    from extproc.sim.scenarios import Scenario

LOADS = (0.8, 1.5, 3.0)
POLICIES = ("naive", "saturation", "default", "oracle", "tuned")
BASELINES = ("naive", "saturation", "tuned", "oracle")  # default/X ratios, in this order
TUNED_SHARE = 0.95  # default must reach this share of tuned's goodput
ATTAINMENT = 0.99
REFUSED_IDLE = 0.02  # of the run: refusing work an idle replica would have done (issue 27;
# ``Result.refused_idle_s``)
PEERS = ("naive", "saturation")  # the untuned limits an operator would otherwise run
HARM_SHARE = 0.97  # do no harm: the default's goodput at least this share of the better peer's
HARM_SLACK = 0.005  # ... and its attainment at most this far under min(99 %, the better's)
REDUCED_LOAD, REDUCED_FLEET, REDUCED_SIZE = 1.5, "70b-16", 0.25
AUTOSCALE_LOAD, AUTOSCALE_FLEET, AUTOSCALE_SIZE = 1.0, "70b-16", 3.0
AUTOSCALE_PROVISIONING_S = 180.0  # a replica whose weights are cached on its node

Record = dict[str, Any]


@dataclass(frozen=True)
class Cell:
    family: str
    load: float
    seed: int
    fleet: str
    size: float = 1.0

    @property
    def key(self) -> str:
        return f"{self.family}/{self.fleet}/{self.load:g}x/s{self.seed}"


def cells(family_names: Sequence[str], loads: Sequence[float], seeds: int,
          fleets: Sequence[str], size: float = 1.0) -> list[Cell]:
    return [Cell(f, load, s, fl, size) for f in family_names for fl in fleets for load in loads
            for s in range(seeds)]


# ---- one cell -----------------------------------------------------------------------------

def figures(r: Result) -> Record:
    """What the matrix keeps of a run (goodput: good completions in span / span)."""
    p99 = r.latency(0.99)
    return {"goodput": round(r.goodput, 6), "good": r.good_in_span,
            "attainment": round(r.attainment, 6), "admitted": r.admitted,
            "rejected": r.rejected, "jobs_shed": r.jobs_shed,
            "refused_idle_share": round(r.refused_idle_s / r.span_s, 5) if r.span_s else 0.0,
            "p99_latency_s": None if math.isinf(p99) or math.isnan(p99) else round(p99, 3)}


def upper_limit(scenario: Scenario) -> int:
    """The sweep's top: ``min(max_num_seqs, KV tokens / mean prompt)`` per replica."""
    engine = scenario.engine
    jobs = scenario.jobs
    if not engine.kv_tokens or not jobs:
        return engine.max_num_seqs
    mean_prompt = sum(j.prompt_tokens for j in jobs) / len(jobs)
    return max(1, min(engine.max_num_seqs, int(engine.kv_tokens / mean_prompt)))


def tune(scenario: Scenario, upper: int) -> tuple[int, dict[int, Record]]:
    """The best ``limit-N`` in hindsight (module docstring): ``(N*, every N tried)``."""
    tried: dict[int, Record] = {}

    def run(n: int) -> Record:
        if n not in tried:
            tried[n] = figures(simulate(scenario, make(f"limit-{n}")))
        return tried[n]

    grid = sorted({min(upper, 2 ** k) for k in range(upper.bit_length() + 1)})
    best, stale = grid[0], 0
    for n in grid:
        if run(n)["goodput"] > tried[best]["goodput"] or n == best:
            best, stale = n, 0
        else:
            stale += 1
        if tried[n]["rejected"] == 0 or stale >= 2:
            break  # never bound (any larger N is this run), or past the peak
    below = max((n for n in tried if n < best), default=None)
    above = min((n for n in tried if n > best), default=None)
    for a, b in ((below, best), (best, above)):
        if a is not None and b is not None and round(math.sqrt(a * b)) not in tried:
            run(round(math.sqrt(a * b)))
    best = max(tried, key=lambda n: (tried[n]["goodput"], -n))
    return best, tried


def run_cell(cell: Cell, policies: Sequence[str] = POLICIES) -> Record:
    """Every policy on the cell's scenario; the record ``matrix.json`` holds."""
    started, cpu = time.monotonic(), time.process_time()
    drawn = families.draw(cell.family, cell.seed, cell.load, cell.fleet, cell.size)
    sc = drawn.scenario
    results: dict[str, Record] = {}
    for name in policies:
        if name != "tuned":
            results[name] = figures(simulate(sc, make(name)))
    record: Record = {
        "cell": cell.key, "family": cell.family, "fleet": cell.fleet, "load": cell.load,
        "seed": cell.seed, "size": cell.size, "params": drawn.params, "jobs": len(sc.jobs),
        "span_s": round(sc.span_s, 3), "description": sc.description, "policies": results,
    }
    if "tuned" in policies:
        upper = upper_limit(sc)
        best, tried = tune(sc, upper)
        results["tuned"] = {**tried[best], "limit": best}
        record["tuned"] = {"limit": best, "upper": upper,
                           "tried": {str(n): tried[n]["goodput"] for n in sorted(tried)}}
    record["wall_s"] = round(time.monotonic() - started, 2)
    record["cpu_s"] = round(time.process_time() - cpu, 2)  # the cell's cost, shared CPU or not
    record.update(score(record))
    return record


# ---- scoring ------------------------------------------------------------------------------

def _ratio(a: float, b: float) -> float | None:
    """a / b; 1 when both are 0; None (no ratio: a gain from nothing) when only b is."""
    if b > 0:
        return round(a / b, 4)
    return 1.0 if a <= 0 else None


def score(record: Record) -> Record:
    """The ratios ``default/X`` and the targets missed (``losses``), from the goodputs and
    attainments in ``record["policies"]`` alone."""
    pol = record["policies"]
    d = pol["default"]
    ratios = {f"default/{b}": _ratio(d["goodput"], pol[b]["goodput"])
              for b in BASELINES if b in pol}
    losses = [b for b in ("naive", "saturation") if b in pol
              and d["goodput"] < pol[b]["goodput"]]
    if "tuned" in pol and d["goodput"] < TUNED_SHARE * pol["tuned"]["goodput"]:
        losses.append("tuned")
    if "oracle" in pol and pol["oracle"]["attainment"] >= ATTAINMENT > d["attainment"]:
        losses.append("attainment")
    return {"ratios": ratios, "losses": losses, "harm": harm(pol)}


def harm(pol: Record) -> list[str]:
    """The do-no-harm rules (issue 27) the default breaks in one cell, against the better of
    the untuned peers (``PEERS``, those run)::

        goodput     default < HARM_SHARE x max(goodput of the peers)
        attainment  default < min(ATTAINMENT, max(attainment of the peers)) - HARM_SLACK
        idle        refusing work an idle replica would do > REFUSED_IDLE of the run

    Empty when no peer ran."""
    d = pol["default"]
    peers = [pol[p] for p in PEERS if p in pol]
    if not peers:
        return []
    broken = []
    if d["goodput"] < HARM_SHARE * max(p["goodput"] for p in peers):
        broken.append("goodput")
    if d["attainment"] < min(ATTAINMENT, max(p["attainment"] for p in peers)) - HARM_SLACK:
        broken.append("attainment")
    if d.get("refused_idle_share", 0.0) > REFUSED_IDLE:
        broken.append("idle")
    return broken


def _margin(record: Record) -> float:
    """How badly a cell loses: its worst goodput ratio against a target (1: on the line)."""
    r = record["ratios"]
    worst = [v for k, v in r.items() if k in ("default/naive", "default/saturation")
             and v is not None]
    if r.get("default/tuned") is not None:
        worst.append(r["default/tuned"] / TUNED_SHARE)
    if "attainment" in record["losses"]:
        worst.append(record["policies"]["default"]["attainment"] / ATTAINMENT)
    return min(worst, default=1.0)


def ordered(records: Iterable[Record]) -> list[Record]:
    """Losing cells first, worst first; then the rest in matrix order."""
    fam = {f: i for i, f in enumerate(families.FAMILIES)}
    flt = {f: i for i, f in enumerate(families.FLEETS)}

    def natural(r: Record) -> tuple[int, int, float, int]:
        return fam.get(r["family"], 99), flt.get(r["fleet"], 99), r["load"], r["seed"]

    rs = list(records)
    losing = sorted((r for r in rs if r["losses"]), key=lambda r: (_margin(r), natural(r)))
    rest = sorted((r for r in rs if not r["losses"]), key=natural)
    return losing + rest


def summary(records: Sequence[Record]) -> Record:
    n = len(records)
    has = [r for r in records if "oracle" in r["policies"]]
    strict = [r for r in has if r["policies"]["oracle"]["attainment"] >= ATTAINMENT]

    def meets(target: str) -> int:
        return sum(1 for r in records if target not in r["losses"])

    oracle = [r["ratios"]["default/oracle"] for r in records
              if r["ratios"].get("default/oracle") is not None]
    out: Record = {"cells": n}
    for b in ("naive", "saturation", "tuned"):
        if any(b in r["policies"] for r in records):
            out[f">= {b}" if b != "tuned" else f">= {TUNED_SHARE:g} x tuned"] = meets(b)
    out["attainment cells"] = len(strict)
    out["attainment met"] = sum(1 for r in strict if "attainment" not in r["losses"])
    out["all targets"] = sum(1 for r in records if not r["losses"])
    out["median default/oracle"] = round(statistics.median(oracle), 4) if oracle else None
    judged = [r for r in records if any(p in r["policies"] for p in PEERS)]
    if judged:
        out["no harm cells"] = len(judged)
        for rule in ("goodput", "attainment", "idle"):
            out[f"no harm: {rule}"] = sum(1 for r in judged if rule not in r.get("harm", ()))
        out["no harm: all three"] = sum(1 for r in judged if not r.get("harm"))
    out["cpu_s"] = round(sum(r.get("cpu_s", 0.0) for r in records), 1)
    return out


# ---- rendering ----------------------------------------------------------------------------

_COLS = ("naive", "saturation", "default", "oracle", "none")


def table(records: Sequence[Record]) -> str:
    """One row per cell, in ``ordered`` order."""
    rows = ordered(records)
    present = [c for c in _COLS if any(c in r["policies"] for r in rows)]
    tuned = any("tuned" in r["policies"] for r in rows)
    ratios = [b for b in BASELINES if any(f"default/{b}" in r["ratios"] for r in rows)]
    width = max((len(r["cell"]) for r in rows), default=10) + 2
    head = "cell".ljust(width) + "".join(c[:8].rjust(9) for c in present)
    head += "  tuned(N)" if tuned else ""
    head += "  attain" + "".join(f"d/{b[:5]}".rjust(9) for b in ratios) + "  loses  harms"
    lines = [head]
    for r in rows:
        pol = r["policies"]
        line = r["cell"].ljust(width)
        line += "".join(f"{pol[c]['goodput']:9.3f}" if c in pol else "        -"
                        for c in present)
        if tuned:
            t = pol.get("tuned")
            line += f"{t['goodput']:7.3f}({t['limit']})".rjust(10) if t else "         -"
        line += f"{100 * pol['default']['attainment']:7.2f}%"
        line += "".join("      inf" if r["ratios"].get(f"default/{b}") is None
                        else f"{r['ratios'][f'default/{b}']:9.3f}" for b in ratios)
        line += "  " + (",".join(r["losses"]) or "-") + "  " + (",".join(r.get("harm", ())) or "-")
        lines.append(line)
    return "\n".join(lines)


def summary_text(s: Record, elapsed_s: float, workers: int) -> str:
    n = s["cells"]
    lines = [f"cells: {n}"]
    for key in (k for k in s if k.startswith(">=")):
        lines.append(f"  default goodput {key}: {s[key]}/{n}")
    lines.append(f"  attainment >= {100 * ATTAINMENT:g}% where oracle's is:"
                 f" {s['attainment met']}/{s['attainment cells']}")
    lines.append(f"  every target: {s['all targets']}/{n}")
    lines.append(f"  median default/oracle: {s['median default/oracle']}")
    if "no harm cells" in s:
        m = s["no harm cells"]
        lines.append(f"do no harm (issue 27), against the better of {' and '.join(PEERS)}:")
        lines.append(f"  goodput >= {HARM_SHARE:g}x: {s['no harm: goodput']}/{m}")
        lines.append(f"  attainment >= min({100 * ATTAINMENT:g}%, the better's)"
                     f" - {100 * HARM_SLACK:g} pt: {s['no harm: attainment']}/{m}")
        lines.append(f"  refusing while a replica is idle <= {100 * REFUSED_IDLE:g}% of the run:"
                     f" {s['no harm: idle']}/{m}")
        lines.append(f"  all three: {s['no harm: all three']}/{m}")
    lines.append(f"elapsed: {elapsed_s:.0f} s with {workers} worker(s),"
                 f" {s['cpu_s']:.0f} CPU-seconds in the cells")
    return "\n".join(lines)


def plot(records: Sequence[Record], path: str | os.PathLike[str]) -> None:
    rows = ordered(records)
    keys = [f"default/{b}" for b in BASELINES if any(f"default/{b}" in r["ratios"] for r in rows)]
    columns = [*keys, "attainment"]
    values = [[r["ratios"].get(k) for k in keys] + [r["policies"]["default"]["attainment"]]
              for r in rows]
    labels = [r["cell"] + ("  *" if r["losses"] else "") for r in rows]
    report.heatmap(labels, columns, values, path,
                   centres=[1.0] * len(keys) + [ATTAINMENT],
                   spans=[0.5] * len(keys) + [0.05],
                   formats=[".2f"] * len(keys) + [".3f"],
                   title="default against each baseline (goodput ratios) and its SLO"
                         " attainment; * = a target missed")


# ---- running many ---------------------------------------------------------------------------

T = TypeVar("T")
R = TypeVar("R")


def _pool_map(fn: Callable[[T], R], items: Sequence[T], workers: int, label: str,
              progress: bool) -> list[R]:
    """``fn`` over ``items`` in ``workers`` spawned processes (in this one for 1), in the
    items' order, with a progress bar on stderr."""
    bar = report.Progress(label) if progress else None
    done = 0
    out: list[R | None] = [None] * len(items)

    def tick() -> None:
        if bar is not None:
            bar.label = f"{label} {done}/{len(items)}"
            bar(done, len(items))

    tick()
    if workers <= 1:
        for i, item in enumerate(items):
            out[i] = fn(item)
            done += 1
            tick()
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futures: dict[Future[R], int] = {pool.submit(fn, item): i
                                             for i, item in enumerate(items)}
            for fut in as_completed(futures):
                out[futures[fut]] = fut.result()
                done += 1
                tick()
    if bar is not None:
        bar.label = f"{label} {done}/{len(items)}"
        bar.close()
    return [o for o in out if o is not None]


_FLEET_COST = {"8b-vllm": 3.0, "70b-vllm": 1.5}  # CPU per cell against 70b-16, measured
_FAMILY_COST = {"incident": 3.0, "diurnal": 1.5, "flash-crowd": 1.5}


def _cost(cell: Cell) -> float:
    """Longest first (a rough estimate), so the pool does not end on one slow cell."""
    return -(_FLEET_COST.get(cell.fleet, 1.0) * _FAMILY_COST.get(cell.family, 1.0) * cell.load)


@dataclass(frozen=True)
class _Job:
    cell: Cell
    policies: tuple[str, ...]


def _run_job(job: _Job) -> Record:
    return run_cell(job.cell, job.policies)


def matrix(todo: Sequence[Cell], policies: Sequence[str] = POLICIES, *, workers: int = 0,
           progress: bool = True) -> list[Record]:
    """Run every cell (``workers`` 0: one per core)."""
    workers = workers or os.cpu_count() or 1
    jobs = [_Job(c, tuple(policies)) for c in sorted(todo, key=_cost)]
    return _pool_map(_run_job, jobs, min(workers, len(jobs)) or 1, "eval", progress)


def write(records: Sequence[Record], folder: str | os.PathLike[str], meta: Record,
          text: str) -> list[Path]:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    data = {**meta, "summary": summary(records), "cells": ordered(records)}
    paths = [out / "matrix.json", out / "matrix.txt"]
    report.write_summary(paths[0], data)
    paths[1].write_text(text + "\n", encoding="utf-8")
    try:
        plot(records, out / "matrix.png")
        paths.append(out / "matrix.png")
    except ImportError:
        pass
    return paths


# ---- autoscaling --------------------------------------------------------------------------

@dataclass(frozen=True)
class ScaleRun:
    family: str
    seed: int
    fleet: str
    autoscaler: str
    load: float = AUTOSCALE_LOAD
    size: float = AUTOSCALE_SIZE
    policy: str = "default"


def run_scaled(run: ScaleRun) -> Record:
    fleet = families.FLEETS[run.fleet]
    drawn = families.draw(run.family, run.seed, run.load, fleet, run.size)
    top = 3 * fleet.replicas
    provisioning = (drawn.scenario.provisioning_s if run.family == "incident"
                    else AUTOSCALE_PROVISIONING_S)
    sc = dataclasses.replace(drawn.scenario, provisioning_s=provisioning,
                             autoscaler=scenarios._autoscaler(run.autoscaler, 1, top))
    r = simulate(sc, make(run.policy))
    replica_min = r.replica_s / 60.0
    return {"family": run.family, "seed": run.seed, "fleet": run.fleet, "load": run.load,
            "autoscaler": run.autoscaler, "policy": run.policy, "params": drawn.params,
            "span_s": round(sc.span_s, 1), "provisioning_s": round(provisioning, 1),
            **figures(r), "replica_min": round(replica_min, 2),
            "peak_replicas": r.peak_replicas,
            "good_per_replica_min": round(r.good_in_span / replica_min, 3) if replica_min else None}


def autoscale(family_names: Sequence[str] = families.TIME_VARYING, seeds: int = 1,
              fleet: str = AUTOSCALE_FLEET,
              autoscalers: Sequence[str] = autoscaler_mod.AUTOSCALERS, *, workers: int = 0,
              progress: bool = True, policies: Sequence[str] = ("default",),
              size: float = 1.0) -> list[Record]:
    """The autoscaling section's runs (``size`` scales their request budget, as the
    matrix's)."""
    runs = [ScaleRun(f, s, fleet, a, size=AUTOSCALE_SIZE * size, policy=p) for f in family_names
            for s in range(seeds) for a in autoscalers for p in policies]
    workers = workers or os.cpu_count() or 1
    return _pool_map(run_scaled, runs, min(workers, len(runs)) or 1, "autoscale", progress)


def autoscale_table(rows: Sequence[Record]) -> str:
    lines = [f"{'workload':26s}{'autoscaler':>12s}{'policy':>9s}{'goodput':>9s}{'attain':>9s}"
             f"{'replica-min':>13s}{'peak':>6s}{'good/replica-min':>18s}"]
    for r in rows:
        name = f"{r['family']}/{r['fleet']}/s{r['seed']}"
        lines.append(f"{name:26s}{r['autoscaler']:>12s}{r['policy']:>9s}{r['goodput']:9.3f}"
                     f"{100 * r['attainment']:8.2f}%{r['replica_min']:13.1f}"
                     f"{r['peak_replicas']:6d}{r['good_per_replica_min'] or 0:18.2f}")
    return "\n".join(lines)


# ---- the command --------------------------------------------------------------------------

@dataclass(frozen=True)
class Selection:
    """Which cells ``extproc eval`` runs: the families (None: every one), the fleets (None:
    every one; the reduced matrix and the autoscaling section take the first given), the
    loads (None: ``LOADS``) and seeds; ``reduced``: one small cell per family; ``size``: each
    run's request budget scaled (``extproc.sim.families``, "Size": a run never outgrows its
    family's nominal length, so a large size runs each at that length, where a controller
    that latches shows it)."""

    families: Sequence[str] | None = None
    fleets: Sequence[str] | None = None
    loads: Sequence[float] | None = None
    seeds: int = 1
    reduced: bool = False
    size: float = 1.0


EVERY_CELL = Selection()


def main(selection: Selection = EVERY_CELL, *, scale: bool = False,
         policies: Sequence[str] = POLICIES, workers: int = 0, out: str | None = "out/eval",
         progress: bool = True, stream: TextIO | None = None) -> int:
    """``extproc eval``: the matrix (or, with ``scale``, the autoscaling section)."""
    stream = stream if stream is not None else sys.stdout
    family_names, fleets, loads = selection.families, selection.fleets, selection.loads
    seeds, reduced = selection.seeds, selection.reduced
    chosen = list(family_names) if family_names else list(families.FAMILIES)
    unknown = [f for f in chosen if f not in families.FAMILIES]
    unknown += [f for f in fleets or () if f not in families.FLEETS]
    unknown += [p for p in policies if p not in ("tuned", "none") and not _known(p)]
    if unknown:
        raise ValueError(f"unknown: {', '.join(unknown)} (families: {', '.join(families.FAMILIES)};"
                         f" fleets: {', '.join(families.FLEETS)}; policies: {', '.join(POLICIES)},"
                         " none, limit-N)")
    if "default" not in policies:
        raise ValueError("policies: the matrix scores default; include it")
    for note in filter(None, map(families.missing, chosen)):
        stream.write(note + "\n")
    chosen = [f for f in chosen if families.missing(f) is None]
    started = time.monotonic()
    workers = workers or os.cpu_count() or 1
    if scale:
        fleet = (fleets or [AUTOSCALE_FLEET])[0]
        timed = [f for f in chosen if f in families.TIME_VARYING] if family_names is None \
            else chosen
        # the step's policies asked for (by default, the default alone): ``defer`` beside it
        # shows what holding costs in replicas
        scaled = [p for p in policies if p in ("default", "defer")]
        rows = autoscale(timed, seeds, fleet, workers=workers, progress=progress,
                         policies=scaled, size=selection.size)
        text = autoscale_table(rows)
        stream.write(text + f"\nelapsed: {time.monotonic() - started:.0f} s with {workers}"
                     " worker(s)\n")
        if out is not None:
            Path(out).mkdir(parents=True, exist_ok=True)
            report.write_summary(Path(out) / "autoscale.json", {"runs": rows})
            stream.write(f"wrote {Path(out) / 'autoscale.json'}\n")
        return 0
    if reduced:
        todo = [Cell(f, REDUCED_LOAD, 0, (fleets or [REDUCED_FLEET])[0],
                     REDUCED_SIZE * selection.size) for f in chosen]
    else:
        todo = cells(chosen, loads or LOADS, seeds, fleets or list(families.FLEETS),
                     selection.size)
    records = matrix(todo, policies, workers=workers, progress=progress)
    elapsed = time.monotonic() - started
    text = table(records) + "\n\n" + summary_text(summary(records), elapsed, workers)
    stream.write(text + "\n")
    if out is not None:
        meta = {"reduced": reduced, "seeds": seeds, "size": selection.size,
                "loads": list(loads or LOADS),
                "policies": list(policies), "workers": workers,
                "elapsed_s": round(elapsed, 1)}
        for path in write(records, out, meta, text):
            stream.write(f"wrote {path}\n")
    return 0


def _known(name: str) -> bool:
    try:
        make(name)
    except ValueError:
        return False
    return True
