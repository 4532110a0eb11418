"""``spec.tracing``: OpenTelemetry traces of every request, checked as every OTLP exporter reads them."""

from __future__ import annotations

import re
from enum import StrEnum

from pydantic import Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from kvbridge_agent.core.model import CamelModel


class TracingProtocol(StrEnum):
    """How spans are exported (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, in OpenTelemetry's words)."""

    GRPC = "grpc"  # OTLP over gRPC (a collector's port 4317)
    HTTP_PROTOBUF = "http/protobuf"  # OTLP over HTTP, protobuf bodies (a collector's port 4318, path /v1/traces)


TRACING_ENDPOINT_INVALID = "TRACING_ENDPOINT_INVALID"
TRACING_ENDPOINT_PATH = "TRACING_ENDPOINT_PATH"
#: an OTLP endpoint: http(s)://HOST[:PORT][/PATH], no user, query or fragment (what every OTLP exporter reads)
TRACING_ENDPOINT_PATTERN = r"^https?://[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?(:[0-9]{1,5})?(/[-A-Za-z0-9_.~/]*)?$"
#: the path an OTLP/HTTP collector takes traces on (the signal's endpoint is used as written, path included)
OTLP_HTTP_TRACES_PATH = "/v1/traces"


class TracingSpec(CamelModel):
    """OpenTelemetry traces of every request (docs/tracing.md): rendered as the standard OTEL_* environment on the
    engine pods and the router, and as vLLM's own --otlp-traces-endpoint on vLLM engines."""

    protocol: TracingProtocol = Field(
        default=TracingProtocol.GRPC,
        description="grpc (the default) or http/protobuf (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL).",
    )
    endpoint: str = Field(
        min_length=1,
        max_length=512,
        pattern=TRACING_ENDPOINT_PATTERN,
        description="The OTLP collector's traces endpoint (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT): grpc "
        "http://HOST:4317, http/protobuf http://HOST:4318/v1/traces (the path included, as OpenTelemetry reads it).",
    )
    sampling_ratio: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="The share of new traces recorded, 0 to 1 (OTEL_TRACES_SAMPLER parentbased_traceidratio, "
        "OTEL_TRACES_SAMPLER_ARG): a request that arrives with a trace context follows its caller's decision.",
    )

    @field_validator("endpoint", mode="before")
    @classmethod
    def _endpoint(cls, endpoint: object, info: ValidationInfo) -> object:
        """Refused with a code of its own (before the pattern's generic message); the path must suit the protocol,
        which is checked first (declared first)."""
        if not isinstance(endpoint, str):
            return endpoint
        if not re.fullmatch(TRACING_ENDPOINT_PATTERN, endpoint):
            raise PydanticCustomError(
                TRACING_ENDPOINT_INVALID,
                "{endpoint} is not an OTLP endpoint: write http://HOST:PORT (grpc) or http://HOST:PORT/v1/traces "
                "(http/protobuf), https:// for TLS; no user, query or fragment",
                {"endpoint": repr(endpoint[:80])},
            )
        path = re.sub(r"^https?://[^/]*", "", endpoint)
        protocol = info.data.get("protocol")
        if protocol is TracingProtocol.HTTP_PROTOBUF and not path.endswith(OTLP_HTTP_TRACES_PATH):
            raise PydanticCustomError(
                TRACING_ENDPOINT_PATH,
                "protocol http/protobuf posts to the endpoint as written, path included: end it with "
                "{path} (e.g. http://collector:4318{path}), or use protocol grpc",
                {"path": OTLP_HTTP_TRACES_PATH},
            )
        if protocol is TracingProtocol.GRPC and path not in ("", "/"):
            raise PydanticCustomError(
                TRACING_ENDPOINT_PATH,
                "protocol grpc takes no path: write the endpoint as http://HOST:PORT (e.g. http://collector:4317), "
                "or use protocol http/protobuf",
            )
        return endpoint
