"""Model-server signals: what each replica's engine says it holds, from its own ``/metrics``.

Names read (samples summed over their labels; vLLM labels by model and engine):

    waiting    vllm:num_requests_waiting   | tgi_queue_size
    running    vllm:num_requests_running   | tgi_batch_current_size
    kv usage   vllm:kv_cache_usage_perc (0..1; vllm:gpu_cache_usage_perc before vLLM 0.10)
    kv cache   vllm:cache_config_info's labels num_gpu_blocks and block_size (vLLM's own
               configuration, exported as an info gauge): the KV tokens a replica holds

TGI has no KV-usage gauge; a page with none of these names is a failed scrape, not zeros.
vLLM's ``vllm:request_generation_tokens`` histogram (output tokens of each finished request)
is read too, its cumulative buckets summed per ``le``: TGI has none, and then it is absent.

Speed. vLLM's ``vllm:time_to_first_token_seconds`` and ``vllm:inter_token_latency_seconds``
(``vllm:time_per_output_token_seconds`` before vLLM 0.11) histograms are read as their sums
and counts: each round, their increase over every target (a count that went down: the engine
restarted, and what it counted since is the increase) is the mean first-token time and
inter-token latency the engines measured since the last round, handed to the pool's
``on_speed`` sink when both moved. The tokens a stream had when its client left are estimated
at that speed (``extproc.decision.learning``, "Answers nobody waited for"): vLLM counts an abandoned
request in neither its length histogram nor any other per-request metric.

Output lengths. Each scrape round, every target's buckets are compared with its previous ones
(``histogram_increase``): the increase is the outputs finished since, handed with the other
targets' to the pool's ``on_lengths`` sink (the gate's ``Observed``). A bucket that went down
means the engine restarted: its counts since then are the increase. A target seen for the
first time only sets the baseline: its counts may be days of history, which would drown the
~15 minutes the sink is meant to remember.

Queues. Each round's samples (the targets that answered) go to the pool's ``on_round`` sink:
the gate reads there whether a replica waits for compute, for the measured level's climb
(``extproc.decision.level.waits_for_compute``).

Each replica is scraped concurrently with a short timeout. A failed scrape keeps that
replica's previous sample until it is older than ``max_age_s``; the pool's aggregate sums the
fresh samples and is **stale** when fewer than ``min_coverage`` of the targets have one. Stale
is not overload: a stale aggregate never tightens admission (``correction`` returns nothing),
so an exporter outage cannot turn into rejections.

The correction. The ledger counts the requests this gateway admitted; the engines count what
they really hold. When the engines hold far more (traffic that bypassed this gateway, other
gateway replicas each with an in-process ledger, requests the ledger already released but an
engine still runs), the ledger's view is too rosy. With ``E = waiting + running`` summed over
the engines and ``L`` the ledger's in-flight count:

    allowed = L x (1 + tolerance) + slack          scrape lag and rounding are not a signal
    extra   = max(0, ceil(E - allowed))            requests the ledger does not know about
    cost    = outstanding_ms / L                   the ledger's mean charge per request
              (fallback_request_ms when L = 0)
    corrected snapshot = (L + extra, outstanding_ms + extra x cost)

It only ever adds work: engines holding fewer requests than the ledger (requests still on the
wire) never loosen admission.

The request's own replica. An endpoint picker in front of the gateway (the Gateway API
Inference Extension's EPP, llm-d's router) names the replica it chose for each request in
Envoy's dynamic metadata (``envoy.lb`` / ``x-gateway-destination-endpoint``, ``host:port``;
clients cannot write metadata, unlike the header it also sets). When that replica's engine
reported nothing running and nothing waiting, in a fresh sample taken after the last request
this gateway sent it (``EngineStats.sent``), the correction says so (``idle``): the step then
admits what the model refused for the pool as a whole (``extproc.decision.level.measured``). One
request per report: the next sees the replica busy, or waits for the next scrape. The one way
the engines loosen admission, and only where the report is about the very replica the request
is going to. When that replica (with no picker: the fresh target holding the fewest waiting,
where a least-loaded balancer sends it, ``EngineStats.where``) reports requests waiting, the
correction says how many wait for a slot or KV memory (``queued``) and how many for compute
(``prefilling``, ``extproc.decision.level.waiting_for_room``): the step predicts the request to
start after them (``extproc.decision.step``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from extproc.decision.admission import Reported, Snapshot
from extproc.fleet.capacity import cancel_all

if TYPE_CHECKING:
    from extproc.config import Pool

log = logging.getLogger(__name__)

DESTINATION_NAMESPACE = "envoy.lb"  # the endpoint picker protocol's metadata (module docstring)
DESTINATION_KEY = "x-gateway-destination-endpoint"

WAITING = ("vllm:num_requests_waiting", "tgi_queue_size")
RUNNING = ("vllm:num_requests_running", "tgi_batch_current_size")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
GENERATION_TOKENS = "vllm:request_generation_tokens_bucket"
TTFT = ("vllm:time_to_first_token_seconds",)
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
CACHE_INFO = "vllm:cache_config_info"

Cumulative = tuple[tuple[float, float], ...]  # (le, outputs <= le), by le ascending
Bucket = tuple[float, float, float]  # (low, high, outputs in (low, high])
Timing = tuple[float, float]  # a latency histogram's (sum of seconds, count)


@dataclass(frozen=True)
class EngineSample:
    """One replica's engine at one scrape."""

    waiting: int
    running: int
    kv_usage: float | None = None  # 0..1, when the engine reports it
    generation_tokens: Cumulative | None = None  # vLLM's output-length histogram; TGI: None
    kv_blocks: tuple[int, int] | None = None  # (num_gpu_blocks, block_size), vLLM's info gauge
    ttft: Timing | None = None  # vLLM's first-token times, cumulative; TGI: None
    itl: Timing | None = None  # ... and inter-token latencies

    def kv_free(self, kv_tokens: int) -> float | None:
        """The KV cache tokens free on this replica: of its own cache where it reported the
        cache's size, else of ``kv_tokens`` (the configured one); None: no usage reported,
        or no bound."""
        if self.kv_blocks is not None:
            kv_tokens = self.kv_blocks[0] * self.kv_blocks[1]
        if self.kv_usage is None or kv_tokens <= 0:
            return None
        return (1.0 - self.kv_usage) * kv_tokens


@dataclass(frozen=True)
class PoolStats:
    """A pool's engines, summed over replicas with a fresh sample."""

    waiting: int
    running: int
    kv_usage_max: float | None  # the fullest replica (a mean hides a hot one)
    kv_usage_mean: float | None
    targets: int  # replicas asked
    fresh: int  # replicas with a sample younger than max_age_s
    stale: bool  # too few fresh samples to trust the sums
    kv_blocks: tuple[int, int] | None = None  # the smallest replica's (blocks, block size)
    kv_usage_min: float | None = None  # the emptiest replica

    @property
    def total(self) -> int:
        return self.waiting + self.running

    def kv_reported(self) -> Reported | None:
        """The KV cache free on the fullest and on the emptiest fresh replica (their usage
        of the smallest replica's cache), beside a replica's mean of requests; None: not
        reported."""
        if (self.stale or self.kv_usage_max is None or self.kv_usage_min is None
                or self.kv_blocks is None):
            return None
        return kv_between(self.kv_usage_max, self.kv_usage_min,
                          self.kv_blocks[0] * self.kv_blocks[1], self.total, self.fresh)


def kv_between(fullest: float, emptiest: float, kv_tokens: int, requests: int,
               replicas: int) -> Reported:
    """What replicas of ``kv_tokens`` each report of their KV caches: the tokens free on the
    fullest (its usage ``fullest``, 0..1) and on the emptiest, beside a replica's mean of the
    ``requests`` they run or hold waiting (``PoolStats.kv_reported``, and the simulator's
    scrape)."""
    return Reported((1.0 - fullest) * kv_tokens, (1.0 - emptiest) * kv_tokens,
                    math.ceil(requests / max(1, replicas)))


def address(target: str) -> str:
    """A target's ``host:port`` (a base URL's network location), as an endpoint picker names
    the replica it chose."""
    return urllib.parse.urlsplit(target).netloc if "://" in target else target.rstrip("/")


def parse(text: str) -> EngineSample:
    """An ``EngineSample`` from a Prometheus text page; ValueError if no engine metric is there."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    buckets: dict[float, float] = {}
    blocks: list[tuple[int, int]] = []
    timings: dict[str, float] = {}  # histogram name + "_sum" / "_count" -> over labels
    timed = {n + suffix for n in (*TTFT, *ITL) for suffix in ("_sum", "_count")}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in timed:
                timings[sample.name] = timings.get(sample.name, 0.0) + sample.value
            elif sample.name == CACHE_INFO:
                with contextlib.suppress(KeyError, ValueError):
                    blocks.append((int(sample.labels["num_gpu_blocks"]),
                                   int(sample.labels["block_size"])))
            elif sample.name == GENERATION_TOKENS and "le" in sample.labels:
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name in (*WAITING, *RUNNING, *KV_USAGE):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
                counts[sample.name] = counts.get(sample.name, 0) + 1

    def first(names: Sequence[str]) -> float | None:
        return next((sums[n] for n in names if n in sums), None)

    waiting, running = first(WAITING), first(RUNNING)
    if waiting is None and running is None:
        raise ValueError("no vLLM or TGI queue metrics on the page")
    kv_name = next((n for n in KV_USAGE if n in sums), None)
    kv = sums[kv_name] / counts[kv_name] if kv_name else None  # mean over a replica's engines

    def timing(names: Sequence[str]) -> Timing | None:
        return next(((timings[n + "_sum"], timings[n + "_count"]) for n in names
                     if n + "_sum" in timings and n + "_count" in timings), None)

    return EngineSample(round(waiting or 0), round(running or 0), kv,
                        tuple(sorted(buckets.items())) if buckets else None,
                        min(blocks, key=lambda b: b[0] * b[1]) if blocks else None,
                        timing(TTFT), timing(ITL))


def timing_increase(old: Timing | None, new: Timing) -> Timing:
    """What a latency histogram counted between two scrapes of one engine: nothing when
    ``old`` is None (the baseline is set), all of ``new`` after a restart (its count went
    down)."""
    if old is None:
        return (0.0, 0.0)
    if new[1] < old[1] or new[0] < old[0]:
        return new
    return (new[0] - old[0], new[1] - old[1])


def finished_since(rounds: Iterable[tuple[EngineSample | None, EngineSample]]) -> list[Bucket]:
    """The outputs the targets finished between their previous sample and this round's
    (``histogram_increase`` each), over the targets."""
    out: list[Bucket] = []
    for before, sample in rounds:
        if sample.generation_tokens is not None:
            out += histogram_increase(before.generation_tokens if before else None,
                                      sample.generation_tokens)
    return out


def speed_since(rounds: Iterable[tuple[EngineSample | None, EngineSample]]
                ) -> tuple[float, float] | None:
    """The mean first-token time and inter-token latency, ms, the targets measured between
    their previous sample and this round's (``timing_increase`` each); None unless both
    histograms counted something."""
    ttft, itl = [0.0, 0.0], [0.0, 0.0]
    for before, sample in rounds:
        for now, then, into in ((sample.ttft, before.ttft if before else None, ttft),
                                (sample.itl, before.itl if before else None, itl)):
            if now is not None:
                seconds, count = timing_increase(then, now)
                into[0] += seconds
                into[1] += count
    if ttft[1] <= 0 or itl[1] <= 0:
        return None
    return 1000.0 * ttft[0] / ttft[1], 1000.0 * itl[0] / itl[1]


def histogram_increase(old: Cumulative | None, new: Cumulative) -> tuple[Bucket, ...]:
    """The outputs counted in each bucket between two scrapes of one engine's cumulative
    histogram, as ``(low, high, count)`` with ``count > 0``. ``old`` None (a target seen for
    the first time): nothing, the baseline is set (module docstring). A bucket that went down,
    or bounds that changed: the engine restarted, so everything in ``new`` is new."""
    if old is None:
        return ()
    before = dict(old)
    restarted = ([le for le, _ in old] != [le for le, _ in new]
                 or any(n < before[le] for le, n in new))
    out: list[Bucket] = []
    low, below_new, below_old = 0.0, 0.0, 0.0
    for le, n in new:
        was = 0.0 if restarted else before[le]
        count = (n - below_new) - (was - below_old)
        if count > 0:
            out.append((low, le, count))
        low, below_new, below_old = le, n, was
    return tuple(out)


def aggregate(samples: Iterable[tuple[float, EngineSample]], targets: int, now: float, *,
              max_age_s: float, min_coverage: float) -> PoolStats:
    """Sum the samples younger than ``max_age_s``; stale below ``min_coverage`` of targets."""
    fresh = [s for at, s in samples if now - at <= max_age_s]
    kvs = [s.kv_usage for s in fresh if s.kv_usage is not None]
    blocks = [s.kv_blocks for s in fresh if s.kv_blocks is not None]
    stale = not fresh or len(fresh) < min_coverage * targets
    return PoolStats(
        waiting=sum(s.waiting for s in fresh), running=sum(s.running for s in fresh),
        kv_usage_max=max(kvs) if kvs else None,
        kv_usage_mean=sum(kvs) / len(kvs) if kvs else None,
        targets=targets, fresh=len(fresh), stale=stale,
        kv_blocks=min(blocks, key=lambda b: b[0] * b[1]) if blocks else None,
        kv_usage_min=min(kvs) if kvs else None)


@dataclass(frozen=True)
class Correction:
    """Work to add to the ledger's snapshot before deciding (zero: no correction)."""

    extra_inflight: int = 0
    extra_ms: float = 0.0
    idle: bool = False  # the request's own replica has nothing to do (module docstring)
    queued: int = 0  # ... or holds this many waiting for a slot or KV memory (docstring) ...
    prefilling: int = 0  # ... or this many waiting for compute: their prompts first
    # The KV cache where it may go, as last reported: the named replica's, else the fresh ones'
    reported: Reported | None = None

    def apply(self, snapshot: Snapshot) -> Snapshot:
        if not self.extra_inflight:
            return snapshot
        return Snapshot(snapshot.inflight + self.extra_inflight,
                        snapshot.outstanding_ms + self.extra_ms)


def correction(ledger: Snapshot, engines: PoolStats | None, *, fallback_request_ms: float,
               tolerance: float = 0.25, slack: int = 2) -> Correction:
    """How much to tighten admission; see the module docstring for the formula."""
    if engines is None or engines.stale:
        return Correction()
    allowed = ledger.inflight * (1.0 + tolerance) + slack
    extra = max(0, math.ceil(engines.total - allowed))
    if extra == 0:
        return Correction()
    cost = ledger.outstanding_ms / ledger.inflight if ledger.inflight else fallback_request_ms
    return Correction(extra, extra * cost)


def kv_reported(sample: EngineSample, kv_tokens: int) -> Reported | None:
    """What one replica's engine (one scrape's ``sample``) reported of its KV cache: the
    tokens free of its own cache if it reported its size, else of ``kv_tokens``; None: no
    usage reported or no bound (``EngineSample.kv_free``)."""
    free = sample.kv_free(kv_tokens)
    return None if free is None else Reported(free, free, sample.running + sample.waiting)


def with_reported_kv(pool: Pool, engines: PoolStats | None,
                     seen: dict[tuple[str, int, int], Pool]) -> Pool:
    """The pool with the KV cache its engines report (``vllm:cache_config_info``, the
    smallest fresh replica's) instead of the configured one: vLLM sizes its cache at start
    from the memory left, so what it says beats what was written down. ``seen``: the pools
    made so far, by (name, blocks, block size), so a decision makes none."""
    if engines is None or engines.stale or engines.kv_blocks is None:
        return pool
    blocks, size = engines.kv_blocks
    if (blocks, size) == (pool.engine.num_gpu_blocks, pool.engine.block_size):
        return pool
    key = (pool.name, blocks, size)
    reported = seen.get(key)
    if reported is None:
        engine = dataclasses.replace(pool.engine, num_gpu_blocks=blocks, block_size=size)
        reported = seen[key] = dataclasses.replace(pool, engine=engine)
    return reported


Targets = Callable[[str], Sequence[str]]
LengthSink = Callable[[str, Sequence[Bucket]], None]  # (pool, outputs finished this round)
SpeedSink = Callable[[str, float, float], None]  # (pool, first-token ms, inter-token ms)
RoundSink = Callable[[str, Sequence[EngineSample]], None]  # (pool, this round's samples)


class EngineStats:
    """Scrapes every replica of a pool; ``targets(pool)`` lists ``host:port`` or base URLs.

    Call ``await scrape(pool)`` on a timer (or ``start(pools, interval_s)``), read
    ``latest(pool)`` at decision time: it re-applies ``max_age_s`` at the clock's now, so a
    scraper that stopped turns stale by itself.
    """

    def __init__(self, targets: Targets | Mapping[str, Sequence[str]], *,
                 timeout_s: float = 0.5, max_age_s: float = 5.0, min_coverage: float = 0.5,
                 path: str = "/metrics", clock: Callable[[], float] = time.monotonic,
                 on_lengths: LengthSink | None = None,
                 on_speed: SpeedSink | None = None) -> None:
        self._targets: Targets = targets.__getitem__ if isinstance(targets, Mapping) else targets
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.max_age_s, self.min_coverage, self.path = max_age_s, min_coverage, path
        self._clock = clock
        self._samples: dict[str, dict[str, tuple[float, EngineSample]]] = {}
        self.on_lengths = on_lengths  # called once per round with the outputs finished since
        self.on_speed = on_speed  # called in a round where both latency histograms moved
        self.on_round: RoundSink | None = None  # called once per round with its samples
        self._errors: dict[str, str] = {}  # target -> last error, for logs and debugging
        self._sent: dict[str, dict[str, float]] = {}  # pool -> target -> last request sent
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def _url(self, target: str) -> str:
        base = target if "://" in target else f"http://{target}"
        return base.rstrip("/") + self.path

    async def _one(self, session: aiohttp.ClientSession, target: str) -> EngineSample | None:
        try:
            async with session.get(self._url(target)) as resp:
                resp.raise_for_status()
                sample = parse(await resp.text())
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if target not in self._errors:
                log.warning("engine metrics of %s: %r", target, exc)
            self._errors[target] = repr(exc)
            return None
        self._errors.pop(target, None)
        return sample

    async def scrape(self, pool: str) -> PoolStats:
        """Scrape every target of ``pool`` at once; returns the new aggregate."""
        targets = list(self._targets(pool))
        session = self._session or aiohttp.ClientSession(timeout=self.timeout)
        try:
            results = await asyncio.gather(*(self._one(session, t) for t in targets))
        finally:
            if session is not self._session:
                await session.close()
        now = self._clock()
        known = self._samples.setdefault(pool, {})
        sent = self._sent.get(pool, {})
        for target in list(known):
            if target not in targets:
                del known[target]  # a replica that left the pool
                sent.pop(target, None)
        rounds = [(known[t][1] if t in known else None, sample)  # (previous, this round's)
                  for t, sample in zip(targets, results, strict=True) if sample is not None]
        for target, sample in zip(targets, results, strict=True):
            if sample is not None:
                known[target] = (now, sample)
        if self.on_lengths is not None:
            self.on_lengths(pool, finished_since(rounds))
        speed = speed_since(rounds)
        if speed is not None and self.on_speed is not None:
            self.on_speed(pool, *speed)
        if self.on_round is not None:
            self.on_round(pool, [sample for _, sample in rounds])
        return self.latest(pool)

    def latest(self, pool: str) -> PoolStats:
        known = self._samples.get(pool, {})
        targets = len(list(self._targets(pool)))
        return aggregate(known.values(), targets, self._clock(), max_age_s=self.max_age_s,
                         min_coverage=self.min_coverage)

    def where(self, pool: str, destination: str | None) -> EngineSample | None:
        """The fresh sample of the replica a request goes to: ``destination`` (``host:port``),
        if taken after the last ``sent`` to it; with none named, the target holding the
        fewest waiting (where a least-loaded balancer sends it). None: no fresh sample says."""
        now = self._clock()
        sent = self._sent.get(pool, {})
        seen = []
        for target, (at, sample) in self._samples.get(pool, {}).items():
            if now - at > self.max_age_s:
                continue
            if destination is None:
                seen.append(sample)
            elif address(target) == destination:
                return sample if at > sent.get(target, -math.inf) else None
        return min(seen, key=lambda sample: sample.waiting, default=None)

    def sent(self, pool: str, destination: str) -> None:
        """A request is on its way to ``destination``: its last sample is out of date."""
        for target in self._samples.get(pool, {}):
            if address(target) == destination:
                self._sent.setdefault(pool, {})[target] = self._clock()

    def errors(self) -> Mapping[str, str]:
        return dict(self._errors)

    async def start(self, pools: Iterable[str], interval_s: float = 2.0) -> None:
        self._session = aiohttp.ClientSession(timeout=self.timeout)
        for pool in pools:
            self._tasks.append(asyncio.create_task(self._loop(pool, interval_s)))

    async def _loop(self, pool: str, interval_s: float) -> None:
        while True:
            try:
                await self.scrape(pool)
            except Exception:  # a bug here must not end the loop; latest() goes stale
                log.exception("scraping engines of pool %s failed", pool)
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        await cancel_all(self._tasks)
        if self._session is not None:
            await self._session.close()
            self._session = None
