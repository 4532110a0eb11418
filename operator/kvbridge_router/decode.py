"""The decode call: the client's own request with prefill's ``kv_transfer_params`` added (signed, with a transfer
token, for that pod and the time the router waits), sent to a decode pod paired with the prefill pod; its answer
passed back whole, or streamed as it comes once its first token arrived (answers.py), and a stream broken off ended
with an error event after the last whole event decode sent.

A failure before anything reached the client (connection refused or reset, a 5xx, a timeout before the first byte,
an answer the engine aborted) is a :class:`RouteError` the caller retries on another pair. Bounds: a stream's
``decode_idle_timeout`` per chunk, and ``decode_timeout`` for the call, within the request's ``request_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from kvbridge_agent.core.signing import signed
from kvbridge_operator.api.objects import Obj
from kvbridge_router.answers import Start, StreamStart, WholeEvents, aborted
from kvbridge_router.config import RouterConfig
from kvbridge_router.encoding import encoded, with_field
from kvbridge_router.engines import Engines, Ledger, after_answer, cause_of, client_cause, read_error
from kvbridge_router.errors import RouteError
from kvbridge_router.pool import Target
from kvbridge_router.request import Request
from kvbridge_router.response import Answer, Response, StreamResponse
from kvbridge_router.upstream import AnswerTooLargeError, EngineAnswer, UnreachableError, UpstreamError

log = logging.getLogger(__name__)


async def decode(
    engines: Engines,
    request: Request,
    target: Target,
    body: Obj,
    raw: bytes,
    params: Obj,
    headers: dict[str, str],
    started: float,
    ledger: Ledger,
) -> Answer:
    """``request`` (``body``, its bytes ``raw``) with prefill's ``params`` decoded on ``target``: its answer, or a
    :class:`RouteError` while nothing has reached the client (``retry``; ``reprefill`` when the pod may have read
    the KV, so that a retry prefills again)."""
    config = engines.config
    left = engines.left(started)
    decode_body = _decode_body(config, target, body, raw, params, left)
    stream = bool(body.get("stream"))
    idle = config.decode_idle_timeout if stream else None  # streams: the longest wait for each chunk
    # a pod's first stream of the request's kind: cold_timeout for its first chunk (warmth.py)
    first = engines.bound(target.pod, ledger.kind, idle) if idle is not None else None
    # a streamed answer, begun once decode's first token came; None: decode's answer is read whole
    response = StreamResponse(status=200) if stream else None
    engines.enter("decode", target)
    called = time.perf_counter()
    try:
        async with asyncio.timeout(max(min(config.decode_timeout, left), 0.001)):
            async with engines.upstream.post(
                target.url, request.path, decode_body, headers, config.connect_timeout, first
            ) as upstream:
                if upstream.status >= 500:  # nothing has reached the client: another pair may serve it
                    raise await _failed(engines, target, upstream, ledger)
                if response is None or upstream.status != 200:
                    return await _whole(engines, target, upstream, started, ledger)
                return await _streamed(engines, request, target, upstream, response, first, ledger, started)
    except AnswerTooLargeError as exc:  # read before anything reached the client; the request's, not retried
        raise RouteError(502, "DECODE_ANSWER_TOO_LARGE", f"the decode engine's {exc}", pods=(target.pod,)) from None
    except (TimeoutError, UpstreamError, ConnectionResetError) as exc:
        if isinstance(exc, TimeoutError):  # a longer bound for its first call, if it had one, is spent
            engines.warmth.warmed(target.pod, ledger.kind)
        return await _broken_off(engines, request, target, exc, response, ledger.route)
    finally:
        ledger.spent += time.perf_counter() - called
        engines.leave("decode", target)


def _decode_body(
    config: RouterConfig, target: Target, body: Obj, raw: bytes, params: Obj, left: float
) -> list[bytes | memoryview]:
    """The client's request with the transfer parameters added: its own bytes and the field, else encoded again."""
    if config.transfer_token:  # bound to this pod, and to the time this router waits for its answer
        until = time.time() + min(config.decode_timeout, max(left, 0.0))
        params = signed(config.transfer_token, params, decode_pod=target.pod, expires_at=until)
    decode_body = with_field(raw, "kv_transfer_params", params)
    if decode_body is None:  # not UTF-8 shaped {...}: encoded again
        return [encoded({**body, "kv_transfer_params": params})]
    return decode_body


async def _failed(engines: Engines, target: Target, upstream: EngineAnswer, ledger: Ledger) -> RouteError:
    """Decode's 5xx, as the error the caller retries on another pair (or not: engines.judge_5xx)."""
    error = await read_error(upstream, "decode", "DECODE_FAILED")
    retry, why = await engines.judge_5xx(target, upstream.status, ledger, "decode")
    message = f"the decode engine answered HTTP {upstream.status}: {error['message']}{why}"
    return RouteError(502, "DECODE_FAILED", message, retry=retry, reprefill=True, pods=(target.pod,))


async def _whole(engines: Engines, target: Target, upstream: EngineAnswer, started: float, ledger: Ledger) -> Answer:
    """Decode's answer read whole (not streamed, or not a 200) and passed back as it is; an aborted one is retried.
    A refusal (4xx) is the request's: the engine's error object with its status, not retried."""
    if upstream.status != 200:
        error = await read_error(upstream, "decode", "DECODE_REFUSED")
        raise RouteError(
            upstream.status, "DECODE_REFUSED", error["message"], pods=(target.pod,), engine=("decode", error)
        )
    data = await upstream.read(engines.config.max_answer_bytes)
    if aborted(data):
        raise RouteError(
            502,
            "DECODE_ABORTED",
            "the decode engine aborted the request (shutting down?)",
            retry=True,
            reprefill=True,
            pods=(target.pod,),
        )
    engines.warmth.warmed(target.pod, ledger.kind)
    if ledger.ttft:
        after_answer(engines.metrics.observe_ttft, time.perf_counter() - started, ledger.trace.trace_id)
    return Response(data, upstream.status, upstream.content_type)


async def _streamed(
    engines: Engines,
    request: Request,
    target: Target,
    upstream: EngineAnswer,
    response: StreamResponse,
    first: float | None,
    ledger: Ledger,
    started: float,
) -> Answer:
    """Decode's stream passed on: held back until an event with content (an engine that aborts first is retried),
    then each chunk as it comes, broken off only at an event's end. The first chunk may take ``first`` seconds."""
    response.headers["Content-Type"] = upstream.headers.get("content-type", "text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    start = StreamStart()  # held back until an event with content (answers.py)
    chunks = upstream.chunks(engines.config.decode_idle_timeout, first)
    async for chunk in chunks:
        state = start.feed(chunk)
        if state is not Start.PENDING:
            break
    else:
        state = start.end()
    engines.warmth.warmed(target.pod, ledger.kind)  # it answered: a stream's usual bounds from now on
    if state is Start.FAILED:
        message = f"the decode engine: {start.reason}"
        raise RouteError(502, "DECODE_ABORTED", message, retry=True, reprefill=True, pods=(target.pod,))
    if ledger.ttft:
        after_answer(engines.metrics.observe_ttft, time.perf_counter() - started, ledger.trace.trace_id)
    await response.prepare(request)
    whole = WholeEvents()  # broken off, the stream ends at an event's end, then the error event
    await response.write(whole.feed(start.held))
    async for chunk in chunks:  # the rest, as it comes
        await response.write(whole.feed(chunk))
    await response.write(whole.rest())
    await response.write_eof()
    return response


async def _broken_off(
    engines: Engines,
    request: Request,
    target: Target,
    exc: BaseException,
    response: StreamResponse | None,
    route: str,
) -> Answer:
    """A decode call that failed: before anything reached the client, a :class:`RouteError` to retry on another
    pair; once the stream has begun, the stream ended with an error event the client can read."""
    code, status = ("DECODE_TIMEOUT", 504) if isinstance(exc, TimeoutError) else ("DECODE_UNAVAILABLE", 502)
    message = f"no answer from the decode engine: {client_cause(exc)}"
    if response is None or not response.prepared:  # nothing reached the client: retry on another pair
        reached = not isinstance(exc, UnreachableError)  # else nothing was sent: same parameters elsewhere
        raise RouteError(status, code, message, retry=True, reprefill=reached, pods=(target.pod,)) from None
    transport = request.transport
    if transport is None or transport.is_closing():  # the client went away: stop reading decode's stream
        engines.metrics.answered(route, "CLIENT_GONE")
        return response
    # the stream has begun: end it with an error event the client can read (the pod in the log only)
    log.warning("decode pod %s broke off a stream: %s", target.pod, cause_of(exc))
    message = f"the decode engine's stream broke off: {client_cause(exc)}"
    event = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    with contextlib.suppress(ConnectionResetError):
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write_eof()
    engines.metrics.answered(route, f"{code}_MIDSTREAM")
    return response
