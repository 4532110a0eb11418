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
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvbridge_agent.core import tracing as words
from kvbridge_agent.core.digest import KV_DIGEST_MISMATCH, KV_DIGEST_UNAVAILABLE
from kvbridge_agent.transfer.reads import ReadResult

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

    def record_read(
        self,
        tp_rank: int,
        trace: dict[str, str],
        began: int,
        attributes: dict[str, Value],
        checked: int | None,
        result: ReadResult,
    ) -> None:
        """Decode: a traced request's READs (posted until complete: bytes, descriptors, the failure's code), the
        conversion after them, and, when verified (``checked``: when the check began), the digest check."""
        converted = 0
        if result.seconds:  # the READs' own time (the result comes later when a check or a handshake follows)
            read_end = began + int((result.seconds - result.convert_seconds) * 1e9)
            converted = read_end + int(result.convert_seconds * 1e9) if result.convert_seconds else 0
        else:
            read_end = checked if checked is not None else time.time_ns()
        read = {**attributes, words.BYTES: result.bytes, words.DESCRIPTORS: result.descriptors}
        digest_failed = result.code in (KV_DIGEST_MISMATCH, KV_DIGEST_UNAVAILABLE)
        read_error = "" if result.ok or (checked is not None and digest_failed) else result.code
        rank: dict[str, Value] = {words.TP_RANK: tp_rank}
        self.record(words.DECODE_READ, trace, began, read_end, {**rank, **read}, read_error)
        if converted:
            conversion = {**rank, words.CONVERSION: result.conversion, words.BLOCKS: attributes.get(words.BLOCKS, 0)}
            self.record(words.DECODE_CONVERT, trace, read_end, converted, conversion)
        if checked is not None:
            check = {**rank, words.VERIFIED: result.ok, **attributes}
            error = result.code if not result.ok and read_error == "" else ""
            self.record(words.DECODE_DIGEST_CHECK, trace, checked, time.time_ns(), check, error)
