"""Request bodies sent compressed (``Content-Encoding``): refused, or read within two caps.

``content_encoding: refuse`` (the default): a body in any coding but ``identity`` is a 415
that names the coding. We could not read it, and costing it blind would let any client past
admission by compressing.

``content_encoding: decode``: ``gzip`` (``x-gzip``) and ``deflate`` bodies are inflated for
reading only (the backend still gets the compressed body, as sent); other codings, and more
than one coding stacked, are a 415. A compressed body is a promise of more bytes than were
sent, so inflation is bounded twice, and the smaller bound wins:

    limit = min(max_body_bytes, floor(max_inflation_ratio x compressed bytes))

A body that inflates past ``limit`` is a 413. zlib inflates incrementally, asked each time
for no more than the room left plus one byte, so a gzip bomb costs at most ``limit + 1``
bytes of memory and the CPU to produce them, never its full size. Input that is not valid
data in its coding (corrupt, cut short, trailing bytes after the end) is a 400. A gzip body
may hold several members, one after another (RFC 1952); ``deflate`` is the zlib format
(RFC 9110), and a raw deflate stream, which some clients send instead, is accepted too.

Brotli and zstd are not decoded: the standard library has neither.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from extproc.errors import BadRequest, BodyTooLarge, UnsupportedMedia

_GZIP_WBITS = 16 + zlib.MAX_WBITS
_ZLIB_WBITS = zlib.MAX_WBITS
_RAW_WBITS = -zlib.MAX_WBITS
_GZIP_MAGIC = b"\x1f\x8b"

DECODABLE = {"gzip": "gzip", "x-gzip": "gzip", "deflate": "deflate"}
# Named in a refusal; any other value is client text and is not quoted back.
_KNOWN = {*DECODABLE, "br", "zstd", "compress", "x-compress", "dcb", "dcz", "aes128gcm"}


@dataclass(frozen=True, slots=True)
class Coding:
    """The one content coding a body was sent in: ``gzip`` or ``deflate``."""

    name: str


def coding(header: str | None, *, decode: bool) -> Coding | None:
    """The coding to undo for a ``Content-Encoding`` header value, or None for none.

    Raises ``UnsupportedMedia`` for a coding refused by configuration (``decode`` False), one
    we cannot decode, or several stacked.
    """
    names = [n.strip().lower() for n in (header or "").split(",")]
    names = [n for n in names if n and n != "identity"]
    if not names:
        return None
    if len(names) > 1:
        raise UnsupportedMedia("request bodies with more than one content coding are not"
                               " accepted", code="unsupported_content_encoding")
    name = names[0]
    shown = name if name in _KNOWN else "this coding"
    if not decode:
        raise UnsupportedMedia(f"request bodies with Content-Encoding {shown} are not"
                               " accepted; send the body uncompressed",
                               code="unsupported_content_encoding")
    if name not in DECODABLE:
        raise UnsupportedMedia(f"request bodies with Content-Encoding {shown} are not"
                               " accepted; send it as gzip, deflate or uncompressed",
                               code="unsupported_content_encoding")
    return Coding(DECODABLE[name])


def decode(body: bytes, how: Coding, *, max_bytes: int, max_ratio: float) -> bytes:
    """Inflate ``body`` to at most ``min(max_bytes, max_ratio x len(body))`` bytes.

    Raises ``BodyTooLarge`` past the limit, ``BadRequest`` for data not in its coding.
    """
    ratio_limit = int(max_ratio * len(body))
    limit = min(max_bytes, ratio_limit)
    out = bytearray()
    pending = body
    while True:  # one gzip member (or the one zlib / raw deflate stream) per pass
        inflater = zlib.decompressobj(_wbits(how, pending))
        try:
            while not inflater.eof:
                chunk = inflater.decompress(pending, limit - len(out) + 1)
                out += chunk
                if len(out) > limit:
                    raise _too_large(limit, by_ratio=ratio_limit < max_bytes,
                                     max_ratio=max_ratio)
                consumed = len(pending) - len(inflater.unconsumed_tail)
                pending = inflater.unconsumed_tail
                if not chunk and not consumed:  # no input left, no output: cut short
                    raise _invalid(how)
        except zlib.error:
            raise _invalid(how) from None
        pending = inflater.unused_data
        if not pending:
            return bytes(out)
        if how.name != "gzip" or not pending.startswith(_GZIP_MAGIC):
            raise _invalid(how)  # bytes after the end of the data


def _wbits(how: Coding, data: bytes) -> int:
    if how.name == "gzip":
        return _GZIP_WBITS
    # zlib's two-byte header: compression method 8, and the pair a multiple of 31
    if len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0:
        return _ZLIB_WBITS
    return _RAW_WBITS


def _too_large(limit: int, *, by_ratio: bool, max_ratio: float) -> BodyTooLarge:
    if by_ratio:
        return BodyTooLarge(f"request body inflates more than {max_ratio:g} times its"
                            f" compressed size (limit {limit} bytes)",
                            code="inflation_ratio_exceeded")
    return BodyTooLarge(f"request body exceeds the limit of {limit} bytes once decompressed",
                        code="request_too_large")


def _invalid(how: Coding) -> BadRequest:
    return BadRequest(f"request body is not valid {how.name} data", code="invalid_encoding")
