"""Workload families: scenarios whose parameters are drawn per seed, so no constant fits them all.

A *family* is a function ``(seed, load, fleet) -> Drawn``: the ``Scenario`` and the parameters
drawn for it. Every parameter that shapes the traffic (lengths, deadlines, TTFT objectives,
client timeouts, the shape of a spike or a ramp, the trace window) is drawn from a documented
range by ``random.Random(f"{family}/{seed}")``, independently of the load and the fleet, so the
same seed gives the same parameters on every fleet and at every load, and two seeds differ.
The jobs are drawn from a second stream (``f"{family}/{seed}/jobs"``): the same seed, load and
fleet give the same jobs.

**Load** is a multiple of the fleet's capacity, ``scenarios.capacity_rps``: the request rate the
fleet sustains on the family's own mix with every batch full (``EngineModel.request_ms``). For a
stationary family the offered rate is ``load x capacity``; for a shaped one (``flash-crowd``,
``diurnal``, ``incident``) the documented levels are those at load 1 and every level is
multiplied by ``load`` (``flash-crowd`` at load 3: a base of ~1.8x and a spike of ~18x). The
trace families replay a window of the trace at ``load x capacity`` (``scenarios.replay``).

**Size.** A run is sized in requests, not minutes, so it simulates in about a second per
policy on any fleet: each family draws a nominal length (minutes), and a fleet that would see
more than ``BUDGET`` requests at load 1 in that time gets a shorter run, its timeline (spike
start and length, ramp, provisioning delay) compressed with it, never under ``FLOOR_S``.
``size`` scales the budget (``--reduced`` runs at 0.25).

**Service classes.** Each family sets its own, with the product's safety factor (0.8 for the
``latency`` class, 0.9 for ``throughput``, ``config.DEFAULT_CLASSES``). The chat families draw
their deadline from 20-40 s and their TTFT objective from 1.5-3 s around the product's default
(30 s, 2 s). **Clients** behave like the OpenAI SDK (``ClientModel``: two retries, on 429s and
on timeouts), each family drawing its timeout; a streaming client's disconnect reaches the
engine (``engine_aborts``), a non-streaming one's does not (the answer is finished and thrown
away).

The families (ranges are per seed, ``U(a, b)`` uniform):

- ``long-context``: Mooncake-like lengths. Prompt log-normal, median U(3k, 10k), sigma
  U(0.9, 1.3), capped at ``max_model_len - max_tokens`` (~130k); outputs median U(150, 400),
  sigma U(0.5, 0.8), ``max_tokens`` 1024. Deadline U(90, 150) s, TTFT U(10, 30) s, streaming,
  timeout U(1, 2) x deadline. Poisson; nominal U(8, 12) min.
- ``flash-crowd``: chat lengths (below); base U(0.4, 0.8) x load, a step to U(4, 8) x load at
  U(25, 45)% of the run for U(90, 150) s (compressed with the run), then back. Nominal
  U(8, 10) min.
- ``diurnal``: chat lengths, ``max_tokens`` 1024; linear ramps from U(0.2, 0.4) x load to a peak
  of U(1.8, 3.2) x load at U(35, 65)% of the run, and back down. Nominal U(10, 15) min.
- ``bimodal``: chat prompts; outputs a mixture: a share U(0.7, 0.9) with median U(10, 30)
  tokens, the rest median U(1000, 2000) (sigma 0.4 each); ``max_tokens`` 4096 for every
  request, saying nothing of its length. Deadline U(60, 120) s (a 1,500-token answer takes
  ~30 s at the fastest), TTFT U(1.5, 3) s, streaming. Nominal U(8, 12) min.
- ``class-mix``: a share U(0.6, 0.8) of latency-class chat, the rest throughput-class batch
  work (prompt median U(1k, 4k) sigma 0.8, output median U(600, 1500) sigma 0.5,
  ``max_tokens`` 4096; 600 s deadline, no TTFT objective, safety 0.9). One client model per
  scenario (the simulator has no per-class clients): the SDK's default 600 s timeout, which the
  batch work needs. Nominal U(8, 12) min.
- ``summarisation``: KV-bound documents: prompt median U(10k, 20k), sigma U(0.2, 0.4),
  clipped to 8k-32k; output median U(250, 450), sigma 0.3, clipped to 200-600; ``max_tokens``
  1024. Deadline U(60, 120) s, no TTFT objective, not streamed, timeout U(1.5, 5) x deadline.
  Nominal U(8, 12) min.
- ``multi-turn``: conversations of 2..T turns (T drawn from 4..8). The first prompt's median
  U(300, 1500) (sigma 0.8), each later message's U(30, 200); outputs median U(100, 300), sigma
  0.7, ``max_tokens`` 1024. Turn k's prompt is the conversation so far (every earlier prompt and
  answer) plus its message; ``prefix_key`` is the conversation and ``prefix_tokens`` the
  history, which the engine's prefix cache may still hold. The next turn comes an estimated
  answer time (``output x 30 ms``; jobs are open-loop) plus an exponential think time of mean
  U(10, 60) s later. A conversation ends early where its prompt would pass ``max_model_len``.
  The capacity that sets the rate counts only the uncached part of each prompt (a warm cache).
  Chat class, streaming. Nominal U(8, 12) min.
- ``azure-conv``, ``azure-code``: the Azure 2023 traces in ``tests/data/traces`` (a family
  whose file is missing, outside a checkout, is skipped, see ``missing``): a window of the hour
  starting at a drawn offset, replayed at ``load x capacity``. ``conv``: the chat class, streaming,
  ``max_tokens`` 1024. ``code``: 10 s deadline, no TTFT objective, not streamed (an editor waits
  for the whole answer), ``max_tokens`` 2048, timeout U(10, 60) s.
- ``incident``: ``scenarios.incident`` (the 8 am story: clinical summaries, 4 s deadline,
  non-streaming clients giving up after 30 s, an HPA on GPU utilization) on this fleet: its
  first U(24, 36) minutes at fleet_scale 0.25 give the rate curve, the request mix and every
  setting; the traffic is then redrawn (Poisson thinning) to ``load x`` the curve on this
  fleet's capacity, within the size budget, with the provisioning delay compressed with the
  timeline. The HPA keeps its bounds relative to the fleet (1x to 2x its replicas).

- ``noisy-neighbour``: two tenants of chat traffic (``max_tokens`` 1024, equal weights). Tenant
  ``a`` arrives steadily at U(0.3, 0.45) x load of capacity, below its equal share; tenant
  ``b`` at U(0.2, 0.4) x load, bursting to 10x that for U(60, 120) s (compressed with the run)
  from U(30, 45)% of the run. Streaming. Nominal U(8, 10) min.
- ``priority``: chat traffic at ``load`` x capacity in three priorities, stated per request
  (as a header Envoy sets): the critical share rises linearly from U(0.03, 0.08) to
  U(0.15, 0.25) of ``load`` (at 3x, from ~0.15 to ~0.6 capacity); the rest is a share U(0.3, 0.5)
  standard and the remainder sheddable. Streaming. Nominal U(8, 10) min.

The long families (latching shows over tens of minutes: U(40, 50) min, shortened only where a
run would hold more than ``LONG_BUDGET`` requests at load 1, never under ``LONG_FLOOR_S``):

- ``output-tail``: an output tail no admission can save. Chat prompts; a share U(0.75, 0.85) of
  answers median U(10, 30) tokens, the rest median U(1000, 2000) (sigma 0.3), ``max_tokens``
  4096; the deadline gives a long answer U(0.5, 0.8) of what it needs alone on this fleet's
  engine (so its misses happen at any load), TTFT U(1.5, 3) s (at most a third of the
  deadline), timeout U(1.5, 4) x deadline. Streaming.
- ``reasoning``: heavy-tailed reasoning lengths. Chat prompts; outputs log-normal, median
  U(1000, 2000), sigma U(0.7, 1.1), up to 16,384 (``max_tokens``); deadline U(200, 400) s, TTFT
  U(5, 15) s, the SDK's 600 s timeout. Streaming.
- ``agentic``: tool-loop sessions with growing contexts. A system prompt of U(3k, 8k) tokens and
  a task (median U(200, 800)) open a session of 5..60 steps; each step's prompt is the session
  so far plus a tool result (median U(500, 3000), sigma 1.0), its answer median U(80, 250);
  ``prefix_tokens`` is the session's history (the engine's prefix cache may hold it, and the
  router sends a session's steps to its replica); the next step comes the answer's time plus
  an exponential tool run of mean U(1, 8) s. A session ends where its context would pass
  U(50k, 100k). Deadline U(60, 120) s, TTFT U(5, 15) s, timeout U(1.5, 3) x deadline.
  Streaming; capacity as for ``multi-turn`` (a warm cache).

Fleets (``FLEETS``): ``70b-16`` (4 replicas of Llama-3.3-70B FP8 on 2xH100, ``max_num_seqs``
16, the incident's), ``70b-vllm`` (4 replicas, vLLM's defaults: 1024 sequences, KV-bound) and
``8b-vllm`` (2 replicas of Llama-3.1-8B on one H100). Any family runs on any fleet.

Length: past the house's ~400 lines because it is a catalogue: a sixth is this docstring and
each family is one short function of its own draws; splitting it would scatter the ranges a
reader compares side by side.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from extproc.config import TenantConfig, TenantSource
from extproc.decision.share import CRITICAL, SHEDDABLE, STANDARD
from extproc.fleet.engine import LLAMA_8B_1XH100, LLAMA_70B_FP8_2XH100
from extproc.sim import scenarios
from extproc.sim.clients import ClientModel
from extproc.sim.scenarios import Fleet, Rate, Scenario
from extproc.sim.workload import (
    CONVERSATION,
    Job,
    LogNormal,
    RatePoint,
    piecewise_arrivals,
    poisson_arrivals,
    read_azure,
    step_spike,
)

TRACES = Path(__file__).resolve().parents[2] / "tests" / "data" / "traces"  # in a checkout
BUDGET = 3000  # requests a run holds at load 1 (size 1), at most
FLOOR_S = 60.0  # ... but never shorter than this
PROBE = 2000  # jobs drawn to measure a mix's capacity

Params = dict[str, float | int | str]


FLEETS: dict[str, Fleet] = {f.name: f for f in (
    Fleet(4, dataclasses.replace(LLAMA_70B_FP8_2XH100, max_num_seqs=16), name="70b-16"),
    Fleet(4, LLAMA_70B_FP8_2XH100, name="70b-vllm"),
    Fleet(2, LLAMA_8B_1XH100, name="8b-vllm"),
)}


@dataclass(frozen=True)
class Drawn:
    """A family's scenario and the parameters drawn for it (for the record)."""

    scenario: Scenario
    params: Params


class Family(Protocol):
    def __call__(self, seed: int, load: float, fleet: Fleet, size: float = 1.0) -> Drawn: ...


# ---- shared pieces ------------------------------------------------------------------------

class _Draws:
    """The parameter stream of one family and seed; every draw is recorded under its name."""

    def __init__(self, family: str, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(f"{family}/{seed}")
        self.params: Params = {}

    def uniform(self, name: str, low: float, high: float) -> float:
        value = self.rng.uniform(low, high)
        self.params[name] = round(value, 4)
        return value

    def integer(self, name: str, low: int, high: int) -> int:
        value = self.rng.randint(low, high)
        self.params[name] = value
        return value


def _lognormal(median: float, sigma: float, low: int = 1, high: int | None = None) -> LogNormal:
    return LogNormal(math.log(median), sigma, low=low, high=high)


def _chat_lengths(d: _Draws) -> tuple[LogNormal, LogNormal]:
    """The conversation trace's fitted lengths (``workload.CONVERSATION``), each median moved
    by a factor drawn from exp(U(-0.3, 0.3)) (0.74x to 1.35x)."""
    p, o = CONVERSATION.prompt, CONVERSATION.output
    return (LogNormal(p.mu + d.uniform("prompt_shift", -0.3, 0.3), p.sigma, high=p.high),
            LogNormal(o.mu + d.uniform("output_shift", -0.3, 0.3), o.sigma, high=o.high))


def _chat_class(d: _Draws) -> dict[str, Any]:
    """The product's ``latency`` class (30 s, TTFT 2 s, safety 0.8) with a drawn deadline and
    TTFT objective."""
    return {"latency": {"deadline_ms": 1000 * d.uniform("deadline_s", 20, 40),
                        "ttft_ms": 1000 * d.uniform("ttft_s", 1.5, 3.0), "safety_factor": 0.8}}


def _span(d: _Draws, rate: float, low_min: float, high_min: float, size: float) -> tuple[
        float, float]:
    """(nominal, actual) run length in seconds: the drawn nominal, shortened to hold at most
    ``BUDGET x size`` requests at ``rate`` (the family's mean rate at load 1), never under
    ``FLOOR_S`` (module docstring)."""
    nominal = 60.0 * d.uniform("nominal_min", low_min, high_min)
    actual = min(nominal, max(FLOOR_S * min(1.0, size), BUDGET * size / max(rate, 1e-9)))
    d.params["span_s"] = round(actual, 1)
    return nominal, actual


def _jobs(arrivals: Iterable[float], rng: random.Random, prompt: LogNormal, output: LogNormal,
          max_tokens: int | None, service_class: str = "latency") -> list[Job]:
    return [Job(arrival_s=t, prompt_tokens=prompt.draw(rng), output_tokens=output.draw(rng),
                max_tokens=max_tokens, service_class=service_class) for t in arrivals]


def _probe(family: str, seed: int, prompt: LogNormal, output: LogNormal,
           max_tokens: int | None) -> list[Job]:
    return _jobs([0.0] * PROBE, random.Random(f"{family}/{seed}/probe"), prompt, output,
                 max_tokens)


def _scenario(family: str, d: _Draws, load: float, fleet: Fleet, jobs: list[Job],
              classes: dict[str, Any], clients: ClientModel, streaming: bool) -> Drawn:
    """The scenario for ``jobs`` as they are (their arrivals already at the drawn rate), with
    the parameters ``d`` drew for them."""
    seed, params = d.seed, d.params
    jobs.sort(key=lambda j: j.arrival_s)
    name = f"{family}-{load:g}x-s{seed}-{fleet.name}"
    sc = scenarios.replay(name, jobs, fleet=fleet, classes=classes, clients=clients, seed=seed)
    described = ", ".join(f"{k}={v}" for k, v in params.items())
    sc = dataclasses.replace(sc, engine_aborts=streaming,
                             description=f"{family} at {load:g}x on {fleet.name}: {described}")
    return Drawn(sc, dict(params))


# ---- the families -------------------------------------------------------------------------

def long_context(seed: int, load: float, fleet: Fleet, size: float = 1.0) -> Drawn:
    d = _Draws("long-context", seed)
    max_tokens = 1024
    cap = min(131_072, fleet.engine.max_model_len) - max_tokens
    prompt = _lognormal(d.uniform("prompt_median", 3000, 10_000),
                        d.uniform("prompt_sigma", 0.9, 1.3), high=cap)
    output = _lognormal(d.uniform("output_median", 150, 400),
                        d.uniform("output_sigma", 0.5, 0.8), high=max_tokens)
    deadline_s = d.uniform("deadline_s", 90, 150)
    classes = {"latency": {"deadline_ms": 1000 * deadline_s,
                           "ttft_ms": 1000 * d.uniform("ttft_s", 10, 30), "safety_factor": 0.8}}
    clients = ClientModel(timeout_s=deadline_s * d.uniform("timeout_x", 1.0, 2.0))
    rate = fleet.capacity_rps(_probe("long-context", seed, prompt, output, max_tokens))
    _, span = _span(d, rate, 8, 12, size)
    rng = random.Random(f"long-context/{seed}/jobs")
    jobs = _jobs(poisson_arrivals(load * rate, span, rng), rng, prompt, output, max_tokens)
    return _scenario("long-context", d, load, fleet, jobs, classes, clients, True)


def flash_crowd(seed: int, load: float, fleet: Fleet, size: float = 1.0) -> Drawn:
    d = _Draws("flash-crowd", seed)
    prompt, output = _chat_lengths(d)
    classes = _chat_class(d)
    clients = ClientModel(timeout_s=d.uniform("timeout_s", 45, 120))
    base, peak = d.uniform("base_x", 0.4, 0.8), d.uniform("peak_x", 4, 8)
    start, length = d.uniform("start_frac", 0.25, 0.45), d.uniform("spike_s", 90, 150)
    cap = fleet.capacity_rps(_probe("flash-crowd", seed, prompt, output, 1024))
    nominal, span = _span(d, cap * (base + (peak - base) * length / 600.0), 8, 10, size)
    squeeze = span / nominal
    curve = step_spike(base, peak, start * span, length * squeeze, span)
    rng = random.Random(f"flash-crowd/{seed}/jobs")
    points = [RatePoint(p.at_s, p.rate * load * cap) for p in curve]
    jobs = _jobs(piecewise_arrivals(points, rng), rng, prompt, output, 1024)
    return _scenario("flash-crowd", d, load, fleet, jobs, classes, clients, True)


def diurnal(seed: int, load: float, fleet: Fleet, size: float = 1.0) -> Drawn:
    d = _Draws("diurnal", seed)
    prompt, output = _chat_lengths(d)
    classes = _chat_class(d)
    clients = ClientModel(timeout_s=d.uniform("timeout_s", 45, 120))
    low, peak = d.uniform("trough_x", 0.2, 0.4), d.uniform("peak_x", 1.8, 3.2)
    at = d.uniform("peak_frac", 0.35, 0.65)
    cap = fleet.capacity_rps(_probe("diurnal", seed, prompt, output, 1024))
    _, span = _span(d, cap * (low + peak) / 2.0, 10, 15, size)
    rng = random.Random(f"diurnal/{seed}/jobs")
    points = [RatePoint(0.0, low * load * cap), RatePoint(at * span, peak * load * cap),
              RatePoint(span, low * load * cap)]
    jobs = _jobs(piecewise_arrivals(points, rng), rng, prompt, output, 1024)
    return _scenario("diurnal", d, load, fleet, jobs, classes, clients, True)


def bimodal(seed: int, load: float, fleet: Fleet, size: float = 1.0) -> Drawn:
    d = _Draws("bimodal", seed)
    prompt, _ = _chat_lengths(d)
    share = d.uniform("short_share", 0.7, 0.9)
    short = _lognormal(d.uniform("short_median", 10, 30), 0.4, high=4096)
    long = _lognormal(d.uniform("long_median", 1000, 2000), 0.4, high=4096)
    classes = {"latency": {"deadline_ms": 1000 * d.uniform("deadline_s", 60, 120),
                           "ttft_ms": 1000 * d.uniform("ttft_s", 1.5, 3.0),
                           "safety_factor": 0.8}}
    clients = ClientModel(timeout_s=d.uniform("timeout_s", 120, 300))

    def draw(arrivals: Iterable[float], rng: random.Random) -> list[Job]:
        return [Job(arrival_s=t, prompt_tokens=prompt.draw(rng),
                    output_tokens=(short if rng.random() < share else long).draw(rng),
                    max_tokens=4096) for t in arrivals]

    cap = fleet.capacity_rps(draw([0.0] * PROBE, random.Random(f"bimodal/{seed}/probe")))
    _, span = _span(d, cap, 8, 12, size)
    rng = random.Random(f"bimodal/{seed}/jobs")
    jobs = draw(poisson_arrivals(load * cap, span, rng), rng)
    return _scenario("bimodal", d, load, fleet, jobs, classes, clients, True)


def class_mix(seed: int, load: float, fleet: Fleet, size: float = 1.0) -> Drawn:
    d = _Draws("class-mix", seed)
    chat_prompt, chat_output = _chat_lengths(d)
    classes = _chat_class(d)
    classes["throughput"] = {"deadline_ms": 600_000, "ttft_ms": 0, "safety_factor": 0.9}
    share = d.uniform("latency_share", 0.6, 0.8)
    batch_prompt = _lognormal(d.uniform("batch_prompt_median", 1000, 4000), 0.8, high=16_000)
    batch_output = _lognormal(d.uniform("batch_output_median", 600, 1500), 0.5, high=4096)
    clients = ClientModel(timeout_s=600.0)

    def draw(arrivals: Iterable[float], rng: random.Random) -> list[Job]:
        jobs = []
        for t in arrivals:
            if rng.random() < share:
                jobs.append(Job(t, chat_prompt.draw(rng), chat_output.draw(rng), 1024))
            else:
                jobs.append(Job(t, batch_prompt.draw(rng), batch_output.draw(rng), 4096,
                                service_class="throughput"))
        return jobs

    cap = fleet.capacity_rps(draw([0.0] * PROBE, random.Random(f"class-mix/{seed}/probe")))
    _, span = _span(d, cap, 8, 12, size)
    rng = random.Random(f"class-mix/{seed}/jobs")
    jobs = draw(poisson_arrivals(load * cap, span, rng), rng)
    return _scenario("class-mix", d, load, fleet, jobs, classes, clients, True)


def summarisation(seed: int, load: float, fleet: Fleet, size: float = 1.0) -> Drawn:
    d = _Draws("summarisation", seed)
    prompt = _lognormal(d.uniform("prompt_median", 10_000, 20_000),
                        d.uniform("prompt_sigma", 0.2, 0.4), low=8000, high=32_000)
    output = _lognormal(d.uniform("output_median", 250, 450), 0.3, low=200, high=600)
    deadline_s = d.uniform("deadline_s", 60, 120)
    classes = {"latency": {"deadline_ms": 1000 * deadline_s, "ttft_ms": 0, "safety_factor": 0.8}}
    clients = ClientModel(timeout_s=deadline_s * d.uniform("timeout_x", 1.5, 5.0))
    cap = fleet.capacity_rps(_probe("summarisation", seed, prompt, output, 1024))
    _, span = _span(d, cap, 8, 12, size)
    rng = random.Random(f"summarisation/{seed}/jobs")
    jobs = _jobs(poisson_arrivals(load * cap, span, rng), rng, prompt, output, 1024)
    return _scenario("summarisation", d, load, fleet, jobs, classes, clients, False)


def multi_turn(seed: int, load: float, fleet: Fleet, size: float = 1.0) -> Drawn:
    d = _Draws("multi-turn", seed)
    max_turns = d.integer("max_turns", 4, 8)
    think_s = d.uniform("think_s", 10, 60)
    first = _lognormal(d.uniform("first_median", 300, 1500), 0.8, high=16_000)
    message = _lognormal(d.uniform("message_median", 30, 200), 0.8, high=8000)
    output = _lognormal(d.uniform("output_median", 100, 300), 0.7, high=1024)
    classes = _chat_class(d)
    clients = ClientModel(timeout_s=d.uniform("timeout_s", 45, 120))
    limit = fleet.engine.max_model_len - 1024

    def conversation(key: str, start: float, rng: random.Random) -> list[Job]:
        jobs: list[Job] = []
        history, t = 0, start
        for turn in range(rng.randint(2, max_turns)):
            prompt = history + (first if turn == 0 else message).draw(rng)
            if prompt > limit:
                break
            out = output.draw(rng)
            jobs.append(Job(arrival_s=t, prompt_tokens=prompt, output_tokens=out,
                            max_tokens=1024, prefix_key=key, prefix_tokens=history))
            history = prompt + out
            t += out * 0.03 + rng.expovariate(1.0 / think_s)
        return jobs

    probe_rng = random.Random(f"multi-turn/{seed}/probe")
    probe = [j for i in range(PROBE // 4) for j in conversation(f"p{i}", 0.0, probe_rng)]
    per_conv = len(probe) / (PROBE // 4)
    cap = _warm_capacity(fleet, probe)
    _, span = _span(d, cap, 8, 12, size)
    rng = random.Random(f"multi-turn/{seed}/jobs")
    # conversations start before 0 too, so the run opens mid-traffic (turns before 0 dropped)
    lead = max_turns * (think_s + 10.0)
    starts = poisson_arrivals(load * cap / per_conv, span + lead, rng, start_s=-lead)
    jobs = [j for i, t in enumerate(starts) for j in conversation(f"s{seed}c{i}", t, rng)
            if 0.0 <= j.arrival_s < span]
    return _scenario("multi-turn", d, load, fleet, jobs, classes, clients, True)


def _warm_capacity(fleet: Fleet, jobs: Sequence[Job]) -> float:
    """``capacity_rps`` with the prefix cache warm: each prompt's prefill is only its part
    past the cached history (``EngineModel.prefill_ms(new, context=history)``)."""
    engine = fleet.engine
    n = len(jobs)
    prompt = sum(j.prompt_tokens for j in jobs) / n
    out = sum(j.output_tokens for j in jobs) / n
    full = engine.prefill_ms(prompt)
    warm = sum(engine.prefill_ms(j.prompt_tokens - j.prefix_tokens, j.prefix_tokens)
               for j in jobs) / n
    ms = engine.request_ms(prompt, out) - full + warm
    return fleet.replicas * 1000.0 / ms


@functools.lru_cache(maxsize=4)
def _trace(path: str, max_tokens: int) -> tuple[Job, ...]:
    return tuple(read_azure(path, max_tokens=max_tokens))


def _azure(kind: str, seed: int, load: float, fleet: Fleet, size: float) -> Drawn:
    family = f"azure-{kind}"
    d = _Draws(family, seed)
    path = TRACES / f"azure-llm-2023-{kind}.csv.gz"
    max_tokens = scenarios.AZURE_MAX_TOKENS[kind]
    trace = _trace(str(path), max_tokens)
    hour = trace[-1].arrival_s
    cap = fleet.capacity_rps(trace)
    rate = len(trace) / hour
    _, span = _span(d, cap, 6, 10, size)
    window = min(hour, span * load * cap / rate)  # trace seconds that fill the run at load
    start = d.uniform("window_start_frac", 0.0, 1.0) * (hour - window)
    d.params["window_s"] = round(window, 1)
    jobs = [dataclasses.replace(j, arrival_s=j.arrival_s - start) for j in trace
            if start <= j.arrival_s < start + window]
    if kind == "conv":
        classes, streaming = _chat_class(d), True
        clients = ClientModel(timeout_s=d.uniform("timeout_s", 45, 120))
    else:
        classes, streaming = scenarios.AZURE_CLASSES["code"], False
        clients = ClientModel(timeout_s=d.uniform("timeout_s", 10, 60))
    name = f"{family}-{load:g}x-s{seed}-{fleet.name}"
    sc = scenarios.replay(name, jobs, fleet=fleet, rate=Rate(load=load), classes=classes,
                          clients=clients, seed=seed)
    described = ", ".join(f"{k}={v}" for k, v in d.params.items())
    sc = dataclasses.replace(sc, engine_aborts=streaming,
                             description=f"{family} at {load:g}x on {fleet.name}: {described}")
    return Drawn(sc, dict(d.params))


def azure_conv(seed: int, load: float, fleet: Fleet, size: float = 1.0) -> Drawn:
    return _azure("conv", seed, load, fleet, size)


def azure_code(seed: int, load: float, fleet: Fleet, size: float = 1.0) -> Drawn:
    return _azure("code", seed, load, fleet, size)


INCIDENT_BUDGET = 6000  # its requests are short and many: a larger budget


def incident(seed: int, load: float, fleet: Fleet, size: float = 1.0) -> Drawn:
    d = _Draws("incident", seed)
    minutes = d.uniform("minutes", 24, 36)
    base = scenarios.incident(seed=seed, fleet_scale=0.25, minutes=minutes)
    base_cap = scenarios.capacity_rps(base.engine, base.replicas, base.jobs)
    cap = fleet.capacity_rps(base.jobs)
    nominal = minutes * 60.0
    mean_x = len(base.jobs) / nominal / base_cap  # the curve's mean, in capacities
    span = min(nominal, max(FLOOR_S * min(1.0, size),
                            INCIDENT_BUDGET * size / (cap * mean_x)))
    d.params["span_s"] = round(span, 1)
    squeeze = span / nominal
    # the base arrivals, compressed to the span, form a Poisson process of rate
    # curve(t) x base_cap / squeeze; thinning keeps each with probability p to reach
    # load x curve(t) x cap. Where p > 1 the base is too thin: merge several seeds' mornings.
    p = load * cap * squeeze / base_cap
    copies = max(1, math.ceil(p))
    pool = list(base.jobs)
    for extra in range(1, copies):
        pool += scenarios.incident(seed=seed * 1000 + extra, fleet_scale=0.25,
                                   minutes=minutes).jobs
    rng = random.Random(f"incident/{seed}/jobs")
    keep = p / copies
    jobs = [dataclasses.replace(j, arrival_s=j.arrival_s * squeeze) for j in pool
            if rng.random() < keep]
    jobs.sort(key=lambda j: j.arrival_s)
    top = 2 * fleet.replicas
    sc = dataclasses.replace(
        base, name=f"incident-{load:g}x-s{seed}-{fleet.name}", jobs=jobs, engine=fleet.engine,
        replicas=fleet.replicas,
        config=scenarios._config(fleet.replicas, scenarios.INCIDENT_CLASSES, fleet.engine),
        autoscaler=scenarios._autoscaler("hpa", fleet.replicas, top),
        provisioning_s=base.provisioning_s * squeeze,
        description=f"incident at {load:g}x on {fleet.name}: first {minutes:.0f} min in"
        f" {span:.0f} s, HPA {fleet.replicas}-{top}")
    return Drawn(sc, dict(d.params))


def _tenanted(sc: Scenario) -> Scenario:
    """The scenario with tenant attribution on (the jobs name their tenants)."""
    config = dataclasses.replace(sc.config, tenant=TenantConfig(source=TenantSource.HEADER))
    return dataclasses.replace(sc, config=config)


def noisy_neighbour(seed: int, load: float, fleet: Fleet, size: float = 1.0) -> Drawn:
    d = _Draws("noisy-neighbour", seed)
    prompt, output = _chat_lengths(d)
    classes = _chat_class(d)
    clients = ClientModel(timeout_s=d.uniform("timeout_s", 45, 120))
    a_x, b_x = d.uniform("a_x", 0.3, 0.45), d.uniform("b_x", 0.2, 0.4)
    start, length = d.uniform("start_frac", 0.3, 0.45), d.uniform("burst_s", 60, 120)
    cap = fleet.capacity_rps(_probe("noisy-neighbour", seed, prompt, output, 1024))
    nominal, span = _span(d, cap * load * (a_x + b_x * (1 + 9 * length / 540.0)), 8, 10, size)
    squeeze = span / nominal
    rng = random.Random(f"noisy-neighbour/{seed}/jobs")
    steady = _jobs(poisson_arrivals(a_x * load * cap, span, rng), rng, prompt, output, 1024)
    begin, end = start * span, start * span + length * squeeze
    curve = step_spike(b_x, 10 * b_x, begin, length * squeeze, span)
    burst = _jobs(piecewise_arrivals([RatePoint(p.at_s, p.rate * load * cap) for p in curve],
                                     rng), rng, prompt, output, 1024)
    d.params["burst_from_s"], d.params["burst_to_s"] = round(begin, 1), round(end, 1)
    jobs = ([dataclasses.replace(j, tenant="a") for j in steady]
            + [dataclasses.replace(j, tenant="b") for j in burst])
    drawn = _scenario("noisy-neighbour", d, load, fleet, jobs, classes, clients, True)
    return Drawn(_tenanted(drawn.scenario), drawn.params)


def priority(seed: int, load: float, fleet: Fleet, size: float = 1.0) -> Drawn:
    d = _Draws("priority", seed)
    prompt, output = _chat_lengths(d)
    classes = _chat_class(d)
    clients = ClientModel(timeout_s=d.uniform("timeout_s", 45, 120))
    low, high = d.uniform("critical_from", 0.03, 0.08), d.uniform("critical_to", 0.15, 0.25)
    standard = d.uniform("standard_share", 0.3, 0.5)
    cap = fleet.capacity_rps(_probe("priority", seed, prompt, output, 1024))
    _, span = _span(d, cap * load, 8, 10, size)
    rng = random.Random(f"priority/{seed}/jobs")
    jobs = _jobs(poisson_arrivals(load * cap, span, rng), rng, prompt, output, 1024)
    levels = []
    for j in jobs:
        critical = low + (high - low) * j.arrival_s / span
        u = rng.random()
        level = (CRITICAL if u < critical else STANDARD if u < critical + standard
                 * (1 - critical) else SHEDDABLE)
        levels.append(dataclasses.replace(j, priority=level))
    return _scenario("priority", d, load, fleet, levels, classes, clients, True)


LONG_BUDGET = 24_000  # requests a long family's run holds at load 1 (size 1), at most ...
LONG_FLOOR_S = 900.0  # ... but never shorter than this


FLOOD_SPAN_S, FLOOD_FROM_S, FLOOD_TO_S = 960.0, 180.0, 780.0


def sheddable_flood(seed: int, load: float, fleet: str | Fleet, flood: bool = True) -> Drawn:
    """Issue 28's flood, not a family of the matrix (what it measures is each priority's
    goodput beside the flood against alone, ``benchmarks/flood.py``): the priority family's
    chat traffic, critical at 0.3x and standard at 0.5x of capacity for 16 minutes, and
    (``flood``) sheddable at ``load`` x capacity from minute 3 to minute 13."""
    shape = FLEETS[fleet] if isinstance(fleet, str) else fleet
    d = _Draws("priority", seed)
    prompt, output = _chat_lengths(d)
    classes = _chat_class(d)
    clients = ClientModel(timeout_s=d.uniform("timeout_s", 45, 120))
    cap = shape.capacity_rps(_probe("priority", seed, prompt, output, 1024))
    rng = random.Random(f"sheddable-flood/{seed}")
    parts = [(CRITICAL, 0.3, 0.0, FLOOD_SPAN_S), (STANDARD, 0.5, 0.0, FLOOD_SPAN_S)]
    if flood:
        parts.append((SHEDDABLE, load, FLOOD_FROM_S, FLOOD_TO_S))
    jobs = []
    for level, share, start, end in parts:
        arrivals = [start + t for t in poisson_arrivals(share * cap, end - start, rng)]
        jobs += [dataclasses.replace(j, priority=level)
                 for j in _jobs(arrivals, rng, prompt, output, 1024)]
    return _scenario("sheddable-flood", d, load, shape, jobs, classes, clients, True)


def _long_span(d: _Draws, rate: float, size: float) -> float:
    """A long family's run (latching shows over tens of minutes): U(40, 50) min, shortened
    only where it would hold more than ``LONG_BUDGET x size`` requests at load 1, never under
    ``LONG_FLOOR_S x min(1, size)``."""
    nominal = 60.0 * d.uniform("nominal_min", 40, 50)
    span = min(nominal, max(LONG_FLOOR_S * min(1.0, size), LONG_BUDGET * size / max(rate, 1e-9)))
    d.params["span_s"] = round(span, 1)
    return span


def output_tail(seed: int, load: float, fleet: Fleet, size: float = 1.0) -> Drawn:
    d = _Draws("output-tail", seed)
    prompt, _ = _chat_lengths(d)
    share = d.uniform("short_share", 0.75, 0.85)
    short = _lognormal(d.uniform("short_median", 10, 30), 0.4, high=4096)
    long_median = d.uniform("long_median", 1000, 2000)
    long = _lognormal(long_median, 0.3, high=4096)
    # the deadline leaves a long answer U(0.5, 0.8) of what it needs alone on this fleet
    alone_s = long_median * fleet.engine.itl_ms(1, 1000.0) / 1000.0 / 0.8
    deadline_s = d.uniform("deadline_x", 0.5, 0.8) * alone_s
    classes = {"latency": {"deadline_ms": 1000 * deadline_s,
                           "ttft_ms": 1000 * min(deadline_s / 3, d.uniform("ttft_s", 1.5, 3.0)),
                           "safety_factor": 0.8}}
    clients = ClientModel(timeout_s=deadline_s * d.uniform("timeout_x", 1.5, 4.0))

    def draw(arrivals: Iterable[float], rng: random.Random) -> list[Job]:
        return [Job(arrival_s=t, prompt_tokens=prompt.draw(rng),
                    output_tokens=(short if rng.random() < share else long).draw(rng),
                    max_tokens=4096) for t in arrivals]

    cap = fleet.capacity_rps(draw([0.0] * PROBE, random.Random(f"output-tail/{seed}/probe")))
    span = _long_span(d, cap, size)
    rng = random.Random(f"output-tail/{seed}/jobs")
    jobs = draw(poisson_arrivals(load * cap, span, rng), rng)
    return _scenario("output-tail", d, load, fleet, jobs, classes, clients, True)


def reasoning(seed: int, load: float, fleet: Fleet, size: float = 1.0) -> Drawn:
    d = _Draws("reasoning", seed)
    prompt, _ = _chat_lengths(d)
    output = _lognormal(d.uniform("output_median", 1000, 2000),
                        d.uniform("output_sigma", 0.7, 1.1), high=16_384)
    deadline_s = d.uniform("deadline_s", 200, 400)
    classes = {"latency": {"deadline_ms": 1000 * deadline_s,
                           "ttft_ms": 1000 * d.uniform("ttft_s", 5, 15), "safety_factor": 0.8}}
    clients = ClientModel(timeout_s=600.0)
    cap = fleet.capacity_rps(_probe("reasoning", seed, prompt, output, 16_384))
    span = _long_span(d, cap, size)
    rng = random.Random(f"reasoning/{seed}/jobs")
    jobs = _jobs(poisson_arrivals(load * cap, span, rng), rng, prompt, output, 16_384)
    return _scenario("reasoning", d, load, fleet, jobs, classes, clients, True)


def agentic(seed: int, load: float, fleet: Fleet, size: float = 1.0) -> Drawn:
    d = _Draws("agentic", seed)
    system = round(d.uniform("system_tokens", 3000, 8000))
    task = _lognormal(d.uniform("task_median", 200, 800), 0.8, high=8000)
    tool = _lognormal(d.uniform("tool_result_median", 500, 3000), 1.0, high=30_000)
    output = _lognormal(d.uniform("output_median", 80, 250), 0.7, high=2048)
    tool_s = d.uniform("tool_s", 1, 8)  # a tool call's mean run time
    top = round(d.uniform("context_tokens", 50_000, 100_000))
    deadline_s = d.uniform("deadline_s", 60, 120)
    classes = {"latency": {"deadline_ms": 1000 * deadline_s,
                           "ttft_ms": 1000 * d.uniform("ttft_s", 5, 15), "safety_factor": 0.8}}
    clients = ClientModel(timeout_s=deadline_s * d.uniform("timeout_x", 1.5, 3.0))
    limit = min(top, fleet.engine.max_model_len - 2048)

    def session(key: str, start: float, rng: random.Random) -> list[Job]:
        jobs: list[Job] = []
        history, t = 0, start
        for step in range(rng.randint(5, 60)):
            prompt = history + (system + task.draw(rng) if step == 0 else tool.draw(rng))
            if prompt > limit:
                break
            out = output.draw(rng)
            jobs.append(Job(arrival_s=t, prompt_tokens=prompt, output_tokens=out,
                            max_tokens=2048, prefix_key=key, prefix_tokens=history))
            history = prompt + out
            t += out * 0.03 + rng.expovariate(1.0 / tool_s)
        return jobs

    probe_rng = random.Random(f"agentic/{seed}/probe")
    probe = [j for i in range(PROBE // 20) for j in session(f"p{i}", 0.0, probe_rng)]
    per_session = len(probe) / (PROBE // 20)
    cap = _warm_capacity(fleet, probe)
    span = _long_span(d, cap, size)
    rng = random.Random(f"agentic/{seed}/jobs")
    lead = 600.0  # sessions start before 0 too, so the run opens mid-traffic
    starts = poisson_arrivals(load * cap / per_session, span + lead, rng, start_s=-lead)
    jobs = [j for i, t in enumerate(starts) for j in session(f"s{seed}a{i}", t, rng)
            if 0.0 <= j.arrival_s < span]
    return _scenario("agentic", d, load, fleet, jobs, classes, clients, True)


FAMILIES: dict[str, Family] = {
    "long-context": long_context,
    "flash-crowd": flash_crowd,
    "diurnal": diurnal,
    "bimodal": bimodal,
    "class-mix": class_mix,
    "summarisation": summarisation,
    "multi-turn": multi_turn,
    "azure-conv": azure_conv,
    "azure-code": azure_code,
    "incident": incident,
    "noisy-neighbour": noisy_neighbour,
    "priority": priority,
    "output-tail": output_tail,
    "reasoning": reasoning,
    "agentic": agentic,
}
TIME_VARYING = ("diurnal", "flash-crowd", "incident")


def missing(name: str) -> str | None:
    """Why a family cannot run here (a trace file is missing), or None."""
    if name.startswith("azure-"):
        path = TRACES / f"azure-llm-2023-{name[6:]}.csv.gz"
        if not path.is_file():
            return f"{name}: skipped, no trace at {path}"
    return None


def draw(name: str, seed: int, load: float, fleet: str | Fleet, size: float = 1.0) -> Drawn:
    """The scenario of family ``name`` for ``seed`` at ``load`` on ``fleet``."""
    try:
        family = FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown family {name!r}; choose from {', '.join(FAMILIES)}") from None
    shape = FLEETS[fleet] if isinstance(fleet, str) else fleet
    return family(seed, load, shape, size)

