"""Operator settings, from flags or ``KVBRIDGE_OPERATOR_*`` environment variables."""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from kvbridge_agent.core import SpecError
from kvbridge_agent.core.handshake import host_problem
from kvbridge_operator.api.images import KVBRIDGE_ENGINE_REPOSITORY, lacks_connector

from . import __version__

ENV_PREFIX = "KVBRIDGE_OPERATOR_"
#: the vLLM release kvbridge renders for and tests against, written only here: the default images below, the
#: renderer's ``VLLM_RELEASE`` and the Makefile's CPU build (which reads this line) come from it; the chart, the
#: manifests and the docs repeat it, and tests/test_vllm_version.py keeps every mention equal to it
VLLM_VERSION = "0.32.0"
#: what the renderer targets: the flags, variables and layout names of this minor release
VLLM_RELEASE = VLLM_VERSION.rpartition(".")[0]


def _setting(default: object, help: str, flag: str = "") -> Any:
    """A setting: its default, its help (flag help and docs), its flag when not ``--<name-with-dashes>``."""
    if isinstance(default, tuple):
        return field(default_factory=lambda: default, metadata={"help": help, "flag": flag})
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass(frozen=True)
class OperatorConfig:
    """Every setting is a flag of ``kvbridge operator run`` and a ``KVBRIDGE_OPERATOR_<NAME>`` variable (flags win);
    docs/operator.md lists them all (a test keeps it complete)."""

    synthetic_image: str = _setting(
        f"ghcr.io/kvbridge/kvbridge-agent:{__version__}",
        "image of the synthetic engine (engine kind Synthetic: kvbridge's worker, which serves no model)",
    )
    vllm_image: str = _setting(
        f"vllm/vllm-openai:v{VLLM_VERSION}",
        f"image of vLLM engines on GPUs with NixlConnector (engine kind VLLM; vLLM {VLLM_RELEASE}, what the "
        "renderer targets)",
    )
    vllm_cpu_image: str = _setting(
        f"public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v{VLLM_VERSION}",
        "image of vLLM engines on CPUs with NixlConnector (engine.device CPU; vLLM's CPU build)",
    )
    kvbridge_vllm_image: str = _setting(
        f"{KVBRIDGE_ENGINE_REPOSITORY}:{__version__}",
        "image of vLLM engines on GPUs with kvbridge's connector (connector KVBridge): vLLM with kvbridge "
        "installed (images/vllm-engine/Dockerfile); vLLM's own images are refused",
    )
    kvbridge_vllm_cpu_image: str = _setting(
        f"{KVBRIDGE_ENGINE_REPOSITORY}:{__version__}-cpu",
        "image of vLLM engines on CPUs with kvbridge's connector: vLLM's CPU build with kvbridge installed "
        "(images/vllm-engine-cpu/Dockerfile); vLLM's own images are refused",
    )
    router_image: str = _setting(
        f"ghcr.io/kvbridge/kvbridge-operator:{__version__}",
        "image of the router (spec.router; the operator image, which has `kvbridge-router`)",
    )
    routing_sidecar_image: str = _setting(
        "", "llm-d routing sidecar image put in front of vLLM decode pods; empty: no sidecar"
    )
    routing_sidecar_args: tuple[str, ...] = _setting(
        ("--connector=nixlv2", "--secure-proxy=false"),
        "arguments of the routing sidecar after --port and --vllm-port (flag repeatable, one argument each; "
        "the variable takes a JSON array)",
        flag="--routing-sidecar-arg",
    )
    gpu_resource: str = _setting("nvidia.com/gpu", "extended resource each TP rank requests, one per rank")
    gpus_per_node: int = _setting(
        0,
        "GPUs one node offers: the fit check (ROLE_DOES_NOT_FIT) of deployments that leave "
        "spec.placement.gpusPerNode unset; 0: not checked",
    )
    cpu_mode: bool = _setting(False, "request no GPUs for synthetic-engine pods; they move host memory")
    synthetic_num_blocks: int = _setting(256, "KV blocks each rank of the synthetic engine allocates")
    engine_http_port: int = _setting(
        8000,
        "every engine pod's HTTP port (vLLM's API, or the routing sidecar's in front of it; the synthetic "
        "engine's API and probes)",
    )
    keys_mount_path: str = _setting("/var/run/kvbridge/keys", "where pods mount the side-channel key Secret")
    pod_networks: tuple[str, ...] = _setting(
        (),
        "the cluster's pod address ranges (CIDR, flag repeatable; the variable takes a comma-separated list): decode "
        "engines open side channels only to prefill hosts in them (KVBRIDGE_PREFILL_HOSTS); none: to any host",
        flag="--pod-network",
    )
    service_domain: str = _setting(
        "svc",
        "what follows <service>.<namespace> in the cluster's Service DNS names (svc, which pods' search path "
        "completes, or svc.cluster.local): decode engines of kvbridge's transfer open side channels only to the "
        "addresses of their deployment's prefill Service, <deployment>-prefill.<namespace>.<this> "
        "(KVBRIDGE_PREFILL_SERVICE); empty: not rendered (no Service DNS: podNetworks alone restricts them)",
    )
    namespaces: tuple[str, ...] = _setting(
        (),
        "namespace to watch (flag repeatable; the variable takes a comma-separated list); none: all namespaces",
        flag="--namespace",
    )
    api_server: str = _setting(
        "",
        "Kubernetes API URL of a local emulator (plain HTTP or unverified TLS, no credentials); empty: the "
        "kubeconfig or the in-cluster service account",
    )
    kubeconfig: str = _setting(
        "",
        "kubeconfig file for running outside a cluster; empty: KUBECONFIG, else the in-cluster service account, "
        "else ~/.kube/config",
    )
    context: str = _setting("", "kubeconfig context to use; empty: the kubeconfig's current context")
    liveness_port: int = _setting(8080, "port of the operator's /healthz; 0 disables it")
    metrics_port: int = _setting(0, "port of the operator's Prometheus /metrics; 0 disables it")

    def __post_init__(self) -> None:
        for network in self.pod_networks:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise SpecError(
                    f"pod network {network!r} is not an address range in CIDR notation (10.244.0.0/16, fd00::/8)",
                    field=ENV_PREFIX + "POD_NETWORKS",
                    code="INVALID_ENVIRONMENT",
                ) from None
        if self.service_domain and host_problem(self.service_domain):
            raise SpecError(
                f"service domain {self.service_domain!r} is not a DNS name (svc, svc.cluster.local)",
                field=ENV_PREFIX + "SERVICE_DOMAIN",
                code="INVALID_ENVIRONMENT",
            )
        self._check_engine_images()

    def _check_engine_images(self) -> None:
        """kvbridge's vLLM images must carry kvbridge: vLLM's own images are refused (api/images.py)."""
        for name in ("kvbridge_vllm_image", "kvbridge_vllm_cpu_image"):
            if lacks_connector(getattr(self, name)):
                raise SpecError(
                    f"{ENV_PREFIX}{name.upper()}={getattr(self, name)!r} is one of vLLM's own images, which do not "
                    "contain kvbridge: engines with connector KVBridge could not start from it; use kvbridge's "
                    f"engine image ({KVBRIDGE_ENGINE_REPOSITORY}) or an image of your own with kvbridge installed",
                    field=ENV_PREFIX + name.upper(),
                    code="IMAGE_LACKS_CONNECTOR",
                )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **overrides: object) -> OperatorConfig:
        values: dict[str, object] = {}
        for item in fields(cls):
            names = [item.name, *(old for old, new in RENAMED.items() if new == item.name)]
            given = next((name for name in names if ENV_PREFIX + name.upper() in environ), None)
            if given is None:
                continue
            values[item.name] = _convert(given, environ[ENV_PREFIX + given.upper()], item.type)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


#: settings' former names -> their names now: the former variables and flags are still read (deprecated; the new
#: name wins where both are given)
RENAMED = {
    "agent_image": "synthetic_image",
    "agent_num_blocks": "synthetic_num_blocks",
    "agent_http_port": "engine_http_port",
}


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
            if raw.lstrip().startswith("["):  # a JSON array: items may hold commas (sidecar arguments)
                items = json.loads(raw)
                if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
                    raise ValueError(raw)
                return tuple(items)
            return tuple(p.strip() for p in raw.split(",") if p.strip())
    except ValueError as exc:
        raise SpecError(
            f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {text}",
            field=ENV_PREFIX + name.upper(),
            code="INVALID_ENVIRONMENT",
        ) from exc
    return raw


def flag_of(item: Field[Any]) -> str:
    """The ``kvbridge operator run`` flag of a setting."""
    return str(item.metadata.get("flag") or "--" + item.name.replace("_", "-"))


def former_flags(item: Field[Any]) -> list[str]:
    """The deprecated flags of a renamed setting (``--agent-image``), still accepted."""
    return ["--" + old.replace("_", "-") for old, new in RENAMED.items() if new == item.name]


def variable_of(item: Field[Any]) -> str:
    return ENV_PREFIX + item.name.upper()


def settings() -> tuple[Field[Any], ...]:
    return fields(OperatorConfig)


def default_of(item: Field[Any]) -> Any:
    return item.default_factory() if item.default_factory is not MISSING else item.default


def from_flags(flags: object, environ: Mapping[str, str] = os.environ) -> OperatorConfig:
    """The settings from parsed ``kvbridge operator run`` flags (an attribute per setting, ``None`` when not
    given; repeatable flags as lists), the variables filling in the rest."""
    given: dict[str, object] = {}
    for item in settings():
        value = getattr(flags, item.name)
        given[item.name] = tuple(value) if isinstance(value, list) else value
    return OperatorConfig.from_env(environ, **given)
