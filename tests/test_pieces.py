"""Counting a piece at a time gives the tokenizer's own count, or leaves the text to it
(``extproc.tokens.pieces``): on real text, on every code point in context, on random Unicode, and
where the two regex engines are made to disagree."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from extproc.errors import BadRequest
from extproc.tokens.estimate import TokenizerCounter
from extproc.tokens.pieces import PROBED, PieceCounter, Splitter, probe

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tokenizer(llama3_tokenizer: str) -> Tokenizer:
    return Tokenizer.from_file(llama3_tokenizer)


@pytest.fixture(scope="module")
def pieces(tokenizer: Tokenizer) -> PieceCounter:
    counter = PieceCounter.of(tokenizer)
    assert counter is not None  # Llama 3's tokenizer.json is of the byte-level BPE shape
    return counter


def truth(tokenizer: Tokenizer, texts: list[str]) -> list[int]:
    return [len(e) for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


def test_real_text_and_code_count_as_the_tokenizer_counts(tokenizer: Tokenizer,
                                                         pieces: PieceCounter) -> None:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "extproc").glob("*.py")), ROOT / "tests/data/traces/README.md"]
    texts = [f.read_text() for f in files]
    texts += [line for text in texts for line in text.splitlines()]
    assert [pieces.count(t) for t in texts] == truth(tokenizer, texts)


@pytest.mark.slow  # ~15 s: 1.3 million texts, each counted both ways
def test_every_code_point_in_context_counts_as_the_tokenizer_counts_or_is_left_to_it(
        tokenizer: Tokenizer, pieces: PieceCounter) -> None:
    """Inside a word, after a space and before a digit, after an apostrophe (the contractions'
    case-insensitive alternatives), before newlines, four in a row (digits group by three):
    every probed code point. What is left to the tokenizer is a small share, and no common
    script's letter, digit or emoji."""
    points = [chr(c) for lo, hi in PROBED for c in range(lo, hi)]
    texts = [t for x in points for t in (f"a{x}b", f" {x}1", f"'{x}", f"{x}\n\n", x * 4)]
    ours = [pieces.count(t) for t in texts]
    left = {t for t, n in zip(texts, ours, strict=True) if n is None}
    counted = [(t, n) for t, n in zip(texts, ours, strict=True) if n is not None]
    wrong = [(t, n, m) for (t, n), m in zip(counted, truth(tokenizer, [t for t, _ in counted]),
                                           strict=True) if n != m]
    assert wrong == []
    assert len(left) < len(texts) // 10
    common = ("English, Ελληνικά, Русский, العربية, עברית, हिन्दी, ไทย, 中文, 日本語, 한국어,"
              " 0123456789 ٠١٢ ०१२, “quotes” — dashes… 🙂👍🚀 ½ ™")
    assert pieces.count(common) == truth(tokenizer, [common])[0]


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=0, max_size=80))
def test_random_unicode_counts_as_the_tokenizer_counts(tokenizer: Tokenizer,
                                                       pieces: PieceCounter, text: str) -> None:
    n = pieces.count(text)
    assert n is not None or not text.isascii()  # only a guarded character leaves it
    if n is not None:
        assert n == truth(tokenizer, [text])[0]


def test_added_tokens_count_one_each_the_longest_where_two_start_together(
        tokenizer: Tokenizer, pieces: PieceCounter) -> None:
    texts = ["<|eot_id|>", "hi<|eot_id|>there", "<|begin_of_text|><|eot_id|> <|", "<|eot_id",
             "<|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>"]
    assert [pieces.count(t) for t in texts] == truth(tokenizer, texts)
    both = Splitter([r"\w+|\W"], ["<|a|>", "<|a|>b"])
    assert both.split("x<|a|>by<|a|>") == (2, ["x", "y"])


def test_a_disagreement_between_the_engines_is_found_and_left_to_the_tokenizer(
        tokenizer: Tokenizer) -> None:
    """Our pattern made to differ from the tokenizer's (numbers of up to three ASCII digits,
    where it groups every ``\\p{N}``): the probe finds the other digits, and texts holding
    one are left to it."""
    spec = json.loads(tokenizer.to_str())
    split = spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]
    split["Regex"] = split["Regex"].replace(r"\p{N}{1,3}", "[0-9]{1,3}")
    splitter = Splitter.of(spec)
    assert splitter is not None
    guarded = probe(splitter, tokenizer.pre_tokenizer.pre_tokenize_str)
    model = tokenizer.model
    counter = PieceCounter(splitter, lambda p: len(model.tokenize(p)), guarded)
    for text in ("Arabic-Indic ٣٤٥ and superscript ² digits", "ⅻ roman", "\uff15 fullwidth"):
        assert counter.count(text) is None
    texts = ["plain 12345 digits, é and ü", "héllo wörld 42"]
    assert [counter.count(t) for t in texts] == truth(tokenizer, texts)


@pytest.mark.parametrize("change", [
    {"normalizer": {"type": "NFC"}},
    {"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                       "split": True}},
    {"model": {"type": "BPE", "dropout": 0.1}},
    {"model": {"type": "WordPiece"}},
    {"added_tokens": [{"content": "<x>", "lstrip": True, "rstrip": False, "normalized": False,
                       "single_word": False}]},
])
def test_pipelines_of_another_shape_are_left_to_the_tokenizer(tokenizer: Tokenizer,
                                                              change: dict[str, Any]) -> None:
    spec = {**json.loads(tokenizer.to_str()), **change}
    assert Splitter.of(spec) is None


def test_a_gpt2_style_byte_level_pre_tokenizer_is_split_by_its_own_pattern() -> None:
    spec = {"normalizer": None, "model": {"type": "BPE", "dropout": None},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                              "use_regex": True}, "added_tokens": []}
    splitter = Splitter.of(spec)
    assert splitter is not None
    assert splitter.split("Hello world's 123  ok") == (
        0, ["Hello", " world", "'s", " 123", " ", " ok"])


def test_a_lone_surrogate_is_left_to_the_tokenizer_which_refuses_it(
        pieces: PieceCounter, llama3_tokenizer: str) -> None:
    assert pieces.count("half \ud800 a pair") is None
    with pytest.raises(BadRequest):
        TokenizerCounter(llama3_tokenizer).count(["half \ud800 a pair, long enough to cache it"])


def test_the_piece_cache_is_bounded(tokenizer: Tokenizer) -> None:
    splitter = Splitter.of(json.loads(tokenizer.to_str()))
    assert splitter is not None
    model = tokenizer.model
    counter = PieceCounter(splitter, lambda p: len(model.tokenize(p)), cache_entries=100)
    text = " ".join(f"w{i}x" for i in range(1000))
    assert counter.count(text) == truth(tokenizer, [text])[0]
    assert len(counter.cache) <= 100


def test_the_counter_counts_a_piece_at_a_time_and_natively_alike(llama3_tokenizer: str) -> None:
    counter = TokenizerCounter(llama3_tokenizer)
    native = TokenizerCounter(llama3_tokenizer, pieces=False)
    assert counter.pieces and not native.pieces
    texts = ["a message long enough to be remembered by the cache, with some words in it",
             "日本語のテキストも同じ数になる", "emoji 🙂 and a new Unicode 16 digit \U00010d40"]
    assert counter.count(texts) == native.count(texts) == counter.count(texts, native=True)
    assert counter.counts(texts) == native.counts(texts)
