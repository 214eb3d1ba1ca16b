"""Exact token counts for byte-level BPE tokenizers, a piece at a time, without their pipeline.

A byte-level BPE tokenizer (Llama 3, GPT-2 and GPT-4 style, ...) turns a text into tokens in
steps that never look across a piece boundary, so its count is a sum:

    tokens(text) = added tokens found in it                  (each one token, matched first)
                 + sum over the pieces of the rest            (the pre-tokenizer's regex splits)
                   of bpe(piece)                              (the model's merges, piece alone)

``bpe(piece)`` depends on the piece alone, and natural text repeats its pieces (words with their
leading space, numbers of up to three digits, punctuation runs), so each piece's count is asked
of the model once and remembered. What is left per text is the split, done here with the
``regex`` module (``\\p{L}``, ``\\p{N}``, lookaheads), and a dictionary look-up per piece:
0.36-0.58x the CPU of the tokenizer's own call for the same count on prose and code, about the
same (1.1x) for Chinese and Japanese, whose runs of characters repeat less
(``benchmarks/counting.py``). In the whole server it took the decision's p50 at a moderate
rate from 1.37 to 1.01 ms for short prompts and from 1.65 to 1.43 ms for chat
(docs/performance.md).

Exact, not estimated: every number comes from the tokenizer's own model, and the split is the
tokenizer's own regex. Two regex engines can still disagree where their Unicode tables differ
(a letter or digit assigned in a newer Unicode version than one engine knows), so ``Splitter``
is checked against the tokenizer at start-up (``probe``): every code point is split by both
engines, and the characters of any piece they split differently are *guarded*: a text holding
one is counted by the tokenizer itself, as is any text in a plane no Unicode version has
assigned letters in (4 to 13, and private use), or with a lone surrogate (which the tokenizer
refuses: the same error either way). ``tests/test_pieces.py`` holds the count equal to the
tokenizer's on every code point in several contexts, random Unicode and the repository's text.

Which tokenizers: the ``tokenizer.json`` shape of the byte-level BPE family, read from the
file itself: no normalizer; a pre-tokenizer of ``Split`` steps (regex or string, behaviour
``Isolated``) and a final ``ByteLevel`` (without a prefix space; with ``use_regex`` it splits
with GPT-2's pattern itself); a BPE model without dropout; added tokens matched on the raw text
(not normalized, no strip or whole-word rules). Anything else (SentencePiece's ``Metaspace``,
a normalizer, ...) gets ``None`` from ``Splitter.of`` and is counted by the tokenizer, as
before. The caller passes ``add_special_tokens=False`` semantics: nothing is added around the
text.
"""

from __future__ import annotations

import bisect
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import regex

from extproc.tokens.generations import TwoGenerations

log = logging.getLogger(__name__)

# ByteLevel's own pattern, when it splits (``use_regex``: GPT-2's)
GPT2_PATTERN = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
# Characters always left to the tokenizer: lone surrogates (it refuses them) and the planes no
# Unicode version has assigned a letter or digit in, where a newer table could (module
# docstring). Planes 14's tags and variation selectors (E0000-E0FFF) are probed like the rest.
ALWAYS_GUARDED = "\\ud800-\\udfff\\U00040000-\\U000DFFFF\\U000E1000-\\U0010FFFF"
PROBED = ((0, 0xD800), (0xE000, 0x40000), (0xE0000, 0xE1000))  # code point ranges, end open
_PROBED: dict[bytes, str] = {}  # a pre-tokenizer's state -> the characters its probe guards
PIECE_CACHE = 100_000  # pieces whose count is remembered (extproc.tokens.generations)


def _bytes_to_unicode() -> dict[int, str]:
    """ByteLevel's alphabet: every byte as a printable character (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# a piece's UTF-8 bytes, read as Latin-1 (one character a byte), to ByteLevel's characters
_BYTE_LEVEL = str.maketrans({chr(b): c for b, c in _bytes_to_unicode().items()})


class Splitter:
    """A tokenizer's split into pieces, in Python: added tokens first, then each ``Split``
    step in turn over the pieces of the one before (``Isolated``: matches and the text between
    them are both pieces)."""

    def __init__(self, patterns: Sequence[str], added: Sequence[str]) -> None:
        self.patterns = [regex.compile(p) for p in patterns]
        self._grouped = [regex.compile(f"({p})") for p in patterns]  # split keeps the matches
        # leftmost, and the longest where several start at one place (the tokenizer's rule)
        literal = "|".join(regex.escape(a) for a in sorted(set(added), key=len, reverse=True))
        self.added = regex.compile(f"({literal})") if literal else None
        self._starts = sorted({a[0] for a in added if a})  # a text without these has none

    @classmethod
    def of(cls, spec: dict[str, Any]) -> Splitter | None:
        """The splitter of a parsed ``tokenizer.json``, or None (why, at debug) when its
        pipeline is not the byte-level BPE shape this module reproduces (module docstring)."""
        why = _unsupported(spec)
        if why is not None:
            log.debug("token counts use the tokenizer itself: %s", why)
            return None
        pre = spec["pre_tokenizer"]
        steps = pre["pretokenizers"] if pre["type"] == "Sequence" else [pre]
        patterns = [_pattern(s) for s in steps[:-1]]
        if steps[-1].get("use_regex", True):
            patterns.append(GPT2_PATTERN)
        return cls(patterns, [t["content"] for t in spec.get("added_tokens") or ()])

    def split(self, text: str) -> tuple[int, list[str]]:
        """``(added tokens found, the pieces of the rest)``."""
        found, parts = 0, [text]
        if (self.added is not None and any(c in text for c in self._starts)
                and self.added.search(text)):
            pieces = self.added.split(text)  # text, token, text, token, ..., text
            found, parts = len(pieces) // 2, pieces[::2]
        for pattern, grouped in zip(self.patterns, self._grouped, strict=True):
            out: list[str] = []
            for part in parts:
                pieces = pattern.findall(part)
                if sum(map(len, pieces)) != len(part):  # text between matches: pieces too
                    pieces = [p for p in grouped.split(part) if p]
                out += pieces
            parts = out
        return found, parts


def _pattern(step: dict[str, Any]) -> str:
    pattern = step["pattern"]
    return str(pattern["Regex"]) if "Regex" in pattern else regex.escape(str(pattern["String"]))


def _unsupported(spec: dict[str, Any]) -> str | None:
    """Why ``spec``'s pipeline is not one ``Splitter`` reproduces, or None."""
    if spec.get("normalizer") is not None:
        return "it has a normalizer"
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
        return "its model is not BPE without dropout"
    pre = spec.get("pre_tokenizer") or {}
    steps = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]
    if not steps or steps[-1].get("type") != "ByteLevel" or steps[-1].get("add_prefix_space"):
        return "its pre-tokenizer does not end in ByteLevel without a prefix space"
    for step in steps[:-1]:
        if (step.get("type") != "Split" or step.get("behavior") != "Isolated"
                or step.get("invert") or not {"Regex", "String"} & set(step.get("pattern", {}))):
            return f"its pre-tokenizer has a {step.get('type')} step this module does not model"
        try:
            if regex.compile(_pattern(step)).groups:
                return "a Split pattern has capturing groups"
        except regex.error as exc:
            return f"a Split pattern does not compile here ({exc})"
    for token in spec.get("added_tokens") or ():
        if (token.get("normalized") or token.get("lstrip") or token.get("rstrip")
                or token.get("single_word")):
            return "an added token is normalized or has strip or whole-word rules"
    return None


class PieceCounter:
    """Counts texts a piece at a time (module docstring); ``count`` answers None for a text
    the tokenizer must count itself (a guarded character)."""

    def __init__(self, splitter: Splitter, bpe: Callable[[str], int],
                 guarded: str = "", cache_entries: int = PIECE_CACHE) -> None:
        self.splitter = splitter
        self._bpe = bpe  # a piece in ByteLevel's characters -> its token count
        self.guard = regex.compile(f"[{ALWAYS_GUARDED}{guarded}]")
        self.cache: TwoGenerations[str] = TwoGenerations(cache_entries)

    @classmethod
    def of(cls, tokenizer: Any) -> PieceCounter | None:
        """The counter for a ``tokenizers.Tokenizer``, probed against it, or None."""
        splitter = Splitter.of(json.loads(tokenizer.to_str()))
        if splitter is None:
            return None
        model = tokenizer.model
        key = tokenizer.pre_tokenizer.__getstate__()  # the split's whole definition
        if key not in _PROBED:  # once per process and pre-tokenizer (half a second)
            _PROBED[key] = probe(splitter, tokenizer.pre_tokenizer.pre_tokenize_str)
        return cls(splitter, lambda piece: len(model.tokenize(piece)), _PROBED[key])

    def count(self, text: str) -> int | None:
        found, pieces = self.splitter.split(text)
        cache = self.cache
        young = cache.young  # the usual hit, without a call (extproc.tokens.generations)
        total = found
        for piece in pieces:
            n = young.get(piece)
            if n is None:
                n = cache.get(piece)
                if n is None:
                    # Every character is in some piece, and only pieces free of guarded ones
                    # are remembered: checking the new ones checks the text.
                    if self.guard.search(piece):
                        return None
                    mapped = piece.encode("utf-8").decode("latin-1").translate(_BYTE_LEVEL)
                    n = self._bpe(mapped)
                    cache.put(piece, n)
            total += n
        return total


def probe(splitter: Splitter, pre_tokenize: Callable[[str], list[tuple[str, tuple[int, int]]]]
          ) -> str:
    """The characters ``splitter`` and the tokenizer's own pre-tokenizer split differently, as
    a regex character-class body (empty when they agree everywhere).

    First every probed code point in order, as one text: neighbours mostly share a class, so
    the pieces are long runs, and a character either engine classes differently from its run
    moves a boundary; the characters of the pieces around a boundary the engines do not share
    are suspects (and so are the letters that fold to ASCII, tried after an apostrophe
    for the contractions' case-insensitive alternatives). Then each suspect alone, in a line of
    its own that puts it inside a word, between digits and after an apostrophe: a suspect is
    guarded if the engines split its line differently."""
    every = "".join(chr(c) for lo, hi in PROBED for c in range(lo, hi))
    folding = "".join(regex.findall(r"(?i)[a-z]", every))
    suspects = sorted(set(folding) | _differing(splitter, pre_tokenize, [every]))
    return _char_class(sorted(map(ord, _differing(
        splitter, pre_tokenize, [f"a{c}b1{c}1'{c}\n" for c in suspects]))))


def _differing(splitter: Splitter,
               pre_tokenize: Callable[[str], list[tuple[str, tuple[int, int]]]],
               lines: Sequence[str]) -> set[str]:
    """The characters of the pieces in which the two splits of the lines (joined as one text)
    differ: of every piece either engine ends at a boundary the other lacks; for lines of one
    suspect each, the suspect of each line that differs."""
    text = "".join(lines)
    ours = _pieces_of(splitter, text)
    theirs = [span for _, span in pre_tokenize(text)]
    differ = sorted({end for _, end in ours} ^ {end for _, end in theirs})
    if not differ:
        return set()
    if len(lines) > 1:  # a line at a time: the suspect of each line that differs
        ends, at = [], 0
        for line in lines:
            at += len(line)
            ends.append(at)
        lines_hit = {bisect.bisect_left(ends, d) for d in differ}
        return {lines[i][1] for i in lines_hit if i < len(lines)}
    out: set[str] = set()
    for start, end in ours + theirs:
        i = bisect.bisect_right(differ, start)  # the first such boundary past the start
        if i < len(differ) and differ[i] <= end:
            out.update(text[start:end])
    return out


def _char_class(points: Sequence[int]) -> str:
    """Sorted code points as a character-class body of ranges (``a-z``)."""
    out, i = [], 0
    while i < len(points):
        j = i
        while j + 1 < len(points) and points[j + 1] == points[j] + 1:
            j += 1
        lo, hi = regex.escape(chr(points[i])), regex.escape(chr(points[j]))
        out.append(lo if i == j else f"{lo}-{hi}")
        i = j + 1
    return "".join(out)


def _pieces_of(splitter: Splitter, text: str) -> list[tuple[int, int]]:
    """``splitter``'s pieces of ``text`` as offsets (the probe's side: ``split`` keeps none,
    for speed). There are no added tokens in the probe's text."""
    spans = [(0, len(text))]
    for pattern in splitter.patterns:
        out = []
        for lo, hi in spans:
            at = lo
            for match in pattern.finditer(text, lo, hi):
                start, end = match.span()
                if start > at:
                    out.append((at, start))
                if end > start:
                    out.append((start, end))
                at = end
            if at < hi:
                out.append((at, hi))
        spans = out
    return spans
