"""The router's HTTP/1.1 client to the engines: keep-alive connections, one request at a time on each.

The hot path of every routed request is two calls to engines (prefill, then decode) on the same few hosts. A
general client (aiohttp's) spends most of the router's CPU per request on what these calls never need: cookies,
redirects, proxies, URL building, compression, tracing. This one writes a request's head and body in one vectored
write (the body's pieces as given: a view of the client's bytes is not copied) and parses the answer with
``httptools`` (llhttp, Node's parser: Content-Length, chunked and keep-alive handled there).

Answers are read as HTTP/1.1 says: interim ``1xx`` answers (``100 Continue``, ``103 Early Hints``) are skipped and
the final answer is the one given; a body with neither ``Content-Length`` nor ``Transfer-Encoding`` ends when the
engine closes the connection. A status that is no final answer with a body (``101``, ``204``, ``304``, anything
outside 200-599) is an error.

Errors: :class:`UnreachableError` when no connection could be made (nothing was sent: another pod may be tried with
the same request), :class:`UpstreamError` for anything after (the engine may have the request; a malformed answer, a
status as above, a connection closed mid-answer), :class:`AnswerTooLargeError` (an ``UpstreamError``) when a body
read whole passes its limit, ``TimeoutError`` for a bound passed. A connection is reused only after its answer was
read whole and the engine kept it alive; one that fails, or on which the engine sends anything while no answer is
due (after the answer, or while idle in the pool), is closed, so no byte of one answer can become another's. Idle
ones are dropped after ``keepalive`` seconds (before the engine's own keep-alive timeout closes them under a
request).

Bounds: an answer's head is at most ``MAX_HEAD_BYTES`` (interim answers included, at most ``MAX_INTERIM`` of them);
a body read whole (:meth:`EngineAnswer.read`) at most its ``limit`` (``MAX_ANSWER_BYTES`` unless given), refused on an
announced ``Content-Length`` before a byte of it is read, else as soon as it passes; a body arriving faster than the
router passes it on pauses reading from the engine (at ``BUFFER_BYTES``), so a slow client holds back its engine's
stream, not the router's memory.
"""

from __future__ import annotations

import asyncio
import functools
import time
import urllib.parse
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import httptools

#: what a request is written from: bytes, or slices of the client's body (memoryviews: not copied)
Buffer = bytes | memoryview

#: buffered body bytes above which reading from the engine pauses until the router has passed them on
BUFFER_BYTES = 1 << 20
#: an answer's headers larger than this are refused (the engines' are a few hundred bytes)
MAX_HEAD_BYTES = 64 << 10
#: interim (1xx) answers skipped before the final one; more is an engine talking nonsense
MAX_INTERIM = 8
#: a body read whole (EngineAnswer.read) larger than this is refused unless the caller gives its own limit
MAX_ANSWER_BYTES = 16 << 20
#: statuses that are a final answer but have no body (RFC 9110 6.4.1), and the switch to another protocol
NO_ANSWER_STATUSES = frozenset((101, 204, 304))


class UpstreamError(Exception):
    """The call failed after a connection was made: the engine may have received the request."""


class UnreachableError(UpstreamError):
    """No connection could be made (refused, no route, DNS): the engine did not receive the request."""


class AnswerTooLargeError(UpstreamError):
    """A body read whole is larger than its limit; the rest was not read and the connection is closed."""

    def __init__(self, limit: int, size: int | None = None) -> None:
        said = f"is announced as {size} bytes, over" if size is not None else "passed"
        super().__init__(f"the answer {said} the limit of {limit} bytes")
        self.limit = limit


@dataclass
class EngineAnswer:
    """An engine's answer: its status and headers, its body read whole (:meth:`read`) or as it comes
    (:meth:`chunks`)."""

    _connection: _Connection
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/octet-stream").split(";", 1)[0].strip()

    async def read(self, limit: int = MAX_ANSWER_BYTES) -> bytes:
        """The whole body; over ``limit`` bytes, :class:`AnswerTooLargeError` (rest unread, connection closed)."""
        announced = self.headers.get("content-length", "")
        if announced.isdigit() and int(announced) > limit:
            self._connection.close()
            raise AnswerTooLargeError(limit, int(announced))
        pieces: list[bytes] = []
        size = 0
        async for chunk in self.chunks():
            size += len(chunk)
            if size > limit:
                self._connection.close()
                raise AnswerTooLargeError(limit)
            pieces.append(chunk)
        return b"".join(pieces)

    async def chunks(
        self, idle_timeout: float | None = None, first_timeout: float | None = None
    ) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive; ``TimeoutError`` when none comes for ``idle_timeout`` seconds (the first
        one: ``first_timeout``, when given)."""
        connection = self._connection
        wait = first_timeout if first_timeout is not None else idle_timeout
        while True:
            chunk = await connection.next_chunk(wait)
            if chunk is None:
                return
            wait = idle_timeout
            yield chunk


class _OutOfTurnError(UpstreamError):
    """Bytes after an answer was whole: the answer stands, the connection is dropped."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; its answer parsed as it arrives."""

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._answer: EngineAnswer | None = None
        self._head = asyncio.get_running_loop().create_future()  # type: asyncio.Future[None]
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._complete = False
        self._keep_alive = False
        self._error: BaseException | None = None
        self._wake: asyncio.Future[None] | None = None
        self._head_bytes = 0
        self._interim = 0  # interim answers skipped so far; the one being parsed is one while _in_interim
        self._in_interim = False
        self._framed = False  # the body's end is given (Content-Length, Transfer-Encoding): else it is the close

    # -- asyncio.Protocol ----------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._answer is None or self._complete:  # no answer due: an engine talking out of turn
            self.close()  # an answer already read stands; the connection goes, its bytes with it
            return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            cause = exc.__context__  # a callback's own error (httptools reports it as the cause's context)
            if isinstance(cause, _OutOfTurnError):  # bytes behind a whole answer, in its last packet
                self.close()
                return
            self._fail(cause if isinstance(cause, UpstreamError) else UpstreamError(f"malformed HTTP answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self._complete and exc is None and self._head.done() and not self._framed and self._error is None:
            self._complete = True  # a body delimited by the close (no length, not chunked): whole now
            self._notify()
        if not self._complete:
            self._fail(UpstreamError(f"the engine closed the connection{f': {exc}' if exc else ''}"))

    # -- httptools callbacks (an UpstreamError raised here stops the parser and is the call's error) ----------
    def on_message_begin(self) -> None:
        if self._answer is None or self._complete:
            raise _OutOfTurnError("the engine sent data with no request outstanding")
        self._answer.headers.clear()  # an interim answer's headers are not the final one's

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise UpstreamError(f"the answer's headers exceed {MAX_HEAD_BYTES} bytes")
        if self._answer is not None:
            self._answer.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # interim: the final answer follows on the same connection
            self._interim += 1
            if self._interim > MAX_INTERIM:
                raise UpstreamError(f"more than {MAX_INTERIM} interim (1xx) answers")
            self._in_interim = True
            return
        if status in NO_ANSWER_STATUSES or not 200 <= status < 600:
            raise UpstreamError(f"the engine answered with status {status}, not an answer with a body")
        if self._answer is not None:
            self._answer.status = status
            # a body's end is given by its length or its transfer coding; with neither, it ends at the close
            self._framed = "content-length" in self._answer.headers or "transfer-encoding" in self._answer.headers
        if not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > BUFFER_BYTES and not self._paused and self.transport is not None:
            self.transport.pause_reading()
            self._paused = True
        self._notify()

    def on_message_complete(self) -> None:
        if self._in_interim:
            self._in_interim = False
            return
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()  # llhttp forgets it once the message is done
        self._notify()

    # -- the router's side ---------------------------------------------------------------------------------
    def begin(self, request: Sequence[Buffer]) -> EngineAnswer:
        if self.transport is None:
            raise UpstreamError("the connection closed")
        self._answer = EngineAnswer(self)
        self._head = asyncio.get_running_loop().create_future()
        self._body.clear()
        self._buffered, self._complete, self._keep_alive, self._error, self._head_bytes = 0, False, False, None, 0
        self._interim, self._in_interim, self._framed = 0, False, False
        self.transport.writelines(request)  # uvloop: one vectored send, the pieces not joined
        return self._answer

    def head(self) -> asyncio.Future[None]:
        """Done when the answer's status and headers arrived (a future, not a coroutine: waiting on it with a
        timeout makes no task)."""
        return self._head

    async def next_chunk(self, idle_timeout: float | None) -> bytes | None:
        while not self._body:
            if self._error is not None:
                raise self._error
            if self._complete:
                return None
            self._wake = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self._wake, idle_timeout)
            finally:
                self._wake = None
        chunk = self._body.popleft()
        self._buffered -= len(chunk)
        if self._paused and self._buffered <= BUFFER_BYTES // 2 and self.transport is not None:
            self.transport.resume_reading()
            self._paused = False
        return chunk

    @property
    def reusable(self) -> bool:
        return (
            self._complete
            and not self._body
            and self._error is None
            and self.transport is not None
            and not self.transport.is_closing()
            and self._keep_alive
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        if not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved: no "never retrieved" warning when nobody waits
        self._notify()
        self.close()

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)


class Upstream:
    """Connections to the engines, pooled per host and port."""

    def __init__(self, keepalive: float) -> None:
        self.keepalive = keepalive
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._closed = False

    async def _connect(self, host: str, port: int, timeout: float) -> _Connection:
        key = (host, port)
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.transport is not None and now - connection.idle_since < self.keepalive:
                return connection
            connection.close()
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await asyncio.wait_for(loop.create_connection(lambda: _Connection(key), host, port), timeout)
        except OSError as exc:  # refused, unreachable, no such host
            raise UnreachableError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
        return protocol

    def _release(self, connection: _Connection) -> None:
        if self._closed or not connection.reusable:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.key, []).append(connection)

    def post(
        self,
        base: str,
        path: str,
        body: bytes | Sequence[Buffer],
        headers: Mapping[str, str],
        connect_timeout: float,
        head_timeout: float | None = None,
        content_type: str = "application/json",
        sent: Callable[[], None] | None = None,
    ) -> _Call:
        """A POST of a body (JSON unless ``content_type`` says otherwise) to ``base`` (``http://host:port``) +
        ``path``; use it as an async context manager,
        which gives the :class:`EngineAnswer` once its status and headers arrived (within ``head_timeout`` seconds when
        given) and on leaving puts the connection back in the pool, or closes it. ``sent`` is called once the request
        is written, before its answer is awaited (work that can wait until the engine has the request)."""
        host, port, authority = _address(base)
        parts = [body] if isinstance(body, bytes) else list(body)  # the body's pieces, sent as they are
        lines = [
            f"POST {path} HTTP/1.1",
            f"Host: {authority}",
            f"Content-Length: {sum(map(len, parts))}",
            f"Content-Type: {content_type}",
        ]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} holds a line break")
            lines.append(f"{name}: {value}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
        return _Call(self, host, port, [head, *parts], connect_timeout, head_timeout, sent)

    def close(self) -> None:
        self._closed = True
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()


class _Call:
    def __init__(
        self,
        upstream: Upstream,
        host: str,
        port: int,
        request: list[Buffer],
        connect_timeout: float,
        head_timeout: float | None,
        sent: Callable[[], None] | None,
    ) -> None:
        self.upstream, self.host, self.port, self.request = upstream, host, port, request
        self.connect_timeout, self.head_timeout, self.sent = connect_timeout, head_timeout, sent
        self.connection: _Connection | None = None

    async def __aenter__(self) -> EngineAnswer:
        self.connection = connection = await self.upstream._connect(self.host, self.port, self.connect_timeout)
        try:
            answer = connection.begin(self.request)
            if self.sent is not None:
                self.sent()
            await asyncio.wait_for(connection.head(), self.head_timeout)
        except BaseException:
            connection.close()
            raise
        return answer

    async def __aexit__(self, *_: object) -> None:
        if self.connection is not None:
            self.upstream._release(self.connection)


@functools.lru_cache(maxsize=1024)
def _address(base: str) -> tuple[str, int, str]:
    """``http://host:port`` as the host to connect to, its port and the Host header's value."""
    parts = urllib.parse.urlsplit(base)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"not an http://host:port address: {base!r}")
    return parts.hostname, parts.port or 80, parts.netloc
