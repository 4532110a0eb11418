"""``spec.tracing`` as the pods get it: OpenTelemetry's standard environment on the engine pods and the router, and
vLLM's own ``--otlp-traces-endpoint`` on vLLM engines (docs/tracing.md)."""

from __future__ import annotations

from kvbridge_agent.core import tracing as words
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeploymentSpec

#: vLLM 0.32's flag: its request spans, exported over OTLP (the protocol from OTEL_EXPORTER_OTLP_TRACES_PROTOCOL)
VLLM_FLAG = "--otlp-traces-endpoint"


def environment(spec: DisaggregatedDeploymentSpec, service: str) -> dict[str, str]:
    """The OTEL_* variables of a process named ``service`` (OTEL_SERVICE_NAME); none when tracing is off."""
    tracing = spec.tracing
    if tracing is None:
        return {}
    return {
        words.ENV_ENDPOINT: tracing.endpoint,
        words.ENV_PROTOCOL: tracing.protocol.value,
        words.ENV_SAMPLER: words.SAMPLER,
        words.ENV_SAMPLER_ARG: f"{tracing.sampling_ratio:g}",
        words.ENV_SERVICE_NAME: service,
    }


def env_list(spec: DisaggregatedDeploymentSpec, service: str) -> list[Obj]:
    """:func:`environment` as a container's ``env`` items."""
    return [{"name": name, "value": value} for name, value in environment(spec, service).items()]


def vllm_args(spec: DisaggregatedDeploymentSpec) -> list[str]:
    """vLLM's own flag, so its request spans join the trace the router propagates; none when tracing is off."""
    return [VLLM_FLAG, spec.tracing.endpoint] if spec.tracing is not None else []


def service_name(deployment: str, process: str) -> str:
    """OTEL_SERVICE_NAME: the deployment and the process (``prefill``, ``decode``, ``router``)."""
    return f"{deployment}-{process}"
