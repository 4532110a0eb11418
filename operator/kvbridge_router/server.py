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

Bounds (connection.py's): the request line and each header field at most ``MAX_FIELD_BYTES``, ``MAX_HEADERS`` fields
(431, or 400 for a line, and the connection closed); a whole head must arrive ``header_timeout`` seconds after the
connection opened, or after the first byte of a later request, and an idle kept-alive connection is closed after
``keepalive`` seconds; a body is kept up to ``max_body_bytes`` (the handler reads :class:`BodyTooLargeError` past it; it
reads the body within its own timeout), and what a chunked body carries besides (chunk sizes, trailers) up to
``MAX_HEAD_BYTES``; an answer the client takes nothing of for ``SEND_TIMEOUT_SECONDS`` drops the connection. A malformed
request is answered 400 and logged as one warning line; the connection is closed. A connection whose request body was
not read whole is closed after its answer (nothing of it is taken for the next request), the rest read and dropped for
up to ``LINGER_SECONDS`` so that the client, still sending, gets the answer.

A client that leaves: a body being read fails with ``ConnectionResetError``, and so does a write; the handler is not
cancelled (as aiohttp's default), so that what it started (an engine call) ends as it would. :meth:`Server.shutdown`
stops taking requests, closes idle connections, and gives the requests being served ``grace`` seconds.

Its modules: this one (the routes, the bounds, the connections open, shutdown), ``connection`` (one client connection:
parsing, serving in turn, the bounds), ``request`` (what a handler reads) and ``response`` (what it answers, and how
that is written).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping

from kvbridge_router.connection import Connection
from kvbridge_router.request import Request
from kvbridge_router.response import Answer

#: the body kept when a route gives no limit of its own
MAX_BODY_BYTES = 16 << 20

#: a route's handler: the request in, its answer out
Handler = Callable[[Request], Awaitable[Answer]]


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
        self.connections: set[Connection] = set()
        self.closing = False

    def __call__(self) -> Connection:
        """A connection's protocol (the factory ``loop.create_server`` takes)."""
        return Connection(self)

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
