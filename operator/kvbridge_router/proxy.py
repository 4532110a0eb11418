"""The router's HTTP front: OpenAI-compatible, each generation request split into prefill then decode.

``POST /v1/completions`` and ``/v1/chat/completions``: the request goes to a prefill pod with
``kv_transfer_params: {do_remote_decode: true}``, one token and no streaming; the ``kv_transfer_params`` it returns
go with the client's own request to a decode pod paired with it, whose answer (streamed or not) is passed through
unchanged. ``GET /v1/models`` is a decode pod's. ``GET /health`` is 200 while some pair is routable, else 503
with the reason; ``GET /metrics`` is Prometheus text (OpenMetrics, with exemplars, when asked). With API keys
(auth.py), a ``/v1/`` request without one is answered 401 before its body is read; ``/health`` and ``/metrics``
stay open.

Failures: a prefill that cannot be reached, times out, answers 5xx or returns no transfer parameters is tried
on another prefill pod (``prefill_attempts`` in all); a 4xx from prefill is the client's and is passed back (the
engine's error object and status, refusals.py).
A decode call that fails before anything reached the client (connection refused or reset, a 5xx, a timeout
before the first byte — a pod being drained or killed) is retried on another pair, ``decode_attempts`` in all:
on another decode pod with the same transfer parameters when the failed pod was never reached (nothing was
read), else prefilled again (the failed pod may have read the KV, and prefill freed it). An answer a shutting-down
engine aborted (HTTP 200 without tokens) counts as a failure: a stream is held back until its first token
(answers.py). A 4xx from decode is the client's and is passed back likewise. Once the stream has begun it is not
retried: it ends with an error event, after the last whole event decode sent (answers.WholeEvents).
Bounds: ``connect_timeout`` per connection, ``prefill_timeout`` per prefill call, ``decode_idle_timeout`` for each
chunk of a stream (the first one included), ``decode_timeout`` per decode call, and ``request_timeout`` for the
whole request, retries included: no call gets more than the time left, none is made when none is left (504
``REQUEST_TIMEOUT`` when prefill runs out of it), and no client waits longer. A client's connection is closed when a
request's head has not arrived ``header_timeout`` seconds after the connection opened or the head began, and
when idle ``CLIENT_KEEPALIVE_SECONDS`` (server.py, the router's own HTTP server); its body has ``body_timeout``. A
prefill answer, and a decode answer that is not streamed, is read whole up to ``max_answer_bytes`` (16 MiB; more is
refused unread, ``*_ANSWER_TOO_LARGE``, and not retried: the request asked for it); a stream is passed on as it comes.
Errors are ``{"error": {"message", "type", "param", "code"}}``, as OpenAI's API writes them: an engine's own when it
refused the request, else the router's with its stable code; the pods an error is about are in the log and the
``X-KVBridge-*`` headers, never the body (errors.py). A pod's first call of a kind of request is bounded by
``cold_timeout`` instead of ``prefill_timeout`` (and a stream's first chunk's 60 s): an engine compiles the paths a
request takes the first time (warmth.py).

Its modules: this one (the router: its pool, routes and the read-only ones, served on a port), ``config`` (what it
runs with), ``generation`` (a generation request, decode's retries, ``n`` samples), ``prefill`` and ``decode`` (the
two engine calls), ``engines`` (what the two calls share), ``encoding`` (the JSON sent to the engines).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator

import aiohttp

from kvbridge_router.auth import INVALID_API_KEY
from kvbridge_router.config import RouterConfig
from kvbridge_router.engines import FORWARDED_HEADERS, Engines, cause_of, client_cause
from kvbridge_router.errors import RouteError
from kvbridge_router.generation import ROUTES, generate
from kvbridge_router.metrics import RouterMetrics
from kvbridge_router.peering import PEER_PATH, Exchange
from kvbridge_router.peers import MAX_FRAME_BYTES
from kvbridge_router.pool import Balancer, Pool
from kvbridge_router.request import BodyTooLargeError, Request
from kvbridge_router.response import Answer, Response, json_response
from kvbridge_router.server import Handler, Server
from kvbridge_router.tracing import Tracing

log = logging.getLogger(__name__)
#: the router, what it runs with (config.py's, named here too: the two go together), and serving it
__all__ = ["Router", "RouterConfig", "listening", "serve"]
#: clients' idle keep-alive connections are closed after this; longer than load balancers' idle timeouts (AWS ALB's
#: 60 s), which then close first and never send on a connection the router is closing
CLIENT_KEEPALIVE_SECONDS = 75.0
#: seconds a stopping router gives the requests it is serving (as aiohttp's server gave them)
SHUTDOWN_GRACE_SECONDS = 60.0


class Router:
    """kvbridge's router: its pool (the status's), the policy's balancer, its routes, and the exchange with the other
    replicas."""

    def __init__(
        self, config: RouterConfig | None = None, metrics: RouterMetrics | None = None, tracing: Tracing | None = None
    ) -> None:
        config = config or RouterConfig()
        self.metrics = metrics or RouterMetrics()
        self.tracing = tracing or Tracing()
        self.balancer = Balancer(policy=config.policy, replicas=config.replicas)
        #: the configuration, the pool, the balancer and the clients the prefill and decode calls share
        self.engines = Engines(config, self.metrics, self.balancer)
        #: the reports to and from the other replicas (--peers), or None
        self.exchange = (
            Exchange(
                self.balancer,
                self.metrics,
                self.config.peer_key,
                self.config.peers,
                self.config.peer_interval,
                lambda: self._pods,
            )
            if self.config.peers
            else None
        )
        self._pods: frozenset[str] = frozenset()
        self._exchanging: tuple[asyncio.Task[None], asyncio.Event] | None = None

    @property
    def config(self) -> RouterConfig:
        """What the router runs with (the engines' own: set, it holds for the requests from then on; the policy and
        the replicas stay the balancer's)."""
        return self.engines.config

    @config.setter
    def config(self, config: RouterConfig) -> None:
        self.engines.config = config

    @property
    def pool(self) -> Pool:
        """The pods routed to (:meth:`set_pool`)."""
        return self.engines.pool

    def set_pool(self, pool: Pool) -> None:
        if (pool.prefill, pool.decode, pool.pairings) != (self.pool.prefill, self.pool.decode, self.pool.pairings):
            skipped = f" (skipped: {'; '.join(pool.skipped)})" if pool.skipped else ""
            log.info(
                "routing to prefill %s, decode %s%s",
                [t.pod for t in pool.prefill],
                [t.pod for t in pool.decode],
                skipped,
            )
        reborn = pool.reborn(self.pool)
        if reborn:
            log.info("forgetting what was sent to %s: restarted or replaced (a new incarnation)", sorted(reborn))
        self.engines.pool = pool
        self._pods = frozenset(t.pod for t in (*pool.prefill, *pool.decode))
        self.balancer.keep_only(self._pods - reborn)
        self.engines.warmth.keep_only(self._pods - reborn)  # a restarted or replaced engine is cold again
        self.metrics.keep_pods(self._pods, set(self.balancer.outstanding))
        self.metrics.endpoints.labels("prefill").set(len(pool.routable()))
        self.metrics.endpoints.labels("decode").set(len(pool.decode))

    def routes(self) -> dict[tuple[str, str], Handler]:
        """What the router answers, by method and path (server.py serves them)."""
        routes: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/completions"): self._generate,
            ("POST", "/v1/chat/completions"): self._generate,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
        }
        if self.exchange is not None:
            routes["POST", PEER_PATH] = self._peer_report
        return routes

    async def start(self) -> None:
        """Open what the routes use (a client session, the exchange with the other replicas); before serving."""
        self.engines.open()
        if self.exchange is not None:
            stop = asyncio.Event()
            self._exchanging = (asyncio.create_task(self.exchange.run(stop)), stop)

    async def stop(self) -> None:
        """Close what :meth:`start` opened; after serving."""
        if self._exchanging is not None:
            task, stop = self._exchanging
            stop.set()
            await task
        await self.engines.close()

    # -- read-only routes ------------------------------------------------------------------------------------

    async def _health(self, _: Request) -> Response:
        problem = self.pool.problem()
        body = {
            "ok": not problem,
            "problem": problem,
            "prefill": [t.pod for t in self.pool.routable()],
            "decode": [t.pod for t in self.pool.decode],
            "skipped": list(self.pool.skipped),
        }
        return json_response(body, status=503 if problem else 200)

    async def _peer_report(self, request: Request) -> Response:
        """Another replica's report (peering.py): 200 when taken or stale (the outcome as its body: the sender's client
        reads an answer with a body, and keeps the connection), 400 with the code when not a report."""
        if self.exchange is None:  # not routed without one; for the type checker
            raise RuntimeError("peer reports without an exchange")
        declared = request.content_length
        if declared is not None and declared > MAX_FRAME_BYTES:  # refused unread: no report is that large
            self.metrics.peer_report("received", "TOO_LARGE")
            return _text(413, "TOO_LARGE")
        frame = bytearray()
        try:
            async with asyncio.timeout(self.config.body_timeout):
                async for chunk in request.chunks():
                    frame += chunk
                    if len(frame) > MAX_FRAME_BYTES:
                        self.metrics.peer_report("received", "TOO_LARGE")
                        return _text(413, "TOO_LARGE")
        except BodyTooLargeError:
            self.metrics.peer_report("received", "TOO_LARGE")
            return _text(413, "TOO_LARGE")
        except (TimeoutError, ConnectionResetError):
            self.metrics.peer_report("received", "BODY_INCOMPLETE")
            return _text(400, "BODY_INCOMPLETE")
        outcome = self.exchange.receive(bytes(frame))
        return _text(200 if outcome in ("accepted", "stale") else 400, outcome)

    async def _metrics(self, request: Request) -> Response:
        body, content_type = self.metrics.render(request.headers.get("Accept", ""))
        return Response(body, content_type=content_type)

    def _unauthorized(self, request: Request) -> Response | None:
        """401 for a /v1/ request without one of the configured API keys (none configured: every request passes);
        before its body is read, so no engine is ever called for it."""
        keys = self.config.api_keys
        why = None if keys is None else keys.refused(request.headers.get("Authorization"))
        if why is None:
            return None
        log.warning("%s: %s %s", request.path, INVALID_API_KEY, why)
        response = RouteError(401, INVALID_API_KEY, why).response()
        response.headers["WWW-Authenticate"] = 'Bearer realm="kvbridge-router"'
        return response

    async def _models(self, request: Request) -> Response:
        refused = self._unauthorized(request)
        if refused is not None:
            return refused
        decode = self.balancer.pick(self.pool.decode)
        if decode is None:
            return RouteError(503, "NO_DECODE", self.pool.problem() or "no decode pod").response()
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout, connect=self.config.connect_timeout)
        try:
            forwarded = {k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers}
            async with self.engines.session.get(
                f"{decode.url}/v1/models", timeout=timeout, headers=forwarded
            ) as upstream:
                return Response(await upstream.read(), upstream.status, upstream.content_type)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("/v1/models: decode pod %s: %s", decode.pod, cause_of(exc))
            message = f"no answer from the decode engine: {client_cause(exc)}"
            return RouteError(502, "DECODE_UNAVAILABLE", message, pods=(decode.pod,)).response()

    async def _generate(self, request: Request) -> Answer:
        started = time.perf_counter()
        refused = self._unauthorized(request)
        if refused is not None:
            self.metrics.answered(ROUTES[request.path], INVALID_API_KEY)
            return refused
        return await generate(self.engines, self.tracing, request, started)


def _text(status: int, text: str) -> Response:
    return Response(text.encode(), status, "text/plain; charset=utf-8")


@contextlib.asynccontextmanager
async def listening(router: Router, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[int]:
    """The router served on ``host``:``port`` (0: a free port, the one taken yielded) while the block runs: started,
    then its connections given ``SHUTDOWN_GRACE_SECONDS`` and closed, and the router stopped."""
    await router.start()
    server = Server(
        router.routes(), router.config.header_timeout, CLIENT_KEEPALIVE_SECONDS, router.config.max_body_bytes
    )
    try:
        listener = await asyncio.get_running_loop().create_server(server, host, port, backlog=128)
    except BaseException:
        await router.stop()
        raise
    try:
        yield int(listener.sockets[0].getsockname()[1])
    finally:
        listener.close()
        await server.shutdown(SHUTDOWN_GRACE_SECONDS)
        await router.stop()


async def serve(router: Router, host: str, port: int, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set."""
    async with listening(router, host, port) as taken:
        log.info("router listening on %s:%d", host, taken)
        # what was built at start-up (modules, the router) lives as long as the router: keep it out of the
        # collector's scans, which otherwise grow with every import and run every few hundred allocations
        gc.freeze()
        await stop.wait()
