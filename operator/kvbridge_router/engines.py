"""The router's side of its engines, which the prefill and decode calls share: the pool routed to and the balancer,
the calls' HTTP client (upstream.py) and a session for the rest (health probes, ``/v1/models``), each call in flight
counted, an engine's 5xx judged (another pod, or not), and one request's account across its calls (:class:`Ledger`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from kvbridge_router.config import RouterConfig
from kvbridge_router.errors import RouteError
from kvbridge_router.metrics import RouterMetrics
from kvbridge_router.pool import Balancer, Pool, Target
from kvbridge_router.refusals import MAX_ERROR_BYTES, ErrorObject, engine_error, error_type
from kvbridge_router.tracing import OFF, Trace
from kvbridge_router.upstream import AnswerTooLargeError, EngineAnswer, UnreachableError, Upstream
from kvbridge_router.warmth import Warmth

#: client headers passed on to both engines (vLLM's --api-key checks Authorization)
FORWARDED_HEADERS = ("Authorization",)
#: how long the router waits for an engine's /health after it answered 500
HEALTH_PROBE_SECONDS = 1.0
#: idle upstream connections are dropped before vLLM's own keep-alive timeout (5 s) closes them under us
KEEPALIVE_SECONDS = 3.0


@dataclass
class Ledger:
    """One client request's account, across its prefill and decode calls and their retries."""

    #: its generation route's name (``completions`` or ``chat``: metrics and traces)
    route: str
    #: seconds spent inside prefill and decode calls (the rest is the router's own time)
    spent: float = 0.0
    #: engines (pods, each once) that answered it 500 and were unhealthy right after (:meth:`Engines.judge_5xx`);
    #: the samples of one request share this list, so that one request, however many samples it has, loses at most
    #: two engines
    lost_engines: list[str] = field(default_factory=list)
    #: its spans (tracing.py; OFF when tracing is off)
    trace: Trace = OFF
    #: whether its first answer is observed as a time to first token (one of a request's ``n`` samples only)
    ttft: bool = True
    #: its kind, as far as an engine's first-time paths go (warmth.kind): a pod's first call of it gets cold_timeout
    kind: str = ""


@dataclass
class Engines:
    """The pool, the balancer and the clients the two calls use, with the router's configuration and metrics."""

    config: RouterConfig
    metrics: RouterMetrics
    balancer: Balancer
    #: the pods routed to (the status's; Router.set_pool replaces it)
    pool: Pool = field(default_factory=Pool)
    #: the prefill and decode calls (every request's two); the session serves the rest
    upstream: Upstream = field(default_factory=lambda: Upstream(KEEPALIVE_SECONDS))
    #: the kinds of request each pod has answered: a pod's first call of a kind gets ``cold_timeout`` (warmth.py)
    warmth: Warmth = field(default_factory=Warmth)
    _session: aiohttp.ClientSession | None = field(default=None, init=False)

    def open(self) -> None:
        """Open the session (before serving)."""
        connector = aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_SECONDS, limit=0)
        # no cookie jar: engines set no cookies, and one client's would otherwise leak to another's requests
        self._session = aiohttp.ClientSession(connector=connector, trust_env=False, cookie_jar=aiohttp.DummyCookieJar())

    async def close(self) -> None:
        """Close the calls' connections and the session (after serving)."""
        self.upstream.close()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router is not started (Router.start)")
        return self._session

    def left(self, started: float) -> float:
        """Seconds left of the request's ``request_timeout``, since it ``started`` (``time.perf_counter``)."""
        return self.config.request_timeout - (time.perf_counter() - started)

    def bound(self, pod: str, kind: str, usual: float) -> float:
        """A call's bound: ``usual``, or ``cold_timeout`` when longer and ``pod`` has not answered ``kind`` yet."""
        cold = self.config.cold_timeout
        return cold if cold > usual and self.warmth.cold(pod, kind) else usual

    def request_timeout(self, tried: list[str]) -> RouteError:
        pods = f" ({len(tried)} prefill pod(s) tried)" if tried else ""
        return RouteError(
            504,
            "REQUEST_TIMEOUT",
            f"no answer within the request's bound, request_timeout {self.config.request_timeout:g} s{pods}",
            pods=tried,
        )

    def enter(self, role: str, target: Target) -> None:
        """A call to ``target`` begins."""
        self.balancer.started(target.pod)
        self.metrics.calling(role, target.pod)

    def leave(self, role: str, target: Target) -> None:
        """A call to ``target`` ended (answered, failed or cancelled)."""
        self.balancer.finished(target.pod)
        self.metrics.called(role, target.pod)

    async def judge_5xx(self, target: Target, status: int, ledger: Ledger, role: str) -> tuple[bool, str]:
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
        if await self.healthy(target):
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

    async def healthy(self, target: Target) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=HEALTH_PROBE_SECONDS)
            async with self.session.get(f"{target.url}/health", timeout=timeout) as answer:
                return answer.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False


def after_answer(account: Callable[..., object], *args: object) -> None:
    """Metrics of a request, taken as it goes (its times measured then) but written once the event loop is free: after
    the answer or the call at hand is on its way (an observation costs 5-30 us of Prometheus' locks and buckets)."""
    asyncio.get_running_loop().call_soon(account, *args)


async def read_error(upstream: EngineAnswer, role: str, code: str) -> ErrorObject:
    """An engine's answer other than 200 as an OpenAI error object (refusals.py), read up to
    :data:`~kvbridge_router.refusals.MAX_ERROR_BYTES` (a longer one is not read: the object says so)."""
    try:
        data = await upstream.read(MAX_ERROR_BYTES)
    except AnswerTooLargeError:
        message = (
            f"the {role} engine answered HTTP {upstream.status} with an error over {MAX_ERROR_BYTES} bytes, not read "
            "(the engine's log has it)"
        )
        return {"message": message, "type": error_type(upstream.status), "param": None, "code": code}
    return engine_error(upstream.status, data, code)


def client_cause(exc: BaseException) -> str:
    """A failed call's exception as a client is told it: no address of an engine (the log has those)."""
    if isinstance(exc, UnreachableError):
        return "no connection could be made"
    return cause_of(exc)


def cause_of(exc: BaseException) -> str:
    """A failed call's exception, as an error message says it."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
