"""Cost of a request in tokens: prompt tokens counted, output tokens charged.

    prompt = tokens(texts) + token ids given directly
             + messages x message_overhead_tokens      (the chat template's per-message frame)
             + non-text parts x non_text_part_tokens   (images, audio, files: a flat charge)
    output = (max_tokens or the pool's default) x choices     (0 for embeddings)

Token counters are small strategies. ``TokenizerCounter`` counts exactly with the model's
``tokenizer.json`` (HF ``tokenizers``; ``encode_batch_fast`` releases the GIL, so the caller
may run it on a thread). ``ByteCounter`` divides UTF-8 bytes by a bytes-per-token ratio: the
fallback when no tokenizer is configured, and the estimate for prompts too long to count
exactly within Envoy's message timeout (``exact_max_bytes``: 8 MiB of text takes ~5 s to
tokenize on one core, while any real context window ends near 512 KiB).

Chat clients resend the whole conversation every turn, so ``TokenizerCounter`` remembers the
count of every text it has counted (each message's content, each prompt; texts shorter than
``CACHE_MIN_CHARS`` are cheaper to count than to look up): a turn pays only for its new
message. The cache is two generations of at most ``cache_entries / 2`` items each: new counts
and hits go into the young one; when it is full it becomes the old one and the old one is
dropped. A text used in the current or the previous generation is remembered (an approximate
LRU without per-entry bookkeeping; an ``OrderedDict`` LRU under the same churn settled at
twice the memory, and later). Keys are ``(length, hash)`` of the text, so it holds no prompt
text and its memory is bounded (~180 bytes an entry). Python's
string hash is keyed per process, so a client cannot aim a collision; a chance collision of
two 64-bit hashes of equal-length texts would misprice one request, never fail it.

``Calibration`` turns characters not yet counted into an estimated token count, learned from
the exact counts (``Gate`` decides a long cold prompt on it when the decision is not close, and
corrects the ledger when the exact count arrives).

The output charged is the most a request can generate; what it will generate is a prediction,
made by an output-length predictor (one method, ``predict(prompt_tokens, charged) ->
(expected, long)``) and carried in the ``Cost`` for ``decide``:

- ``ChargeInFull`` (the default for a pool without output statistics): no prediction, so the
  model charges ``max_tokens`` in full;
- ``Configured``: the pool's ``expected_output_tokens`` / ``long_output_tokens``;
- ``Observed``: learned online from completed requests' output lengths (a decaying histogram
  on a log grid: the mean and the 99th percentile), falling back to another predictor until it
  has seen ``min_samples``. It is pure state: whoever sees completions feeds it. The simulator
  feeds each completion (``observe``); the gateway, which never reads response bodies, feeds
  each scrape round's increase of the engines' ``vllm:request_generation_tokens`` histogram
  (``observe_bucket``: a coarse vLLM bucket spread log-uniformly over the grid cells inside it)
  and forgets with the same memory in seconds (``decay_factor``, ``OUTPUT_MEMORY_S``).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from extproc.admission import Cost
from extproc.config import Pool
from extproc.errors import BadRequest
from extproc.request import InferenceRequest

EXACT_MAX_BYTES = 512 * 1024
CACHE_ENTRIES = 100_000  # texts whose count is remembered (~18 MB at most)
CACHE_MIN_CHARS = 64  # shorter texts are counted again rather than looked up


class TokenCounter(Protocol):
    exact: bool

    def count(self, texts: Sequence[str]) -> int: ...

    def cached(self, texts: Sequence[str]) -> tuple[int, list[str]]: ...


class ByteCounter:
    exact = False

    def __init__(self, bytes_per_token: float) -> None:
        self.bytes_per_token = bytes_per_token

    def cached(self, texts: Sequence[str]) -> tuple[int, list[str]]:
        return 0, list(texts)  # counting is as cheap as looking up

    def count(self, texts: Sequence[str]) -> int:
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        return math.ceil(size / self.bytes_per_token)


class TokenizerCounter:
    """Exact counts from a ``tokenizer.json``, remembered per text (module docstring); texts
    over ``exact_max_bytes`` together are estimated. Safe to call from several threads."""

    exact = True

    def __init__(self, path: str, *, bytes_per_token: float = 4.0,
                 exact_max_bytes: int = EXACT_MAX_BYTES,
                 cache_entries: int = CACHE_ENTRIES) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(path)
        self._fallback = ByteCounter(bytes_per_token)
        self.exact_max_bytes = exact_max_bytes
        self.cache_entries = cache_entries
        self._young: dict[tuple[int, int], int] = {}
        self._old: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()

    @property
    def cache_size(self) -> int:
        return len(self._young) + len(self._old)

    def _remember(self, key: tuple[int, int], tokens: int) -> None:
        """Into the young generation; a full one becomes the old one (hold the lock)."""
        self._young[key] = tokens
        if len(self._young) >= max(1, self.cache_entries // 2):
            self._old, self._young = self._young, {}

    def cached(self, texts: Sequence[str]) -> tuple[int, list[str]]:
        """``(tokens of the texts counted before, the texts not counted yet)``."""
        known, missing = 0, []
        with self._lock:
            for text in texts:
                if len(text) < CACHE_MIN_CHARS:
                    missing.append(text)
                    continue
                key = (len(text), hash(text))
                hit = self._young.get(key)
                if hit is None and (hit := self._old.get(key)) is not None:
                    self._remember(key, hit)  # used again: it lives another generation
                if hit is None:
                    missing.append(text)
                else:
                    known += hit
        return known, missing

    def count(self, texts: Sequence[str]) -> int:
        known, missing = self.cached(texts)
        if not missing:
            return known
        if sum(len(t) for t in missing) > self.exact_max_bytes:
            return known + self._fallback.count(missing)
        try:
            encodings = self._tokenizer.encode_batch_fast(missing, add_special_tokens=False)
        except Exception as exc:  # tokenizers raises plain Exceptions on unencodable input
            raise BadRequest("prompt text could not be tokenized") from exc
        counts = [len(e) for e in encodings]
        with self._lock:
            for text, n in zip(missing, counts, strict=True):
                if len(text) >= CACHE_MIN_CHARS:
                    self._remember((len(text), hash(text)), n)
        return known + sum(counts)


class Calibration:
    """Tokens per character of text not counted yet, learned from exact counts.

        estimate = chars x ratio
        w        = max(weight, 1 / n)                    (n: exact counts seen, this one too)
        error   <- error + w x (|estimate - tokens| / tokens - error)
        ratio   <- ratio + w x (tokens / chars - ratio)
        margin   = min(MAX_MARGIN, max(MIN_MARGIN, 3 x error))

    Averages at first, then a moving average (``weight``) that follows a change of traffic.
    ``margin`` is how far an estimate may be off, relatively: a decision that comes out the
    same at ``estimate x (1 - margin)`` and ``estimate x (1 + margin)`` does not wait for the
    exact count. It starts at ``1 / bytes_per_token`` with a wide margin.
    """

    MIN_MARGIN = 0.05
    MAX_MARGIN = 0.5

    def __init__(self, bytes_per_token: float, *, weight: float = 0.05) -> None:
        self.ratio = 1.0 / bytes_per_token
        self.error = 0.1
        self.weight = weight
        self.samples = 0

    def estimate(self, chars: int) -> int:
        return math.ceil(chars * self.ratio)

    @property
    def margin(self) -> float:
        return min(self.MAX_MARGIN, max(self.MIN_MARGIN, 3.0 * self.error))

    def learn(self, chars: int, tokens: int) -> None:
        if chars <= 0 or tokens <= 0:
            return
        self.samples += 1
        w = max(self.weight, 1.0 / self.samples)
        miss = abs(chars * self.ratio - tokens) / tokens
        self.error += w * (miss - self.error)
        self.ratio += w * (tokens / chars - self.ratio)


def counter_for(pool: Pool) -> TokenCounter:
    if pool.tokenizer:
        return TokenizerCounter(pool.tokenizer, bytes_per_token=pool.bytes_per_token)
    return ByteCounter(pool.bytes_per_token)


class OutputPredictor(Protocol):
    def predict(self, prompt_tokens: int, charged: int) -> tuple[float | None, float | None]:
        """``(expected, long)`` output tokens; ``None`` where there is no prediction."""
        ...


class ChargeInFull:
    def predict(self, prompt_tokens: int, charged: int) -> tuple[float | None, float | None]:
        return None, None


@dataclass(frozen=True)
class Configured:
    expected: float | None
    long: float | None

    def predict(self, prompt_tokens: int, charged: int) -> tuple[float | None, float | None]:
        return self.expected, self.long


# Upper bounds of the histogram's buckets: ten per decade from 1 to 100,000 tokens.
_GRID = tuple(round(10 ** (i / 10), 3) for i in range(51))

# How long ``Observed`` remembers, in seconds: the e-folding time of forgetting 1% every 10 s
# (~16.6 min). The gateway (per scrape round) and the simulator (per sample) both decay by
# ``decay_factor`` of their interval, so they forget alike whatever the interval.
OUTPUT_MEMORY_S = 10.0 / -math.log(0.99)


def decay_factor(interval_s: float) -> float:
    """The ``Observed.decay`` factor per round of ``interval_s``: ``exp(-interval_s / memory)``
    (0.99 at 10 s), so the memory in seconds does not depend on the interval."""
    return math.exp(-interval_s / OUTPUT_MEMORY_S)


class Observed:
    """Mean and ``quantile`` of recent output lengths. ``observe`` adds completions;
    ``decay(f)`` multiplies every count by ``f`` (call it periodically to forget slowly).
    The quantile is interpolated within its bucket (bounds 26% apart). The prediction is
    recomputed once 2% of the histogram is new, not on every observation."""

    def __init__(self, fallback: OutputPredictor | None = None, *, quantile: float = 0.99,
                 min_samples: float = 50.0) -> None:
        self.fallback = fallback or ChargeInFull()
        self.quantile = quantile
        self.min_samples = min_samples
        self._counts = [0.0] * (len(_GRID) + 1)
        self._n = 0.0
        self._sum = 0.0
        self._cached: tuple[float, float] | None = None
        self._fresh = 0.0  # observations since the prediction was computed

    def observe(self, tokens: float, count: float = 1.0) -> None:
        self._add(bisect.bisect_left(_GRID, tokens), count, tokens * count)

    def observe_bucket(self, low: float, high: float, count: float) -> None:
        """``count`` outputs somewhere in ``(low, high]`` (a bucket of an engine's histogram),
        spread over the grid cells inside in proportion to their overlap in log space: within
        a coarse bucket (vLLM's 20-50) the quantile interpolates log-uniformly instead of
        finding every output at one point. Each cell's share is summed at the log-uniform mean
        of its part, ``(b - a) / ln(b / a)``. No output is shorter than one token, so a bucket
        from 0 starts at 1. ``high`` infinite (the +Inf bucket): the top cell, summed at
        ``max(low, top bound)``, the least those outputs can be."""
        if count <= 0:
            return
        if math.isinf(high):
            self._add(len(_GRID), count, count * max(low, _GRID[-1]))
            return
        low = max(low, min(high, 1.0))
        if high <= low or high <= _GRID[0]:
            self._add(bisect.bisect_left(_GRID, high), count, count * high)
            return
        span = math.log(high / low)
        first, last = bisect.bisect_left(_GRID, low), bisect.bisect_left(_GRID, high)
        for i in range(first, last + 1):  # cell i holds (_GRID[i - 1], _GRID[i]]
            a = max(low, _GRID[i - 1] if i > 0 else 0.0)
            b = min(high, _GRID[i] if i < len(_GRID) else high)
            if b <= a:
                continue
            share = count * math.log(b / a) / span
            self._add(i, share, share * (b - a) / math.log(b / a))

    def _add(self, cell: int, count: float, tokens: float) -> None:
        self._counts[cell] += count
        self._n += count
        self._sum += tokens
        self._fresh += count
        if self._fresh > 0.02 * self._n:  # recompute once 2% of what it knows is new
            self._cached = None

    def decay(self, factor: float) -> None:
        self._counts = [c * factor for c in self._counts]
        self._n *= factor
        self._sum *= factor
        self._cached = None

    @property
    def samples(self) -> float:
        return self._n

    def _quantile(self) -> float:
        target = self.quantile * self._n
        seen = 0.0
        for i, c in enumerate(self._counts):
            if c > 0 and seen + c >= target:
                low = _GRID[i - 1] if i > 0 else 0.0
                high = _GRID[i] if i < len(_GRID) else _GRID[-1]
                return low + (high - low) * (target - seen) / c
            seen += c
        return _GRID[-1]

    def learned(self) -> tuple[float, float] | None:
        """``(mean, quantile)`` of what it has seen; None below ``min_samples``."""
        if self._n < self.min_samples:
            return None
        if self._cached is None:
            self._cached = (self._sum / self._n, self._quantile())
            self._fresh = 0.0
        return self._cached

    def predict(self, prompt_tokens: int, charged: int) -> tuple[float | None, float | None]:
        got = self.learned()
        return got if got is not None else self.fallback.predict(prompt_tokens, charged)


def predictor_for(pool: Pool) -> OutputPredictor:
    """The pool's configured prediction, or none (charge in full)."""
    if pool.expected_output_tokens is None and pool.long_output_tokens is None:
        return ChargeInFull()
    return Configured(pool.expected_output_tokens, pool.long_output_tokens)


def cost_of(prompt_tokens: int, max_tokens: int | None, choices: int, pool: Pool, *,
            prefill_only: bool = False, predictor: OutputPredictor | None = None) -> Cost:
    """The charge rule: ``(max_tokens or the pool default) x choices``, plus the prediction."""
    if prefill_only:
        return Cost(prompt_tokens=prompt_tokens, output_tokens=0)
    output = (max_tokens or pool.default_max_tokens) * max(1, choices)
    expected, long = (predictor or predictor_for(pool)).predict(prompt_tokens, output)
    return Cost(prompt_tokens=prompt_tokens, output_tokens=output,
                expected_output_tokens=expected, long_output_tokens=long)


def estimate(request: InferenceRequest, pool: Pool, counter: TokenCounter,
             predictor: OutputPredictor | None = None) -> Cost:
    return cost_for(request, pool, counter.count(request.texts), predictor)


def cost_for(request: InferenceRequest, pool: Pool, text_tokens: int,
             predictor: OutputPredictor | None = None) -> Cost:
    """The request's cost given the token count of its texts."""
    prompt = (
        text_tokens
        + request.token_ids
        + request.messages * pool.message_overhead_tokens
        + request.non_text_parts * pool.non_text_part_tokens
    )
    return cost_of(prompt, request.max_tokens, request.choices, pool,
                   prefill_only=request.prefill_only, predictor=predictor)
