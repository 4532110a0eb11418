"""The connector's spans (``spec.tracing``, docs/tracing.md), parented to the request's trace: the W3C context vLLM
hands the scheduler with each request (``Request.trace_headers``: the router's engine call), which the scheduler
passes to the ranks in their orders, checked (``kvbridge_agent.core.tracing.context_of``).

A span is recorded once its work is over, with the times it began and ended: a READ posted in one step completes in
a later one, and the connector keeps no span open across vLLM's calls. Off (no ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
in the environment, or a request without trace context) :meth:`Spans.record` returns at once; OpenTelemetry is
imported only when a first span is recorded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvbridge_agent.core import tracing as words

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)
SCOPE = "kvbridge_agent.vllm_connector"
Value = str | int | float | bool


class Spans:
    """One process's recorder of connector spans (each TP rank's worker has its own)."""

    def __init__(self, environ: Mapping[str, str] | None = None, tracer: Tracer | None = None) -> None:
        environ = os.environ if environ is None else environ
        self._protocol = environ.get(words.ENV_PROTOCOL, "grpc")
        disabled = environ.get(words.ENV_SDK_DISABLED, "").lower() == "true"
        self.enabled = tracer is not None or (bool(environ.get(words.ENV_ENDPOINT)) and not disabled)
        self._tracer = tracer

    def record(
        self,
        name: str,
        trace: Mapping[str, str],
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Value],
        error: str = "",
    ) -> None:
        """A finished span ``name`` under the request's ``trace`` context, from ``start_ns`` to ``end_ns`` (Unix
        nanoseconds); ``error``: the failure's stable code. Never raises into vLLM."""
        if not trace or not self.enabled:
            return
        try:
            from opentelemetry.trace import Status, StatusCode
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            tracer = self._tracer or self._start()
            parent = TraceContextTextMapPropagator().extract(dict(trace))
            span = tracer.start_span(name, context=parent, start_time=start_ns, attributes=dict(attributes))
            if error:
                span.set_attribute(words.ERROR_CODE, error)
                span.set_status(Status(StatusCode.ERROR, error))
            span.end(end_time=max(end_ns, start_ns))
        except Exception as exc:  # an exporter or SDK problem never fails a request
            log.warning("kvbridge: span %s not recorded: %s", name, exc)

    def _start(self) -> Tracer:
        """This process's tracer provider, as the environment says (endpoint, protocol, sampler, service name)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

        if self._protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

            exporter: SpanExporter = HTTPExporter()
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GRPCExporter

            exporter = GRPCExporter()
        provider = TracerProvider(resource=Resource.create({"kvbridge.process": "vllm-connector"}))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        self._provider = provider
        self._tracer = provider.get_tracer(SCOPE)
        return self._tracer

    def shutdown(self) -> None:
        """Exports what is batched (the SDK's export timeout bounds it)."""
        provider = getattr(self, "_provider", None)
        if provider is not None:
            provider.shutdown()
