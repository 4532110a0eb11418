"""The JSON the router sends the engines: compact and ASCII (the standard library's, which writes back a NaN or a
lone surrogate as the client sent it), or msgspec's for a body parsed from plain JSON; and one field added to the
client's own bytes without encoding them again (decode's ``kv_transfer_params``)."""

from __future__ import annotations

import json

import msgspec

from kvbridge_router.prompts import TokenIds

#: JSON's whitespace and an object's brackets, as byte values
JSON_SPACE = frozenset(b" \t\r\n")
OPEN, CLOSE = ord("{"), ord("}")


def with_field(raw: bytes, name: str, value: object) -> list[bytes | memoryview] | None:
    """The client's JSON object ``raw`` (already parsed and checked as UTF-8, so valid) with one more field added
    before its closing brace, as the pieces to send in order: a view of the client's bytes (neither copied nor
    re-encoded), then the field. None when ``raw`` is not UTF-8 text shaped ``{...}`` (UTF-16 JSON, say); the
    caller encodes the parsed object then. The field must not be in the object already."""
    start, end = 0, len(raw)
    while start < end and raw[start] in JSON_SPACE:
        start += 1
    while end > start and raw[end - 1] in JSON_SPACE:
        end -= 1
    if end - start < 2 or raw[start] != OPEN or raw[end - 1] != CLOSE:
        return None
    inner = start + 1
    while inner < end - 1 and raw[inner] in JSON_SPACE:
        inner += 1
    comma = b"" if inner == end - 1 else b","  # an empty object gets no comma
    return [memoryview(raw)[: end - 1], comma + encoded({name: value})[1:]]


def _raw_ids(value: object) -> msgspec.Raw:
    """A prompt admission kept as :class:`TokenIds`, written from its text (compact, whatever the client's layout)."""
    if not isinstance(value, TokenIds):
        raise TypeError(f"{type(value).__name__} is not JSON")
    return msgspec.Raw(b"[" + value.text + b"]")


def _ids(value: object) -> list[int]:
    if not isinstance(value, TokenIds):
        raise TypeError(f"{type(value).__name__} is not JSON")
    return value.ids()


#: msgspec's C encoder, for what was decoded from plain JSON (admission.parse)
encoded_plain = msgspec.json.Encoder(enc_hook=_raw_ids).encode


def encoded(obj: object) -> bytes:
    """Compact JSON, ASCII-only (lone surrogates a client sent stay escaped)."""
    return json.dumps(obj, separators=(",", ":"), default=_ids).encode("ascii")
