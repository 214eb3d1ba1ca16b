"""Engine signals: parsing vLLM/TGI pages, the correction, scraping real fake-backend processes."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from extproc.decision.admission import Reported, Snapshot
from extproc.decision.level import waits_for_compute
from extproc.decision.step import reported
from extproc.fleet.engine import LLAMA_8B_1XH100
from extproc.fleet.enginestats import (
    Correction,
    EngineSample,
    EngineStats,
    PoolStats,
    aggregate,
    correction,
    kv_reported,
    parse,
    speed_since,
    timing_increase,
)
from extproc_dev.stack import Process, free_port, wait_http

VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.3-70B-Instruct"} 14.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.3-70B-Instruct"} 16.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.3-70B-Instruct"} 3.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.3-70B-Instruct"} 5.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.3-70B-Instruct"} 0.75
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.3-70B-Instruct"} 0.95
# HELP vllm:num_preemptions_total Cumulative number of preemptions.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="meta-llama/Llama-3.3-70B-Instruct"} 2.0
"""

TGI_PAGE = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 7
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 32
# TYPE tgi_request_count counter
tgi_request_count 1234
"""


def test_parse_vllm_sums_engines_and_averages_kv() -> None:
    assert parse(VLLM_PAGE) == EngineSample(waiting=8, running=30, kv_usage=pytest.approx(0.85))


def test_parse_reads_the_kv_cache_size_vllm_reports() -> None:
    page = VLLM_PAGE + (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",'
        'gpu_memory_utilization="0.9",num_gpu_blocks="12345",enable_prefix_caching="True"} 1.0\n')
    assert parse(page).kv_blocks == (12345, 16)
    assert parse(VLLM_PAGE).kv_blocks is None
    fresh = [(0.0, EngineSample(0, 0, kv_blocks=(900, 16))),
             (0.0, EngineSample(0, 0, kv_blocks=(1000, 16)))]
    assert aggregate(fresh, 2, 0.0, max_age_s=5.0, min_coverage=0.5).kv_blocks == (900, 16)


def test_parse_tgi_and_older_vllm() -> None:
    assert parse(TGI_PAGE) == EngineSample(waiting=7, running=32, kv_usage=None)
    old = ("vllm:num_requests_waiting 1\nvllm:num_requests_running 2\n"
           "vllm:gpu_cache_usage_perc 0.5\n")
    assert parse(old) == EngineSample(1, 2, 0.5)


def timed(name: str, seconds: float, count: float, engine: str = "0") -> str:
    """One engine's latency histogram as vLLM exposes it (its buckets left out: unread)."""
    labels = f'engine="{engine}",model_name="m"'
    return (f"# TYPE {name} histogram\n{name}_bucket{{{labels},le=\"+Inf\"}} {count}\n"
            f"{name}_sum{{{labels}}} {seconds}\n{name}_count{{{labels}}} {count}\n")


def test_parse_reads_the_engines_latency_histograms() -> None:
    """First-token and inter-token latency, as (sum of seconds, count) over the engines; the
    name vLLM used before 0.11 when the new one is absent; TGI: neither."""
    page = (VLLM_PAGE + timed("vllm:time_to_first_token_seconds", 3.0, 10)
            + timed("vllm:time_to_first_token_seconds", 1.0, 5, engine="1")
            + timed("vllm:inter_token_latency_seconds", 8.0, 400))
    sample = parse(page)
    assert sample.ttft == (4.0, 15.0)
    assert sample.itl == (8.0, 400.0)
    older = parse(VLLM_PAGE + timed("vllm:time_per_output_token_seconds", 2.0, 100))
    assert older.itl == (2.0, 100.0)
    assert older.ttft is None
    assert parse(TGI_PAGE).itl is None


def test_timing_increase_is_since_the_last_scrape_or_since_a_restart() -> None:
    assert timing_increase(None, (5.0, 50.0)) == (0.0, 0.0)  # first sight: the baseline
    assert timing_increase((5.0, 50.0), (7.0, 60.0)) == (2.0, 10.0)
    assert timing_increase((5.0, 50.0), (1.0, 4.0)) == (1.0, 4.0)  # restarted


def test_a_rounds_speed_is_over_every_target_and_only_once_both_moved() -> None:
    first = EngineSample(0, 1, ttft=(2.0, 10.0), itl=(1.0, 100.0))
    # first sight of a target sets its baseline: nothing measured yet
    assert speed_since([(None, first)]) is None
    later = EngineSample(0, 1, ttft=(3.0, 12.0), itl=(1.5, 150.0))
    restarted = EngineSample(0, 1, ttft=(0.5, 2.0), itl=(0.5, 30.0))
    # (1 s + 0.5 s) over 4 first tokens, (0.5 s + 0.5 s) over 80 tokens
    assert speed_since([(first, later), (first, restarted)]) == pytest.approx((375.0, 12.5))
    no_first = EngineSample(0, 1, ttft=(2.0, 10.0), itl=(2.0, 200.0))
    assert speed_since([(first, no_first)]) is None  # no new first token: no round


def test_a_replica_waits_for_compute_only_with_a_free_slot_and_kv_room() -> None:
    """The measured level's congestion signal (``waits_for_compute``): requests waiting while
    a slot and a typical request's KV cache are free wait for the step's token budget; a
    full batch or a full cache is a wait the admission's own checks see."""
    need = 3_000.0
    assert waits_for_compute(EngineSample(2, 10, 0.5), 256, 100_000, need)
    assert not waits_for_compute(EngineSample(0, 10, 0.5), 256, 100_000, need)  # no queue
    assert not waits_for_compute(EngineSample(2, 256, 0.5), 256, 100_000, need)  # slots full
    assert not waits_for_compute(EngineSample(2, 10, 0.98), 256, 100_000, need)  # KV full
    assert waits_for_compute(EngineSample(2, 10, None), 256, 100_000, need)  # (not reported)
    # the cache the engine reports, not the configured one: 1,000 blocks of 16 = 16,000 tokens
    assert not waits_for_compute(EngineSample(2, 10, 0.9, kv_blocks=(1000, 16)), 256,
                                 1_000_000, need)
    # ... also where the configuration leaves the cache unbounded (0)
    assert not waits_for_compute(EngineSample(2, 10, 0.9, kv_blocks=(1000, 16)), 256, 0, need)


def test_the_kv_cache_a_request_may_go_to_is_what_the_engines_reported_free() -> None:
    """``Capacity.reported`` (``extproc.decision.admission``): the replica an endpoint picker
    named, its own report; else the fullest and the emptiest fresh replicas' free cache
    (their usage of the smallest cache), beside a replica's mean of requests."""
    assert kv_reported(EngineSample(1, 3, 0.25, kv_blocks=(1000, 16)), 0) == \
        Reported(12_000.0, 12_000.0, 4)
    assert kv_reported(EngineSample(1, 3, 0.25), 8_000) == Reported(6_000.0, 6_000.0, 4)
    assert kv_reported(EngineSample(1, 3, None), 8_000) is None  # (no usage reported)
    assert kv_reported(EngineSample(1, 3, 0.25), 0) is None  # (no bound)
    fix = reported(Correction(), EngineSample(0, 3, 0.5), LLAMA_8B_1XH100, 500.0, named=True)
    half = 0.5 * LLAMA_8B_1XH100.kv_tokens
    assert fix.reported == Reported(half, half, 3)
    # not named: where it goes is not known, so not this replica's
    assert reported(Correction(), EngineSample(0, 3, 0.5), LLAMA_8B_1XH100, 500.0,
                    named=False).reported is None
    samples = [(100.0, EngineSample(2, 4, 0.5, kv_blocks=(1000, 16))),
               (100.0, EngineSample(1, 4, 0.9, kv_blocks=(2000, 16)))]
    got = aggregate(samples, 2, 100.0, max_age_s=5.0, min_coverage=0.5)
    assert got.kv_reported() == Reported(pytest.approx(0.1 * 16_000),
                                         pytest.approx(0.5 * 16_000), 6)
    assert aggregate(samples[:1], 2, 100.0, max_age_s=5.0,
                     min_coverage=0.9).kv_reported() is None  # (stale)
    assert PoolStats(0, 4, None, None, targets=1, fresh=1, stale=False).kv_reported() is None


def test_a_page_without_engine_metrics_is_a_failure_not_zeros() -> None:
    with pytest.raises(ValueError, match="no vLLM or TGI"):
        parse("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3.2\n")


def test_aggregate_marks_too_few_fresh_samples_stale() -> None:
    samples = [(100.0, EngineSample(2, 4, 0.5)), (96.0, EngineSample(1, 4, 0.9)),
               (90.0, EngineSample(50, 4, 1.0))]  # the last is older than 5 s: ignored
    got = aggregate(samples, 3, 100.0, max_age_s=5.0, min_coverage=0.5)
    assert (got.waiting, got.running, got.fresh, got.stale) == (3, 8, 2, False)
    assert (got.kv_usage_max, got.kv_usage_mean) == (0.9, pytest.approx(0.7))
    assert aggregate(samples, 3, 100.0, max_age_s=5.0, min_coverage=0.9).stale
    assert aggregate([], 0, 100.0, max_age_s=5.0, min_coverage=0.5).stale


def engines(waiting: int, running: int, stale: bool = False) -> PoolStats:
    return PoolStats(waiting, running, None, None, targets=2, fresh=2, stale=stale)


@pytest.mark.parametrize(("ledger", "waiting", "running", "extra", "extra_ms"), [
    (Snapshot(20, 40_000.0), 2, 20, 0, 0.0),  # within tolerance: 22 <= 20 x 1.25 + 2
    (Snapshot(20, 40_000.0), 10, 20, 3, 6_000.0),  # 30 > 27: 3 unseen, at the 2 s mean charge
    (Snapshot(20, 40_000.0), 0, 10, 0, 0.0),  # engines hold fewer: never loosen
    (Snapshot(0, 0.0), 8, 4, 10, 30_000.0),  # empty ledger: the fallback charge, 3 s each
])
def test_correction(ledger: Snapshot, waiting: int, running: int, extra: int,
                    extra_ms: float) -> None:
    got = correction(ledger, engines(waiting, running), fallback_request_ms=3_000.0)
    assert (got.extra_inflight, got.extra_ms) == (extra, pytest.approx(extra_ms))
    corrected = got.apply(ledger)
    assert corrected.inflight == ledger.inflight + extra
    assert corrected.outstanding_ms == pytest.approx(ledger.outstanding_ms + extra_ms)


def test_stale_or_missing_engine_stats_never_tighten() -> None:
    ledger = Snapshot(1, 1000.0)
    assert correction(ledger, engines(500, 500, stale=True),
                      fallback_request_ms=1.0).apply(ledger) == ledger
    assert correction(ledger, None, fallback_request_ms=1.0).apply(ledger) == ledger


# --- real fake-backend processes --------------------------------------------------------------

@pytest.fixture
def backends(tmp_path: Path) -> Iterator[list[tuple[str, Process]]]:
    """Two fake vLLM replicas: one sequence at a time, a 10,000-token KV cache."""
    procs = []
    for i in range(2):
        port = free_port()
        proc = Process(f"backend{i}", [sys.executable, "-m", "extproc", "fake-backend",
                                       "--port", str(port), "--max-running", "1",
                                       "--kv-cache-tokens", "10000"], tmp_path)
        procs.append((f"127.0.0.1:{port}", proc))
    for addr, proc in procs:
        wait_http(f"http://{addr}/health", proc=proc.popen)
    yield procs
    for _, proc in procs:
        proc.stop()


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def test_scrapes_real_replicas_and_flags_stale(backends: list[tuple[str, Process]]) -> None:
    (addr0, _), (addr1, proc1) = backends
    clock = Clock()
    rounds: list[list[EngineSample]] = []
    stats = EngineStats({"llama": [addr0, addr1]}, timeout_s=0.5, max_age_s=5.0, clock=clock)
    stats.on_round = lambda pool, samples: rounds.append(list(samples))
    idle = await stats.scrape("llama")
    assert len(rounds) == 1 and len(rounds[0]) == 2
    assert (idle.waiting, idle.running, idle.fresh, idle.stale) == (0, 0, 2, False)

    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}],
            "max_tokens": 300, "extproc_output_tokens": 300}  # ~6 s each at 18.6 ms/token
    async with aiohttp.ClientSession() as client:
        calls = [asyncio.create_task(client.post(f"http://{addr0}/v1/chat/completions",
                                                 json=body)) for _ in range(3)]
        try:
            for _ in range(100):
                busy = await stats.scrape("llama")
                if (busy.waiting, busy.running) == (2, 1):  # the engine took the first
                    break
                await asyncio.sleep(0.05)
            # one runs, two wait behind it (max_running 1), all on replica 0
            assert (busy.waiting, busy.running) == (2, 1)
            # each round's samples go to ``on_round``: with a sequence limit of one the two
            # wait for a slot; with four (a free slot, KV room) they would wait for compute
            queued = [s for s in rounds[-1] if s.waiting]
            assert len(queued) == 1
            assert not waits_for_compute(queued[0], 1, 10_000, 150.0)
            assert waits_for_compute(queued[0], 4, 10_000, 150.0)
            assert busy.kv_usage_max is not None and busy.kv_usage_max > 0
            assert busy.kv_usage_mean == pytest.approx(busy.kv_usage_max / 2)

            # the engines hold 3, our ledger knew of none: tighten by 3 - (0 + 2) = 1 request
            fix = correction(Snapshot(0, 0.0), busy, fallback_request_ms=5_000.0)
            assert (fix.extra_inflight, fix.extra_ms) == (1, 5_000.0)

            proc1.stop()  # replica 1 is gone: its last sample is kept while young
            kept = await stats.scrape("llama")
            assert (kept.fresh, kept.stale) == (2, False)
            assert addr1 in stats.errors()
            clock.t += 6.0  # ... and dropped once older than max_age_s
            alone = await stats.scrape("llama")
            assert (alone.fresh, alone.stale, alone.total) == (1, False, 3)
            clock.t += 6.0  # nothing scraped since: the aggregate goes stale by itself
            assert stats.latest("llama").stale
        finally:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)

    assert idle.kv_blocks == (625, 16)  # --kv-cache-tokens 10000, in vLLM's own words

    strict = EngineStats({"llama": [addr0, addr1, f"127.0.0.1:{free_port()}"]},
                         timeout_s=0.3, min_coverage=0.5)
    lonely = await strict.scrape("llama")  # 1 of 3 answered
    assert (lonely.fresh, lonely.stale) == (1, True)
    assert correction(Snapshot(0, 0.0), lonely, fallback_request_ms=1.0).extra_inflight == 0
