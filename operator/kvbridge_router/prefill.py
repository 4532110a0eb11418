"""The prefill call: the pair the policy chooses (and why: the trace's choice span and the picks counter), the
client's request sent to its prefill pod with one token and ``kv_transfer_params: {do_remote_decode: true}``, retried
on another prefill pod when one fails (``prefill_attempts`` in all, each bounded by ``prefill_timeout`` and by what is
left of the request's ``request_timeout``), and what the answer says: the transfer parameters decode takes, or an
engine's refusal, and how much of the prompt the pod's prefix cache served.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable

import msgspec

from kvbridge_agent.core import tracing as span
from kvbridge_operator.api.objects import Obj
from kvbridge_router.encoding import encoded, encoded_plain
from kvbridge_router.engines import Engines, Ledger, after_answer, client_cause, read_error
from kvbridge_router.errors import RouteError
from kvbridge_router.policies import Choice
from kvbridge_router.pool import Target
from kvbridge_router.prefixes import cached_as_keyed, held_chunks, prefix_keys, prompt_ids
from kvbridge_router.refusals import clipped
from kvbridge_router.upstream import AnswerTooLargeError, EngineAnswer, UpstreamError

log = logging.getLogger(__name__)
#: what the router sets on the prefill request (OpenAI and vLLM fields); streaming fields are dropped
PREFILL_DROPPED = ("stream_options", "min_tokens")
#: where a KV connector's prefill says why it offers nothing for a request (kvbridge's connector; vLLM frees the
#: blocks): the request is answered, not sent to another pod
ENGINE_REFUSAL = "kvbridge_error"
#: where vLLM says how many of the prompt's tokens the prefill pod's prefix cache served (in the transfer parameters
#: a KV connector returns for a remote decode)
CACHED_TOKENS = "remote_prefill_cached_tokens"


async def prefill_somewhere(
    engines: Engines,
    path: str,
    body: Obj,
    prefill_body: bytes,
    headers: dict[str, str],
    ledger: Ledger,
    started: float,
    exclude_decodes: list[str] | None = None,
) -> tuple[Target, Target, Obj]:
    """Prefill on the pod the policy chooses among those with a decode partner (other than ``exclude_decodes``); on
    a pod failure, on another one. Each call is bounded by ``prefill_timeout`` (``cold_timeout`` for a pod's first call
    of the request's kind: warmth.py) and by what is left of the request's ``request_timeout`` (it ``started`` then);
    none is made when nothing is. The pair and the transfer parameters."""
    config = engines.config
    tried: list[str] = []
    last: RouteError | None = None
    # a completion's list prompt passed admission's token-id check (prompts.token_ids): not checked again
    admitted_ids = ledger.route == "completions"
    scored = engines.balancer.unit.scores_prefixes
    keys = prefix_keys(body, config.block_tokens, ids_checked=admitted_ids) if scored else []
    for _ in range(config.prefill_attempts):
        left = engines.left(started)
        if left <= 0:
            raise engines.request_timeout(tried)
        choice = _choose(engines, ledger, tried, exclude_decodes or (), keys, scored)
        if choice is None:
            break
        prefill = choice.prefill
        called = time.perf_counter()
        computed = False
        bound = engines.bound(prefill.pod, ledger.kind, config.prefill_timeout)  # cold_timeout for a first call
        timeout = min(bound, left)
        try:
            with ledger.trace.step(span.ROUTER_PREFILL, {span.POD: prefill.pod}, call=True) as call:
                params = await _call(engines, path, prefill, prefill_body, call.inject(headers), timeout, ledger)
        except RouteError as exc:
            if exc.code == "PREFILL_TIMEOUT" and timeout < bound:
                raise engines.request_timeout([*tried, prefill.pod]) from None  # cut at the time left: no more
            if exc.code == "PREFILL_TIMEOUT":  # the pod had its whole bound: a longer one is spent
                engines.warmth.warmed(prefill.pod, ledger.kind)
            if not exc.retry:
                raise
            more = len(tried) + 1 < config.prefill_attempts
            log.warning(
                "prefill pod %s failed (%s: %s); %s",
                prefill.pod,
                exc.code,
                exc.message,
                "trying another" if more else "giving up",
            )
            engines.metrics.retries.labels(prefill.pod).inc()
            tried.append(prefill.pod)
            last = exc
            continue
        else:
            computed = True
            engines.warmth.warmed(prefill.pod, ledger.kind)
        finally:
            ledger.spent += time.perf_counter() - called
            if choice.tick:  # this choice's record at the prefill pod
                engines.balancer.prefilled(prefill.pod, choice.tick, keys, choice.matched, computed)
        after_answer(engines.metrics.prefill_seconds.observe, time.perf_counter() - called)
        if choice.ticks and cached_as_keyed(body):
            _held(engines, prefill.pod, body, params, list(choice.ticks), admitted_ids)
        return prefill, choice.decode, params
    if last is not None:
        message = f"{last.message} ({len(tried)} prefill pod(s) tried)"
        raise RouteError(last.status, last.code, message, pods=tried)
    raise RouteError(503, "NO_ROUTE", engines.pool.problem() or "every paired prefill pod failed", pods=tried)


def _choose(
    engines: Engines, ledger: Ledger, tried: list[str], exclude_decodes: Iterable[str], keys: list[int], scored: bool
) -> Choice | None:
    """The policy's pair for this attempt, or None when none is left; what it chose and why on the trace's choice span
    and in the metrics (picks by policy and reason; kv-aware: the prompt's chunks the pod had been sent)."""
    policy = engines.balancer.policy
    with ledger.trace.step(span.ROUTER_CHOOSE, {span.POLICY: policy}) as step:
        choice = engines.balancer.decide(engines.pool, tried, exclude_decodes, keys)
        if choice is None:
            step.failed("NO_ROUTE")
            return None
        step.set(span.PREFILL_POD, choice.prefill.pod)
        step.set(span.DECODE_POD, choice.decode.pod)
        step.set(span.CHOICE_REASON, choice.reason)
        if scored:
            step.set(span.PREFIX_CHUNKS, len(keys))
            step.set(span.PREFIX_HIT_CHUNKS, choice.matched)
    after_answer(engines.metrics.picked, policy, choice.reason)
    if keys:
        after_answer(engines.metrics.prefix_matched, choice.matched, len(keys))
    return choice


def _held(engines: Engines, pod: str, body: Obj, params: Obj, believed: list[int], ids_checked: bool) -> None:
    """What the prefill pod's answer says its prefix cache served of the prompt (vLLM adds
    ``remote_prefill_cached_tokens`` to the transfer parameters), against the ``believed`` chunks: a pod that
    evicted what it was sent is forgotten that far (``Balancer.observed``). The prompt is read as its keys were
    built (``prompt_ids``: token ids, or text)."""
    cached = params.get(CACHED_TOKENS)
    if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
        return  # another engine, or none said: the view stays as it is
    ids = prompt_ids(body, ids_checked)
    tokens = None if ids is None else len(ids)
    if engines.balancer.observed(pod, believed, held_chunks(cached, engines.config.block_tokens, tokens)):
        engines.metrics.prefix_evictions.inc()


async def _call(
    engines: Engines, path: str, target: Target, request: bytes, headers: dict[str, str], timeout: float, ledger: Ledger
) -> Obj:
    """One prefill call: the transfer parameters of a 200; a :class:`RouteError` saying whether another pod may
    serve the request (the pod named in its ``pods``, never in its message)."""
    config = engines.config
    pods = (target.pod,)
    engines.enter("prefill", target)
    try:
        async with asyncio.timeout(timeout):
            async with engines.upstream.post(
                target.url, path, request, headers, config.connect_timeout, sent=engines.balancer.flush
            ) as upstream:
                if upstream.status != 200:
                    raise await _refusal(engines, target, upstream, ledger)
                data = await upstream.read(config.max_answer_bytes)
    except TimeoutError:
        message = f"the prefill engine gave no answer within {timeout:g} s"
        raise RouteError(504, "PREFILL_TIMEOUT", message, retry=True, pods=pods) from None
    except AnswerTooLargeError as exc:  # the request's (prompt_logprobs, say): another pod would answer the same
        raise RouteError(502, "PREFILL_ANSWER_TOO_LARGE", f"the prefill engine's {exc}", pods=pods) from None
    except UpstreamError as exc:
        message = f"the prefill engine is unavailable: {client_cause(exc)}"
        raise RouteError(502, "PREFILL_UNAVAILABLE", message, retry=True, pods=pods) from None
    finally:
        engines.leave("prefill", target)
    return _transfer_params(target, data)


async def _refusal(engines: Engines, target: Target, upstream: EngineAnswer, ledger: Ledger) -> RouteError:
    """Prefill's answer other than 200: a 4xx is the request's (another pod would refuse it too), answered with the
    engine's error object and status; a 5xx is the router's ``PREFILL_FAILED``, another pod's to try or not
    (engines.judge_5xx), its message the engine's."""
    error = await read_error(upstream, "prefill", "PREFILL_REFUSED")
    if upstream.status < 500:
        return RouteError(
            upstream.status, "PREFILL_REFUSED", error["message"], pods=(target.pod,), engine=("prefill", error)
        )
    retry, why = await engines.judge_5xx(target, upstream.status, ledger, "prefill")
    message = f"the prefill engine answered HTTP {upstream.status}: {error['message']}{why}"
    return RouteError(502, "PREFILL_FAILED", message, retry=retry, pods=(target.pod,))


def _transfer_params(target: Target, data: bytes) -> Obj:
    """The ``kv_transfer_params`` of prefill's answer; a :class:`RouteError` when its KV connector refused the
    request (not another pod's to try) or returned none."""
    try:
        params = _ANSWER(data).get("kv_transfer_params")
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        params = _standard_params(data)
    except AttributeError:  # not an object
        params = None
    refused = params.get(ENGINE_REFUSAL) if isinstance(params, dict) else None
    pods = (target.pod,)
    if isinstance(refused, dict):  # the engine's KV connector would not offer this request: not another pod's to try
        code, message = clipped(str(refused.get("code", "")), 128), clipped(str(refused.get("message", "")), 300)
        message = f"the prefill engine's KV connector offered no KV for this request: {code}: {message}"
        raise RouteError(502, "PREFILL_REFUSED", message, pods=pods)
    if not isinstance(params, dict) or not params:
        raise RouteError(
            502,
            "PREFILL_NO_TRANSFER_PARAMS",
            "the prefill engine answered without kv_transfer_params (is it a kv_producer with a KV connector?)",
            retry=True,
            pods=pods,
        )
    return params


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
    return encoded_plain(request) if plain else encoded(request)


def _prefill_fields(body: Obj) -> Obj:
    """The fields prefill's request sets (over the client's)."""
    fields: Obj = {"stream": False, "max_tokens": 1}
    if "max_completion_tokens" in body:
        fields["max_completion_tokens"] = 1
    fields["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return fields


#: prefill's answer, decoded at C speed (what msgspec refuses, a NaN in a logprob say, the standard library reads)
_ANSWER = msgspec.json.Decoder().decode


def _standard_params(data: bytes) -> object:
    try:
        return json.loads(data).get("kv_transfer_params")
    except (ValueError, AttributeError, RecursionError):
        return None
