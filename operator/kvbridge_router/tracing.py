"""The router's traces (``spec.tracing``, docs/tracing.md): one span per client request, continuing the client's W3C
trace context when it is valid, with spans for admission, each choice of a pair, each prefill and decode call (a
retry is a sibling), and the context of each call propagated to its engine.

Configured by OpenTelemetry's standard environment, which the operator renders: tracing is on when
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set (and ``OTEL_SDK_DISABLED`` is not true); the SDK reads the protocol,
the sampler and the service name. Off, every request gets :data:`OFF`, whose methods do nothing: no OpenTelemetry
code runs per request.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvbridge_agent.core import tracing as words

log = logging.getLogger(__name__)
#: the router's instrumentation scope
SCOPE = "kvbridge_router"
_PROPAGATOR = TraceContextTextMapPropagator()
#: attribute values the router sets: OpenTelemetry's primitive types
Value = str | int | float | bool


class Step:
    """One span of a request (admission, a choice, an engine call): ``with`` ends it; a :class:`RouteError` (or any
    exception) passing through marks it failed with the error's code."""

    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    def __enter__(self) -> Step:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _: TracebackType | None) -> None:
        if error is not None:
            self.failed(str(getattr(error, "code", type(error).__name__)), getattr(error, "status", None))
        self._span.end()

    def set(self, name: str, value: Value) -> None:
        self._span.set_attribute(name, value)

    def failed(self, code: str, status: int | None = None) -> None:
        """Records a failure's stable code (docs/troubleshooting.md) on this span."""
        self._span.set_attribute(words.ERROR_CODE, code)
        if status is not None:
            self._span.set_attribute(words.HTTP_STATUS, status)
        self._span.set_status(Status(StatusCode.ERROR, code))

    def inject(self, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` with this span's W3C trace context added (``traceparent``, and ``tracestate`` when the
        client's valid one was continued): what the engine called in this span gets."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=set_span_in_context(self._span))
        return {**headers, **carrier}


class RequestTrace:
    """The spans of one client request, under its root span."""

    __slots__ = ("_attempts", "_context", "_extra", "_failed", "_root", "_tracer")

    def __init__(self, tracer: Tracer, parent: Context, path: str, route: str) -> None:
        self._tracer = tracer
        attributes: dict[str, Value] = {"http.request.method": "POST", "url.path": path, words.ROUTE: route}
        self._root = tracer.start_span(
            words.ROUTER_REQUEST, context=parent, kind=SpanKind.SERVER, attributes=attributes
        )
        self._context = set_span_in_context(self._root)
        #: spans started so far of each name, and the code of the last one that failed
        self._attempts: dict[str, int] = {}
        self._failed: dict[str, str] = {}
        #: attributes every step carries (a sample's index)
        self._extra: dict[str, Value] = {}

    def sample(self, index: int) -> RequestTrace:
        """The steps of one of the request's ``n`` samples (samples.py): under the same request span, each with
        ``kvbridge.sample``, their attempts and retries counted within the sample."""
        other = object.__new__(RequestTrace)
        other._tracer, other._root, other._context = self._tracer, self._root, self._context
        other._attempts, other._failed, other._extra = {}, {}, {words.SAMPLE: index}
        return other

    def step(self, name: str, attributes: dict[str, Value] | None = None, *, call: bool = False) -> Step:
        """A child span of the request (an engine ``call`` is a client span). Each carries its ``kvbridge.attempt``
        (1 for the first of its name); one after a failed one of its name carries the failure's code
        (``kvbridge.retry_of``): retries are siblings under the request."""
        attempt = self._attempts.get(name, 0) + 1
        self._attempts[name] = attempt
        attributes = {**(attributes or {}), **self._extra, words.ATTEMPT: attempt}
        retry_of = self._failed.get(name)
        if retry_of is not None:
            attributes[words.RETRY_OF] = retry_of
        kind = SpanKind.CLIENT if call else SpanKind.INTERNAL
        return _Watched(self, name, self._tracer.start_span(name, self._context, kind, attributes))

    def set(self, name: str, value: Value) -> None:
        self._root.set_attribute(name, value)

    @property
    def trace_id(self) -> str:
        """The request's trace id (32 hex digits) when its spans are recorded, else "" (an exemplar's label)."""
        context = self._root.get_span_context()
        return format(context.trace_id, "032x") if context.is_valid and context.trace_flags.sampled else ""

    def finish(self, status: int, code: str = "") -> None:
        """Ends the request's span with the status the client got, and the error's code when it failed."""
        self._root.set_attribute(words.HTTP_STATUS, status)
        if code:
            self._root.set_attribute(words.ERROR_CODE, code)
            self._root.set_status(Status(StatusCode.ERROR, code))
        self._root.end()


class _Watched(Step):
    """A step that tells its request when it failed (for the next sibling's ``kvbridge.retry_of``)."""

    __slots__ = ("_name", "_request")

    def __init__(self, request: RequestTrace, name: str, span: Span) -> None:
        super().__init__(span)
        self._request, self._name = request, name

    def failed(self, code: str, status: int | None = None) -> None:
        super().failed(code, status)
        self._request._failed[self._name] = code


class _Off(Step):
    """Tracing off: a request, and each of its steps, that does nothing (one object for every request)."""

    __slots__ = ()

    def __init__(self) -> None:
        pass

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _: TracebackType | None) -> None:
        return None

    def step(self, name: str, attributes: dict[str, Value] | None = None, *, call: bool = False) -> _Off:
        return self

    def sample(self, index: int) -> _Off:
        return self

    def set(self, name: str, value: Value) -> None:
        return None

    def failed(self, code: str, status: int | None = None) -> None:
        return None

    def inject(self, headers: dict[str, str]) -> dict[str, str]:
        return headers

    @property
    def trace_id(self) -> str:
        return ""

    def finish(self, status: int, code: str = "") -> None:
        return None


#: the request (and step) of every request while tracing is off
OFF = _Off()
#: one request's trace, on or off
Trace = RequestTrace | _Off


class Tracing:
    """The router's tracer provider, or none (off)."""

    def __init__(self, provider: TracerProvider | None = None) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer(SCOPE) if provider is not None else None

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> Tracing:
        """On when the operator rendered an OTLP endpoint: spans batched to it over the protocol, sampled by the
        sampler, under the service name, all as the environment says (OpenTelemetry's SDK reads it)."""
        if not environ.get(words.ENV_ENDPOINT) or environ.get(words.ENV_SDK_DISABLED, "").lower() == "true":
            return cls()
        provider = TracerProvider(resource=Resource.create())
        provider.add_span_processor(BatchSpanProcessor(exporter(environ.get(words.ENV_PROTOCOL, "grpc"))))
        log.info("traces go to %s (%s)", environ[words.ENV_ENDPOINT], environ.get(words.ENV_PROTOCOL, "grpc"))
        return cls(provider)

    def request(self, headers: Any, path: str, route: str) -> RequestTrace | _Off:
        """The trace of one request: a child of the client's ``traceparent`` when the request carries exactly one
        valid one (with its ``tracestate`` when that is valid too), else a new trace; never an error.
        ``headers``: the request's (aiohttp's multidict: ``getall``)."""
        if self._tracer is None:
            return OFF
        carrier = words.trace_context(headers.getall(words.TRACEPARENT, []), headers.getall(words.TRACESTATE, []))
        parent = _PROPAGATOR.extract(carrier, context=Context()) if carrier else Context()
        return RequestTrace(self._tracer, parent, path, route)

    def shutdown(self) -> None:
        """Exports what is batched (bounded by the SDK's own export timeout) and stops."""
        if self.provider is not None:
            self.provider.shutdown()


def exporter(protocol: str) -> SpanExporter:
    """OTLP's exporter for ``protocol`` (``grpc`` or ``http/protobuf``; the endpoint from the environment)."""
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

        return HTTPExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GRPCExporter

    return GRPCExporter()
