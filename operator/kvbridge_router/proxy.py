"""The router's HTTP front: OpenAI-compatible, each generation request split into prefill then decode.

``POST /v1/completions`` and ``/v1/chat/completions``: the request goes to a prefill pod with
``kv_transfer_params: {do_remote_decode: true}``, one token and no streaming; the ``kv_transfer_params`` it returns
go with the client's own request to a decode pod paired with it, whose answer (streamed or not) is passed through
unchanged. ``GET /v1/models`` is a decode pod's. ``GET /health`` is 200 while some pair is routable, else 503
with the reason; ``GET /metrics`` is Prometheus text (OpenMetrics, with exemplars, when asked). With API keys
(auth.py), a ``/v1/`` request without one is answered 401 before its body is read; ``/health`` and ``/metrics``
stay open.

Failures: a prefill that cannot be reached, times out, answers 5xx or returns no transfer parameters is tried
on another prefill pod (``prefill_attempts`` in all); a 4xx from prefill is the client's and is passed back.
A decode call that fails before anything reached the client (connection refused or reset, a 5xx, a timeout
before the first byte — a pod being drained or killed) is retried on another pair, ``decode_attempts`` in all:
on another decode pod with the same transfer parameters when the failed pod was never reached (nothing was
read), else prefilled again (the failed pod may have read the KV, and prefill freed it). An answer a shutting-down
engine aborted (HTTP 200 without tokens) counts as a failure: a stream is held back until its first token
(answers.py). A 4xx from decode is the client's and is passed back. Once the stream has begun it is not retried:
it ends with an error event, after the last whole event decode sent (answers.WholeEvents).
Bounds: ``connect_timeout`` per connection, ``prefill_timeout`` per prefill call, ``decode_idle_timeout`` for each
chunk of a stream (the first one included), ``decode_timeout`` per decode call, and ``request_timeout`` for the
whole request, retries included: no call gets more than the time left, none is made when none is left (504
``REQUEST_TIMEOUT`` when prefill runs out of it), and no client waits longer. A client's connection is closed when a
request's head has not arrived ``header_timeout`` seconds after the connection opened or the head began, and
when idle ``CLIENT_KEEPALIVE_SECONDS`` (server.py, the router's own HTTP server); its body has ``body_timeout``. A
prefill answer, and a decode answer that is not streamed, is read whole up to ``max_answer_bytes`` (16 MiB; more is
refused unread, ``*_ANSWER_TOO_LARGE``, and not retried: the request asked for it); a stream is passed on as it comes.
Errors are ``{"error": {"message", "type", "code"}}``, as OpenAI's API writes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp
import msgspec

from kvbridge_agent.core import tracing as span
from kvbridge_agent.core.signing import signed
from kvbridge_operator.api.objects import Obj
from kvbridge_router.admission import Limits, admit, engine_request_id, sample_count
from kvbridge_router.answers import Start, StreamStart, WholeEvents, aborted
from kvbridge_router.auth import INVALID_API_KEY, ApiKeys
from kvbridge_router.errors import RouteError
from kvbridge_router.metrics import RouterMetrics
from kvbridge_router.peering import PEER_PATH, Exchange
from kvbridge_router.peers import MAX_FRAME_BYTES
from kvbridge_router.pool import Balancer, Pool, Target
from kvbridge_router.prefixes import cached_as_keyed, held_chunks, prefix_keys, prompt_ids
from kvbridge_router.prompts import TokenIds
from kvbridge_router.samples import JoinError, joined, sample_bodies
from kvbridge_router.server import (
    Answer,
    BodyTooLargeError,
    Handler,
    Request,
    Response,
    Server,
    StreamResponse,
    json_response,
)
from kvbridge_router.settings import DEFAULTS, RouterSettings
from kvbridge_router.tracing import OFF, Trace, Tracing
from kvbridge_router.upstream import AnswerTooLargeError, UnreachableError, Upstream, UpstreamError

log = logging.getLogger(__name__)
ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
#: client headers passed on to both engines (vLLM's --api-key checks Authorization)
FORWARDED_HEADERS = ("Authorization",)
#: what the router sets on the prefill request (OpenAI and vLLM fields); streaming fields are dropped
PREFILL_DROPPED = ("stream_options", "min_tokens")
#: how long the router waits for an engine's /health after it answered 500
HEALTH_PROBE_SECONDS = 1.0
#: where a KV connector's prefill says why it offers nothing for a request (kvbridge's connector; vLLM frees the
#: blocks): the request is answered, not sent to another pod
ENGINE_REFUSAL = "kvbridge_error"
#: where vLLM says how many of the prompt's tokens the prefill pod's prefix cache served (in the transfer parameters
#: a KV connector returns for a remote decode)
CACHED_TOKENS = "remote_prefill_cached_tokens"
#: streaming decode: the longest wait for the next chunk (no longer than the decode timeout)
DECODE_IDLE_SECONDS = 60.0
#: idle upstream connections are dropped before vLLM's own keep-alive timeout (5 s) closes them under us
KEEPALIVE_SECONDS = 3.0
#: clients' idle keep-alive connections are closed after this; longer than load balancers' idle timeouts (AWS ALB's
#: 60 s), which then close first and never send on a connection the router is closing
CLIENT_KEEPALIVE_SECONDS = 75.0
#: seconds a stopping router gives the requests it is serving (as aiohttp's server gave them)
SHUTDOWN_GRACE_SECONDS = 60.0
#: JSON's whitespace and an object's brackets, as byte values
JSON_SPACE = frozenset(b" \t\r\n")
OPEN, CLOSE = ord("{"), ord("}")


@dataclass
class Ledger:
    """One client request's account, across its prefill and decode calls and their retries."""

    #: seconds spent inside prefill and decode calls (the rest is the router's own time)
    spent: float = 0.0
    #: engines (pods, each once) that answered it 500 and were unhealthy right after (:meth:`Router._judge_5xx`);
    #: the samples of one request share this list, so that one request, however many samples it has, loses at most
    #: two engines
    lost_engines: list[str] = field(default_factory=list)
    #: its spans (tracing.py; OFF when tracing is off)
    trace: Trace = OFF
    #: whether its first answer is observed as a time to first token (one of a request's ``n`` samples only)
    ttft: bool = True


@dataclass(frozen=True)
class RouterConfig:
    """What a :class:`Router` runs with: the settings (settings.py, their defaults written there) as the proxy uses
    them, and the bounds that are not flags."""

    prefill_timeout: float = DEFAULTS.prefill_timeout
    decode_timeout: float = DEFAULTS.decode_timeout
    #: streaming decode: the longest wait for the next chunk
    decode_idle_timeout: float = DECODE_IDLE_SECONDS
    connect_timeout: float = 3.0
    prefill_attempts: int = DEFAULTS.prefill_attempts
    #: decode calls per request (the first and its retries on other pairs)
    decode_attempts: int = DEFAULTS.decode_attempts
    #: how pods are chosen (policies/): kv-aware (by the prompt prefix each pod was sent, then load), least-loaded or
    #: round-robin
    policy: str = DEFAULTS.policy.value
    #: kv-aware: tokens per prompt chunk scored, the prefill pods' KV block size (vLLM caches whole blocks)
    block_tokens: int = DEFAULTS.block_size
    #: kv-aware: the router replicas in front of the pool (each scales its counts of requests in flight by it)
    replicas: int = DEFAULTS.replicas
    #: the whole request, every prefill and decode call and retry included
    request_timeout: float = DEFAULTS.request_timeout
    max_body_bytes: int = 16 << 20
    #: seconds a request's body may take to arrive (a client that stalls gets 408)
    body_timeout: float = DEFAULTS.body_timeout
    #: seconds a request's head may take to arrive, from the connection's opening or the head's first byte (a client
    #: that sends nothing or half a head is disconnected)
    header_timeout: float = DEFAULTS.header_timeout
    #: the largest prefill answer, and decode answer when not streamed, read whole (streams are passed on as they come)
    max_answer_bytes: int = 16 << 20
    #: the router's token (--transfer-token-file): set, decode's kv_transfer_params carry its signature
    transfer_token: bytes = field(default=b"", repr=False)
    #: the clients' API keys (--api-key-file, auth.py): set, /v1/ requests without one are answered 401
    api_keys: ApiKeys | None = field(default=None, repr=False)
    #: the other router replicas (--peers, peering.py): set, this one reports to them and takes their reports
    peers: str = DEFAULTS.peers
    peer_interval: float = DEFAULTS.peer_interval
    #: the key reports are signed with (--peer-key-file)
    peer_key: bytes = field(default=b"", repr=False)

    @classmethod
    def of(
        cls,
        settings: RouterSettings,
        transfer_token: bytes = b"",
        api_keys: ApiKeys | None = None,
        peer_key: bytes = b"",
    ) -> RouterConfig:
        """The configuration ``settings`` give, with the token read from their ``transfer_token_file``, the keys
        of their ``api_key_file`` and the peers' key of their ``peer_key_file``."""
        return cls(
            prefill_timeout=settings.prefill_timeout,
            decode_timeout=settings.decode_timeout,
            decode_idle_timeout=min(settings.decode_timeout, DECODE_IDLE_SECONDS),
            prefill_attempts=settings.prefill_attempts,
            decode_attempts=settings.decode_attempts,
            request_timeout=settings.request_timeout,
            body_timeout=settings.body_timeout,
            header_timeout=settings.header_timeout,
            policy=settings.policy.value,
            block_tokens=settings.block_size,
            replicas=settings.replicas,
            transfer_token=transfer_token,
            api_keys=api_keys,
            peers=settings.peers,
            peer_interval=settings.peer_interval,
            peer_key=peer_key,
        )

    @property
    def limits(self) -> Limits:
        return Limits(self.max_body_bytes, self.body_timeout)


class Router:
    def __init__(
        self, config: RouterConfig | None = None, metrics: RouterMetrics | None = None, tracing: Tracing | None = None
    ) -> None:
        self.config = config or RouterConfig()
        self.metrics = metrics or RouterMetrics()
        self.tracing = tracing or Tracing()
        self.pool = Pool()
        self.balancer = Balancer(policy=self.config.policy, replicas=self.config.replicas)
        self._session: aiohttp.ClientSession | None = None
        #: the prefill and decode calls (every request's two); the session serves the rest
        self.upstream = Upstream(KEEPALIVE_SECONDS)
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
        self.pool = pool
        self._pods = frozenset(t.pod for t in (*pool.prefill, *pool.decode))
        self.balancer.keep_only(self._pods - reborn)
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

        connector = aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_SECONDS, limit=0)
        # no cookie jar: engines set no cookies, and one client's would otherwise leak to another's requests
        self._session = aiohttp.ClientSession(connector=connector, trust_env=False, cookie_jar=aiohttp.DummyCookieJar())
        if self.exchange is not None:
            stop = asyncio.Event()
            self._exchanging = (asyncio.create_task(self.exchange.run(stop)), stop)

    async def stop(self) -> None:
        """Close what :meth:`start` opened; after serving."""
        if self._exchanging is not None:
            task, stop = self._exchanging
            stop.set()
            await task
        self.upstream.close()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router is not started (Router.start)")
        return self._session

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
            async with self.session.get(f"{decode.url}/v1/models", timeout=timeout, headers=forwarded) as upstream:
                return Response(await upstream.read(), upstream.status, upstream.content_type)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return RouteError(502, "DECODE_UNAVAILABLE", f"decode pod {decode.pod}: {_reason(exc)}").response()

    # -- generation ------------------------------------------------------------------------------------------

    async def _generate(self, request: Request) -> Answer:
        started = time.perf_counter()
        route = ROUTES[request.path]
        refused = self._unauthorized(request)
        if refused is not None:
            self.metrics.answered(route, INVALID_API_KEY)
            return refused
        ledger = Ledger(trace=self.tracing.request(request.headers, request.path, route))
        try:
            with ledger.trace.step(span.ROUTER_ADMISSION) as admission:
                body, raw, plain = await admit(request, route, self.config.limits)
                admission.set(span.BODY_BYTES, len(raw))
            request_id = engine_request_id(request.headers.get("X-Request-Id"))
            ledger.trace.set(span.REQUEST_ID, request_id)
            headers = {
                "X-Request-Id": request_id,
                **{k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers},
            }
            n = sample_count(body)
            prefill_body = prefill_bytes(body, plain) if n == 1 else b""
            if n == 1:
                response = await self._served(request, body, raw, prefill_body, headers, ledger, started)
            else:
                response = await self._sampled(request, body, n, headers, ledger, started)
        except RouteError as exc:
            self.metrics.answered(route, exc.code)
            log.warning("%s: %s %s", request.path, exc.code, exc.message)
            ledger.trace.finish(exc.status, exc.code)
            return exc.response()
        except BaseException as exc:  # the client went away (cancelled), or a bug: the span still ends
            ledger.trace.finish(500, type(exc).__name__)
            raise
        ledger.trace.finish(response.status)
        total = time.perf_counter() - started
        _after_answer(self.metrics.answered_in, route, response.status, total, max(total - ledger.spent, 0.0))
        return response

    async def _served(
        self,
        request: Request,
        body: Obj,
        raw: bytes,
        prefill_body: bytes,
        headers: dict[str, str],
        ledger: Ledger,
        started: float,
        after: asyncio.Event | None = None,
        prefilled: asyncio.Event | None = None,
    ) -> Answer:
        """One completion: prefilled on a pair's prefill pod, decoded on its decode pod, each retried elsewhere while
        nothing has reached the client. A sample of several (``_sampled``) prefills only ``after`` the event is set,
        and sets ``prefilled`` once it has."""
        if after is not None:
            await after.wait()
        request_id = headers["X-Request-Id"]
        prefill, decode, params = await self._prefill_somewhere(
            request.path, body, prefill_body, headers, ledger, started
        )
        if prefilled is not None:
            prefilled.set()
        tried: list[str] = []
        while True:
            try:
                with ledger.trace.step(span.ROUTER_DECODE, {span.POD: decode.pod}, call=True) as call:
                    call.set(span.STREAM, bool(body.get("stream")))
                    response = await self._decode(
                        request, decode, body, raw, params, call.inject(headers), started, ledger
                    )
                    call.set(span.HTTP_STATUS, response.status)
                return response
            except RouteError as exc:  # retried only while nothing has reached the client
                tried.append(decode.pod)
                left = self.config.request_timeout - (time.perf_counter() - started)
                no_pair = not any(d.pod not in tried for p in self.pool.routable() for d in self.pool.decodes_for(p))
                if not exc.retry or len(tried) >= self.config.decode_attempts or left <= 0 or no_pair:
                    raise
                self.metrics.decode_retries.labels(decode.pod).inc()
                other = None if exc.reprefill else self.balancer.pick(self.pool.decodes_for(prefill), tried)
                if other is None:  # decode had the request (or no partner is left): prefill again
                    log.warning("decode pod %s failed (%s); prefilling again for another pair", decode.pod, exc.message)
                    # a new request id: the first prefill pod may still hold the first one's KV (until its
                    # lease ends) and would refuse the id as a duplicate
                    headers = {**headers, "X-Request-Id": f"{request_id}-retry{len(tried)}"}
                    prefill, decode, params = await self._prefill_somewhere(
                        request.path, body, prefill_body, headers, ledger, started, exclude_decodes=tried
                    )
                else:
                    log.warning("decode pod %s unreachable (%s); trying %s", decode.pod, exc.message, other.pod)
                    decode = other

    async def _sampled(
        self, request: Request, body: Obj, n: int, headers: dict[str, str], ledger: Ledger, started: float
    ) -> Answer:
        """``n`` completions of one prompt (samples.py): the first sample prefilled alone, the others after it (the
        prefill pod's prefix cache then holds the prompt), every decode at once; one answer joining them, or the
        first failure (the other samples cancelled)."""
        first_prefilled = asyncio.Event()
        calls, ledgers = [], []
        for index, sample in enumerate(sample_bodies(body, n)):
            sample_headers = {**headers, "X-Request-Id": f"{headers['X-Request-Id']}-{index}"}
            wait, done = (None, first_prefilled) if index == 0 else (first_prefilled, None)
            ledgers.append(Ledger(lost_engines=ledger.lost_engines, trace=ledger.trace.sample(index), ttft=index == 0))
            served = self._served(
                request,
                sample,
                _encoded(sample),
                prefill_bytes(sample),
                sample_headers,
                ledgers[-1],
                started,
                wait,
                done,
            )
            calls.append(asyncio.ensure_future(served))
        try:
            answers = await asyncio.gather(*calls)
        except BaseException:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            raise
        finally:  # the samples ran side by side: the longest one's engine time is the request's
            ledger.spent += max(sample.spent for sample in ledgers)
        data = []
        for answer in answers:
            if answer.status != 200 or not isinstance(answer, Response):
                return answer  # an engine's refusal of the request, as it gave it
            data.append(answer.body)
        try:
            return Response(joined(data))
        except JoinError as exc:
            raise RouteError(502, "DECODE_ANSWER_INVALID", str(exc)) from None

    async def _prefill_somewhere(
        self,
        path: str,
        body: Obj,
        prefill_body: bytes,
        headers: dict[str, str],
        ledger: Ledger,
        started: float,
        exclude_decodes: list[str] | None = None,
    ) -> tuple[Target, Target, Obj]:
        """Prefill on the pod the policy chooses among those with a decode partner (other than
        ``exclude_decodes``); on a pod failure, on another one. Each call is bounded by ``prefill_timeout`` and by
        what is left of the request's ``request_timeout`` (it ``started`` then); none is made when nothing is."""
        tried: list[str] = []
        last: RouteError | None = None
        # a completion's list prompt passed admission's token-id check (prompts.token_ids): not checked again
        admitted_ids = ROUTES[path] == "completions"
        scored = self.balancer.unit.scores_prefixes
        keys = prefix_keys(body, self.config.block_tokens, ids_checked=admitted_ids) if scored else []
        for _ in range(self.config.prefill_attempts):
            left = self.config.request_timeout - (time.perf_counter() - started)
            if left <= 0:
                raise self._request_timeout(tried)
            with ledger.trace.step(span.ROUTER_CHOOSE, {span.POLICY: self.balancer.policy}) as step:
                choice = self.balancer.decide(self.pool, tried, exclude_decodes or (), keys)
                if choice is None:
                    step.failed("NO_ROUTE")
                    break
                prefill, decode = choice.prefill, choice.decode
                step.set(span.PREFILL_POD, prefill.pod)
                step.set(span.DECODE_POD, decode.pod)
                if scored:
                    step.set(span.PREFIX_CHUNKS, len(keys))
                    step.set(span.PREFIX_HIT_CHUNKS, choice.matched)
                if keys:
                    _after_answer(self.metrics.prefix_matched, choice.matched, len(keys))
                # when the pod was sent the chunks it matched; this choice's record at the prefill pod
                believed, tick, matched = list(choice.ticks), choice.tick, choice.matched
            called = time.perf_counter()
            computed = False
            timeout = min(self.config.prefill_timeout, left)
            try:
                with ledger.trace.step(span.ROUTER_PREFILL, {span.POD: prefill.pod}, call=True) as call:
                    params = await self._call_prefill(
                        path, prefill, prefill_body, call.inject(headers), timeout, ledger
                    )
            except RouteError as exc:
                if exc.code == "PREFILL_TIMEOUT" and timeout < self.config.prefill_timeout:
                    raise self._request_timeout([*tried, prefill.pod]) from None  # cut at the time left: no more
                if not exc.retry:
                    raise
                more = len(tried) + 1 < self.config.prefill_attempts
                log.warning(
                    "prefill pod %s failed (%s); %s",
                    prefill.pod,
                    exc.message,
                    "trying another" if more else "giving up",
                )
                self.metrics.retries.labels(prefill.pod).inc()
                tried.append(prefill.pod)
                last = exc
                continue
            else:
                computed = True
            finally:
                ledger.spent += time.perf_counter() - called
                if tick:
                    self.balancer.prefilled(prefill.pod, tick, keys, matched, computed)
            _after_answer(self.metrics.prefill_seconds.observe, time.perf_counter() - called)
            if believed and cached_as_keyed(body):
                self._held(prefill.pod, body, params, believed, admitted_ids)
            return prefill, decode, params
        if last is not None:
            raise RouteError(last.status, last.code, f"{last.message} (prefill pods tried: {', '.join(tried)})")
        raise RouteError(503, "NO_ROUTE", self.pool.problem() or "every paired prefill pod failed")

    def _held(self, pod: str, body: Obj, params: Obj, believed: list[int], ids_checked: bool) -> None:
        """What the prefill pod's answer says its prefix cache served of the prompt (vLLM adds
        ``remote_prefill_cached_tokens`` to the transfer parameters), against the ``believed`` chunks: a pod that
        evicted what it was sent is forgotten that far (``Balancer.observed``). The prompt is read as its keys were
        built (``prompt_ids``: token ids, or text)."""
        cached = params.get(CACHED_TOKENS)
        if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
            return  # another engine, or none said: the view stays as it is
        ids = prompt_ids(body, ids_checked)
        tokens = None if ids is None else len(ids)
        if self.balancer.observed(pod, believed, held_chunks(cached, self.config.block_tokens, tokens)):
            self.metrics.prefix_evictions.inc()

    def _request_timeout(self, tried: list[str]) -> RouteError:
        pods = f" (prefill pods tried: {', '.join(tried)})" if tried else ""
        return RouteError(
            504,
            "REQUEST_TIMEOUT",
            f"no answer within the request's bound, request_timeout {self.config.request_timeout:g} s{pods}",
        )

    async def _call_prefill(
        self, path: str, target: Target, request: bytes, headers: dict[str, str], timeout: float, ledger: Ledger
    ) -> Obj:
        self._enter("prefill", target)
        try:
            async with asyncio.timeout(timeout):
                async with self.upstream.post(
                    target.url, path, request, headers, self.config.connect_timeout, sent=self.balancer.flush
                ) as upstream:
                    data = await upstream.read(self.config.max_answer_bytes)
            text = data.decode(errors="replace") if upstream.status != 200 else ""
            if upstream.status >= 500:
                retry, why = await self._judge_5xx(target, upstream.status, ledger, "prefill")
                message = f"prefill pod {target.pod}: HTTP {upstream.status}: {text[:300]}{why}"
                raise RouteError(502, "PREFILL_FAILED", message, retry=retry)
            if upstream.status != 200:  # the request's fault: another pod would refuse it too
                raise RouteError(upstream.status, "PREFILL_REFUSED", f"prefill pod {target.pod}: {text[:1000]}")
        except TimeoutError:
            raise RouteError(
                504, "PREFILL_TIMEOUT", f"prefill pod {target.pod}: no answer within {timeout:g} s", retry=True
            ) from None
        except AnswerTooLargeError as exc:  # the request's (prompt_logprobs, say): another pod would answer the same
            raise RouteError(502, "PREFILL_ANSWER_TOO_LARGE", f"prefill pod {target.pod}: {exc}") from None
        except UpstreamError as exc:
            raise RouteError(
                502, "PREFILL_UNAVAILABLE", f"prefill pod {target.pod}: {_reason(exc)}", retry=True
            ) from None
        finally:
            self._leave("prefill", target)
        try:
            params = _ANSWER(data).get("kv_transfer_params")
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            params = _standard_params(data)
        except AttributeError:  # not an object
            params = None
        refused = params.get(ENGINE_REFUSAL) if isinstance(params, dict) else None
        if isinstance(
            refused, dict
        ):  # the engine's KV connector would not offer this request: not another pod's to try
            code, message = str(refused.get("code", "")), str(refused.get("message", ""))[:300]
            raise RouteError(502, "PREFILL_REFUSED", f"prefill pod {target.pod} offered no KV: {code}: {message}")
        if not isinstance(params, dict) or not params:
            raise RouteError(
                502,
                "PREFILL_NO_TRANSFER_PARAMS",
                f"prefill pod {target.pod} answered without "
                "kv_transfer_params (is it a kv_producer with a KV connector?)",
                retry=True,
            )
        return params

    async def _decode(
        self,
        request: Request,
        target: Target,
        body: Obj,
        raw: bytes,
        params: Obj,
        headers: dict[str, str],
        started: float,
        ledger: Ledger,
    ) -> Answer:
        left = self.config.request_timeout - (time.perf_counter() - started)
        if self.config.transfer_token:  # bound to this pod, and to the time this router waits for its answer
            until = time.time() + min(self.config.decode_timeout, max(left, 0.0))
            params = signed(self.config.transfer_token, params, decode_pod=target.pod, expires_at=until)
        decode_body = with_field(raw, "kv_transfer_params", params)
        if decode_body is None:  # not UTF-8 shaped {...}: encoded again
            decode_body = [_encoded({**body, "kv_transfer_params": params})]
        stream = bool(body.get("stream"))
        idle = self.config.decode_idle_timeout if stream else None  # streams: the longest wait for each chunk
        self._enter("decode", target)
        called = time.perf_counter()
        response: StreamResponse | None = None
        try:
            async with asyncio.timeout(max(min(self.config.decode_timeout, left), 0.001)):
                async with self.upstream.post(
                    target.url, request.path, decode_body, headers, self.config.connect_timeout, idle
                ) as upstream:
                    if upstream.status >= 500:  # nothing has reached the client: another pair may serve it
                        text = (await upstream.read(self.config.max_answer_bytes)).decode(errors="replace")
                        retry, why = await self._judge_5xx(target, upstream.status, ledger, "decode")
                        message = f"decode pod {target.pod}: HTTP {upstream.status}: {text[:300]}{why}"
                        raise RouteError(502, "DECODE_FAILED", message, retry=retry, reprefill=True)
                    if not stream or upstream.status != 200:
                        data = await upstream.read(self.config.max_answer_bytes)
                        if upstream.status == 200 and aborted(data):
                            raise RouteError(
                                502,
                                "DECODE_ABORTED",
                                f"decode pod {target.pod}: the engine aborted the request (shutting down?)",
                                retry=True,
                                reprefill=True,
                            )
                        if ledger.ttft:
                            _after_answer(
                                self.metrics.observe_ttft, time.perf_counter() - started, ledger.trace.trace_id
                            )
                        return Response(data, upstream.status, upstream.content_type)
                    response = StreamResponse(
                        status=200,
                        headers={
                            "Content-Type": upstream.headers.get("content-type", "text/event-stream"),
                            "Cache-Control": "no-cache",
                        },
                    )
                    start = StreamStart()  # held back until an event with content (answers.py)
                    chunks = upstream.chunks(idle)
                    async for chunk in chunks:
                        state = start.feed(chunk)
                        if state is not Start.PENDING:
                            break
                    else:
                        state = start.end()
                    if state is Start.FAILED:
                        raise RouteError(
                            502,
                            "DECODE_ABORTED",
                            f"decode pod {target.pod}: {start.reason}",
                            retry=True,
                            reprefill=True,
                        )
                    if ledger.ttft:
                        _after_answer(self.metrics.observe_ttft, time.perf_counter() - started, ledger.trace.trace_id)
                    await response.prepare(request)
                    whole = WholeEvents()  # broken off, the stream ends at an event's end, then the error event
                    await response.write(whole.feed(start.held))
                    async for chunk in chunks:  # the rest, as it comes
                        await response.write(whole.feed(chunk))
                    await response.write(whole.rest())
                    await response.write_eof()
                    return response
        except AnswerTooLargeError as exc:  # read before anything reached the client; the request's, not retried
            raise RouteError(502, "DECODE_ANSWER_TOO_LARGE", f"decode pod {target.pod}: {exc}") from None
        except (TimeoutError, UpstreamError, ConnectionResetError) as exc:
            code, status = ("DECODE_TIMEOUT", 504) if isinstance(exc, TimeoutError) else ("DECODE_UNAVAILABLE", 502)
            message = f"decode pod {target.pod}: {_reason(exc)}"
            if response is None or not response.prepared:  # nothing reached the client: retry on another pair
                reached = not isinstance(exc, UnreachableError)  # else nothing was sent: same parameters elsewhere
                raise RouteError(status, code, message, retry=True, reprefill=reached) from None
            transport = request.transport
            if transport is None or transport.is_closing():  # the client went away: stop reading decode's stream
                self.metrics.answered(ROUTES[request.path], "CLIENT_GONE")
                return response
            # the stream has begun: end it with an error event the client can read
            event = {"error": {"message": message, "type": "server_error", "code": code}}
            with contextlib.suppress(ConnectionResetError):
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
                await response.write_eof()
            self.metrics.answered(ROUTES[request.path], f"{code}_MIDSTREAM")
            return response
        finally:
            ledger.spent += time.perf_counter() - called
            self._leave("decode", target)

    async def _judge_5xx(self, target: Target, status: int, ledger: Ledger, role: str) -> tuple[bool, str]:
        """After an engine answered 5xx: whether another pod may serve the request, and why not (for the message).

        502, 503 and 504 say the engine is unavailable, and a pod that left the pool is being drained or replaced:
        another pod. A 500 from an engine that is still healthy (``/health`` 200 within ``HEALTH_PROBE_SECONDS``)
        is that engine failing this request: on prefill the request's own fault, answered as it is (another pod
        would fail it too); on decode a KV load that failed (lease, digest, peer: vLLM answers 500 for those), which
        another pair serves, since prefill already took the request. A 500 from an engine that is no longer healthy
        may have been caused by the request (an engine killed by what it was sent would be killed again): one such
        engine per request is retried, never a second."""
        if status in (502, 503, 504) or not self.pool.has(target.pod):
            return True, ""
        if await self._healthy(target):
            if role == "prefill":
                return False, " (the engine is healthy: this request failed on it, and would on another pod)"
            return True, ""
        if target.pod not in ledger.lost_engines:  # samples of one request may meet the same engine: count it once
            ledger.lost_engines.append(target.pod)
            self.metrics.engines_lost.labels(role, target.pod).inc()
        if len(ledger.lost_engines) > 1:
            lost = len(ledger.lost_engines)
            return False, f" (unhealthy since: {lost} engines failed after this request; not sent to another)"
        return True, ""

    async def _healthy(self, target: Target) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=HEALTH_PROBE_SECONDS)
            async with self.session.get(f"{target.url}/health", timeout=timeout) as answer:
                return answer.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    def _enter(self, role: str, target: Target) -> None:
        self.balancer.started(target.pod)
        self.metrics.calling(role, target.pod)

    def _leave(self, role: str, target: Target) -> None:
        self.balancer.finished(target.pod)
        self.metrics.called(role, target.pod)


def _after_answer(account: Callable[..., object], *args: object) -> None:
    """Metrics of a request, taken as it goes (its times measured then) but written once the event loop is free: after
    the answer or the call at hand is on its way (an observation costs 5-30 us of Prometheus' locks and buckets)."""
    asyncio.get_running_loop().call_soon(account, *args)


def prefill_request(body: Obj) -> Obj:
    """The client's request as prefill gets it: one token, no streaming, and the flag that makes a KV connector
    keep the prompt's blocks for a remote decode."""
    # a shallow copy: only top-level keys change, and the prompt (maybe thousands of token ids) is not copied
    request = {key: value for key, value in body.items() if key not in PREFILL_DROPPED}
    request.update(_prefill_fields(body))
    return request


def prefill_bytes(body: Obj, plain: bool = False) -> bytes:
    """:func:`prefill_request` as the bytes sent: encoded by msgspec when the client's body was ``plain`` JSON
    (admission.parse: a 1,700-id prompt in an eighth of the standard library's time), else by the standard library,
    which writes a NaN or a lone surrogate back as the client sent it (msgspec would write NaN as null)."""
    request = prefill_request(body)
    return _encoded_plain(request) if plain else _encoded(request)


def _prefill_fields(body: Obj) -> Obj:
    """The fields prefill's request sets (over the client's)."""
    fields: Obj = {"stream": False, "max_tokens": 1}
    if "max_completion_tokens" in body:
        fields["max_completion_tokens"] = 1
    fields["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return fields


def with_field(raw: bytes, name: str, value: object) -> list[bytes | memoryview] | None:
    """The client's JSON object ``raw`` (already parsed and checked as UTF-8, so valid) with one more field added
    before its closing brace, as the pieces to send in order: a view of the client's bytes (neither copied nor
    re-encoded), then the field. None when ``raw`` is not UTF-8 text shaped ``{...}`` (UTF-16 JSON, say); the
    caller encodes the parsed object then. The field must not be in the object already."""
    start, end = 0, len(raw)
    while start < end and raw[start] in JSON_SPACE:
        start += 1
    while end > start and raw[end - 1] in JSON_SPACE:
        end -= 1
    if end - start < 2 or raw[start] != OPEN or raw[end - 1] != CLOSE:
        return None
    inner = start + 1
    while inner < end - 1 and raw[inner] in JSON_SPACE:
        inner += 1
    comma = b"" if inner == end - 1 else b","  # an empty object gets no comma
    return [memoryview(raw)[: end - 1], comma + _encoded({name: value})[1:]]


def _raw_ids(value: object) -> msgspec.Raw:
    """A prompt admission kept as :class:`TokenIds`, written from its text (compact, whatever the client's layout)."""
    if not isinstance(value, TokenIds):
        raise TypeError(f"{type(value).__name__} is not JSON")
    return msgspec.Raw(b"[" + value.text + b"]")


def _ids(value: object) -> list[int]:
    if not isinstance(value, TokenIds):
        raise TypeError(f"{type(value).__name__} is not JSON")
    return value.ids()


#: msgspec's C encoder, for what was decoded from plain JSON (admission.parse)
_encoded_plain = msgspec.json.Encoder(enc_hook=_raw_ids).encode


def _encoded(obj: object) -> bytes:
    """Compact JSON, ASCII-only (lone surrogates a client sent stay escaped)."""
    return json.dumps(obj, separators=(",", ":"), default=_ids).encode("ascii")


#: prefill's answer, decoded at C speed (what msgspec refuses, a NaN in a logprob say, the standard library reads)
_ANSWER = msgspec.json.Decoder().decode


def _standard_params(data: bytes) -> object:
    try:
        return json.loads(data).get("kv_transfer_params")
    except (ValueError, AttributeError, RecursionError):
        return None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


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
