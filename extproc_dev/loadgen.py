"""An open-loop load generator for OpenAI-compatible chat endpoints, on aiohttp.

Open loop: every arrival time is fixed before the run (Poisson or evenly spaced, from a seed)
and each request starts at its time whatever happened to those before it. A closed loop (N
clients each waiting for its answer) slows down with the server and hides the very queue that
admission control exists to prevent. Latencies are measured from the *scheduled* arrival, so a
generator that falls behind counts its own lateness against the server rather than hiding it;
``Result.start_lag_s`` says how late each request really left.

Lengths follow the log-normal fits of the Azure 2023 conversation trace (ln prompt tokens
6.63 / 0.99, ln output tokens 5.02 / 0.86), prompts capped at 4,000 tokens, outputs at
``max_tokens`` (the request asks for ``max_tokens`` and the true output never exceeds it). The
true output length travels to the fake backend as ``extproc_output_tokens``; real servers
ignore the field. Lengths come from a random stream of their own, so request ``i`` has the same
lengths whatever the rate.

Prompt text is ordinary English-looking words and numbers (a fixed list, nothing secret),
``BYTES_PER_TOKEN`` bytes per prompt token: the fake backend counts exactly ``bytes // 4``;
the Llama 3 tokenizer counts about 10% fewer. Prompts are never logged.

Each client abandons its request after ``timeout_s`` (its connection is closed, so the server
sees the disconnect). Streaming answers are Server-Sent Events: every ``data:`` event with
content counts as a token, until ``data: [DONE]``; the first one is the time to first token.

Every request ends as exactly one ``outcome``: ok, rejected (429), abandoned or failed. A
``Tally`` handed to ``run`` counts them while the run goes (for a progress line); ``summarize``
counts them afterwards.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

BYTES_PER_TOKEN = 4

_WORD_TEXT = """
the of and to in is that for it as was with be by on not he this are or his from at which
but have an they you were her she there been one all we their has would when if so no will
more can who its some could them than other into time only new about these two may first
then do any like my now over such our man me even most made after also did many before must
through years where much your way well down should because each just those people how too
little state good very make world still own see men work long here get both between life being
under never day same another know while last might us great old year off come since against go
came right used take three patient clinic doctor nurse report morning visit summary history
medication dose daily blood pressure heart rate review plan follow note please write short
letter explain result test question answer table list section model request response service
system team project week month data value change number level group case point area part place
"""
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class Lengths:
    """Log-normal prompt and output lengths; defaults: the Azure conversation trace fit."""

    prompt_mu: float = 6.63
    prompt_sigma: float = 0.99
    prompt_cap: int = 4000
    output_mu: float = 5.02
    output_sigma: float = 0.86
    max_tokens: int = 512  # asked for in every request; caps the true output

    def mean_prompt(self) -> float:
        """``E[min(X, prompt_cap)]`` for the log-normal ``X``."""
        return _capped_lognormal_mean(self.prompt_mu, self.prompt_sigma, self.prompt_cap)

    def mean_output(self) -> float:
        """``E[min(X, max_tokens)]`` for the log-normal ``X``."""
        return _capped_lognormal_mean(self.output_mu, self.output_sigma, self.max_tokens)


CONVERSATION = Lengths()


def _capped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """``E[min(X, c)] = e^(mu + s^2/2) Phi((ln c - mu - s^2)/s) + c (1 - Phi((ln c - mu)/s))``."""

    def phi(z: float) -> float:
        return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))

    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma**2 / 2) * phi(z - sigma) + cap * (1.0 - phi(z))


@dataclass(frozen=True)
class Planned:
    """One request of a workload: when it leaves (seconds from the start) and its lengths."""

    at_s: float
    prompt_tokens: int
    output_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    seed: int
    rate_rps: float
    duration_s: float
    requests: tuple[Planned, ...]

    @classmethod
    def generate(cls, rate_rps: float, duration_s: float, *, seed: int = 0,
                 lengths: Lengths = CONVERSATION, poisson: bool = True) -> Workload:
        """Arrivals in ``[0, duration_s)`` at ``rate_rps``: Poisson (exponential gaps) or evenly
        spaced; the same seed gives the same workload."""
        if rate_rps <= 0 or duration_s <= 0:
            raise ValueError(f"rate_rps and duration_s must be > 0, got {rate_rps}, {duration_s}")
        arrivals = random.Random(f"{seed}:arrivals")
        sizes = random.Random(f"{seed}:lengths")
        requests: list[Planned] = []
        at = arrivals.expovariate(rate_rps) if poisson else 0.0
        while at < duration_s:
            prompt = round(sizes.lognormvariate(lengths.prompt_mu, lengths.prompt_sigma))
            output = round(sizes.lognormvariate(lengths.output_mu, lengths.output_sigma))
            requests.append(Planned(
                at_s=at,
                prompt_tokens=min(max(1, prompt), lengths.prompt_cap),
                output_tokens=min(max(1, output), lengths.max_tokens),
                max_tokens=lengths.max_tokens,
            ))
            at += arrivals.expovariate(rate_rps) if poisson else 1.0 / rate_rps
        return cls(seed, rate_rps, duration_s, tuple(requests))


def prompt_text(tokens: int, rng: random.Random) -> str:
    """Sentences of common words and numbers, exactly ``tokens * BYTES_PER_TOKEN`` bytes."""
    size = tokens * BYTES_PER_TOKEN
    sentences: list[str] = []
    length = 0
    while length < size:
        words = rng.choices(_WORDS, k=rng.randint(5, 12))
        words[0] = words[0].capitalize()
        if rng.random() < 0.5:
            words.insert(rng.randrange(1, len(words)), str(rng.randint(2, 999)))
        if rng.random() < 0.4:
            i = rng.randrange(1, len(words))
            words[i] += ","
        sentence = " ".join(words) + ("." if rng.random() < 0.8 else "?")
        sentences.append(sentence)
        length += len(sentence) + 1
    return " ".join(sentences)[:size]


def chat_body(planned: Planned, text: str, *, model: str, stream: bool = True,
              hint_output: bool = True) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": planned.max_tokens,
        "stream": stream,
    }
    if hint_output:
        body["extproc_output_tokens"] = planned.output_tokens
    return json.dumps(body).encode()


@dataclass(frozen=True)
class Result:
    """What one client saw. Times are seconds from the request's scheduled arrival."""

    index: int
    status: int  # HTTP status; 0 when no response head arrived (abandoned or connection error)
    latency_s: float  # to the end of the answer, the abandonment or the error
    ttft_s: float | None = None  # first content token (streaming only)
    tokens: int = 0  # content events (streaming) or usage.completion_tokens
    completed: bool = False  # 200 and the whole answer arrived ([DONE] when streaming)
    abandoned: bool = False  # the client gave up at its timeout
    retry_after_s: float | None = None  # the Retry-After of a 429
    error: str | None = None  # exception class name, if the request failed
    start_lag_s: float = 0.0  # how late the request actually left

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.completed


OUTCOMES = ("ok", "rejected", "abandoned", "failed")


def outcome(result: Result) -> str:
    """One of ``OUTCOMES``: ok (200, whole answer), rejected (a 429), abandoned (the client gave
    up at its timeout) or failed (any other status, a broken stream, a connection error)."""
    if result.ok:
        return "ok"
    if result.status == 429:
        return "rejected"
    return "abandoned" if result.abandoned else "failed"


def within_slo(result: Result, deadline_s: float, ttft_objective_s: float | None) -> bool:
    """ok, ended within ``deadline_s`` of its arrival and, if an objective is given, its first
    token within ``ttft_objective_s`` (see ``summarize``)."""
    return (result.ok and result.latency_s <= deadline_s
            and (ttft_objective_s is None
                 or (result.ttft_s is not None and result.ttft_s <= ttft_objective_s)))


@dataclass
class Tally:
    """Live counts of a run in progress: requests sent and how many ended as each outcome.
    ``run`` updates it on the event loop's thread; read it from a task of the same loop."""

    sent: int = 0
    ended: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))

    @property
    def in_flight(self) -> int:
        return self.sent - sum(self.ended.values())

    def add(self, result: Result) -> None:
        self.ended[outcome(result)] += 1

    def _settle(self, task: asyncio.Task[Result]) -> None:
        if not task.cancelled() and task.exception() is None:
            self.add(task.result())


@dataclass
class _Progress:
    """Mutable per-request state, so a timeout still reports what had arrived."""

    status: int = 0
    ttft_s: float | None = None
    tokens: int = 0
    completed: bool = False
    retry_after_s: float | None = None


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None  # an HTTP date: not used by our gateway


def _has_content(event: Any) -> bool:
    if not isinstance(event, dict):
        return False
    for choice in event.get("choices") or ():
        if isinstance(choice, dict):
            delta = choice.get("delta")
            if (isinstance(delta, dict) and delta.get("content")) or choice.get("text"):
                return True
    return False


async def _exchange(session: aiohttp.ClientSession, url: str, body: bytes,
                    headers: Mapping[str, str], stream: bool, t0: float,
                    progress: _Progress) -> None:
    async with session.post(url, data=body, headers=headers) as resp:
        progress.status = resp.status
        if resp.status != 200:
            progress.retry_after_s = _retry_after(resp.headers.get("Retry-After"))
            await resp.read()
            return
        if not stream:
            answer = await resp.json(content_type=None)
            usage = answer.get("usage") if isinstance(answer, dict) else None
            if isinstance(usage, dict):
                progress.tokens = int(usage.get("completion_tokens") or 0)
            progress.completed = True
            return
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                progress.completed = True
                return
            if _has_content(json.loads(payload)):
                if progress.ttft_s is None:
                    progress.ttft_s = time.monotonic() - t0
                progress.tokens += 1


async def _one(session: aiohttp.ClientSession, index: int, url: str, body: bytes,
               headers: Mapping[str, str], stream: bool, scheduled: float,
               timeout_s: float) -> Result:
    """Send one request and record what came back; never raises (except cancellation).
    The client gives up ``timeout_s`` after it actually sent the request."""
    progress = _Progress()
    started = time.monotonic()
    error: str | None = None
    abandoned = False
    try:
        async with asyncio.timeout(timeout_s):
            await _exchange(session, url, body, headers, stream, scheduled, progress)
    except TimeoutError:
        abandoned = True
    except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: malformed SSE
        error = type(exc).__name__
    return Result(
        index=index, status=progress.status, latency_s=time.monotonic() - scheduled,
        ttft_s=progress.ttft_s, tokens=progress.tokens,
        completed=progress.completed and error is None and not abandoned,
        abandoned=abandoned, retry_after_s=progress.retry_after_s, error=error,
        start_lag_s=started - scheduled,
    )


async def run(workload: Workload, base_url: str, *, timeout_s: float = 30.0,
              model: str = "llama", path: str = "/v1/chat/completions", stream: bool = True,
              headers: Mapping[str, str] | None = None, hint_output: bool = True,
              tally: Tally | None = None) -> list[Result]:
    """Play ``workload`` against ``base_url``; one ``Result`` per request, in workload order.

    Bodies are built before the clock starts, so the schedule is not disturbed by building
    them. Rejected requests are not retried. Cancelling the run cancels every request.
    ``tally``, if given, counts each request as it leaves and as it ends.
    """
    bodies = [
        chat_body(p, prompt_text(p.prompt_tokens, random.Random(f"{workload.seed}:prompt:{i}")),
                  model=model, stream=stream, hint_output=hint_output)
        for i, p in enumerate(workload.requests)
    ]
    url = base_url.rstrip("/") + path
    sent_headers = {"Content-Type": "application/json", **(headers or {})}
    tasks: list[asyncio.Task[Result]] = []
    connector = aiohttp.TCPConnector(limit=0)  # open loop: never queue inside the client
    no_timeout = aiohttp.ClientTimeout(total=None)  # each request's own timeout_s applies
    async with aiohttp.ClientSession(connector=connector, timeout=no_timeout) as session:
        try:
            start = time.monotonic() + 0.05
            for i, planned in enumerate(workload.requests):
                delay = start + planned.at_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(_one(
                    session, i, url, bodies[i], sent_headers, stream, start + planned.at_s,
                    timeout_s))
                tasks.append(task)
                if tally is not None:
                    tally.sent += 1
                    task.add_done_callback(tally._settle)
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), interpolating linearly between closest ranks (numpy's
    default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(results: Sequence[Result], duration_s: float, deadline_s: float,
              ttft_objective_s: float | None = None) -> dict[str, Any]:
    """The numbers the demo and benchmarks print.

    Every request is exactly one ``outcome``: ok, rejected_429, abandoned or failed (any other
    status, a broken stream, a connection error). Percentiles are over the ok ones (200, whole
    answer). Shares are of all requests sent; rates are per second of the arrival window
    ``duration_s``.

    - *within deadline*: ok and ended within ``deadline_s`` of its arrival; ``goodput_rps``
      counts these, ``good_tokens_per_s`` their output tokens (a request-count goodput
      flatters a queue that lets short requests through and starves long ones; tokens do not);
    - *within SLO*: within deadline and, if ``ttft_objective_s`` is given, its first token
      within that objective (the latency class's promise to an interactive client).
    """
    sent = len(results)
    ok = [r for r in results if r.ok]
    latencies = [r.latency_s for r in ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    good = [r for r in ok if r.latency_s <= deadline_s]
    slo = [r for r in good if within_slo(r, deadline_s, ttft_objective_s)]
    outcomes = [outcome(r) for r in results]
    rejected = outcomes.count("rejected")
    abandoned = outcomes.count("abandoned")
    return {
        "sent": sent,
        "ok": len(ok),
        "rejected_429": rejected,
        "share_429": rejected / sent if sent else 0.0,
        "abandoned": abandoned,
        "failed": sent - len(ok) - rejected - abandoned,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p95_s": percentile(latencies, 95),
        "latency_p99_s": percentile(latencies, 99),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "within_deadline": len(good),
        "within_deadline_share": len(good) / sent if sent else 0.0,
        "goodput_rps": len(good) / duration_s,
        "good_tokens_per_s": sum(r.tokens for r in good) / duration_s,
        "within_slo": len(slo),
        "within_slo_share": len(slo) / sent if sent else 0.0,
        "slo_goodput_rps": len(slo) / duration_s,
        "tokens": sum(r.tokens for r in results),
        "start_lag_max_s": max((r.start_lag_s for r in results), default=0.0),
    }
