"""The bounds of the engine's HTTP server on its clients (docs/environment.md):

- a **request deadline** (``KVBRIDGE_HTTP_REQUEST_SECONDS``): a request's line, headers and body must all arrive
  within this long of its first byte, however the bytes are spread. A socket timeout bounds each read only, so a
  client sending a byte every few seconds (slow loris) would otherwise hold its connection and thread for as long
  as it likes. An idle keep-alive connection waits for its next request's first byte at most the idle timeout;
- a **cap on open connections** (``KVBRIDGE_HTTP_MAX_CONNECTIONS``), each holding a thread: one past it is answered
  503 ``TOO_MANY_CONNECTIONS`` with ``Retry-After`` at once, by the accepting thread, and closed; the connections
  being served are not affected.
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from typing import Any

from kvbridge_agent.core.contract import HTTP_MAX_CONNECTIONS, HTTP_REQUEST_SECONDS

#: how long a connection may wait for the first byte of its next request, and each read at most
IDLE_TIMEOUT_SECONDS = 30.0
#: the defaults of the request deadline and of the cap (the environment contract's)
REQUEST_SECONDS, MAX_CONNECTIONS = HTTP_REQUEST_SECONDS, HTTP_MAX_CONNECTIONS
TOO_MANY_CONNECTIONS = "TOO_MANY_CONNECTIONS"


class DeadlineReader(io.RawIOBase):
    """A connection's reads, each bounded by what is left of the current request's deadline (armed by the request's
    first byte, :meth:`next_request` disarms it) and by the idle timeout. Past the deadline a read raises
    ``TimeoutError``, which ends the connection (the request line or a header) or the request (its body, 408)."""

    def __init__(self, sock: socket.socket, request_seconds: float, idle_seconds: float = IDLE_TIMEOUT_SECONDS) -> None:
        super().__init__()
        self._sock = sock
        self.request_seconds = request_seconds
        self._idle = idle_seconds
        self._deadline: float | None = None

    def readable(self) -> bool:
        return True

    def next_request(self) -> None:
        self._deadline = None

    def readinto(self, buffer: Any) -> int:
        timeout = self._idle
        if self._deadline is not None:
            timeout = min(timeout, self._deadline - time.monotonic())
            if timeout <= 0:
                raise TimeoutError(f"the request did not arrive within {self.request_seconds:g} s")
        self._sock.settimeout(timeout)
        try:
            count = self._sock.recv_into(buffer)
        finally:
            self._sock.settimeout(self._idle)  # the answer's writes are not bound by what was left of the deadline
        if count and self._deadline is None:
            self._deadline = time.monotonic() + self.request_seconds
        return count


class ConnectionSlots:
    """At most ``limit`` connections served at once; :meth:`refuse` answers one more without a thread."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free = threading.BoundedSemaphore(limit)

    def take(self) -> bool:
        return self._free.acquire(blocking=False)

    def give_back(self) -> None:
        self._free.release()

    def refuse(self, sock: socket.socket) -> None:
        """503 with ``Retry-After``, written without waiting (a client that does not read it loses it), then closed."""
        body = json.dumps(
            {
                "error": {
                    "code": TOO_MANY_CONNECTIONS,
                    "field": "",
                    "message": f"this engine serves {self.limit} connections at most (KVBRIDGE_HTTP_MAX_CONNECTIONS)",
                    "invalidBlocks": [],
                }
            }
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        ).encode()
        try:
            sock.setblocking(False)
            sock.send(head + body)
        except OSError:
            pass
