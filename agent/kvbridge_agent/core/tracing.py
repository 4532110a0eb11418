"""The words of kvbridge's traces, defined once: span and attribute names, the OpenTelemetry environment the
operator renders, and the checks on W3C trace context a client sends.

The router (``kvbridge_router.tracing``) and kvbridge's vLLM connector (``kvbridge_agent.vllm_connector.tracing``)
name their spans from here; neither this module nor anything else in the core imports OpenTelemetry.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# -- the environment (OpenTelemetry's own names: every SDK and vLLM read them) ----------------------------------------
ENV_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
ENV_SAMPLER = "OTEL_TRACES_SAMPLER"
ENV_SAMPLER_ARG = "OTEL_TRACES_SAMPLER_ARG"
ENV_SERVICE_NAME = "OTEL_SERVICE_NAME"
ENV_SDK_DISABLED = "OTEL_SDK_DISABLED"
#: new traces sampled at the ratio, a request with a trace context as its caller decided
SAMPLER = "parentbased_traceidratio"

# -- W3C trace context ------------------------------------------------------------------------------------------------
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
#: version 00 exactly (55 characters); trace and parent ids of lower-case hex, neither all zeros (checked below)
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
#: one list member: ``key=value`` (W3C Trace Context §3.3.1: a simple or multi-tenant key, printable value)
_MEMBER = re.compile(
    r"(?:[a-z][-a-z0-9_*/]{0,255}|[a-z0-9][-a-z0-9_*/]{0,240}@[a-z][-a-z0-9_*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
#: the most tracestate members and characters passed on (W3C: 32 members; at least 512 characters propagated)
MAX_TRACESTATE_MEMBERS = 32
MAX_TRACESTATE_CHARS = 512


def valid_traceparent(value: str) -> bool:
    """Whether ``value`` is a W3C ``traceparent`` of version 00: anything else (another version, upper-case hex, an
    all-zero id, extra fields, whitespace inside) starts a new trace."""
    match = _TRACEPARENT.fullmatch(value.strip(" \t"))
    return match is not None and match[1] != "0" * 32 and match[2] != "0" * 16


def valid_tracestate(value: str) -> bool:
    """Whether ``value`` is a W3C ``tracestate`` kvbridge passes on: at most 32 well-formed members, each key once,
    512 characters in all. Anything else is dropped whole (the trace goes on from ``traceparent``)."""
    if len(value) > MAX_TRACESTATE_CHARS:
        return False
    members = [member.strip(" \t") for member in value.split(",")]
    members = [member for member in members if member]  # empty members are allowed and ignored
    if len(members) > MAX_TRACESTATE_MEMBERS or not all(_MEMBER.fullmatch(member) for member in members):
        return False
    keys = [member.partition("=")[0] for member in members]
    return len(set(keys)) == len(keys)


def trace_context(traceparents: list[str], tracestates: list[str]) -> dict[str, str]:
    """The W3C trace context of a request's headers (every ``traceparent`` and ``tracestate`` it carried), checked:
    one valid ``traceparent`` and, with it, a valid ``tracestate`` (several headers joined, as W3C says); empty when
    the request carries none or something else (a new trace starts). Never raises."""
    if len(traceparents) != 1 or not valid_traceparent(traceparents[0]):
        return {}
    context = {TRACEPARENT: traceparents[0].strip(" \t")}
    state = ",".join(tracestates)
    if state and valid_tracestate(state):
        context[TRACESTATE] = state
    return context


def context_of(headers: Mapping[str, str] | None) -> dict[str, str]:
    """:func:`trace_context` of a mapping with at most one value per name (vLLM's ``trace_headers``)."""
    if not headers:
        return {}
    parent, state = headers.get(TRACEPARENT), headers.get(TRACESTATE)
    return trace_context([parent] if isinstance(parent, str) else [], [state] if isinstance(state, str) else [])


# -- span names -------------------------------------------------------------------------------------------------------
#: the router's span over one client request (its root, or a child of the client's trace context)
ROUTER_REQUEST = "kvbridge.router.request"
#: reading and checking the client's body
ROUTER_ADMISSION = "kvbridge.router.admission"
#: choosing a prefill and decode pair (one per attempt: retries are siblings)
ROUTER_CHOOSE = "kvbridge.router.choose"
#: one call to a prefill engine; vLLM's own request span is its child
ROUTER_PREFILL = "kvbridge.router.prefill"
#: one call to a decode engine
ROUTER_DECODE = "kvbridge.router.decode"
#: prefill's connector: the request's blocks offered to decode (held under a lease until read or expiry)
PREFILL_OFFER = "kvbridge.prefill.offer"
#: prefill's connector: the digest of a request's KV (right after the step that computed it, or at the offer)
PREFILL_DIGEST = "kvbridge.prefill.digest"
#: decode's connector: the side channel's handshake with a prefill engine (when none was cached)
DECODE_HANDSHAKE = "kvbridge.decode.handshake"
#: decode's connector: one request's READs from one prefill engine, posted to completion
DECODE_READ = "kvbridge.decode.read"
#: decode's connector: what was read made into decode's own blocks (a block-size or layout conversion, or the copy
#: out of a host buffer), after the READs and before the digest check
DECODE_CONVERT = "kvbridge.decode.convert"
#: decode's connector: the digest of what was read compared with prefill's
DECODE_DIGEST_CHECK = "kvbridge.decode.digest_check"

# -- attribute names --------------------------------------------------------------------------------------------------
DEPLOYMENT = "kvbridge.deployment"
REQUEST_ID = "kvbridge.request_id"
ROUTE = "kvbridge.route"
POLICY = "kvbridge.policy"
#: why the policy chose the pair (``prefix``, ``ring``, ``load``, ``turn``: kvbridge_router/policies/base.py)
CHOICE_REASON = "kvbridge.choice.reason"
ATTEMPT = "kvbridge.attempt"
#: which of a request's ``n`` completions a step serves (0 to n - 1; absent when n is 1)
SAMPLE = "kvbridge.sample"
POD = "kvbridge.pod"
PREFILL_POD = "kvbridge.prefill.pod"
DECODE_POD = "kvbridge.decode.pod"
PREFIX_CHUNKS = "kvbridge.prefix.chunks"
PREFIX_HIT_CHUNKS = "kvbridge.prefix.hit_chunks"
STREAM = "kvbridge.stream"
BODY_BYTES = "kvbridge.body_bytes"
#: why the router tries again (the failed call's code)
RETRY_OF = "kvbridge.retry_of"
#: a failure's stable code (docs/troubleshooting.md), on the span where it happened
ERROR_CODE = "kvbridge.error.code"
HTTP_STATUS = "http.response.status_code"
ENGINE_ID = "kvbridge.engine_id"
REMOTE_ENGINE = "kvbridge.remote_engine"
BLOCKS = "kvbridge.blocks"
BYTES = "kvbridge.bytes"
DESCRIPTORS = "kvbridge.descriptors"
LEASE_SECONDS = "kvbridge.lease_seconds"
VERIFIED = "kvbridge.verified"
TP_RANK = "kvbridge.tp_rank"
TOKENS = "kvbridge.tokens"
#: what a conversion span did: the plan's steps on its side (``merge``, ``permute``...) or ``host_copy``
CONVERSION = "kvbridge.conversion"
