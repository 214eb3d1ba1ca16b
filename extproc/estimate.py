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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


def estimate(request: InferenceRequest, pool: Pool, counter: TokenCounter) -> Cost:
    prompt = (
        counter.count(request.texts)
        + request.token_ids
        + request.messages * pool.message_overhead_tokens
        + request.non_text_parts * pool.non_text_part_tokens
    )
    if request.prefill_only:
        output = 0
    else:
        output = (request.max_tokens or pool.default_max_tokens) * max(1, request.choices)
    return Cost(prompt_tokens=prompt, output_tokens=output)
