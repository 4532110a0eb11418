"""The agent worker's small HTTP API (stdlib server): health, metrics, prefill, decode.

- ``GET /healthz`` — 200 when every rank and the side-channel listener are up (probes); 503 with ``problems``
- ``GET /metrics`` — Prometheus text
- ``POST /v1/prefill`` ``{"requestId", "numTokens"}`` -> ``{"kvTransferParams": {...}}``
- ``POST /v1/decode`` ``{"requestId", "kvTransferParams", "prefixHitBlocks"}`` -> transfer result (behind a
  signing router also ``"prompt"``: the request's token ids or text, which the signature binds)
  (both take an optional ``"blockAllocation": "Sequential" | "Scattered"`` overriding the engine's default)
- ``POST /v1/completions``, ``/v1/chat/completions`` — what a P/D router sends vLLM (``completions``)
- ``GET /v1/models`` — the synthetic model's name
- ``GET /v1/held`` — prefill requests whose blocks await readers
- ``GET /v1/ranks`` — per-rank state (open NIXL handles, requests in flight)

With several data-parallel ranks (``data_parallel``) each POST runs on one of them, the one named by vLLM's header
``X-data-parallel-rank`` or else the least busy; health and metrics cover them all.

Errors are ``{"error": {"code", "field", "message", "invalidBlocks"}}`` with a
4xx/5xx status; a bad request never affects other requests. On SIGTERM the server drains: new POSTs get 503
``DRAINING`` (a router retries them elsewhere) while those in flight finish, at most ``KVBRIDGE_DRAIN_SECONDS``.
A request must arrive within ``KVBRIDGE_HTTP_REQUEST_SECONDS`` of its first byte, and at most
``KVBRIDGE_HTTP_MAX_CONNECTIONS`` connections are served at once (``http_bounds``).
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import threading
from collections.abc import Generator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvbridge_agent.core import KVBridgeError
from kvbridge_agent.core.contract import BlockAllocation
from kvbridge_agent.synthetic import completions, pace
from kvbridge_agent.synthetic.data_parallel import DP_RANK_HEADER, DataParallelEngines
from kvbridge_agent.synthetic.http_bounds import (
    IDLE_TIMEOUT_SECONDS,
    MAX_CONNECTIONS,
    REQUEST_SECONDS,
    ConnectionSlots,
    DeadlineReader,
)
from kvbridge_agent.synthetic.ranks import INVALID_REQUEST, EngineError

log = logging.getLogger(__name__)
MAX_BODY = 64 << 20
_POST_ROUTES = ("/v1/prefill", "/v1/decode", "/v1/completions", "/v1/chat/completions")


def _error(code: str, message: str, field: str = "", invalid: list[int] | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "field": field, "message": message, "invalidBlocks": invalid or []}}


class _Handler(BaseHTTPRequestHandler):
    server: AgentHTTPServer
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_SECONDS  # on the connection's socket: every read and write is bounded

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # read through the request deadline instead (http_bounds)
        self._reader = DeadlineReader(self.connection, self.server.request_seconds)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        self._reader.next_request()  # its deadline runs from its first byte
        super().handle_one_request()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http: " + format, *args)

    def _send(self, status: int, body: dict[str, Any] | bytes, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_events(self, events: Generator[bytes]) -> None:
        """Server-sent events as they come (chunked); a client gone mid-stream ends it (and the connection)."""
        first = next(events)  # an error before the first token is still an answer of its own
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for event in itertools.chain([first], events):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True
        finally:
            events.close()

    def _body(self) -> dict[str, Any]:
        declared = (self.headers.get("Content-Length") or "0").strip()
        if not declared.isdigit() or not declared.isascii():
            self.close_connection = True  # where this request's body ends is unknown
            raise EngineError(
                f"Content-Length {declared[:20]!r} is not a number of bytes",
                code=INVALID_REQUEST,
                field="Content-Length",
            )
        length = int(declared)
        if length > MAX_BODY:
            self.close_connection = True
            raise EngineError(f"body of {length} bytes exceeds {MAX_BODY}", code=INVALID_REQUEST)
        try:
            raw = self.rfile.read(length)
        except TimeoutError as exc:
            self.close_connection = True
            raise EngineError(f"the body did not arrive in time: {exc}", code=INVALID_REQUEST, status=408) from exc
        if len(raw) < length:
            self.close_connection = True
            raise EngineError(f"the body ended after {len(raw)} of {length} bytes", code=INVALID_REQUEST)
        try:
            body = json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EngineError(f"body is not JSON: {exc}", code=INVALID_REQUEST) from exc
        if not isinstance(body, dict):
            raise EngineError("body must be a JSON object", code=INVALID_REQUEST)
        return body

    def do_GET(self) -> None:
        engine = self.server.engine
        if self.path in ("/healthz", "/health"):  # /health: vLLM's name, which routers probe
            healthy = engine.healthy
            status = HTTPStatus.OK if healthy else HTTPStatus.SERVICE_UNAVAILABLE
            self._send(
                status,
                {
                    "ok": healthy,
                    "problems": engine.problems(),
                    "role": engine.env.role.value,
                    "engineId": engine.env.engine_id,
                    "incarnation": engine.incarnation,
                    "rankPids": engine.rank_pids(),
                    **_ranks_of(engine),
                },
            )
        elif self.path == "/metrics":
            self._send(HTTPStatus.OK, engine.metrics.render() + engine.pace.render(), "text/plain; version=0.0.4")
        elif self.path == "/v1/models":
            self._send(HTTPStatus.OK, completions.models())
        elif self.path == "/v1/held":
            self._send(HTTPStatus.OK, {"held": engine.held(), "freeBlocks": engine.free_blocks})
        elif self.path == "/v1/ranks":
            self._send(HTTPStatus.OK, {"ranks": engine.rank_stats()})
        else:
            self._send(HTTPStatus.NOT_FOUND, _error("NOT_FOUND", f"no route {self.path}"))

    def do_POST(self) -> None:
        server: AgentHTTPServer = self.server
        if not server.enter():  # draining (SIGTERM): the router retries the request on another pair
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, _error("DRAINING", "this engine is shutting down"))
            return
        try:
            self._post()
        finally:
            server.leave()

    def _post(self) -> None:
        engine = self.server.engine
        if self.path not in _POST_ROUTES:
            self._send(HTTPStatus.NOT_FOUND, _error("NOT_FOUND", f"no route {self.path}"))
            return
        try:
            body = self._body()
            rank = engine.rank_of(self.headers.get(DP_RANK_HEADER))
            if self.path == "/v1/prefill":
                params = engine.prefill(
                    str(body.get("requestId", "")), _int(body, "numTokens"), _allocation(body), rank
                )
                self._send(HTTPStatus.OK, {"kvTransferParams": params.model_dump(by_alias=True)})
            elif self.path == "/v1/decode":
                raw = body.get("kvTransferParams")
                if isinstance(raw, dict):  # a signature binds a prompt: this route checks the one it is given
                    prompt = completions.prompt_digest(body, chat=False)
                    raw = completions.signed_by_router(engine, raw, "kvTransferParams", prompt)
                params = completions.transfer_params(raw, "kvTransferParams")
                result = engine.decode(
                    str(body.get("requestId", "")), params, _int(body, "prefixHitBlocks", 0), _allocation(body), rank
                )
                self._send(HTTPStatus.OK, result)
            else:  # /v1/completions, /v1/chat/completions
                chat = self.path == "/v1/chat/completions"
                request_id = self.headers.get("X-Request-Id") or ""
                answer, stream = completions.complete(engine, body, chat, request_id, rank)
                sent = pace.paced(engine.pace, answer, body, chat, stream)  # a decode at the set speed (pace.py)
                if isinstance(sent, dict):
                    self._send(HTTPStatus.OK, sent)
                elif sent is not None:
                    self._send_events(sent)
                elif stream:
                    self._send(HTTPStatus.OK, completions.event_stream(answer, chat), "text/event-stream")
                else:
                    self._send(HTTPStatus.OK, answer)
        except EngineError as exc:
            self._send(exc.status, _error(exc.code, exc.message, exc.field, exc.invalid_blocks))
        except KVBridgeError as exc:
            self._send(HTTPStatus.BAD_REQUEST, _error(exc.code, exc.message, exc.field))
        except Exception as exc:  # keep serving; report the bug
            log.exception("request %s failed", self.path)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, _error("INTERNAL_ERROR", f"{type(exc).__name__}: {exc}"))


def _ranks_of(engine: DataParallelEngines) -> dict[str, Any]:
    """Each DP rank as a transfer peer, where the engine has several."""
    return {"dataParallelRanks": engine.data_parallel_ranks()} if len(engine.members) > 1 else {}


def _int(body: dict[str, Any], name: str, default: int | None = None) -> int:
    value = body.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise EngineError(f"{name} must be an integer", code=INVALID_REQUEST, field=name)
    return value


def _allocation(body: dict[str, Any]) -> BlockAllocation | None:
    value = body.get("blockAllocation")
    if value is None:
        return None
    try:
        return BlockAllocation(value)
    except ValueError:
        choices = ", ".join(a.value for a in BlockAllocation)
        raise EngineError(
            f"blockAllocation must be one of {choices}, got {value!r}", code=INVALID_REQUEST, field="blockAllocation"
        ) from None


class AgentHTTPServer(ThreadingHTTPServer):
    """The engine's HTTP server: a thread per connection, at most ``max_connections`` of them (one more is answered
    503 and closed), each request read within ``request_seconds`` of its first byte (http_bounds)."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst is accepted (and served, or refused) rather than dropped

    def __init__(
        self,
        host: str,
        port: int,
        engine: DataParallelEngines,
        *,
        request_seconds: float = REQUEST_SECONDS,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        super().__init__((host, port), _Handler)
        self.engine = engine
        self.request_seconds = request_seconds
        self._slots = ConnectionSlots(max_connections)
        self._in_flight = 0
        self._draining = False
        self._idle = threading.Condition()

    def enter(self) -> bool:
        """A request starts, unless the server drains (then it is refused)."""
        with self._idle:
            if self._draining:
                return False
            self._in_flight += 1
            return True

    def leave(self) -> None:
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def drain(self, seconds: float) -> int:
        """Refuse new requests (503 ``DRAINING``) and wait, at most ``seconds``, for those in flight to finish;
        returns how many were still running."""
        with self._idle:
            self._draining = True
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=seconds)
            return self._in_flight

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.take():
            self._slots.refuse(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread to give the slot back
            self._slots.give_back()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.give_back()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="http", daemon=True)
        thread.start()
        return thread
