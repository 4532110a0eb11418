"""What the router admits: a request is read and checked before any prefill, so bad input costs no engine work.

Each refusal is a :class:`RouteError` with an HTTP status, a stable code, the offending parameter and a message; the
proxy answers it in OpenAI's error shape. Checked, in order: the media type and charset (415), the declared size
(413, before a byte is read), a body that stalls (408), the size read (413), JSON syntax and nesting (400), then the
OpenAI fields the router itself relies on (400): ``prompt`` or ``messages``, ``stream``, ``max_tokens`` and
``max_completion_tokens``, ``model``, ``n``, and that the client does not set ``kv_transfer_params``. Fields the
router does not read are the engines' to judge.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from kvbridge_operator.api.objects import Obj
from kvbridge_router.errors import RouteError
from kvbridge_router.prompts import TokenIds, one_prompt, token_ids
from kvbridge_router.request import BodyTooLargeError, Request
from kvbridge_router.samples import MAX_SAMPLES

#: deeper JSON than this is refused (an OpenAI request nests a few levels: messages, content parts, tool schemas)
MAX_DEPTH = 64
#: a client's X-Request-Id the router passes on (with a suffix); any other is replaced
_CLIENT_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: the JSON types that hold others
CONTAINERS = (dict, list)
JSON_TYPES = ("application/json",)
CHARSETS = ("utf-8", "utf8")


#: msgspec's C decoder: plain JSON (finite numbers, text without lone surrogates; most requests) in a third of the
#: standard library's time, into the same objects; what it refuses, the standard library decides on as before
_PLAIN = msgspec.json.Decoder()
#: the same parser over a body's top level: each field's value checked as JSON and kept as its text, then decoded
#: alone (a prompt of token ids stays text: prompts.TokenIds). What it checks of a value kept as text is its syntax,
#: not its UTF-8 (a field given twice keeps the last value, and the first is never decoded): the body's bytes are
#: checked as UTF-8 as a whole.
_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
#: a body of more fields than this is decoded whole (one decoder call per field costs more than one for the body)
MAX_FIELDS_APART = 64


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 16 << 20
    #: seconds the whole body may take to arrive once the headers did (a client that stalls gets 408)
    body_timeout: float = 10.0


async def admit(request: Request, route: str, limits: Limits) -> tuple[Obj, bytes, bool]:
    """The request's body, read within the limits and checked for what ``route`` (``completions`` or ``chat``)
    needs, its bytes as the client sent them, and whether it is plain JSON (:func:`parse`); raises
    :class:`RouteError`."""
    _media_type(request)
    declared = request.content_length
    if declared is not None and declared > limits.max_body_bytes:
        raise RouteError(413, "TOO_LARGE", f"the request body ({declared} bytes) exceeds {limits.max_body_bytes} bytes")
    announced = f"{declared if declared is not None else 'unknown'} bytes announced"
    try:
        async with asyncio.timeout(limits.body_timeout):  # not wait_for: no task of its own per request
            raw = await request.read()
    except TimeoutError:
        raise RouteError(
            408, "BODY_TIMEOUT", f"the request body did not arrive within {limits.body_timeout:g} s ({announced})"
        ) from None
    except ConnectionResetError:  # the client left (or broke off) mid-body
        raise RouteError(
            400, "BODY_INCOMPLETE", f"the client closed the connection before the body arrived ({announced})"
        ) from None
    except BodyTooLargeError:
        raise RouteError(413, "TOO_LARGE", f"the request body exceeds {limits.max_body_bytes} bytes") from None
    body, plain = parse(raw)
    check_fields(body, route)
    return body, raw, plain


def _media_type(request: Request) -> None:
    kind = request.content_type  # application/octet-stream when the header is absent
    if request.headers.get("Content-Type") and kind not in JSON_TYPES and not kind.endswith("+json"):
        raise RouteError(
            415, "UNSUPPORTED_MEDIA_TYPE", f"the request body must be JSON (Content-Type: application/json), not {kind}"
        )
    charset = (request.charset or "utf-8").lower()
    if charset not in CHARSETS:
        raise RouteError(415, "UNSUPPORTED_MEDIA_TYPE", f"the request body must be UTF-8 JSON, not charset {charset!r}")


def parse(raw: bytes) -> tuple[Obj, bool]:
    """``raw`` as ``json.loads`` parses it, and whether it is plain JSON: every number finite and every string free of
    lone surrogates, which any JSON encoder writes back as it was (``json.loads`` alone takes the others: a NaN, an
    Infinity, a lone ``\\ud800``, a BOM); raises :class:`RouteError`. A plain body's ``prompt`` of token ids is kept
    as :class:`~kvbridge_router.prompts.TokenIds` (the same ids, never made into Python integers)."""
    try:
        fields = _FIELDS.decode(raw)
        if len(fields) > MAX_FIELDS_APART:
            body, plain = _PLAIN.decode(raw), True
        else:
            if not raw.isascii():  # the values decoded below are checked, a value shadowed by a later one is not
                raw.decode("utf-8")  # not kept: checked
            body, plain = {name: _field(name, value) for name, value in fields.items()}, True
    except RecursionError:
        raise RouteError(400, "INVALID_JSON", f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except (msgspec.DecodeError, UnicodeDecodeError):  # not plain, or not JSON: the standard library says which
        body, plain = _standard(raw), False
    if not isinstance(body, dict):
        raise RouteError(400, "INVALID_REQUEST", "the request body must be a JSON object")
    # fewer opening brackets than the limit (strings included) cannot nest deeper: no walk for most requests
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _depth_exceeds(body, MAX_DEPTH):
        raise RouteError(400, "INVALID_JSON", f"the request body nests deeper than {MAX_DEPTH} levels")
    return body, plain


def _field(name: str, value: msgspec.Raw) -> Any:
    if name == "prompt":
        ids = TokenIds.read(value)
        if ids is not None:
            return ids
    return _PLAIN.decode(value)


def _standard(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise RouteError(400, "INVALID_JSON", f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise RouteError(400, "INVALID_JSON", f"the request body is not JSON: {exc}") from None


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether containers nest deeper than ``limit`` (iterative: no recursion on hostile input)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        current, depth = stack.pop()
        if depth > limit:
            return True
        children = current.values() if isinstance(current, dict) else current
        # the containers among the children, picked at C speed (a prompt's thousands of token ids are not)
        containers = itertools.compress(children, map(CONTAINERS.__contains__, map(type, children)))
        stack.extend((child, depth + 1) for child in containers)
    return False


def check_fields(body: Obj, route: str) -> None:
    """The OpenAI fields the router relies on have the types OpenAI's API gives them."""
    if "kv_transfer_params" in body:
        raise RouteError(
            400,
            "INVALID_REQUEST",
            "kv_transfer_params is the router's to set, not the client's",
            param="kv_transfer_params",
        )
    if route == "chat":
        _messages(body.get("messages"))
    else:
        _prompt(body.get("prompt"))
    if "model" in body and not isinstance(body["model"], str):
        raise RouteError(400, "INVALID_REQUEST", "model must be a string", param="model")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise RouteError(
            400, "INVALID_REQUEST", f"stream must be true or false, not {json.dumps(body['stream'])}", param="stream"
        )
    for name in ("max_tokens", "max_completion_tokens"):
        if body.get(name) is not None and not _positive_int(body[name]):
            raise RouteError(
                400, "INVALID_REQUEST", f"{name} must be a positive integer, not {_shown(body[name])}", param=name
            )
    sample_count(body)
    if "stream_options" in body and body["stream_options"] is not None and not isinstance(body["stream_options"], dict):
        raise RouteError(400, "INVALID_REQUEST", "stream_options must be an object", param="stream_options")


def engine_request_id(client_id: str | None) -> str:
    """The request id the engines get (``X-Request-Id``; vLLM derives its own ids from it): the client's, when it is
    1-64 letters, digits, ``.``, ``_`` or ``-``, with a random suffix (two clients' ids never collide on an engine),
    else one of the router's. Never refused: an id is the client's label, not its request."""
    drawn = os.urandom(16).hex()  # one system call: 12 hex digits of suffix, 20 more for an id of the router's
    suffix = drawn[:12]
    if client_id and _CLIENT_ID.fullmatch(client_id):
        return f"{client_id}-{suffix}"
    return f"kvb-{drawn[12:]}{suffix}"


def _prompt(prompt: Any) -> None:
    """A non-empty string, a non-empty list of token ids, or one prompt in a list (P/D prefills one prompt)."""
    prompt = one_prompt(prompt)
    if isinstance(prompt, TokenIds) or (isinstance(prompt, str) and prompt):  # TokenIds: checked as read
        return
    if isinstance(prompt, list) and token_ids(prompt):
        return
    if prompt is None:
        raise RouteError(400, "INVALID_REQUEST", "prompt is required: a string or a list of token ids", param="prompt")
    raise RouteError(
        400,
        "INVALID_REQUEST",
        "prompt must be a non-empty string or a non-empty list of token ids (one prompt per request)",
        param="prompt",
    )


def _messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RouteError(400, "INVALID_REQUEST", "messages must be a non-empty list", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RouteError(
                400,
                "INVALID_REQUEST",
                f"messages[{index}] must be an object with a string role",
                param=f"messages[{index}]",
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise RouteError(
                400,
                "INVALID_REQUEST",
                f"messages[{index}].content must be a string or a list of parts",
                param=f"messages[{index}].content",
            )


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def sample_count(body: Obj) -> int:
    """``n``, checked: a positive integer up to :data:`MAX_SAMPLES` (absent or null: 1); several only unstreamed."""
    n = body.get("n")
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SAMPLES:
        raise RouteError(
            400,
            "INVALID_REQUEST",
            f"n must be an integer from 1 to {MAX_SAMPLES}, not {json.dumps(n)[:40]}",
            param="n",
        )
    if n > 1 and body.get("stream"):
        raise RouteError(
            400,
            "INVALID_REQUEST",
            "n > 1 is served without streaming only: send stream: false, or n requests of one completion each "
            "(the prefill pod's prefix cache serves the later ones' prompts)",
            param="n",
        )
    return n
