"""One generation request (``/v1/completions``, ``/v1/chat/completions``): admitted, prefilled on a pair's prefill
pod (prefill.py), decoded on its decode pod (decode.py), decode retried on another pair while nothing has reached
the client (``decode_attempts`` in all: another decode pod with the same transfer parameters when the failed one was
never reached, else prefilled again); OpenAI's ``n`` as that many samples side by side, joined into one answer
(samples.py). The request's span, outcome and times are recorded here.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvbridge_agent.core import tracing as span
from kvbridge_operator.api.objects import Obj
from kvbridge_router import warmth
from kvbridge_router.admission import admit, engine_request_id, sample_count
from kvbridge_router.decode import decode
from kvbridge_router.encoding import encoded
from kvbridge_router.engines import FORWARDED_HEADERS, Engines, Ledger, after_answer
from kvbridge_router.errors import RouteError
from kvbridge_router.prefill import prefill_bytes, prefill_somewhere
from kvbridge_router.request import Request
from kvbridge_router.response import Answer, Response
from kvbridge_router.samples import JoinError, joined, sample_bodies
from kvbridge_router.tracing import Tracing

log = logging.getLogger(__name__)
#: the generation routes, by path, and their names (metrics and traces)
ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


async def generate(engines: Engines, tracing: Tracing, request: Request, started: float) -> Answer:
    """The answer to one generation request (received at ``started``), its client's key already checked."""
    route = ROUTES[request.path]
    ledger = Ledger(route, trace=tracing.request(request.headers, request.path, route))
    try:
        with ledger.trace.step(span.ROUTER_ADMISSION) as admission:
            body, raw, plain = await admit(request, route, engines.config.limits)
            admission.set(span.BODY_BYTES, len(raw))
        ledger.kind = warmth.kind(route, body)
        request_id = engine_request_id(request.headers.get("X-Request-Id"))
        ledger.trace.set(span.REQUEST_ID, request_id)
        headers = {
            "X-Request-Id": request_id,
            **{k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers},
        }
        n = sample_count(body)
        if n == 1:
            prefill_body = prefill_bytes(body, plain)
            response = await served(engines, request, body, raw, prefill_body, headers, ledger, started)
        else:
            response = await sampled(engines, request, body, n, headers, ledger, started)
    except RouteError as exc:
        engines.metrics.answered(route, exc.code)
        log.warning("%s: %s %s", request.path, exc.code, exc.logged())
        ledger.trace.finish(exc.status, exc.code)
        return exc.response()
    except BaseException as exc:  # the client went away (cancelled), or a bug: the span still ends
        ledger.trace.finish(500, type(exc).__name__)
        raise
    ledger.trace.finish(response.status)
    total = time.perf_counter() - started
    after_answer(engines.metrics.answered_in, route, response.status, total, max(total - ledger.spent, 0.0))
    return response


async def served(
    engines: Engines,
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
    nothing has reached the client. A sample of several (:func:`sampled`) prefills only ``after`` the event is set,
    and sets ``prefilled`` once it has."""
    if after is not None:
        await after.wait()
    request_id = headers["X-Request-Id"]
    prefill, target, params = await prefill_somewhere(
        engines, request.path, body, prefill_body, headers, ledger, started
    )
    if prefilled is not None:
        prefilled.set()
    tried: list[str] = []
    while True:
        try:
            with ledger.trace.step(span.ROUTER_DECODE, {span.POD: target.pod}, call=True) as call:
                call.set(span.STREAM, bool(body.get("stream")))
                response = await decode(
                    engines, request, target, body, raw, params, call.inject(headers), started, ledger
                )
                call.set(span.HTTP_STATUS, response.status)
            return response
        except RouteError as exc:  # retried only while nothing has reached the client
            tried.append(target.pod)
            pool = engines.pool
            no_pair = not any(d.pod not in tried for p in pool.routable() for d in pool.decodes_for(p))
            if not exc.retry or len(tried) >= engines.config.decode_attempts or engines.left(started) <= 0 or no_pair:
                raise
            engines.metrics.decode_retries.labels(target.pod).inc()
            other = None if exc.reprefill else engines.balancer.pick(pool.decodes_for(prefill), tried)
            if other is None:  # decode had the request (or no partner is left): prefill again
                log.warning("decode pod %s failed (%s); prefilling again for another pair", target.pod, exc.message)
                # a new request id: the first prefill pod may still hold the first one's KV (until its lease ends)
                # and would refuse the id as a duplicate
                headers = {**headers, "X-Request-Id": f"{request_id}-retry{len(tried)}"}
                prefill, target, params = await prefill_somewhere(
                    engines, request.path, body, prefill_body, headers, ledger, started, exclude_decodes=tried
                )
            else:
                log.warning("decode pod %s unreachable (%s); trying %s", target.pod, exc.message, other.pod)
                target = other


async def sampled(
    engines: Engines,
    request: Request,
    body: Obj,
    n: int,
    headers: dict[str, str],
    ledger: Ledger,
    started: float,
) -> Answer:
    """``n`` completions of one prompt (samples.py): the first sample prefilled alone, the others after it (the
    prefill pod's prefix cache then holds the prompt), every decode at once; one answer joining them, or the
    first failure (the other samples cancelled)."""
    first_prefilled = asyncio.Event()
    calls, ledgers = [], []
    for index, sample in enumerate(sample_bodies(body, n)):
        sample_headers = {**headers, "X-Request-Id": f"{headers['X-Request-Id']}-{index}"}
        wait, done = (None, first_prefilled) if index == 0 else (first_prefilled, None)
        trace = ledger.trace.sample(index)
        ledgers.append(
            Ledger(ledger.route, lost_engines=ledger.lost_engines, trace=trace, ttft=index == 0, kind=ledger.kind)
        )
        sample_body = prefill_bytes(sample)
        served_sample = served(
            engines, request, sample, encoded(sample), sample_body, sample_headers, ledgers[-1], started, wait, done
        )
        calls.append(asyncio.ensure_future(served_sample))
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
