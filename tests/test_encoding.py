"""Compressed request bodies: refused by default, or inflated within two caps."""

from __future__ import annotations

import gzip
import os
import time
import tracemalloc
import zlib
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc import config
from extproc.config import ContentEncoding
from extproc.errors import BadRequest, BodyTooLarge, ConfigError, UnsupportedMedia
from extproc.gateway.encoding import Coding, coding, decode

GZIP = Coding("gzip")
DEFLATE = Coding("deflate")
MIB = 1024 * 1024


def bomb(size: int) -> bytes:
    """A gzip member of ``size`` zero bytes, made without holding them in memory."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(MIB)
    out = [packer.compress(zeros) for _ in range(size // MIB)]
    return b"".join(out) + packer.flush()


@pytest.mark.parametrize("value", [None, "", "identity", " Identity ", "identity, "])
def test_no_coding_means_nothing_to_undo(value: str | None) -> None:
    assert coding(value, decode=False) is None
    assert coding(value, decode=True) is None


@pytest.mark.parametrize("value, name", [("gzip", "gzip"), ("GZIP", "gzip"),
                                         ("x-gzip", "gzip"), ("deflate", "deflate"),
                                         ("identity, gzip", "gzip")])
def test_refuse_mode_refuses_every_coding_naming_it(value: str, name: str) -> None:
    with pytest.raises(UnsupportedMedia) as err:
        coding(value, decode=False)
    assert err.value.status == 415
    assert err.value.code == "unsupported_content_encoding"
    assert value.split(",")[-1].strip().lower() in err.value.message
    assert coding(value, decode=True) == Coding(name)


def test_codings_we_cannot_decode_and_stacked_codings_are_415() -> None:
    for value in ("br", "zstd", "compress", "gzip, gzip", "deflate, br"):
        with pytest.raises(UnsupportedMedia):
            coding(value, decode=True)
    with pytest.raises(UnsupportedMedia, match="Content-Encoding br "):
        coding("br", decode=True)


def test_an_unknown_coding_is_not_quoted_back() -> None:
    canary = "CANARY-ENC-5e1d"
    for decode_ in (False, True):
        with pytest.raises(UnsupportedMedia) as err:
            coding(canary, decode=decode_)
        assert canary.lower() not in err.value.message.lower()
        assert "this coding" in err.value.message


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-15)
    return packer.compress(data) + packer.flush()


def two_members(data: bytes) -> bytes:
    return gzip.compress(data[:7]) + gzip.compress(data[7:])


@pytest.mark.parametrize("pack, how", [
    (gzip.compress, GZIP),
    (zlib.compress, DEFLATE),  # RFC 9110's deflate: the zlib format
    (raw_deflate, DEFLATE),  # as some clients send it
    (two_members, GZIP),  # RFC 1952: members one after another
], ids=["gzip", "zlib", "raw deflate", "gzip members"])
def test_round_trip(pack: Callable[[bytes], bytes], how: Coding) -> None:
    data = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}' * 20
    assert decode(pack(data), how, max_bytes=MIB, max_ratio=20) == data


@given(data=st.binary(max_size=4096), max_bytes=st.integers(1, 8192),
       ratio=st.floats(1, 100), how=st.sampled_from([GZIP, DEFLATE]))
@settings(max_examples=150, deadline=None, derandomize=True, database=None)
def test_decode_returns_the_data_or_refuses_over_the_limit(
        data: bytes, max_bytes: int, ratio: float, how: Coding) -> None:
    packed = gzip.compress(data) if how is GZIP else zlib.compress(data)
    limit = min(max_bytes, int(ratio * len(packed)))
    if len(data) <= limit:
        assert decode(packed, how, max_bytes=max_bytes, max_ratio=ratio) == data
    else:
        with pytest.raises(BodyTooLarge):
            decode(packed, how, max_bytes=max_bytes, max_ratio=ratio)


def test_the_absolute_cap_is_a_413_naming_it() -> None:
    data = os.urandom(3000)  # incompressible: the ratio never bites
    with pytest.raises(BodyTooLarge) as err:
        decode(gzip.compress(data), GZIP, max_bytes=2999, max_ratio=20)
    assert err.value.code == "request_too_large" and "2999 bytes" in err.value.message
    assert decode(gzip.compress(data), GZIP, max_bytes=3000, max_ratio=20) == data


@pytest.fixture(scope="module")
def zeros_64mib() -> bytes:
    return bomb(64 * MIB)


def test_a_gzip_bomb_is_refused_without_being_inflated(zeros_64mib: bytes) -> None:
    """64 MiB of zeros in ~64 KiB: refused by the ratio cap (20x) after at most the cap
    plus one byte was inflated; peak memory stays within a few times that limit."""
    packed = zeros_64mib
    assert len(packed) < 128 * 1024
    limit = 20 * len(packed)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(BodyTooLarge) as err:
            decode(packed, GZIP, max_bytes=64 * MIB, max_ratio=20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 2.0
    assert err.value.status == 413 and err.value.code == "inflation_ratio_exceeded"
    assert peak < 4 * limit, (peak, limit)  # never anywhere near the 64 MiB it holds


def test_a_bomb_under_a_generous_ratio_stops_at_the_absolute_cap(zeros_64mib: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(BodyTooLarge) as err:
            decode(zeros_64mib, GZIP, max_bytes=MIB, max_ratio=10_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.value.code == "request_too_large"
    assert peak < 4 * MIB, peak


@pytest.mark.parametrize("body", [
    b"", b"not gzip at all", gzip.compress(b"x" * 100)[:-9],  # cut short
    gzip.compress(b"{}") + b"trailing", b"\x1f\x8b" + os.urandom(40),
], ids=["empty", "garbage", "truncated", "trailing bytes", "corrupt"])
def test_data_not_in_its_coding_is_400(body: bytes) -> None:
    with pytest.raises(BadRequest) as err:
        decode(body, GZIP, max_bytes=MIB, max_ratio=1000)
    assert err.value.status == 400 and err.value.code == "invalid_encoding"


@pytest.mark.parametrize("body", [
    b"", zlib.compress(b"x" * 100)[:-5], zlib.compress(b"{}") + b"more",
    raw_deflate(b"x" * 100)[:-2], b"\x78\x9c" + bytes(range(40)),
], ids=["empty", "truncated", "trailing bytes", "truncated raw", "corrupt"])
def test_deflate_data_not_in_its_coding_is_400(body: bytes) -> None:
    with pytest.raises(BadRequest, match="not valid deflate data"):
        decode(body, DEFLATE, max_bytes=MIB, max_ratio=1000)


def test_config_keys_default_to_refuse_and_ratio_20_and_are_validated() -> None:
    c = config.from_mapping({})
    assert c.content_encoding is ContentEncoding.REFUSE and c.max_inflation_ratio == 20
    c = config.from_mapping({"content_encoding": "decode", "max_inflation_ratio": 5})
    assert c.content_encoding is ContentEncoding.DECODE and c.max_inflation_ratio == 5
    with pytest.raises(ConfigError) as err:
        config.from_mapping({"content_encoding": "gunzip", "max_inflation_ratio": 0.5})
    text = "\n".join(err.value.problems)
    assert "content_encoding: must be one of 'refuse', 'decode'" in text
    assert "max_inflation_ratio: must be >= 1 (got 0.5)" in text
