"""Cost of a request in tokens: prompt tokens counted, output tokens charged.

    prompt = tokens(texts) + token ids given directly
             + messages x message_overhead_tokens      (the chat template's per-message frame)
             + non-text parts x non_text_part_tokens   (images, audio, files: a flat charge)
    output = (max_tokens or the pool's default) x choices     (0 for embeddings)

Token counters are one-method strategies. ``TokenizerCounter`` counts exactly with the model's
``tokenizer.json`` (HF ``tokenizers``; ``encode_batch_fast`` releases the GIL, so the caller
may run it on a thread). ``ByteCounter`` divides UTF-8 bytes by a bytes-per-token ratio: the
fallback when no tokenizer is configured, and the estimate for prompts too long to count
exactly within Envoy's message timeout (``exact_max_bytes``: 8 MiB of text takes ~5 s to
tokenize on one core, while any real context window ends near 512 KiB).

The output charged is the most a request can generate; what it will generate is a prediction,
made by an output-length predictor (one method, ``predict(prompt_tokens, charged) ->
(expected, long)``) and carried in the ``Cost`` for ``decide``:

- ``ChargeInFull`` (the default for a pool without output statistics): no prediction, so the
  model charges ``max_tokens`` in full;
- ``Configured``: the pool's ``expected_output_tokens`` / ``long_output_tokens``;
- ``Observed``: learned online from completed requests' output lengths (a decaying histogram
  on a log grid: the mean and the 99th percentile), falling back to another predictor until it
  has seen ``min_samples``. It is pure state: whoever sees completions feeds it (the simulator
  does; the engines' ``vllm:request_generation_tokens`` histogram can).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from extproc.admission import Cost
from extproc.config import Pool
from extproc.errors import BadRequest
from extproc.request import InferenceRequest

EXACT_MAX_BYTES = 512 * 1024


class TokenCounter(Protocol):
    exact: bool

    def count(self, texts: Sequence[str]) -> int: ...


class ByteCounter:
    exact = False

    def __init__(self, bytes_per_token: float) -> None:
        self.bytes_per_token = bytes_per_token

    def count(self, texts: Sequence[str]) -> int:
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        return math.ceil(size / self.bytes_per_token)


class TokenizerCounter:
    """Exact counts from a ``tokenizer.json``; texts over ``exact_max_bytes`` are estimated."""

    exact = True

    def __init__(self, path: str, *, bytes_per_token: float = 4.0,
                 exact_max_bytes: int = EXACT_MAX_BYTES) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(path)
        self._fallback = ByteCounter(bytes_per_token)
        self.exact_max_bytes = exact_max_bytes

    def count(self, texts: Sequence[str]) -> int:
        if not texts:
            return 0
        if sum(len(t) for t in texts) > self.exact_max_bytes:
            return self._fallback.count(texts)
        try:
            encodings = self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        except Exception as exc:  # tokenizers raises plain Exceptions on unencodable input
            raise BadRequest("prompt text could not be tokenized") from exc
        return sum(len(e) for e in encodings)


def counter_for(pool: Pool) -> TokenCounter:
    if pool.tokenizer:
        return TokenizerCounter(pool.tokenizer, bytes_per_token=pool.bytes_per_token)
    return ByteCounter(pool.bytes_per_token)


def prompt_chars(request: InferenceRequest) -> int:
    return sum(len(t) for t in request.texts)


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
        self._cached: tuple[float | None, float | None] | None = None
        self._fresh = 0.0  # observations since the prediction was computed

    def observe(self, tokens: float, count: float = 1.0) -> None:
        self._counts[bisect.bisect_left(_GRID, tokens)] += count
        self._n += count
        self._sum += tokens * count
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

    def predict(self, prompt_tokens: int, charged: int) -> tuple[float | None, float | None]:
        if self._n < self.min_samples:
            return self.fallback.predict(prompt_tokens, charged)
        if self._cached is None:
            self._cached = (self._sum / self._n, self._quantile())
            self._fresh = 0.0
        return self._cached


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
    prompt = (
        counter.count(request.texts)
        + request.token_ids
        + request.messages * pool.message_overhead_tokens
        + request.non_text_parts * pool.non_text_part_tokens
    )
    return cost_of(prompt, request.max_tokens, request.choices, pool,
                   prefill_only=request.prefill_only, predictor=predictor)
