"""Operator settings, from flags or ``KVBRIDGE_OPERATOR_*`` environment variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from kvbridge_agent.core import SpecError

from . import __version__

ENV_PREFIX = "KVBRIDGE_OPERATOR_"


@dataclass(frozen=True)
class OperatorConfig:
    #: image of the kvbridge agent worker (engine kind Agent)
    agent_image: str = f"ghcr.io/kvbridge/kvbridge-agent:{__version__}"
    #: image of vLLM engines on GPUs (engine kind VLLM; the release the renderer targets, vllm.VLLM_RELEASE)
    vllm_image: str = "vllm/vllm-openai:v0.32.0"
    #: image of vLLM engines on CPUs (engine.device CPU; vLLM's CPU build of the same release)
    vllm_cpu_image: str = "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0"
    #: llm-d routing sidecar image injected into vLLM decode pods; empty: no sidecar
    routing_sidecar_image: str = ""
    #: extra arguments of the routing sidecar (after --port and --vllm-port)
    routing_sidecar_args: tuple[str, ...] = ("--connector=nixlv2", "--secure-proxy=false")
    #: extended resource that TP ranks request, one per rank
    gpu_resource: str = "nvidia.com/gpu"
    #: request no GPUs and run the agent on host memory (tests, demos, CPU-only clusters)
    cpu_mode: bool = False
    #: KV blocks each agent-worker rank allocates
    agent_num_blocks: int = 256
    #: the agent worker's HTTP port (API and probes)
    agent_http_port: int = 8000
    #: where pods mount the side-channel key Secret
    keys_mount_path: str = "/var/run/kvbridge/keys"
    #: namespaces to watch; empty means the whole cluster
    namespaces: tuple[str, ...] = field(default_factory=tuple)
    #: Kubernetes API server URL; empty: in-cluster service account (or Kopf's own discovery)
    api_server: str = ""
    #: port of the operator's liveness endpoint (/healthz)
    liveness_port: int = 8080
    #: port of the operator's Prometheus /metrics (0 disables)
    metrics_port: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **overrides: object) -> OperatorConfig:
        values: dict[str, object] = {}
        for item in fields(cls):
            raw = environ.get(ENV_PREFIX + item.name.upper())
            if raw is None:
                continue
            values[item.name] = _convert(item.name, raw, item.type)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


def _convert(name: str, raw: str, kind: object) -> object:
    text = str(kind)
    try:
        if "bool" in text:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if "int" in text:
            return int(raw)
        if "tuple" in text:
            return tuple(p.strip() for p in raw.split(",") if p.strip())
    except ValueError as exc:
        raise SpecError(
            f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {text}",
            field=ENV_PREFIX + name.upper(),
            code="INVALID_ENVIRONMENT",
        ) from exc
    return raw
