"""Output lengths learned in production: the engines' ``vllm:request_generation_tokens``
histogram, scraped, feeds each pool's ``Lengths`` (extproc.fleet.enginestats,
extproc.decision.lengths), and the gate's costs carry what it learned."""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc import config
from extproc.decision.lengths import Lengths, Prior, decay_factor
from extproc.errors import ConfigError
from extproc.fleet.capacity import StaticCapacity
from extproc.fleet.enginestats import EngineSample, EngineStats, histogram_increase, parse
from extproc.gateway.gate import Gate
from extproc.ledger.memory import MemoryLedger
from extproc.observability.metrics import Metrics
from extproc_dev.fakebackend import TOKEN_BUCKETS
from extproc_dev.stack import Process, free_port, wait_http
from tests.extproc_client import chat

BOUNDS = (*map(float, TOKEN_BUCKETS), math.inf)  # vLLM's, and the fake backend's


def binned(lengths: list[int]) -> list[tuple[float, float, float]]:
    """``lengths`` as vLLM's histogram holds them: ``(low, high, count)`` per bucket."""
    out, low = [], 0.0
    for high in BOUNDS:
        out.append((low, high, float(sum(1 for x in lengths if low < x <= high))))
        low = high
    return out


def lognormal(median: float, sigma: float, n: int, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [max(1, round(rng.lognormvariate(math.log(median), sigma))) for _ in range(n)]


def truth(lengths: list[int]) -> tuple[float, float]:
    """The sample's mean and 99th percentile."""
    ordered = sorted(lengths)
    return sum(ordered) / len(ordered), float(ordered[int(0.99 * len(ordered))])


# -- pure parts ------------------------------------------------------------------------------

def test_histogram_increase_is_what_each_bucket_gained() -> None:
    old = ((10.0, 3.0), (20.0, 5.0), (math.inf, 6.0))
    new = ((10.0, 4.0), (20.0, 9.0), (math.inf, 10.0))
    # per bucket: (0, 10] 3 -> 4, (10, 20] 2 -> 5, (20, inf) 1 -> 1
    assert histogram_increase(old, new) == ((0.0, 10.0, 1.0), (10.0, 20.0, 3.0))


def test_a_restarted_engine_counts_from_zero() -> None:
    old = ((10.0, 30.0), (20.0, 50.0), (math.inf, 60.0))
    new = ((10.0, 2.0), (20.0, 2.0), (math.inf, 3.0))  # went down: the engine restarted
    assert histogram_increase(old, new) == ((0.0, 10.0, 2.0), (20.0, math.inf, 1.0))


def test_a_new_target_only_sets_the_baseline() -> None:
    assert histogram_increase(None, ((10.0, 500.0), (math.inf, 900.0))) == ()
    assert histogram_increase(((10.0, 1.0),), ((10.0, 1.0),)) == ()  # nothing finished


def test_parse_sums_the_buckets_over_label_sets_and_tgi_has_none() -> None:
    page = "\n".join([
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="a"} 1',
        "# TYPE vllm:request_generation_tokens histogram",
        *(f'vllm:request_generation_tokens_bucket{{engine="{e}",le="{le}"}} {n}'
          for e, counts in (("0", (1, 4, 5)), ("1", (2, 2, 7)))
          for le, n in zip(("10.0", "20.0", "+Inf"), counts, strict=True)),
        'vllm:request_generation_tokens_count{engine="0"} 5',
        'vllm:request_generation_tokens_sum{engine="0"} 60',
        "", ])
    assert parse(page).generation_tokens == ((10.0, 3.0), (20.0, 6.0), (math.inf, 12.0))
    tgi = "# TYPE tgi_queue_size gauge\ntgi_queue_size 2\n"
    assert parse(tgi).generation_tokens is None


@pytest.mark.parametrize(("median", "sigma", "long_over"), [
    (24.0, 0.5, 1.25),  # narrow: its p99 (~76) sits low in vLLM's (50, 100] bucket
    (13.0, 0.85, 1.15),  # heavy tail
])
def test_coarse_buckets_spread_log_uniformly_recover_mean_and_p99(
        median: float, sigma: float, long_over: float) -> None:
    lengths = lognormal(median, sigma, 20_000)
    mean, p99 = truth(lengths)
    observed = Lengths(Prior(mean=mean, p99=p99))  # 20 outputs' worth: negligible here
    for low, high, count in binned(lengths):
        observed.observe_bucket(low, high, count)
    got = (observed.mean(), observed.quantile(0.99))
    assert abs(got[0] - mean) <= 0.15 * mean, (got, mean)
    # Log-uniform within a bucket puts too much of a falling tail near the bucket's top: the
    # p99 comes out high (the safe side for a promise), never more than long_over x the truth.
    assert 0.95 * p99 <= got[1] <= long_over * p99, (got, p99)


def test_one_count_at_one_point_would_be_worse() -> None:
    """Why spread: all of (50, 100] at 100 puts the narrow case's p99 at 100, +30%."""
    lengths = lognormal(24.0, 0.5, 20_000)
    _, p99 = truth(lengths)
    pointwise = Lengths(Prior(mean=24.0, p99=76.0))
    for _, high, count in binned(lengths):
        pointwise.observe(min(high, 1e5), count)
    spread = Lengths(Prior(mean=24.0, p99=76.0))
    for low, high, count in binned(lengths):
        spread.observe_bucket(low, high, count)
    assert spread.quantile(0.99) < pointwise.quantile(0.99)
    assert pointwise.quantile(0.99) > 1.25 * p99


def test_the_memory_is_the_same_in_seconds_whatever_the_interval() -> None:
    assert decay_factor(10.0) == pytest.approx(0.99)  # the simulator's per-sample factor
    assert decay_factor(2.0) ** 450 == pytest.approx(0.99 ** 90)  # 15 minutes either way
    assert 0.36 < decay_factor(2.0) ** (16.6 * 30) < 0.37  # ~16.6 min: 1/e left


# -- end to end: a real fake vLLM, scraped -----------------------------------------------------

FAST = {"interval_s": 0.1, "timeout_s": 0.5, "max_age_s": 1.0}
SENT = 200


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[str]:
    """A fake vLLM that runs everything at once, at 1/100 of real time."""
    port = free_port()
    proc = Process("backend", [sys.executable, "-m", "extproc", "fake-backend", "--port",
                               str(port), "--max-running", "256", "--time-scale", "0.01"],
                   tmp_path)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc.popen)
        yield f"127.0.0.1:{port}"
    finally:
        proc.stop()


def gate_for(addr: str, **section: Any) -> tuple[Gate, EngineStats, Metrics]:
    pool = {"name": "llama", "replicas": 1, "engine": {"max_num_seqs": 2},
            "engine_metrics": {"targets": [addr], **FAST, **section}}
    cfg = config.from_mapping({"pools": [pool], "classes": {
        "latency": {"deadline_ms": 60_000, "ttft_ms": 5_000}}})
    stats = EngineStats({"llama": [addr]}, timeout_s=0.5)
    metrics = Metrics()
    return Gate(cfg, MemoryLedger(), StaticCapacity(cfg.pools), metrics,
                engines={"llama": stats}), stats, metrics


def gauge(metrics: Metrics, kind: str) -> float | None:
    """``extproc_output_tokens_predicted{pool="llama",kind}``; None when not exported."""
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name == "extproc_output_tokens_predicted" and s.labels == {
                    "pool": "llama", "kind": kind}:
                return s.value
    return None


async def send(addr: str, lengths: list[int]) -> None:
    """Completions straight to the engine, each generating exactly its given length."""
    async with aiohttp.ClientSession() as client:
        async def one(n: int) -> None:
            doc = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}],
                   "max_tokens": 1000, "extproc_output_tokens": n}
            async with client.post(f"http://{addr}/v1/chat/completions", json=doc) as r:
                assert r.status == 200, await r.text()
                await r.read()
        await asyncio.gather(*(one(n) for n in lengths))


async def learn(gate: Gate, stats: EngineStats, addr: str, lengths: list[int],
                within: float = 20.0) -> None:
    """Scrape once (the baseline), send ``lengths``, and scrape until the engine has counted
    them all."""
    await stats.scrape("llama")
    await send(addr, lengths)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        sample = (await stats.scrape("llama"), stats._samples["llama"][addr][1])[1]
        assert sample.generation_tokens is not None
        if sample.generation_tokens[-1][1] >= len(lengths):
            return
        assert loop.time() < deadline, f"engine counted {sample.generation_tokens[-1][1]}"
        await asyncio.sleep(0.05)


async def check(gate: Gate) -> Any:
    route = gate.config.route("/v1/chat/completions")
    assert route is not None
    verdict = await gate.check(route, route.path, {}, json.dumps(chat(2000)).encode())
    if verdict.ticket is not None:
        await gate.settle(verdict.ticket)
    return route, verdict


async def test_the_gate_learns_output_lengths_from_the_engines(backend: str) -> None:
    lengths = lognormal(24.0, 0.5, SENT)
    mean, p99 = truth(lengths)
    gate, stats, metrics = gate_for(backend)
    assert stats.on_lengths is not None
    prior = gauge(metrics, "expected")
    assert prior == pytest.approx(Prior.mean, rel=0.05)  # a fresh pool prices by its prior

    await learn(gate, stats, backend, lengths)

    expected, long = gauge(metrics, "expected"), gauge(metrics, "long")
    assert expected is not None and long is not None
    assert abs(expected - mean) <= 0.15 * mean, (expected, mean)
    assert 0.9 * p99 <= long <= 1.4 * p99, (long, p99)
    # the decision's cost carried them: its typical length is the learned mean, its promise a
    # quantile of the learned lengths (q = 0.99 before any feedback), not max_tokens (2,000)
    _, verdict = await check(gate)
    assert verdict.admission is not None
    cost = verdict.admission.cost
    learned = gate.learning["llama"]
    assert cost.typical == pytest.approx(expected, rel=0.01)  # mean of min(output, 2000)
    # (settling the request fed the promise a hit since: it moved a hair)
    assert cost.promised == pytest.approx(
        learned.lengths.quantile(learned.promise("latency").quantile), rel=0.01)
    assert cost.promised < 0.1 * cost.max_output_tokens


async def test_the_gate_learns_the_engines_measured_speed(backend: str) -> None:
    """Each scrape round's increase of vLLM's first-token and inter-token histograms reaches
    the pool's learning as their means (what a cancelled stream's answer is estimated at:
    ``PoolLearning.engine_speed``), equal to the engine's own sums over counts."""
    gate, stats, _ = gate_for(backend)
    assert stats.on_speed is not None
    assert gate.learning["llama"]._speed is None
    await learn(gate, stats, backend, lognormal(24.0, 0.5, SENT))
    speed = gate.learning["llama"]._speed
    assert speed is not None
    async with aiohttp.ClientSession() as client, client.get(f"http://{backend}/metrics") as r:
        page = parse(await r.text())
    assert page.ttft is not None and page.itl is not None
    # the first round set the baseline (nothing had run); the last round that counted both
    # is what the pool keeps, one part of the run, so near the run's mean, in ms not seconds
    assert speed.ttft_ms == pytest.approx(1000.0 * page.ttft[0] / page.ttft[1], rel=0.5)
    assert speed.itl_ms == pytest.approx(1000.0 * page.itl[0] / page.itl[1], rel=0.5)


async def test_each_scrape_round_tells_the_level_whether_an_engine_waits_for_compute(
        backend: str) -> None:
    """``EngineStats.on_round`` -> ``Gate.learn_round`` -> ``PoolLearning.engines_round``: a
    replica with requests waiting beside a free slot (the pool's ``max_num_seqs``, 2 here)
    and KV room waits for compute; the round after, an idle engine scraped for real, does
    not (``extproc.decision.level``, "Congestion")."""
    gate, stats, _ = gate_for(backend)
    learning = gate.learning["llama"]
    assert stats.on_round is not None and not learning.queued(gate._clock())
    gate.learn_round("llama", [EngineSample(waiting=3, running=2, kv_usage=0.1)])
    assert not learning.queued(gate._clock())  # both slots taken: a wait the checks see
    gate.learn_round("llama", [EngineSample(waiting=3, running=1, kv_usage=0.1)])
    assert learning.queued(gate._clock())
    await stats.scrape("llama")  # the real engine: nothing waiting
    assert not learning.queued(gate._clock())


async def test_learning_can_be_turned_off(backend: str) -> None:
    gate, stats, metrics = gate_for(backend, learn_output_lengths=False)
    assert stats.on_lengths is None and stats.on_speed is None
    await learn(gate, stats, backend, lognormal(24.0, 0.5, SENT))
    assert gate.learning["llama"].lengths.seen == 0  # the prior alone
    assert gauge(metrics, "expected") == pytest.approx(Prior.mean, rel=0.05)
    _, verdict = await check(gate)
    assert verdict.admission is not None
    assert verdict.admission.cost.typical == pytest.approx(Prior.mean, rel=0.05)


def test_the_config_key_is_validated_by_name() -> None:
    pool = {"name": "llama", "engine_metrics": {"targets": ["h:1"],
                                                 "learn_output_lengths": "yes"}}
    with pytest.raises(ConfigError) as err:
        config.from_mapping({"pools": [pool]})
    assert err.value.problems == [
        "pools[0].engine_metrics.learn_output_lengths: must be true or false (got 'yes')"]
    pool["engine_metrics"] = {"targets": ["h:1"]}
    got = config.from_mapping({"pools": [pool]}).pools[0].engine_metrics
    assert got is not None and got.learn_output_lengths is True
