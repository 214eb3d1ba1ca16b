"""A simulated run's input (``Scenario``: workload, fleet, configuration, clients) and the
built-in ones: the reference incident, trace replays at a chosen load, synthetic ones.

Load is stated against *fleet capacity*: the request rate a pool sustains with every replica's
batch full, from the GPU time one request costs there,

    gpu_ms     = mean prompt x prefill_per_token + mean output x itl(B) / B
    capacity   = replicas x 1000 / gpu_ms          requests per second

(the prefill runs alone; a decode step is shared by the ``B`` sequences of a full batch).
``--scale 3`` replays a trace at three times that rate by dividing its timestamps.

The incident (``incident``) reproduces the source article's 8 am story in numbers that hold
together for Llama-3.3-70B (docs/simulator.md explains each choice): 12 replicas of 16 slots,
short clinical summaries (prompt ~400 tokens, output ~24, max_tokens 96), a 4 s deadline
(SLO p95 ~2 s, so ``deadline x safety`` = 3.2 s), non-streaming clients that give up after
30 s and retry (the SDK's two retries), engines that finish abandoned work (they learn of the
disconnect only when they write the answer), and an HPA on GPU utilization that provisions a
replica in ~9 minutes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from extproc import config as config_mod
from extproc.errors import ConfigError
from extproc.fleet.engine import LLAMA_70B_FP8_2XH100, EngineModel
from extproc.sim import autoscaler as autoscaler_mod
from extproc.sim.clients import ClientModel
from extproc.sim.workload import (
    CONVERSATION,
    Job,
    LogNormal,
    Mix,
    RatePoint,
    on_off_arrivals,
    piecewise_arrivals,
    read_azure,
    synthetic,
)

if TYPE_CHECKING:
    from extproc.config import Config, Pool
    from extproc.sim.autoscaler import Recommender

# The classes of the product's default configuration (extproc.config.DEFAULT_CLASSES).
CHAT_CLASSES: dict[str, Any] = {
    "latency": {"deadline_ms": 30_000, "ttft_ms": 2_000, "safety_factor": 0.8},
}


@dataclass(frozen=True)
class Scenario:
    """Everything but the policy: workload, fleet, gateway configuration, clients."""

    name: str
    jobs: Sequence[Job]
    config: Config  # the gateway's configuration: its first pool is the fleet simulated
    engine: EngineModel  # the replicas' real timing (what the pool config claims may differ)
    replicas: int
    clients: ClientModel = field(default_factory=ClientModel)
    engine_aborts: bool = True  # engines drop a request when its client goes (streaming)
    engines_scraped: bool = True  # the gateway reads each replica's own report (idle, queue)
    autoscaler: Callable[[], Recommender] | None = None  # None: a fixed fleet
    provisioning_s: float = 540.0
    control_period_s: float = 15.0
    sample_s: float = 10.0
    seed: int = 0
    description: str = ""
    clock_origin_s: float = 0.0  # wall-clock seconds after midnight at t = 0, for plots

    @property
    def pool(self) -> Pool:
        return self.config.pools[0]

    @property
    def span_s(self) -> float:
        return max((j.arrival_s for j in self.jobs), default=0.0)



ENGINE = dataclasses.replace(LLAMA_70B_FP8_2XH100, max_num_seqs=16)  # 16 slots a replica
AZURE_MAX_TOKENS = {"conv": 1024, "code": 2048}  # above each trace's longest output
# Code completions are not streamed (the editor waits for the whole answer): no TTFT objective.
AZURE_CLASSES: dict[str, dict[str, Any]] = {
    "conv": CHAT_CLASSES,
    "code": {"latency": {"deadline_ms": 10_000, "ttft_ms": 0, "safety_factor": 0.8}},
}


def capacity_rps(engine: EngineModel, replicas: int, jobs: Sequence[Job]) -> float:
    """Requests per second the fleet sustains on this mix with full batches."""
    if not jobs:
        return 0.0
    prompt = sum(j.prompt_tokens for j in jobs) / len(jobs)
    output = sum(min(j.output_tokens, j.max_tokens or j.output_tokens) for j in jobs) / len(jobs)
    return replicas * 1000.0 / engine.request_ms(prompt, output)


def _config(replicas: int, classes: dict[str, Any], engine: EngineModel,
            **pool: Any) -> config_mod.Config:
    return config_mod.from_mapping({
        "pools": [{"name": "llm", "replicas": replicas,
                   "engine": dataclasses.asdict(engine), **pool}],
        "classes": classes,
    })


@dataclass(frozen=True)
class Fleet:
    """The replicas a scenario runs on: ``replicas`` of ``engine``, fixed, or scaled by
    ``autoscaler`` (a name of ``autoscaler.AUTOSCALERS``) between ``replicas`` and
    ``max_replicas`` (None: twice as many), a new replica ready ``provisioning_s`` after it is
    asked for; ``name`` labels it in the evaluation's cells."""

    replicas: int = 4
    engine: EngineModel = ENGINE
    autoscaler: str | None = None
    max_replicas: int | None = None
    provisioning_s: float = 540.0
    name: str = ""

    def capacity_rps(self, jobs: Sequence[Job]) -> float:
        return capacity_rps(self.engine, self.replicas, jobs)


@dataclass(frozen=True)
class Rate:
    """How fast a trace is replayed: ``load`` x the fleet's capacity, or ``rate_x`` x its own
    rate (at most one of them; neither: as recorded)."""

    load: float | None = None
    rate_x: float | None = None

    def __post_init__(self) -> None:
        if self.load is not None and self.rate_x is not None:
            raise ConfigError(["give at most one of a load (--scale) and a rate (--rate-x)"])

    def factor(self, fleet: Fleet, jobs: Sequence[Job]) -> float:
        """What the trace's arrival rate is multiplied by."""
        if self.load is None:
            return self.rate_x or 1.0
        span = max((j.arrival_s for j in jobs), default=0.0)
        offered = len(jobs) / span if span else 0.0
        return self.load * fleet.capacity_rps(jobs) / offered if offered else 1.0


AS_RECORDED = Rate()  # a trace at its own rate


def replay(name: str, jobs: Sequence[Job], *, fleet: Fleet = Fleet(), rate: Rate = AS_RECORDED,
           classes: dict[str, Any] | None = None, clients: ClientModel | None = None,
           seed: int = 0) -> Scenario:
    """A ``fleet`` serving ``jobs`` at ``rate``."""
    rate_x = rate.factor(fleet, jobs)
    scaled = [dataclasses.replace(j, arrival_s=j.arrival_s / rate_x) for j in jobs]
    classes = classes or CHAT_CLASSES
    for cls in {j.service_class for j in scaled} - set(classes):
        raise ConfigError([f"class {cls!r} of the trace is not configured"])
    replicas, engine, autoscaler = fleet.replicas, fleet.engine, fleet.autoscaler
    top = fleet.max_replicas if fleet.max_replicas is not None else 2 * replicas
    return Scenario(
        name=name, jobs=scaled, config=_config(replicas, classes, engine), engine=engine,
        replicas=replicas, clients=clients or ClientModel(timeout_s=60.0), seed=seed,
        autoscaler=_autoscaler(autoscaler, replicas, top), provisioning_s=fleet.provisioning_s,
        description=f"{len(jobs)} requests at {rate_x:.2f}x the trace's rate"
        + (f" ({rate.load:g}x fleet capacity)" if rate.load is not None else "")
        + f", {replicas} replicas of {engine.max_num_seqs} slots"
        + (f", autoscaler {autoscaler} up to {top}" if autoscaler else ""),
    )


def _autoscaler(name: str | None, low: int, high: int
                ) -> Callable[[], autoscaler_mod.Recommender] | None:
    """A factory for the fleet (each run gets a fresh autoscaler), or None: a fixed fleet."""
    if name is None:
        return None
    autoscaler_mod.make(name, min_replicas=low, max_replicas=high)  # fail early on a bad name
    return lambda: autoscaler_mod.make(name, min_replicas=low, max_replicas=high)


def azure(trace: str, path: str | os.PathLike[str], *, rate: Rate = AS_RECORDED,
          fleet: Fleet = Fleet(), start_s: float = 0.0, duration_s: float | None = None,
          seed: int = 0) -> Scenario:
    """An Azure 2023 trace (``conv`` or ``code``) at ``rate``, optionally cut to
    ``duration_s`` from ``start_s``. Clients send ``max_tokens`` above the trace's longest
    output, so no output is cut."""
    jobs = read_azure(path, max_tokens=AZURE_MAX_TOKENS.get(trace), start_s=start_s,
                      duration_s=duration_s)
    scale = f"{rate.load:g}x" if rate.load is not None else f"r{rate.rate_x or 1:g}x"
    named = f"azure-{trace}-{scale}" + (f"-{fleet.autoscaler}" if fleet.autoscaler else "")
    return replay(named, jobs, fleet=fleet, rate=rate, seed=seed,
                  classes=AZURE_CLASSES.get(trace))


# ---- the reference incident --------------------------------------------------------------

INCIDENT_MIX = Mix(prompt=LogNormal(math.log(400), 0.6, high=4_000),
                   output=LogNormal(math.log(24), 0.5, high=400), max_tokens=96)
INCIDENT_CLASSES: dict[str, Any] = {
    "latency": {"deadline_ms": 4_000, "safety_factor": 0.8},
}
INCIDENT_START_S = 7 * 3600 + 55 * 60  # t = 0 is 07:55


def incident_rate(c: float) -> list[RatePoint]:
    """The morning as a rate curve, in multiples of the 12-replica capacity ``c``."""
    m = 60.0
    return [RatePoint(0 * m, 0.30 * c), RatePoint(6 * m, 0.35 * c),  # 07:55 .. 08:01
            RatePoint(6.5 * m, 1.25 * c), RatePoint(10 * m, 1.25 * c),  # the spike, 08:01
            RatePoint(14 * m, 0.92 * c), RatePoint(45 * m, 0.92 * c),  # .. 08:40
            RatePoint(50 * m, 0.50 * c), RatePoint(65 * m, 0.50 * c)]  # 08:45 .. 09:00


def incident(*, seed: int = 0, fleet_scale: float = 1.0, minutes: float | None = None,
             autoscaler: str = "hpa") -> Scenario:
    """The 8 am incident; ``fleet_scale`` shrinks the fleet, its traffic and its autoscaler's
    bounds together (0.25: 3 replicas), keeping every per-replica figure, and ``minutes``
    ends the morning early (tests use both). ``autoscaler`` is the incident's HPA on GPU
    utilization (``hpa``) or the gateway's replica recommender (``recommender``)."""
    replicas = max(1, round(12 * fleet_scale))
    rng = random.Random(seed)
    probe = synthetic([0.0] * 4000, INCIDENT_MIX, random.Random(seed + 1))
    c = capacity_rps(ENGINE, replicas, probe)
    curve = incident_rate(c)
    if minutes is not None:
        curve = [p for p in curve if p.at_s < minutes * 60] + [
            RatePoint(minutes * 60, _rate_at(curve, minutes * 60))]
    jobs = synthetic(piecewise_arrivals(curve, rng), INCIDENT_MIX, rng)
    max_replicas = max(replicas + 1, round(24 * fleet_scale))
    return Scenario(
        name="incident" + ("" if fleet_scale == 1.0 else f"-x{fleet_scale:g}")
        + ("" if minutes is None else f"-{minutes:g}min")
        + ("" if autoscaler == "hpa" else f"-{autoscaler}"),
        jobs=jobs, config=_config(replicas, INCIDENT_CLASSES, ENGINE), engine=ENGINE,
        replicas=replicas,
        clients=ClientModel(timeout_s=30.0, max_retries=2, retry_on_timeout=True),
        engine_aborts=False,
        autoscaler=_autoscaler(autoscaler, replicas, max_replicas),
        provisioning_s=540.0, control_period_s=15.0, sample_s=10.0, seed=seed,
        clock_origin_s=INCIDENT_START_S,
        description=f"{replicas} replicas of 16 slots, 8 am spike to 1.25x capacity,"
        + (" HPA on GPU utilization," if autoscaler == "hpa"
           else f" autoscaler {autoscaler},")
        + " ~9 min to provision, 30 s client timeouts",
    )


def _rate_at(curve: Sequence[RatePoint], t: float) -> float:
    for a, b in itertools.pairwise(curve):
        if a.at_s <= t <= b.at_s and b.at_s > a.at_s:
            return a.rate + (b.rate - a.rate) * (t - a.at_s) / (b.at_s - a.at_s)
    return curve[-1].rate


# ---- synthetic ---------------------------------------------------------------------------

def bursty(*, load: float = 1.5, replicas: int = 4, duration_s: float = 900.0,
           seed: int = 0) -> Scenario:
    """Conversation-like lengths, on/off arrivals: bursts at 4x the mean rate."""
    rng = random.Random(seed)
    probe = synthetic([0.0] * 4000, CONVERSATION, random.Random(seed + 1))
    mean_rate = load * capacity_rps(ENGINE, replicas, probe)
    # ON 20% of the time at 4x the mean rate, OFF at 0.25x: the mean is load x capacity
    on, off = 4.0 * mean_rate, 0.25 * mean_rate
    share_on = (mean_rate - off) / (on - off)
    arrivals = on_off_arrivals(on, off, 20.0, 20.0 * (1 - share_on) / share_on, duration_s, rng)
    return replay(f"bursty-{load:g}x", synthetic(arrivals, _with_max(CONVERSATION, 1024), rng),
                  fleet=Fleet(replicas), seed=seed)


def _with_max(mix: Mix, max_tokens: int) -> Mix:
    return Mix(mix.prompt, mix.output, max_tokens)


NAMES = ("incident", "bursty")


def builtin(name: str, *, seed: int = 0, load: float = 1.5, fleet_scale: float = 1.0,
            autoscaler: str = "hpa") -> Scenario:
    """A built-in scenario; ``autoscaler`` chooses the incident's autoscaler."""
    if name == "incident":
        return incident(seed=seed, fleet_scale=fleet_scale, autoscaler=autoscaler)
    if name == "bursty":
        return bursty(load=load, seed=seed)
    raise ConfigError([f"scenario: must be one of {', '.join(NAMES)} (got {name!r})"])
