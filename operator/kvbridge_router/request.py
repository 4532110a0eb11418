"""A request as the router's HTTP server hands it to a route's handler: its head (method, path, header fields) and
its body as it arrives (server.py says what the server does; connection.py feeds the body in)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    from kvbridge_router.connection import Connection


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
        connection: Connection,
        method: str,
        path: str,
        headers: Headers,
        keep_alive: bool,
        version: str,
    ) -> None:
        self.method, self.path, self.headers, self.version = method, path, headers, version
        self.keep_alive = keep_alive
        #: the client connection it came on (what a streamed answer writes to)
        self.connection = connection
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
        return self.connection.transport

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
            self.connection.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    def feed_body(self, data: bytes) -> None:
        """Bytes of the body, as the connection read them (past ``max_body_bytes``: none kept, the reader fails)."""
        if self._error is not None:
            return
        self._size += len(data)
        if self._size > self._limit:
            self._parts.clear()
            self.fail_body(BodyTooLargeError(self._limit))
            return
        self._parts.append(data)
        self._wake()

    def end_body(self) -> None:
        """The body arrived whole."""
        self._complete = True
        self._wake()

    def fail_body(self, error: BaseException) -> None:
        """The body will not arrive whole (the client left, the request was malformed): its reader raises ``error``."""
        if self._error is None and not self._complete:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
