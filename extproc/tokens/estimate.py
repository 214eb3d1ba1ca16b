"""A request's prompt in tokens: counted, cached, or estimated while the count comes.

    prompt = tokens(texts) + token ids given directly
             + messages x message_overhead_tokens      (the chat template's per-message frame)
             + non-text parts x non_text_part_tokens   (images, audio, files: a flat charge)

(The output side, what a request is charged and promised, is ``extproc.decision.step.cost_of`` from
the pool's learned lengths, ``extproc.decision.lengths``.)

Token counters are small strategies. ``TokenizerCounter`` counts exactly with the model's
``tokenizer.json`` (HF ``tokenizers``): for the byte-level BPE family a piece at a time with
the tokenizer's own regex and model (``extproc.tokens.pieces``: about half the CPU, on the calling
thread), otherwise with the tokenizer's ``encode_batch_fast``, which releases the GIL, so the
caller may run it on a thread (``native``: always the tokenizer's call). ``ByteCounter``
divides UTF-8 bytes by a bytes-per-token ratio: the fallback when no tokenizer is configured,
and the estimate for prompts too long to count
exactly within Envoy's message timeout (``exact_max_bytes``: 8 MiB of text takes ~5 s to
tokenize on one core, while any real context window ends near 512 KiB).

Chat clients resend the whole conversation every turn, so ``TokenizerCounter`` remembers the
count of every text it has counted (each message's content, each prompt; texts shorter than
``CACHE_MIN_CHARS`` are cheaper to count than to look up): a turn pays only for its new
message. The cache holds ``cache_entries`` counts in two generations
(``extproc.tokens.generations``). Keys are ``(length, hash)`` of the text, so it holds no prompt
text and its memory is bounded (~180 bytes an entry). Python's
string hash is keyed per process, so a client cannot aim a collision; a chance collision of
two 64-bit hashes of equal-length texts would misprice one request, never fail it.

``Calibration`` turns characters not yet counted into an estimated token count, learned from
the exact counts (``Gate`` decides a long cold prompt on it when the decision is not close, and
corrects the ledger when the exact count arrives).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from extproc.errors import BadRequest
from extproc.tokens.generations import TwoGenerations
from extproc.tokens.pieces import PieceCounter

if TYPE_CHECKING:
    from extproc.config import Pool
    from extproc.gateway.request import InferenceRequest

EXACT_MAX_BYTES = 512 * 1024
CACHE_ENTRIES = 100_000  # texts whose count is remembered (~18 MB at most)
CACHE_MIN_CHARS = 64  # shorter texts are counted again rather than looked up


class TokenCounter(Protocol):
    exact: bool
    pieces: bool  # counts a piece at a time on the calling thread (extproc.tokens.pieces)

    def count(self, texts: Sequence[str], *, native: bool = False) -> int: ...

    def cached(self, texts: Sequence[str]) -> tuple[int, list[str]]: ...


class ByteCounter:
    exact = False
    pieces = False

    def __init__(self, bytes_per_token: float) -> None:
        self.bytes_per_token = bytes_per_token

    def cached(self, texts: Sequence[str]) -> tuple[int, list[str]]:
        return 0, list(texts)  # counting is as cheap as looking up

    def count(self, texts: Sequence[str], *, native: bool = False) -> int:
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        return math.ceil(size / self.bytes_per_token)


class TokenizerCounter:
    """Exact counts from a ``tokenizer.json``, remembered per text (module docstring); texts
    over ``exact_max_bytes`` together are estimated. Safe to call from several threads."""

    exact = True

    def __init__(self, path: str, *, bytes_per_token: float = 4.0,
                 exact_max_bytes: int = EXACT_MAX_BYTES,
                 cache_entries: int = CACHE_ENTRIES, pieces: bool = True) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(path)
        self._pieces = PieceCounter.of(self._tokenizer) if pieces else None
        self.pieces = self._pieces is not None
        self._fallback = ByteCounter(bytes_per_token)
        self.exact_max_bytes = exact_max_bytes
        self.cache: TwoGenerations[tuple[int, int]] = TwoGenerations(cache_entries)
        self._lock = threading.Lock()  # held around every use of the cache

    @property
    def cache_size(self) -> int:
        return len(self.cache)

    def _lookup(self, text: str) -> int | None:
        """The text's remembered count, if any (hold the lock)."""
        if len(text) < CACHE_MIN_CHARS:
            return None
        return self.cache.get((len(text), hash(text)))

    def cached(self, texts: Sequence[str]) -> tuple[int, list[str]]:
        """``(tokens of the texts counted before, the texts not counted yet)``."""
        known, missing = 0, []
        with self._lock:
            for text in texts:
                if (hit := self._lookup(text)) is None:
                    missing.append(text)
                else:
                    known += hit
        return known, missing

    def count(self, texts: Sequence[str], *, native: bool = False) -> int:
        """The texts' tokens together (estimated by bytes past ``exact_max_bytes``);
        ``native``: counted by the tokenizer's own call, which releases the GIL (for a
        thread beside the event loop), never a piece at a time."""
        known, missing = self.cached(texts)
        if not missing:
            return known
        if sum(len(t) for t in missing) > self.exact_max_bytes:
            return known + self._fallback.count(missing)
        return known + sum(self.counts(missing, native=native))

    def counts(self, texts: Sequence[str], *, native: bool = False) -> list[int]:
        """Each text's exact count: a piece at a time where ``extproc.tokens.pieces`` can (unless
        ``native``), the rest in one call of the tokenizer (which releases the GIL); texts
        counted before are looked up. Every text is counted whatever its length (``count``
        applies ``exact_max_bytes`` to a request's texts together)."""
        out: list[int | None] = []
        todo: dict[tuple[int, int], list[int]] = {}  # a text twice in a batch: counted once
        order: list[str] = []
        with self._lock:
            for i, text in enumerate(texts):
                out.append(hit := self._lookup(text))
                if hit is None:
                    key = (len(text), hash(text))
                    if key not in todo:
                        order.append(text)
                    todo.setdefault(key, []).append(i)
        if order and self._pieces is not None and not native:
            order = self._by_pieces(order, todo, out)
        if order:
            try:
                encodings = self._tokenizer.encode_batch_fast(order, add_special_tokens=False)
            except Exception as exc:  # tokenizers raises plain Exceptions on unencodable input
                raise BadRequest("prompt text could not be tokenized") from exc
            with self._lock:
                for text, encoding in zip(order, encodings, strict=True):
                    key, n = (len(text), hash(text)), len(encoding)
                    if len(text) >= CACHE_MIN_CHARS:
                        self.cache.put(key, n)
                    for i in todo[key]:
                        out[i] = n
        return [n or 0 for n in out]

    def _by_pieces(self, order: list[str], todo: dict[tuple[int, int], list[int]],
                   out: list[int | None]) -> list[str]:
        """Count ``order``'s texts a piece at a time into ``out``; the texts left for the
        tokenizer (a guarded character: ``extproc.tokens.pieces``)."""
        assert self._pieces is not None
        left = []
        for text in order:
            n = self._pieces.count(text)
            if n is None:
                left.append(text)
                continue
            key = (len(text), hash(text))
            with self._lock:
                if len(text) >= CACHE_MIN_CHARS:
                    self.cache.put(key, n)
            for i in todo[key]:
                out[i] = n
        return left


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


def prompt_tokens(request: InferenceRequest, pool: Pool, text_tokens: int) -> int:
    """The prompt's tokens given the token count of its texts (module docstring)."""
    return (text_tokens
            + request.token_ids
            + request.messages * pool.message_overhead_tokens
            + request.non_text_parts * pool.non_text_part_tokens)
