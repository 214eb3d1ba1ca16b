"""Client traffic for the fault, drain, overload and soak tests: many async HTTP clients against
a real Envoy, every request's fate recorded, plus the few probes those tests share.

Each request ends as exactly one ``Reply``: a status (the whole body read), a client timeout
(``error == "timeout"``: the request hung past what its client waits) or a connection error
(``error`` names the exception). Nothing is retried. Loads are closed (N clients, each sending
its next request when the last one is answered: the saturation probe) or open (arrivals at a
fixed rate whatever happens to earlier ones: overload and soak, where a slow gateway must not
slow the offered load down).

Prompts are ordinary words (``extproc_dev.loadgen.prompt_text``), different for every request so a
tokenizer's cache never makes the processor's work cheaper than production's; never logged.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import random
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc_dev.loadgen import prompt_text

CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Reply:
    """What one client saw; times are ``time.monotonic()`` seconds."""

    started: float
    ended: float
    status: int  # 0: no complete answer (see ``error``)
    error: str | None = None  # "timeout" (the client gave up) or an exception's class name

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    @property
    def answered(self) -> bool:
        return self.error is None and self.status != 0

    @property
    def kind(self) -> str:
        """A low-cardinality label: the status, "timeout" or the error's name."""
        return str(self.status) if self.answered else str(self.error)


HAN_PROMPTS = 256  # x ~670 pieces each: more than extproc.tokens.pieces.PIECE_CACHE


@dataclass(frozen=True)
class Ask:
    """The request every client sends: a chat completion of ``prompt_tokens`` words' worth,
    charged ``max_tokens``, generating ``output_tokens`` on the fake backend."""

    prompt_tokens: int = 20
    max_tokens: int = 64
    output_tokens: int = 8
    deadline_ms: float | None = None  # sent as x-admission-deadline-ms
    bearer: str | None = None  # sent as the Authorization header (a JWT, for a tenant)
    han: bool = False  # the prompts in random Han characters instead (``texts``)

    def texts(self, seed: int = 0) -> list[str]:
        """A few prompts of ``prompt_tokens`` tokens' worth (made once: it takes a while).
        With ``han``, ``HAN_PROMPTS`` prompts of ``prompt_tokens`` random Han characters, a
        space after every sixth: ~1.7 Llama 3 tokens a character, in more distinct pieces
        than the processor's piece cache holds (``extproc.tokens.pieces``), so sent in turn every
        piece costs a call of the tokenizer's model."""
        if self.han:
            rng = random.Random(f"{seed}:han")
            han = [chr(c) for c in range(0x4E00, 0x9FA6)]
            words = self.prompt_tokens // 6
            return [" ".join("".join(rng.choices(han, k=6)) for _ in range(words))
                    for _ in range(HAN_PROMPTS)]
        return [prompt_text(self.prompt_tokens, random.Random(f"{seed}:{i}")) for i in range(8)]

    def body(self, i: int, texts: Sequence[str]) -> bytes:
        """Request ``i``: its own number leads the prompt, so no two prompts are the same
        and a tokenizer's cache of whole texts never makes a request cheaper than a fresh
        one."""
        return json.dumps({
            "model": "m", "max_tokens": self.max_tokens,
            "extproc_output_tokens": self.output_tokens,
            "messages": [{"role": "user", "content": f"{i}. {texts[i % len(texts)]}"}],
        }).encode()

    def headers(self) -> dict[str, str]:
        extra = {} if self.deadline_ms is None else {
            "x-admission-deadline-ms": f"{self.deadline_ms:.0f}"}
        if self.bearer is not None:
            extra["authorization"] = f"Bearer {self.bearer}"
        return {"content-type": "application/json", **extra}


@dataclass
class Traffic:
    """Clients of ``url`` (Envoy), each request given up after ``timeout_s``."""

    url: str
    ask: Ask = field(default_factory=Ask)
    timeout_s: float = 10.0
    replies: list[Reply] = field(default_factory=list)
    _texts: list[str] = field(init=False, repr=False)
    _next: itertools.count[int] = field(init=False, repr=False, default_factory=itertools.count)

    def __post_init__(self) -> None:
        self._texts = self.ask.texts()
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Traffic:
        # open loop: never queue inside the client; each request's own timeout applies
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=None))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def one(self) -> Reply:
        """Send one request and record its fate; never raises (but for cancellation)."""
        assert self._session is not None, "use `async with Traffic(...)`"
        body = self.ask.body(next(self._next), self._texts)
        started = time.monotonic()
        status, error = 0, None
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._session.post(self.url + CHAT, data=body,
                                              headers=self.ask.headers()) as resp:
                    await resp.read()
                    status = resp.status
        except TimeoutError:
            error = "timeout"
        except (aiohttp.ClientError, OSError) as exc:
            status, error = 0, type(exc).__name__
        reply = Reply(started, time.monotonic(), status, error)
        self.replies.append(reply)
        return reply

    async def closed(self, clients: int, stop: asyncio.Event) -> None:
        """``clients`` clients, each sending again as soon as it is answered, until ``stop``."""

        async def client() -> None:
            while not stop.is_set():
                await self.one()

        await asyncio.gather(*(client() for _ in range(clients)))

    async def open(self, rate_rps: float, until: asyncio.Event | float) -> None:
        """Evenly spaced arrivals at ``rate_rps`` until the event ``until`` is set, or for
        ``until`` seconds; then waits for every request sent. A client that falls behind sends
        the late ones at once: the offered load is kept, not quietly lowered (with a duration,
        exactly ``rate_rps x until`` requests, however busy the machine)."""
        stop = until if isinstance(until, asyncio.Event) else asyncio.Event()
        planned = None if isinstance(until, asyncio.Event) else round(rate_rps * until)
        tasks: set[asyncio.Task[Reply]] = set()
        start = time.monotonic()
        for i in itertools.count():
            if stop.is_set() or i == planned:
                break
            delay = start + i / rate_rps - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                if stop.is_set():
                    break
            task = asyncio.create_task(self.one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    def between(self, start: float, end: float) -> list[Reply]:
        """The replies to requests sent in ``[start, end)``."""
        return [r for r in self.replies if start <= r.started < end]


def count(replies: Sequence[Reply]) -> dict[str, int]:
    return dict(collections.Counter(r.kind for r in replies))


async def saturation_rps(url: str, ask: Ask, *, clients: int = 32, seconds: float = 3.0,
                         warmup_s: float = 0.5) -> float:
    """The stack's throughput with ``clients`` closed-loop clients (answers per second after a
    warm-up): the most it serves, so the load at which queues start to grow."""
    async with Traffic(url, ask, timeout_s=30.0) as traffic:
        stop = asyncio.Event()
        run = asyncio.create_task(traffic.closed(clients, stop))
        await asyncio.sleep(warmup_s)
        begin = time.monotonic()
        await asyncio.sleep(seconds)
        end = time.monotonic()
        stop.set()
        await run
    done = [r for r in traffic.replies if begin <= r.ended < end and r.answered]
    return len(done) / (end - begin)


def health(port: int, service: str = "", timeout: float = 1.0) -> str:
    """The gRPC health status of ``service`` on the processor at ``port``: "SERVING",
    "NOT_SERVING", or the gRPC error code's name when it does not answer."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            return str(err.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def envoy_stats(admin_port: int, contains: str = "") -> dict[str, int]:
    """Envoy's counters and gauges from its admin endpoint (``/stats``), by full name."""
    url = f"http://127.0.0.1:{admin_port}/stats?filter={contains}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    stats: dict[str, int] = {}
    for line in lines:
        name, _, value = line.partition(": ")
        if value.strip().isdigit():
            stats[name] = int(value)
    return stats


def rss_bytes(pid: int) -> int:
    """Resident memory of a process, from ``/proc/<pid>/status`` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def wait_until(predicate: Callable[[], bool], within_s: float, what: str,
                     interval: float = 0.05) -> float:
    """Poll ``predicate`` (on a thread: it may block) until true; seconds it took."""
    begin = time.monotonic()
    while not await asyncio.to_thread(predicate):
        if time.monotonic() - begin > within_s:
            raise AssertionError(f"{what}: not reached within {within_s:.1f}s")
        await asyncio.sleep(interval)
    return time.monotonic() - begin


def figures(**values: Any) -> str:
    """One line of ``key=value`` figures for a test's output (no request content)."""
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    return " ".join(f"{k}={fmt(v)}" for k, v in values.items())

