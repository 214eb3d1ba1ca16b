"""Pricing a request: its prompt counted, or estimated and counted exactly afterwards.

Texts counted before cost a lookup (``TokenizerCounter``'s cache: a chat turn pays only for its
new message). New text up to ``ESTIMATE_CHARS`` is counted exactly before the decision. A
byte-level BPE tokenizer counts it a piece at a time on the event loop (``extproc.tokens.pieces``:
~0.3-0.5 µs a token). Any other tokenizer counts with its own call,
~1 µs a token: while other decisions are under way in the process (``OFFLOAD_WHEN_DECIDING``),
off the event loop (``Batches``): the texts of every request deciding at that moment go to the
tokenizer together, in one ``encode_batch_fast`` call on a thread of their own, which releases
the GIL, so the loop goes on parsing, deciding and answering other streams meanwhile. One
thread, so a batch waits at most for the one before it; a text twice in a batch is counted
once, and a text counted before is a cache hit. A decision alone in the process counts on the
loop: no other stream waits for the loop, and the trip to the thread would add two thread
wake-ups to its latency. Longer new text (a long
prompt never seen: 8,000 tokens take ~20 ms to count) is priced by the pool's ``Calibration``
instead, and the decision is taken at once when it comes out the same at the estimate's low
and high ends (``margin``) on the local view of the ledger (the gate says whether it does:
``close``); only a close decision waits for the exact count, on
the counting thread (``encode_batch_fast`` releases the GIL), and for at most ``COUNT_WAIT_S``:
a thread behind on a burst of long cold prompts would otherwise hold decisions past Envoy's
message timeout (which forwards the request unchecked when fail-open). Past it the decision is
taken on the estimate's high end, the conservative one, and counted
(``extproc_decision_fallthroughs_total{kind="count_wait"}``).

An admission made on an estimate is counted exactly on that thread afterwards (``count``), and
the gate sets its ledger entry's charge to the exact cost, so the ledger ends exact; the
calibration learns from every exact count. One thread: on a small machine a pool of tokenizing
threads starves the loop that answers Envoy. That thread counts ~45 prompts of 8,000 tokens a
second; when long cold prompts come faster, at most ``MAX_PENDING_COUNTS`` exact counts wait
for it (``claim``) and the others keep their estimate (the calibration has learned from the
counted ones), so neither memory nor a close decision's wait for the thread grows with the
backlog.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from extproc.decision.step import Ask
from extproc.errors import RequestError
from extproc.tokens.estimate import (
    Calibration,
    TokenCounter,
    TokenizerCounter,
    counter_for,
    prompt_tokens,
)

if TYPE_CHECKING:
    from extproc.config import Config, Pool
    from extproc.gateway.request import InferenceRequest
    from extproc.observability.metrics import Metrics

ESTIMATE_CHARS = 8 * 1024  # new prompt text longer than this is estimated (docstring)
MAX_PENDING_COUNTS = 8  # exact counts queued for the counting thread; beyond, estimates stay
COUNT_WAIT_S = 0.25  # the most a close decision waits for its exact count (docstring)
# New text goes to the batch thread when at least this many decisions are under way (this one
# included; ``Pricing.deciding``); fewer: counted on the loop (docstring). 1: always the
# thread; a number no process reaches: always the loop (as before issue 19; the benchmark's
# side-by-side variant sets it so).
OFFLOAD_WHEN_DECIDING = 2


@dataclass(frozen=True)
class Uncounted:
    """Prompt text a decision priced by estimate: what its exact count is still owed on."""

    texts: list[str] = field(repr=False)
    chars: int
    known: int  # tokens of the request's texts counted before
    counting: asyncio.Future[int] | None = field(default=None, repr=False)  # already begun


_Waiting = tuple[TokenCounter, Sequence[str], "asyncio.Future[int]"]


class Batches:
    """Exact counts for the requests deciding now, counted together on one thread (module
    docstring): while a batch is counted the next one gathers; when it is done, the next goes.
    """

    def __init__(self) -> None:
        self.thread = concurrent.futures.ThreadPoolExecutor(1, "extproc-batch")
        self._waiting: list[_Waiting] = []
        self._busy = False

    async def count(self, counter: TokenCounter, texts: Sequence[str]) -> int:
        """The texts' exact token count (``RequestError`` if they cannot be tokenized)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        self._waiting.append((counter, texts, done))
        self._next(loop)
        return await done

    def _next(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._busy or not self._waiting:
            return
        batch, self._waiting = self._waiting, []
        self._busy = True
        work = loop.run_in_executor(self.thread, _count_batch,
                                    [(counter, texts) for counter, texts, _ in batch])
        work.add_done_callback(functools.partial(self._settle, loop, batch))

    def _settle(self, loop: asyncio.AbstractEventLoop, batch: list[_Waiting],
                work: asyncio.Future[list[int | RequestError]]) -> None:
        self._busy = False
        try:
            results = work.result()
        except Exception as exc:  # a bug in counting: each request hears of it
            results = [RequestError(str(exc))] * len(batch)
        for (_, _, done), result in zip(batch, results, strict=True):
            if done.done():  # its stream went away
                continue
            if isinstance(result, RequestError):
                done.set_exception(result)
            else:
                done.set_result(result)
        self._next(loop)


def _count_batch(batch: Sequence[tuple[TokenCounter, Sequence[str]]]) -> list[int | RequestError]:
    """Each request's count (or why its texts cannot be counted), on the batch thread: the
    texts of requests sharing a tokenizer in one call; if that call fails, request by request,
    so one request's unencodable text fails only that request."""
    out: list[int | RequestError] = [0] * len(batch)
    groups: dict[int, list[int]] = {}
    for i, (counter, _) in enumerate(batch):
        groups.setdefault(id(counter), []).append(i)
    for members in groups.values():
        counter = batch[members[0]][0]
        if isinstance(counter, TokenizerCounter) and len(members) > 1:
            texts = [t for i in members for t in batch[i][1]]
            try:
                counts = iter(counter.counts(texts, native=True))
            except RequestError:
                pass
            else:
                for i in members:
                    out[i] = sum(next(counts) for _ in batch[i][1])
                continue
        for i in members:
            try:
                out[i] = counter.count(batch[i][1], native=True)
            except RequestError as exc:
                out[i] = exc
    return out


class Pricing:
    """Each pool's token counter and calibration, and the one counting thread."""

    def __init__(self, config: Config, metrics: Metrics,
                 counters: Mapping[str, TokenCounter] | None = None) -> None:
        self.metrics = metrics
        self.counters = dict(counters) if counters is not None else {
            p.name: counter_for(p) for p in config.pools
        }
        self.calibrations = {p.name: Calibration(p.bytes_per_token) for p in config.pools}
        self.counting = concurrent.futures.ThreadPoolExecutor(1, "extproc-count")
        self.pending = 0  # exact counts waiting for or running on that thread
        self.batches = Batches()  # exact counts before a decision
        self.deciding = 0  # decisions under way in the process (``Gate.check`` counts them)

    @staticmethod
    def _priced_at(request: InferenceRequest, pool: Pool, service_class: str,
                   deadline_ms: float | None, text_tokens: int) -> Ask:
        """The request's ask with its texts priced at ``text_tokens``."""
        return Ask(service_class, prompt_tokens(request, pool, text_tokens), request.max_tokens,
                   request.choices, deadline_ms, request.prefill_only, streaming=request.stream,
                   min_tokens=request.min_tokens, ignore_eos=request.ignore_eos,
                   fingerprint=request.fingerprint)

    async def ask(self, request: InferenceRequest, pool: Pool, service_class: str,
                  deadline_ms: float | None, close: Callable[[Ask, Ask], bool]
                  ) -> tuple[Ask, Uncounted | None]:
        """The request's ask, its prompt counted exactly or (long new text, and ``close`` says
        the decision is not close at the estimate's two ends) estimated; then also what is
        still to count (module docstring)."""
        counter = self.counters[pool.name]
        known, missing = counter.cached(request.texts)
        chars = sum(len(t) for t in missing)
        if not missing or not counter.exact or chars <= ESTIMATE_CHARS:
            how = "counted" if missing else "cached"
            self.metrics.prompt_counts.labels(pool.name, how).inc()
            if (missing and counter.exact and not counter.pieces
                    and self.deciding >= OFFLOAD_WHEN_DECIDING):
                # off the loop, with the texts of the other requests deciding now
                text = known + await self.batches.count(counter, missing)
            else:  # a piece at a time, alone, nothing new, or a byte count: here (docstring)
                text = known + counter.count(missing)
            return self._priced_at(request, pool, service_class, deadline_ms, text), None
        calibration = self.calibrations[pool.name]
        guess = calibration.estimate(chars)
        estimated = self._priced_at(request, pool, service_class, deadline_ms, known + guess)
        low, high = (self._priced_at(request, pool, service_class, deadline_ms,
                                  known + round(guess * (1.0 + m)))
                     for m in (-calibration.margin, calibration.margin))
        if not close(low, high):
            self.metrics.prompt_counts.labels(pool.name, "estimated").inc()
            return estimated, Uncounted(missing, chars, known)
        self.metrics.prompt_counts.labels(pool.name, "awaited").inc()
        counting = asyncio.get_running_loop().run_in_executor(
            self.counting, functools.partial(counter.count, missing, native=True))
        try:
            tokens = await asyncio.wait_for(asyncio.shield(counting), COUNT_WAIT_S)
        except TimeoutError:
            # The counting thread is behind (long cold prompts arriving faster than it counts):
            # decide now on the estimate's high end, the conservative one; the count corrects
            # the ledger when it comes, as for an estimated prompt.
            self.metrics.fallthroughs.labels("count_wait").inc()
            return high, Uncounted(missing, chars, known, counting)
        calibration.learn(chars, tokens)
        return self._priced_at(request, pool, service_class, deadline_ms, known + tokens), None

    def claim(self) -> bool:
        """A place on the counting thread for an exact count, if fewer than
        ``MAX_PENDING_COUNTS`` hold one; ``count`` gives it back."""
        if self.pending >= MAX_PENDING_COUNTS:
            return False
        self.pending += 1
        return True

    async def count(self, pool: str, uncounted: Uncounted) -> int | None:
        """The exact token count of the texts priced by estimate, off the event loop (None:
        they cannot be tokenized, the estimate stands); the calibration learns from it. Gives
        back the place ``claim`` took."""
        try:
            tokens = await (uncounted.counting or asyncio.get_running_loop().run_in_executor(
                self.counting, functools.partial(self.counters[pool].count, uncounted.texts,
                                                 native=True)))
        except RequestError:
            return None
        finally:
            self.pending -= 1
        self.calibrations[pool].learn(uncounted.chars, tokens)
        return tokens
