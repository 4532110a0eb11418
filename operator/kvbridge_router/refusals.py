"""Pure: an engine's error answer as the client gets it, OpenAI's error object ``{"message", "type", "param",
"code"}``, whichever role gave it and whatever it held.

vLLM answers a request it refuses (an unknown model, a prompt over the context length) with
``{"error": {"message", "type", "param", "code"}}`` (older versions: the four fields at the top level, with
``"object": "error"``); a proxy in between may answer text or HTML. The router passes the engine's object on with the
engine's status, its fields kept as given and bounded: a message of at most :data:`MAX_MESSAGE_CHARS` characters,
``type`` and ``param`` strings (or null) of at most :data:`MAX_FIELD_CHARS` (``param``: kvbridge's agent worker's
``field`` when it gives none), ``code`` a string, an integer or null; anything else the engine wrote is dropped. A
body that is not such an object becomes one: its text (stripped, bounded) as the message, the type by the status,
the router's ``code``. Which pod refused is never in the body: it goes to the router's log and its ``X-KVBridge-*``
headers (errors.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

#: an engine's error body read at most this far; a longer one is not read (errors.py says so instead)
MAX_ERROR_BYTES = 64 << 10
#: the longest message passed on (vLLM's are a few hundred characters; a validation error listing a request's
#: fields may be a few thousand)
MAX_MESSAGE_CHARS = 8192
#: the longest ``type``, ``param`` or string ``code`` passed on
MAX_FIELD_CHARS = 256
_CUT = " [...]"
#: what no message keeps: lone surrogates (JSON escapes them, strict readers refuse them) and control characters
#: other than tab and line feed (a log line's, a terminal's)
_UNFIT = re.compile("[\ud800-\udfff]|[\x00-\x08\x0b-\x1f\x7f]")

#: an OpenAI error object: message, type, param, code
ErrorObject = dict[str, Any]


def clipped(text: str, limit: int) -> str:
    """``text`` without lone surrogates (U+FFFD instead) or control characters (a space), cut to ``limit`` characters
    (saying so) when longer."""
    text = _UNFIT.sub(_fit, text)
    return text if len(text) <= limit else text[: limit - len(_CUT)] + _CUT


def _fit(found: re.Match[str]) -> str:
    return "\ufffd" if "\ud800" <= found.group() <= "\udfff" else " "


def error_type(status: int) -> str:
    """The type OpenAI's API gives an error of this status: the request's below 500, the server's from 500."""
    return "invalid_request_error" if status < 500 else "server_error"


def engine_error(status: int, body: bytes, code: str) -> ErrorObject:
    """The OpenAI error object of an engine's answer ``body`` with this ``status``: the engine's own, bounded, when it
    wrote one; else one made of its text, with the router's ``code``."""
    text = body.decode("utf-8", errors="replace")
    given = _error_of(text)
    if given is None:
        message = " ".join(text.split()) or f"the engine answered HTTP {status} without a message"
        return {"message": clipped(message, MAX_MESSAGE_CHARS), "type": error_type(status), "param": None, "code": code}
    said = given.get("message")
    if isinstance(said, str) and said.strip():
        message = said
    else:  # a message that is not text: its JSON, bounded below
        message = json.dumps(said) if said is not None else f"the engine answered HTTP {status}"
    kind = given.get("type")
    return {
        "message": clipped(message, MAX_MESSAGE_CHARS),
        "type": clipped(kind, MAX_FIELD_CHARS) if isinstance(kind, str) and kind else error_type(status),
        # kvbridge's agent worker names the field as "field"
        "param": _string_or_none(given.get("param", given.get("field") or None)),
        "code": _code(given.get("code")),
    }


def _error_of(text: str) -> dict[str, Any] | None:
    """The error object in an engine's JSON: ``{"error": {...}}``, or the fields at the top level; None when the text
    is not JSON or holds no error (a non-object, nothing that reads as one)."""
    try:
        answer = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(answer, dict):
        return None
    inner = answer.get("error")
    if isinstance(inner, dict):
        return inner
    if isinstance(inner, str):  # {"error": "text"}: some servers say only that
        return {"message": inner}
    if isinstance(answer.get("message"), str):  # vLLM before 0.9: {"object": "error", "message", "type", ...}
        return answer
    return None


def _string_or_none(value: object) -> str | None:
    return clipped(value, MAX_FIELD_CHARS) if isinstance(value, str) else None


def _code(value: object) -> str | int | None:
    """A code as given when a string or an integer (vLLM writes the HTTP status); anything else, null."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if abs(value) < 1 << 53 else None  # exact in every client's JSON numbers
    return _string_or_none(value)
