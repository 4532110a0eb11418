"""The router's HTTP/1.1 server for its clients: ``asyncio.Protocol`` connections parsed by ``httptools`` (llhttp,
Node's parser), as the router's client to the engines (upstream.py) parses their answers.

Why its own: a routed request's CPU is mostly the Python it runs, and aiohttp's server ran about 0.24 ms of it per
request here (a general server: middlewares, a router of resources, multidicts, a payload stream per request), a
quarter of what the router may spend (docs/benchmarks.md). This one does what the router's routes need and no more.

What it does: requests routed by method and path (404 for another path, 405 with ``Allow`` for another method; HEAD
is GET without the body), one at a time on a connection (pipelined requests wait their turn, reading paused while
they do), kept alive as HTTP/1.1 and 1.0 say (``Connection``), ``Expect: 100-continue`` answered when the handler
reads the body, bodies with ``Content-Length`` or chunked (llhttp checks the framing: both, or two lengths, are
refused), answers with ``Content-Length`` or streamed (chunked; to an HTTP/1.0 client, until the connection closes).
A request asking to switch protocols (``Upgrade: h2c``, as ``curl --http2`` asks) is answered in HTTP/1.1 and the
connection closed; its body, which llhttp leaves unread, is read by its ``Content-Length`` (a chunked one is refused).
A target in absolute form (``http://host/path``) is routed by its path; any other (``CONNECT``'s ``host:port``) is
refused.

Bounds: the request line and each header field at most ``MAX_FIELD_BYTES``, ``MAX_HEADERS`` fields (431, or 400 for
a line, and the connection closed); a whole head must arrive ``header_timeout`` seconds after the connection opened,
or after the first byte of a later request, and an idle kept-alive connection is closed after ``keepalive`` seconds;
a body is kept up to ``max_body_bytes`` (the handler reads :class:`BodyTooLargeError` past it; it reads the body within
its own timeout), and what a chunked body carries besides (chunk sizes, trailers) up to ``MAX_HEAD_BYTES``; an answer
the client takes nothing of for ``SEND_TIMEOUT_SECONDS`` drops the connection. A malformed request is answered 400
and logged as one warning line; the connection is closed. A connection whose request body was not read whole is
closed after its answer (nothing of it is taken for the next request), the rest read and dropped for up to
``LINGER_SECONDS`` so that the client, still sending, gets the answer.

A client that leaves: a body being read fails with ``ConnectionResetError``, and so does a write; the handler is not
cancelled (as aiohttp's default), so that what it started (an engine call) ends as it would. :meth:`Server.shutdown`
stops taking requests, closes idle connections, and gives the requests being served ``grace`` seconds.
"""

from __future__ import annotations

import asyncio
import email.utils
import http
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import overload

import httptools

log = logging.getLogger(__name__)

#: header fields in a request's head, and bytes in its request line and in each field (aiohttp's limits, and nginx's
#: large_client_header_buffers: 8 KiB)
MAX_HEADERS = 64
MAX_FIELD_BYTES = 8190
#: a head larger than this is refused before it is parsed whole (llhttp holds a field until it ends)
MAX_HEAD_BYTES = (MAX_HEADERS + 1) * (MAX_FIELD_BYTES + 4)
#: the body kept when a route gives no limit of its own
MAX_BODY_BYTES = 16 << 20
#: seconds a connection closed with the client still sending (a refused head, an answer before the body) reads and
#: drops what comes, its own side shut, before it closes: closing with unread bytes resets the connection, and the
#: client may lose the answer (nginx's lingering_close)
LINGER_SECONDS = 2.0
#: requests read ahead of the one being answered (pipelined); past these, no more is read, those are answered and the
#: connection closed
MAX_PIPELINED = 16
#: seconds an answer may wait for the client to take it (its bytes past the transport's buffer) before the connection
#: is aborted; and a closed connection's last bytes, before they are dropped
SEND_TIMEOUT_SECONDS = 60.0
#: each status's reason phrase
_PHRASES = {status.value: status.phrase.encode() for status in http.HTTPStatus}


class BodyTooLargeError(Exception):
    """The request's body passed the server's ``max_body_bytes``; the rest was not kept."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body exceeds {limit} bytes")
        self.limit = limit


class Headers:
    """A request's header fields: names compared without case, a field's first value (:meth:`getall`: each)."""

    __slots__ = ("_fields",)

    def __init__(self, fields: dict[str, list[str]]) -> None:
        self._fields = fields  # by lower-case name

    def __getitem__(self, name: str) -> str:
        return self._fields[name.lower()][0]

    def __contains__(self, name: str) -> bool:
        return name.lower() in self._fields

    @overload
    def get(self, name: str) -> str | None: ...

    @overload
    def get(self, name: str, default: str) -> str: ...

    def get(self, name: str, default: str | None = None) -> str | None:
        values = self._fields.get(name.lower())
        return values[0] if values else default

    def getall(self, name: str, default: list[str] | None = None) -> list[str]:
        values = self._fields.get(name.lower())
        return list(values) if values else ([] if default is None else default)


class Request:
    """A request whose head arrived: what a handler reads of it, and its body as it comes (:meth:`read`)."""

    def __init__(
        self,
        connection: _Connection,
        method: str,
        path: str,
        headers: Headers,
        keep_alive: bool,
        version: str,
    ) -> None:
        self.method, self.path, self.headers, self.version = method, path, headers, version
        self.keep_alive = keep_alive
        self._connection = connection
        self._parts: list[bytes] = []
        self._size = 0
        self._limit = connection.server.max_body_bytes
        self._complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        #: a streamed answer's head was written (a handler that fails after it gets no other answer)
        self.head_sent = False
        self._continue = version != "1.0" and headers.get("Expect", "").lower() == "100-continue"

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._connection.transport

    @property
    def content_length(self) -> int | None:
        """The announced body size (llhttp has checked it is one number), or None."""
        value = self.headers.get("Content-Length")
        return int(value) if value is not None else None

    @property
    def content_type(self) -> str:
        """The media type, lower case, without parameters (absent: ``application/octet-stream``, as RFC 9110 allows
        a recipient to assume)."""
        value = self.headers.get("Content-Type")
        if not value:
            return "application/octet-stream"
        return value.split(";", 1)[0].strip().lower()

    @property
    def charset(self) -> str | None:
        """The ``charset`` parameter of ``Content-Type``, unquoted, or None."""
        for parameter in (self.headers.get("Content-Type") or "").split(";")[1:]:
            name, _, value = parameter.partition("=")
            if name.strip().lower() == "charset":
                return value.strip().strip('"') or None
        return None

    @property
    def body_complete(self) -> bool:
        return self._complete

    async def read(self) -> bytes:
        """The whole body; raises :class:`BodyTooLargeError`, or ``ConnectionResetError`` when the client left first."""
        while self._error is None and not self._complete:
            self._wait_for_more()
            await self._wait()
        if self._error is not None:
            raise self._error
        return self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; raises as :meth:`read` does."""
        while True:
            if self._error is not None:
                raise self._error
            if self._parts:
                parts, self._parts = self._parts, []
                for part in parts:
                    yield part
            elif self._complete:
                return
            else:
                self._wait_for_more()
                await self._wait()

    def _wait_for_more(self) -> None:
        if self._error is not None:
            raise self._error
        if self._continue:  # the client waits for leave to send its body
            self._continue = False
            self._connection.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _feed(self, data: bytes) -> None:
        if self._error is not None:
            return
        self._size += len(data)
        if self._size > self._limit:
            self._parts.clear()
            self._fail(BodyTooLargeError(self._limit))
            return
        self._parts.append(data)
        self._wake()

    def _end(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if self._error is None and not self._complete:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


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
        connection = request._connection
        keep = connection.keeps(request) and self._chunked
        request.head_sent = True
        connection.write(_head(self.status, self.headers, framing, keep, request.version))
        await connection.drain()

    async def write(self, data: bytes) -> None:
        request = self._request
        if request is None:
            raise RuntimeError("write before prepare")
        if self._ended:  # nothing may follow the end: on a kept-alive connection it would open the next answer
            raise ConnectionResetError("the answer has ended")
        if not data:
            return
        connection = request._connection
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
            request._connection.write(b"0\r\n\r\n")
            await request._connection.drain()


Answer = Response | StreamResponse
Handler = Callable[[Request], Awaitable[Answer]]


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


def _head(status: int, headers: Mapping[str, str], framing: bytes, keep_alive: bool, version: str = "1.1") -> bytes:
    lines = [b"HTTP/1.1 %d %b\r\nDate: %b\r\n" % (status, _PHRASES.get(status, b""), _Date.now()), framing]
    for name, value in headers.items():  # values a handler set: latin-1, as HTTP's fields are (else replaced)
        lines.append(f"{name}: {value}\r\n".encode("latin-1", "replace"))
    if not keep_alive:
        lines.append(b"Connection: close\r\n\r\n")
    else:  # an HTTP/1.0 client is told, or it reads until the connection closes
        lines.append(b"Connection: keep-alive\r\n\r\n" if version == "1.0" else b"\r\n")
    return b"".join(lines)


class _RefusedError(Exception):
    """A request the server answers itself, its head malformed or too large: its status, code and reason."""

    def __init__(self, status: int, code: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.code, self.reason = status, code, reason


class _PipelineFullError(Exception):
    """More requests read ahead than :data:`MAX_PIPELINED`: nothing more is read."""


class Server:
    """The routes, the bounds, and the connections open."""

    def __init__(
        self,
        routes: Mapping[tuple[str, str], Handler],
        header_timeout: float,
        keepalive: float,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.routes = dict(routes)
        for (method, path), handler in routes.items():
            if method == "GET":
                self.routes.setdefault(("HEAD", path), handler)
        methods: dict[str, set[str]] = {}
        for method, path in self.routes:
            methods.setdefault(path, set()).add(method)
        #: each path's methods, as a 405's ``Allow`` lists them
        self.allowed = {path: ", ".join(sorted(taken)) for path, taken in methods.items()}
        self.header_timeout, self.keepalive, self.max_body_bytes = header_timeout, keepalive, max_body_bytes
        self.connections: set[_Connection] = set()
        self.closing = False

    def __call__(self) -> _Connection:
        """A connection's protocol (the factory ``loop.create_server`` takes)."""
        return _Connection(self)

    async def shutdown(self, grace: float) -> None:
        """Take no more requests: close idle connections at once, the others once their request is answered or
        ``grace`` seconds have passed."""
        self.closing = True
        for connection in list(self.connections):
            if connection.idle:
                connection.close()
        deadline = time.monotonic() + grace
        while any(not connection.idle for connection in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for connection in list(self.connections):
            connection.close()


class _Connection(asyncio.Protocol):
    """One client connection: its parser, the request being served and those waiting their turn, its timers."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._loop = asyncio.get_running_loop()
        #: the message being parsed: its head's pieces, then (head complete) its request
        self._url: list[bytes] = []
        self._fields: dict[str, list[str]] = {}
        self._count = 0
        self._head_bytes = 0
        self._in_head = False
        self._parsing: Request | None = None
        #: the request being served, and those whose heads arrived while it was (pipelined)
        self._serving: Request | None = None
        self._waiting: deque[Request] = deque()
        #: the bound running: on a head ("head") or on an idle kept-alive connection ("idle")
        self._timer: asyncio.TimerHandle | None = None
        self._timing = ""
        #: the transport's buffer size when the bound last found it not empty (a client that takes nothing is cut)
        self._unsent = 0
        #: handlers waiting for the client to take what was written (each its own future: one cancelled wait
        #: leaves the others, and a later one, as they were)
        self._writing_paused = False
        self._drains: deque[asyncio.Future[None]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._url_bytes = 0
        #: a body's reads: the bytes llhttp passed on as body in the last read, and what came besides, in all
        self._delivered = 0
        self._framing = 0
        self._aborting = False
        self._paused = False
        #: nothing more is read: a request switched protocols (and its body, if any, was read), was malformed, or the
        #: client half-closed
        self._stopped = False
        #: bytes still to come of a body llhttp does not read: a request's that asked to switch protocols
        self._raw_left = 0

    @property
    def idle(self) -> bool:
        return self._serving is None and not self._in_head

    # -- asyncio.Protocol ---------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        self._arm(self.server.header_timeout, "head")

    def data_received(self, data: bytes) -> None:
        if self._raw_left:
            self._feed_raw(data)
            return
        if self._stopped:
            return
        if self._timing == "idle":  # the first byte of the next request's head: it has a bound now
            self._arm(self.server.header_timeout, "head")
        in_body = self._parsing is not None and not self._in_head
        self._delivered = 0
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            # served in HTTP/1.1 (its head is whole), then the connection closes: nothing more is read once its body,
            # if it has one, is (llhttp left it unread)
            self._feed_raw(data[upgrade.args[0] :])
        except httptools.HttpParserCallbackError as exc:
            refused = exc.__context__
            if isinstance(refused, _PipelineFullError):
                self._stopped = True  # those read are answered, then the connection closes
            elif isinstance(refused, _RefusedError):
                self._refuse(refused.status, refused.code, refused.reason)
            else:  # a fault of this module: the client gets a 500, the log the traceback
                log.error("the HTTP server failed on a request", exc_info=refused)
                self._refuse(500, "INTERNAL_ERROR", "the router failed to read the request")
            return
        except httptools.HttpParserError as exc:
            if "after `Connection: close`" in str(exc):
                self._stopped = True  # a request after one that closed the connection: not read
            else:
                self._refuse(400, "BAD_REQUEST", str(exc))
            return
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, "HEADERS_TOO_LARGE", f"the request head exceeds {MAX_HEAD_BYTES} bytes")
        elif in_body and self._parsing is not None:
            # what a body's read carried besides the body: chunk sizes and trailers, which llhttp holds unbounded
            self._framing += len(data) - self._delivered
            if self._framing > MAX_HEAD_BYTES:
                message = f"the request's chunk framing and trailers exceed {MAX_HEAD_BYTES} bytes"
                self._refuse(400, "BAD_REQUEST", message)

    def eof_received(self) -> bool | None:
        self._stopped = True
        if self._parsing is not None:
            self._parsing._fail(ConnectionResetError("the client closed the connection before its body arrived"))
        if self._serving is None:  # nothing to answer: closed (bounded, if what was written is not taken)
            self.close()
        return True  # else half-closed: the answer being written still goes out, then the connection closes

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._disarm()
        gone = ConnectionResetError("the client closed the connection")
        for request in (self._parsing, self._serving, *self._waiting):
            if request is not None:
                request._fail(gone)
        self._stopped = True
        self._waiting.clear()  # requests read ahead for a client that left are not served
        self.transport = None
        self._wake_drains()  # they find the transport gone

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._wake_drains()

    def _wake_drains(self) -> None:
        for waiter in self._drains:
            if not waiter.done():
                waiter.set_result(None)

    # -- llhttp's callbacks -------------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url, self._fields, self._count, self._in_head, self._url_bytes = [], {}, 0, True, 0
        self._framing = 0

    def on_url(self, url: bytes) -> None:
        self._url.append(url)
        self._url_bytes += len(url)
        if self._url_bytes > MAX_FIELD_BYTES:
            raise _RefusedError(400, "BAD_REQUEST", f"the request line exceeds {MAX_FIELD_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a chunked body's trailer: not the request's headers (a handler has read those already)
        self._count += 1
        if self._count > MAX_HEADERS:
            raise _RefusedError(431, "HEADERS_TOO_LARGE", f"the request has more than {MAX_HEADERS} header fields")
        if len(name) + len(value) > MAX_FIELD_BYTES:
            raise _RefusedError(431, "HEADERS_TOO_LARGE", f"a header field exceeds {MAX_FIELD_BYTES} bytes")
        key = name.decode("latin-1").lower()
        values = self._fields.get(key)
        if values is None:
            self._fields[key] = [value.decode("latin-1")]
        else:
            values.append(value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        parser = self._parser
        url = self._url[0] if len(self._url) == 1 else b"".join(self._url)
        if not url.startswith(b"/"):  # absolute form (``POST http://host/v1/completions``), as proxies send
            try:
                url = httptools.parse_url(url).path or b"/"
            except httptools.HttpParserInvalidURLError:  # CONNECT's host:port, a scanner's nonsense
                raise _RefusedError(400, "BAD_REQUEST", "the request target is not a path or an http URL") from None
        path = url.split(b"?", 1)[0].decode("latin-1")
        version = parser.get_http_version()
        keep_alive = parser.should_keep_alive() and not parser.should_upgrade()
        if version == "1.0" and "transfer-encoding" in self._fields:
            keep_alive = False  # HTTP/1.0 has no chunked framing to trust (RFC 9112 6.1): answered, then closed
        request = Request(self, parser.get_method().decode("latin-1"), path, Headers(self._fields), keep_alive, version)
        has_body = "transfer-encoding" in self._fields or self._fields.get("content-length", ["0"])[0].strip() != "0"
        if parser.should_upgrade() and has_body:
            # llhttp stops at the head of a request that asks to switch protocols (``curl --http2 -d``): its body is
            # read here, by its length (llhttp has checked the field); a chunked one is not read at all
            if "transfer-encoding" in self._fields:
                raise _RefusedError(
                    400, "BAD_REQUEST", "a chunked request cannot switch protocols here (HTTP/1.1 only)"
                )
            self._raw_left = int(self._fields["content-length"][0])
        self._parsing = request
        if self._serving is None:
            self._disarm()
            self._start(request)
        elif len(self._waiting) >= MAX_PIPELINED:  # this one is not taken: those read are answered, then the close
            self._parsing = None
            raise _PipelineFullError
        else:  # pipelined: its turn comes after the request being served; no more is read until then
            self._waiting.append(request)
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        self._delivered += len(body)
        if self._parsing is not None:
            self._parsing._feed(body)

    def on_message_complete(self) -> None:
        if self._parsing is not None and not self._raw_left:  # else its body is still to come (_feed_raw)
            self._parsing._end()
            self._parsing = None

    def _feed_raw(self, data: bytes) -> None:
        """Bytes of a body llhttp does not read (a request's that asked to switch protocols), up to its length; once
        it is whole, nothing more is read."""
        taken = data[: self._raw_left]
        self._raw_left -= len(taken)
        request = self._parsing
        if request is not None and taken:
            request._feed(taken)
        if not self._raw_left:
            self._stopped = True
            if request is not None:
                request._end()
                self._parsing = None

    # -- serving ------------------------------------------------------------------------------------------------

    def _start(self, request: Request) -> None:
        self._serving = request
        self._task = self._loop.create_task(self._serve(request))

    async def _serve(self, request: Request) -> None:
        closes = True
        try:
            answer = await self._answer(request)
            if answer is None:  # the handler failed after its answer's head was sent: nothing can follow
                return
            if isinstance(answer, Response):
                self._write_whole(request, answer)
                await self.drain()  # taken by the client before its next request is read
            elif not answer.prepared:
                self._write_whole(request, Response(status=answer.status, headers=answer.headers))
                await self.drain()
            elif not answer.ended:
                await answer.write_eof()
            closes = isinstance(answer, StreamResponse) and request.version == "1.0"
        except ConnectionResetError:
            pass  # the client left, or took nothing for SEND_TIMEOUT_SECONDS (drain)
        except Exception:
            log.exception("%s %s: the answer could not be written", request.method, request.path)
        finally:
            self._served(request, closes)

    async def _answer(self, request: Request) -> Answer | None:
        handler = self.server.routes.get((request.method, request.path))
        if handler is None:
            allowed = self.server.allowed.get(request.path)
            if allowed is None:
                return Response(error_body(404, "NOT_FOUND", f"no route {request.path}"), 404)
            message = f"{request.path} takes {allowed}, not {request.method}"
            return Response(error_body(405, "METHOD_NOT_ALLOWED", message), 405, headers={"Allow": allowed})
        try:
            return await handler(request)
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            if request.head_sent:
                return None
            return Response(error_body(500, "INTERNAL_ERROR", "the router failed on this request"), 500)

    def _write_whole(self, request: Request, answer: Response) -> None:
        body = b"" if request.method == "HEAD" else answer.body
        framing = b"Content-Type: %b\r\nContent-Length: %d\r\n" % (answer.content_type.encode(), len(answer.body))
        head = _head(answer.status, answer.headers, framing, self.keeps(request), request.version)
        if len(body) < 16384:
            self.write(head + body)
        else:  # not copied into one
            self._live().writelines((head, body))

    def keeps(self, request: Request) -> bool:
        """Whether the connection stays open after this request's answer: kept alive, its framing whole, and more
        to read (or requests read ahead still to answer, when nothing more is read)."""
        more = not self._stopped or bool(self._waiting)
        return request.keep_alive and request.body_complete and not self.server.closing and more

    def _served(self, request: Request, closes: bool) -> None:
        self._serving, self._task = None, None
        if self.transport is None:
            return  # the client left
        if not request.body_complete and not self._stopped:
            self._linger()  # answered before its body arrived whole: the rest is not taken for a request
            return
        if closes or not self.keeps(request):
            if self._stopped and self._paused:  # reading was paused: the client's bytes may wait unread
                self._linger()
            else:
                self.close()
            return
        if self._waiting:
            following = self._waiting.popleft()
            if not self._waiting and not self._stopped:
                self._resume_reading()
            self._start(following)
            return
        self._resume_reading()
        self._unsent = 0
        if self._in_head:
            self._arm(self.server.header_timeout, "head")
        else:
            self._arm(self.server.keepalive, "idle")

    # -- the transport ------------------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        self._live().write(data)

    def _live(self) -> asyncio.Transport:
        """The transport, while it takes writes; else ``ConnectionResetError``."""
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        return transport

    async def drain(self) -> None:
        """Wait while the transport's buffer is full (the client has not taken what was written); raises
        ``ConnectionResetError`` when the client left."""
        if self._writing_paused and self.transport is not None:
            waiter = self._loop.create_future()
            self._drains.append(waiter)
            try:
                async with asyncio.timeout(SEND_TIMEOUT_SECONDS):
                    await waiter
            except TimeoutError:  # a client that takes nothing holds neither this handler nor the memory longer
                if self.transport is not None:
                    self.transport.abort()
                raise ConnectionResetError(f"the client took nothing for {SEND_TIMEOUT_SECONDS:g} s") from None
            finally:
                self._drains.remove(waiter)
        if self.transport is None:
            raise ConnectionResetError("the client closed the connection")

    def close(self) -> None:
        """Close once what was written is sent; what is not taken within ``SEND_TIMEOUT_SECONDS`` is dropped."""
        self._disarm()
        transport = self.transport
        if transport is None:
            return
        if not transport.is_closing():
            transport.close()
        if transport.get_write_buffer_size() and not self._aborting:
            self._aborting = True
            self._loop.call_later(SEND_TIMEOUT_SECONDS, self._abort, transport)

    def _abort(self, transport: asyncio.Transport) -> None:
        if self.transport is transport:  # not lost yet
            transport.abort()

    def _refuse(self, status: int, code: str, reason: str) -> None:
        """Answer a request the server cannot take (its head), and close the connection."""
        reason = " ".join(reason.split())[:200]
        log.warning("refused a malformed HTTP request (%d %s)", status, reason)
        body = error_body(status, code, reason)
        self._stopped = True
        if self._serving is None and self.transport is not None and not self.transport.is_closing():
            framing = b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
            self.transport.write(_head(status, {}, framing, keep_alive=False) + body)
        if self._parsing is not None:
            self._parsing._fail(ConnectionResetError("the request was malformed"))
        if self._serving is None:
            self._linger()

    def _linger(self) -> None:
        """Close once the client stops sending (``LINGER_SECONDS`` at most): this side shut at once, so the answer
        goes out and then the end, what comes meanwhile read and dropped."""
        self._stopped, self._raw_left = True, 0  # what comes is dropped, a body llhttp left unread too
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if transport.can_write_eof():
            transport.write_eof()
        self._arm(LINGER_SECONDS, "linger")
        self._resume_reading()

    def _pause_reading(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._paused and self.transport is not None and not self.transport.is_closing():
            self._paused = False
            self.transport.resume_reading()

    def _arm(self, seconds: float, timing: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timing = self._loop.call_later(seconds, self._expired), timing

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timing = None, ""

    def _expired(self) -> None:
        """No whole head within its bound, or idle for the keep-alive bound: closed, unless an answer is still
        going out (then the bound starts again once it is)."""
        self._timer, timing = None, self._timing
        self._timing = ""
        if timing == "linger":
            self.close()
            return
        if self._serving is not None or self.transport is None:
            return
        unsent = self.transport.get_write_buffer_size()
        if unsent and (not self._unsent or unsent < self._unsent):  # an answer still going out: wait while it does
            self._unsent = unsent
            self._arm(self.server.header_timeout, timing)
            return
        self._unsent = 0
        if unsent:  # the client took nothing of it for a whole bound
            self.transport.abort()
            return
        self.close()
