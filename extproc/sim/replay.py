"""``extproc replay``: a workload, the policies side by side, the table, a JSON summary, plots.

The workload is a built-in scenario (``--scenario incident``) or a file (``--trace``): an Azure
trace CSV, our JSONL, or a decision log recorded by ``extproc serve`` (shadow mode shows what
enforcing would have done to that traffic). For a file the fleet is the first pool of
``--config`` (the gateway's own configuration: replicas, cost model, classes), or the
defaults; ``--replicas`` overrides its size; ``--scale X`` replays at X times the fleet's
capacity, ``--rate-x X`` at X times the file's own rate.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from extproc import config as config_mod
from extproc.errors import ConfigError
from extproc.sim import report, scenarios, workload
from extproc.sim.clients import ClientModel
from extproc.sim.policies import POLICIES
from extproc.sim.scenarios import AS_RECORDED, Fleet, Rate, Scenario

DEFAULT_POLICIES = ("none", "naive", "article", "default", "oracle")


@dataclass(frozen=True)
class Trace:
    """A file to replay (``--trace``): its format (None: sniffed from its first line), the
    gateway's configuration it is replayed against (None: the defaults), the fleet's size
    (None: the configuration's pool's), the ``max_tokens`` sent with Azure rows and the
    clients' timeout."""

    path: str
    fmt: str | None = None
    config: config_mod.Config | None = None
    replicas: int | None = None
    max_tokens: int | None = None
    timeout_s: float = 60.0


def from_file(trace: Trace, *, rate: Rate = AS_RECORDED, seed: int = 0) -> Scenario:
    """The trace replayed against the configuration's pool: the gateway is that configuration,
    every key of it (classes, ``infeasible``, ``retry_after``, the pool's engine, prior and
    wait quantile, ...); keys that only concern the gateway's I/O (listeners, ledger
    connection, tracing, tenants) do not change a decision. What the simulator cannot
    honour is refused: more than one pool (it simulates one fleet)."""
    config = trace.config or config_mod.from_mapping({})
    if len(config.pools) > 1:
        raise ConfigError([f"pools: replay simulates one pool; the configuration has"
                           f" {len(config.pools)} ({', '.join(p.name for p in config.pools)})"
                           " -- give a configuration with the pool to replay"])
    jobs = workload.load(trace.path, trace.fmt, max_tokens=trace.max_tokens)
    if not jobs:
        raise ConfigError([f"{trace.path}: no requests"])
    pool = config.pools[0]
    if trace.replicas is not None:
        pool = dataclasses.replace(pool, replicas=trace.replicas)
    if pool.replicas < 1:
        raise ConfigError([f"pools[0].replicas: must be >= 1 to replay (got {pool.replicas})"])
    unknown = sorted({j.service_class for j in jobs} - set(config.classes))
    if unknown:
        raise ConfigError([f"classes: the trace's class {c!r} is not configured"
                           for c in unknown])
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(trace.path).stem)
    sc = scenarios.replay(name, jobs, fleet=Fleet(pool.replicas, pool.engine), rate=rate,
                          clients=ClientModel(timeout_s=trace.timeout_s), seed=seed,
                          classes={c: {} for c in config.classes})
    return dataclasses.replace(sc, config=dataclasses.replace(config, pools=(pool,)))


def run(source: Trace | str, *, rate: Rate = AS_RECORDED, seed: int = 0, fleet_scale: float = 1.0,
        policies: Sequence[str] = DEFAULT_POLICIES, out: str | None = None,
        progress: bool = True, stream: TextIO | None = None) -> int:
    """Replay ``source`` (a trace file, or a built-in scenario's name: ``fleet_scale``
    shrinks its fleet and traffic together, ``rate.load`` is its load) under each policy."""
    stream = stream if stream is not None else sys.stdout
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ConfigError([f"policies: unknown {', '.join(unknown)}"
                           f" (choose from {', '.join(POLICIES)})"])
    if isinstance(source, Trace):
        sc = from_file(source, rate=rate, seed=seed)
    else:
        sc = scenarios.builtin(source, seed=seed, load=rate.load or 1.5,
                               fleet_scale=fleet_scale)
    bar = (lambda label: report.Progress(label)) if progress else None
    results = report.compare(sc, policies, progress=bar)
    stream.write(report.table(sc, results) + "\n")
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        report.write_summary(folder / f"{sc.name}.json", report.summary(sc, results))
        stream.write(f"wrote {folder / (sc.name + '.json')}\n")
        try:
            report.plot(sc, results, folder / f"{sc.name}.png")
        except ImportError:
            stream.write("no plot: matplotlib is not installed"
                         " (pip install 'envoy-llm-admission[sim]')\n")
        else:
            stream.write(f"wrote {folder / (sc.name + '.png')}\n")
    return 0
