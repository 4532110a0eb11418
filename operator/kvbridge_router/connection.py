"""One client connection of the router's HTTP server (server.py says what the server does): llhttp's callbacks
building each request's head and feeding its body, the request served and those pipelined behind it, the answer
written, and the connection's bounds (head, idle, linger, a client that takes nothing)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING

import httptools

from kvbridge_router.request import Headers, Request
from kvbridge_router.response import Answer, Response, StreamResponse, answer_head, error_body

if TYPE_CHECKING:
    from kvbridge_router.server import Server

log = logging.getLogger(__name__)

#: header fields in a request's head, and bytes in its request line and in each field (aiohttp's limits, and nginx's
#: large_client_header_buffers: 8 KiB)
MAX_HEADERS = 64
MAX_FIELD_BYTES = 8190
#: a head larger than this is refused before it is parsed whole (llhttp holds a field until it ends)
MAX_HEAD_BYTES = (MAX_HEADERS + 1) * (MAX_FIELD_BYTES + 4)
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


class _RefusedError(Exception):
    """A request the server answers itself, its head malformed or too large: its status, code and reason."""

    def __init__(self, status: int, code: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.code, self.reason = status, code, reason


class _PipelineFullError(Exception):
    """More requests read ahead than :data:`MAX_PIPELINED`: nothing more is read."""


class Connection(asyncio.Protocol):
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
            self._parsing.fail_body(ConnectionResetError("the client closed the connection before its body arrived"))
        if self._serving is None:  # nothing to answer: closed (bounded, if what was written is not taken)
            self.close()
        return True  # else half-closed: the answer being written still goes out, then the connection closes

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._disarm()
        gone = ConnectionResetError("the client closed the connection")
        for request in (self._parsing, self._serving, *self._waiting):
            if request is not None:
                request.fail_body(gone)
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
            self._parsing.feed_body(body)

    def on_message_complete(self) -> None:
        if self._parsing is not None and not self._raw_left:  # else its body is still to come (_feed_raw)
            self._parsing.end_body()
            self._parsing = None

    def _feed_raw(self, data: bytes) -> None:
        """Bytes of a body llhttp does not read (a request's that asked to switch protocols), up to its length; once
        it is whole, nothing more is read."""
        taken = data[: self._raw_left]
        self._raw_left -= len(taken)
        request = self._parsing
        if request is not None and taken:
            request.feed_body(taken)
        if not self._raw_left:
            self._stopped = True
            if request is not None:
                request.end_body()
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
        head = answer_head(answer.status, answer.headers, framing, self.keeps(request), request.version)
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
            self.transport.write(answer_head(status, {}, framing, keep_alive=False) + body)
        if self._parsing is not None:
            self._parsing.fail_body(ConnectionResetError("the request was malformed"))
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
