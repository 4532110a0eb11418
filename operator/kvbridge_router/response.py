"""What a route's handler answers, and how an answer is written: whole (:class:`Response`, with its
``Content-Length``) or as it comes (:class:`StreamResponse`, chunked; to an HTTP/1.0 client, until the connection
closes); the head's bytes (status line, ``Date``, fields, ``Connection``) and the error body, as OpenAI writes it."""

from __future__ import annotations

import email.utils
import http
import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvbridge_router.request import Request

#: each status's reason phrase
_PHRASES = {status.value: status.phrase.encode() for status in http.HTTPStatus}


class Response:
    """An answer written whole, with its ``Content-Length``."""

    __slots__ = ("body", "content_type", "headers", "status")

    def __init__(
        self,
        body: bytes = b"",
        status: int = 200,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.body, self.status, self.content_type = body, status, content_type
        self.headers = headers if headers is not None else {}


def json_response(value: object, status: int = 200) -> Response:
    return Response(json.dumps(value).encode(), status)


class StreamResponse:
    """An answer written as it comes: :meth:`prepare` sends the head, :meth:`write` each piece (chunked), then
    :meth:`write_eof`. A write to a client that left raises ``ConnectionResetError``."""

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.headers = headers if headers is not None else {}
        self._request: Request | None = None
        self._chunked = True
        self._ended = False

    @property
    def prepared(self) -> bool:
        return self._request is not None

    @property
    def ended(self) -> bool:
        return self._ended

    async def prepare(self, request: Request) -> None:
        if self._request is not None:
            return
        self._request = request
        self._chunked = request.version != "1.0"
        framing = b"Transfer-Encoding: chunked\r\n" if self._chunked else b""
        connection = request.connection
        keep = connection.keeps(request) and self._chunked
        request.head_sent = True
        connection.write(answer_head(self.status, self.headers, framing, keep, request.version))
        await connection.drain()

    async def write(self, data: bytes) -> None:
        request = self._request
        if request is None:
            raise RuntimeError("write before prepare")
        if self._ended:  # nothing may follow the end: on a kept-alive connection it would open the next answer
            raise ConnectionResetError("the answer has ended")
        if not data:
            return
        connection = request.connection
        if self._chunked:
            connection.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            connection.write(data)
        await connection.drain()

    async def write_eof(self) -> None:
        request = self._request
        if request is None or self._ended:
            return
        self._ended = True
        if self._chunked:
            request.connection.write(b"0\r\n\r\n")
            await request.connection.drain()


Answer = Response | StreamResponse


def error_body(status: int, code: str, message: str, param: str | None = None) -> bytes:
    """An error as OpenAI's API writes one: ``{"error": {"message", "type", "param", "code"}}``, the type by the
    status (the client's request below 500, the server's from 500)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


class _Date:
    """The ``Date`` header's value, formatted once a second."""

    second = -1
    value = b""

    @classmethod
    def now(cls) -> bytes:
        second = int(time.time())
        if second != cls.second:
            cls.second, cls.value = second, email.utils.formatdate(second, usegmt=True).encode()
        return cls.value


def answer_head(
    status: int, headers: Mapping[str, str], framing: bytes, keep_alive: bool, version: str = "1.1"
) -> bytes:
    """An answer's head: the status line, ``Date``, the ``framing`` fields and the handler's, and whether the
    connection stays open (an HTTP/1.0 client is told it does)."""
    lines = [b"HTTP/1.1 %d %b\r\nDate: %b\r\n" % (status, _PHRASES.get(status, b""), _Date.now()), framing]
    for name, value in headers.items():  # values a handler set: latin-1, as HTTP's fields are (else replaced)
        lines.append(f"{name}: {value}\r\n".encode("latin-1", "replace"))
    if not keep_alive:
        lines.append(b"Connection: close\r\n\r\n")
    else:  # an HTTP/1.0 client is told, or it reads until the connection closes
        lines.append(b"Connection: keep-alive\r\n\r\n" if version == "1.0" else b"\r\n")
    return b"".join(lines)
