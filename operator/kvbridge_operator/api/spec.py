"""The DisaggregatedDeployment resource (``kvbridge.io/v1alpha1``), built from the agent core's models.

These pydantic models are the one source of truth for the CRD schema; a
manifest parsed here is checked exactly as the operator checks it.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvbridge_agent.core import KVBridgeError, ModelGeometry, Role, RoleSettings, SpecError, TransferSettings
from kvbridge_agent.core.model import CamelModel, joined_item_check
from kvbridge_operator.api.names import API_VERSION, KIND
from kvbridge_router.settings import DEFAULTS as ROUTER
from kvbridge_router.settings import RouterPolicy


class EngineKind(StrEnum):
    SYNTHETIC = "Agent"  # kvbridge's synthetic engine worker (runs without GPUs); the CRD's value stays "Agent"
    VLLM = "VLLM"  # vLLM with its NixlConnector


class EngineDevice(StrEnum):
    GPU = "GPU"  # one GPU per TP rank; the KV cache in GPU memory
    CPU = "CPU"  # CPU cores per TP rank; the KV cache in host memory (vLLM's CPU build)


class Connector(StrEnum):
    NIXL = "Nixl"  # vLLM's own NixlConnector
    KVBRIDGE = "KVBridge"  # kvbridge's KVBridgeConnector (kvbridge_agent.vllm_connector) inside vLLM


class EngineSpec(CamelModel):
    kind: EngineKind = Field(
        default=EngineKind.VLLM,
        description="VLLM (vLLM serving the model, the default) or Agent (kvbridge's synthetic engine worker: moves "
        "real KV bytes, serves no model; for tests and benchmarks).",
    )
    device: EngineDevice = Field(
        default=EngineDevice.GPU,
        description="GPU, or CPU (vLLM's CPU build: no GPUs requested, the KV cache in host memory, CPU attention).",
    )
    connector: Connector = Field(
        default=Connector.NIXL,
        description="VLLM only: the KV connector, vLLM's Nixl or kvbridge's KVBridge (CURVE side channel, leases "
        "in the transfer parameters, stale-peer recovery; the image must have kvbridge installed).",
    )
    image: str = Field(
        default="", max_length=512, description="Container image; empty takes the default per kind and device."
    )
    extra_args: list[str] = Field(
        default_factory=list, max_length=64, description="VLLM only: arguments appended to `vllm serve`."
    )
    cpu_kv_cache_gib: int = Field(
        default=4,
        alias="cpuKVCacheGiB",
        ge=1,
        le=4096,
        description="VLLM on CPU: host memory for the KV cache in GiB (VLLM_CPU_KVCACHE_SPACE).",
    )


class RolloutSpec(CamelModel):
    max_surge: int = Field(
        default=1, ge=0, le=1024, description="Extra pods of the role while it rolls in place (new before old goes)."
    )
    max_unavailable: int = Field(
        default=0, ge=0, le=1024, description="Pods of the role's count that may be missing while it rolls in place."
    )

    @model_validator(mode="after")
    def _moves(self) -> RolloutSpec:
        if self.max_surge + self.max_unavailable < 1:
            raise ValueError("maxSurge + maxUnavailable must be at least 1, or a rollout could never move")
        return self


#: the most nodes one engine may span (``spec.<role>.nodes``)
MAX_NODES = 64


class RoleSpec(RoleSettings):
    """One role (prefill or decode): how many engines and each engine's settings."""

    replicas: int = Field(
        default=1,
        ge=0,
        le=1024,
        description="Engine instances of this role: the initial count of the role's DisaggregatedRole (its /scale, "
        "which autoscalers and `kubectl scale` change); changing it here sets that count again.",
    )
    min_replicas: int = Field(
        default=1,
        ge=0,
        le=1024,
        description="Fewest engines the operator runs, whatever is asked (default 1). 0 lets an autoscaler of your "
        "own stop the role; kvbridge's planner (spec.autoscaling) refuses 0: nothing brings a role back from 0.",
    )
    max_replicas: int = Field(
        default=1024, ge=0, le=1024, description="Most engines the operator runs, whatever is asked."
    )
    nodes: int = Field(
        default=1,
        ge=1,
        le=MAX_NODES,
        description="Nodes one engine of this role spans (VLLM on GPUs): 1, a pod per engine (StatefulSet); more, "
        "a LeaderWorkerSet group of this many pods per engine, each holding tensorParallelSize / nodes GPUs "
        "(vLLM's multi-node launch: --nnodes, --node-rank, workers --headless).",
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        description="How the role rolls in place when old and new pods of both roles are compatible (else blue/green).",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="VLLM only: arguments appended to `vllm serve` for this role's engines, after "
        "spec.engine.extraArgs; checked like them.",
    )
    template: dict[str, Any] = Field(
        default_factory=dict,
        description="Optional PodTemplateSpec overlay (image, resources, nodeSelector, tolerations, sidecars, ...); "
        "what kvbridge renders from the checked plan (the engine's command, args, managed env and ports, kvbridge "
        "labels, GPUs) may not be overridden.",
    )

    def settings(self) -> RoleSettings:
        """The settings that the compatibility rules look at."""
        return RoleSettings.model_validate(
            {name: getattr(self, name) for name in RoleSettings.model_fields}, by_name=True
        )


class RatioBound(CamelModel):
    min: float | None = Field(default=None, ge=0, le=1024, description="Fewest decode engines per prefill engine.")
    max: float | None = Field(default=None, gt=0, le=1024, description="Most decode engines per prefill engine.")

    @model_validator(mode="after")
    def _ordered(self) -> RatioBound:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        return self


class ScalingSpec(CamelModel):
    decode_per_prefill: RatioBound | None = Field(
        default=None,
        description="Bounds on decode engines per prefill engine, kept when either role scales: the operator raises "
        "the other role (never lowers what an autoscaler asked), within its maxReplicas.",
    )


class LatencyTarget(CamelModel):
    """A latency objective: this percentile of requests at or under ``milliseconds``."""

    milliseconds: float = Field(gt=0, le=600_000, description="The target, in milliseconds.")
    percentile: float = Field(
        default=95, ge=50, le=99.9, description="The percentile held to the target (50 to 99.9; default 95)."
    )


class ConfigMapKeyRef(CamelModel):
    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    key: str = Field(default="profile.json", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")


PROMETHEUS_URL_INVALID = "PROMETHEUS_URL_INVALID"
PLANNER_MIN_REPLICAS = "PLANNER_MIN_REPLICAS"
#: a Prometheus server's base URL: http(s)://HOST[:PORT][/PATH], HOST a DNS name, an IPv4 or a bracketed IPv6
#: address; no user or password, query or fragment; or empty (the planner off)
PROMETHEUS_URL_PATTERN = (
    r"^(https?://([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?(/[-A-Za-z0-9_.~/%]*)?)?$"
)


class AutoscalingSpec(CamelModel):
    """kvbridge's planner (docs/autoscaling.md): both roles sized to TTFT and ITL targets, through their /scale."""

    # it writes the roles' /scale as an autoscaler does, so minReplicas, maxReplicas and spec.scaling.decodePerPrefill
    # still bound what runs

    enabled: bool = Field(default=False, description="Run the planner for this deployment (off by default).")
    prometheus_url: str = Field(
        default="",
        max_length=2048,
        pattern=PROMETHEUS_URL_PATTERN,
        description="The Prometheus server whose HTTP API the planner queries (e.g. "
        "http://prometheus.monitoring:9090): http(s)://HOST[:PORT][/PATH], no user, password, query or fragment. "
        "The operator sends GET PATH/api/v1/query to it from its own pod, so whoever may create a "
        "DisaggregatedDeployment can make the operator send such GETs anywhere its pod reaches: restrict the "
        "operator's egress (docs/autoscaling.md).",
    )
    ttft: LatencyTarget | None = Field(default=None, description="Time to first token, as the router's clients see it.")
    itl: LatencyTarget | None = Field(default=None, description="Inter-token latency on decode.")
    profile: ConfigMapKeyRef | None = Field(
        default=None,
        description="The ConfigMap key holding the engines' performance profile (JSON; docs/autoscaling.md).",
    )
    interval_seconds: int = Field(default=30, ge=5, le=3600, description="How often the planner decides.")
    headroom_percent: int = Field(
        default=0,
        ge=0,
        le=400,
        description="Capacity over the predicted demand, in percent: bursts arrive faster than new engines start "
        "(docs/autoscaling.md measures what it buys).",
    )
    window_seconds: int = Field(
        default=60,
        ge=5,
        le=3600,
        description="The window the planner reads rates and latency percentiles over: at least four of "
        "Prometheus' scrape intervals.",
    )
    stabilization_window_seconds: int = Field(
        default=300,
        ge=0,
        le=86_400,
        description="A role is scaled down only to the largest size recommended over this window (scale-ups act "
        "at once), as HPA's scale-down stabilization.",
    )

    @field_validator("prometheus_url", mode="before")
    @classmethod
    def _prometheus_url(cls, url: object) -> object:
        """Refused with a code of its own, before the pattern's generic message."""
        if isinstance(url, str) and not re.fullmatch(PROMETHEUS_URL_PATTERN, url):
            raise PydanticCustomError(
                PROMETHEUS_URL_INVALID,
                "{url} is not a Prometheus URL the planner may query: write http(s)://HOST[:PORT][/PATH] (e.g. "
                "http://prometheus.monitoring:9090); no user or password, query or fragment",
                {"url": repr(url[:80])},
            )
        return url

    @model_validator(mode="after")
    def _complete(self) -> AutoscalingSpec:
        if self.enabled:
            missing = [
                name
                for name, value in (
                    ("prometheusUrl", self.prometheus_url),
                    ("ttft", self.ttft),
                    ("itl", self.itl),
                    ("profile", self.profile),
                )
                if not value
            ]
            if missing:
                raise ValueError(
                    f"enabled needs {', '.join(missing)}: the planner reads Prometheus, sizes to both targets and "
                    "needs the engines' performance profile (docs/autoscaling.md)"
                )
        return self


#: hf://ORG/NAME[@REVISION] (a branch, tag or commit) or pvc://CLAIM/PATH, or empty
SOURCE_PATTERN = (
    r"^(hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*(@[-A-Za-z0-9_./]{1,128})?"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[-A-Za-z0-9_][-A-Za-z0-9_.]*)*/?)?$"  # no segment starts with "."
)


class SecretKeyRef(CamelModel):
    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    key: str = Field(default="HF_TOKEN", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")


class ModelCache(CamelModel):
    claim_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="A PersistentVolumeClaim (ReadWriteMany, so every pod of both roles mounts it) where "
        "downloaded weights are kept (HF_HOME): each pod downloads only what the cache lacks.",
    )


class ModelSpec(ModelGeometry):
    """The model's geometry (what the compatibility rules look at) and where its weights come from."""

    source: str = Field(
        default="",
        max_length=512,
        pattern=SOURCE_PATTERN,
        description="Where the weights come from: hf://ORG/NAME@REVISION (Hugging Face, pinned to a branch, tag or "
        "commit) or pvc://CLAIM/PATH (a PersistentVolumeClaim, mounted read-only). Empty: name is what the engine "
        "loads. Part of the pairing key: pods of two revisions are never paired (their weights differ).",
    )
    token_secret: SecretKeyRef | None = Field(
        default=None, description="A Secret key holding a Hugging Face token (HF_TOKEN) for gated or private models."
    )
    cache: ModelCache | None = Field(default=None, description="A shared cache of downloaded weights.")

    @model_validator(mode="after")
    def _source_needs(self) -> ModelSpec:
        if (self.token_secret or self.cache) and not self.source.startswith("hf://"):
            raise ValueError("tokenSecret and cache are for downloads: set source to hf://ORG/NAME@REVISION")
        return self


#: a DNS subdomain (RFC 1123): Secret and PriorityClass names
SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


class LocalObjectReference(CamelModel):
    name: str = Field(min_length=1, max_length=253, pattern=SUBDOMAIN_PATTERN)


class TolerationOperator(StrEnum):
    EQUAL = "Equal"
    EXISTS = "Exists"


class TaintEffect(StrEnum):
    ANY = ""  # every effect
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Toleration(CamelModel):
    """A pod toleration, as Kubernetes writes it."""

    key: str = Field(default="", max_length=316, description="The taint's key; empty with Exists: every taint.")
    operator: TolerationOperator = Field(default=TolerationOperator.EQUAL, description="Equal or Exists.")
    value: str = Field(default="", max_length=63, description="Equal: the taint's value; Exists: none.")
    effect: TaintEffect = Field(default=TaintEffect.ANY, description="The taint's effect; empty: every effect.")
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="NoExecute: how long the pod stays bound after the taint appears."
    )

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if self.operator is TolerationOperator.EXISTS and self.value:
            raise ValueError("a toleration with operator Exists takes no value: drop value, or use operator Equal")
        if self.operator is TolerationOperator.EQUAL and not self.key:
            raise ValueError("a toleration with operator Equal needs a key: set key, or use operator Exists")
        return self


class ApiKeySecret(CamelModel):
    name: str = Field(
        min_length=1, max_length=253, pattern=SUBDOMAIN_PATTERN, description="A Secret of the deployment's namespace."
    )
    key: str = Field(
        default="api-keys",
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="The Secret's key holding the API keys, one a line.",
    )


class RouterSpec(CamelModel):
    enabled: bool = Field(default=False, description="Run kvbridge's router (a Deployment and a Service).")
    replicas: int = Field(default=1, ge=1, le=64)
    image: str = Field(default="", max_length=512, description="Empty: the operator's router image.")
    resources: dict[str, Any] = Field(
        default_factory=dict, description="The router container's resources (default: 500m CPU, 256Mi memory)."
    )
    prefill_timeout_seconds: int = Field(
        default=int(ROUTER.prefill_timeout), ge=1, le=3600, description="Per prefill call."
    )
    decode_timeout_seconds: int = Field(
        default=int(ROUTER.decode_timeout), ge=1, le=86400, description="Per decode answer."
    )
    prefill_attempts: int = Field(
        default=ROUTER.prefill_attempts, ge=1, le=16, description="Prefill pods tried per request."
    )
    policy: RouterPolicy = Field(
        default=ROUTER.policy,
        description="kv-aware: send a request to the prefill and decode pods that were sent the longest leading part "
        "of its prompt (their prefix caches), unless they are busier than the least loaded by more than 2 requests; "
        "least-loaded: the pod with the fewest requests in flight.",
    )
    sign_transfers: bool = Field(
        default=False,
        description="Decode engines accept kv_transfer_params only with this router's signature (HMAC-SHA256 under "
        "a token in the Secret <name>-router-token, created once and mounted into the router and the decode pods): "
        "a pod that reaches a decode engine's port cannot hand it forged or altered parameters. Needs enabled, and "
        "engines that check it: kind Agent, or VLLM with connector KVBridge.",
    )
    api_key_secret: ApiKeySecret | None = Field(
        default=None,
        description="Clients must authenticate: /v1/ requests carry one of the API keys this Secret's key holds (one "
        "a line) as 'Authorization: Bearer KEY', else 401 before any engine is called; /health and /metrics stay "
        "open. The Secret is mounted into the router's pods and read again when it changes. Needs enabled. Unset: "
        "no authentication.",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16, description="The router pods' imagePullSecrets."
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="The router pods' nodeSelector.")
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=64, description="The router pods' tolerations."
    )
    affinity: dict[str, Any] = Field(
        default_factory=dict, description="The router pods' affinity (nodeAffinity, podAffinity, podAntiAffinity)."
    )
    priority_class_name: str = Field(
        default="",
        max_length=253,
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$",
        description="The router pods' PriorityClass; empty: the cluster's default.",
    )

    @field_validator("sign_transfers")
    @classmethod
    def _signed_by_the_router(cls, sign: bool, info: ValidationInfo) -> bool:
        if sign and not info.data.get("enabled", False):
            raise ValueError(
                "signTransfers needs kvbridge's router, which signs what decode is handed: set router.enabled: true, "
                "or signTransfers: false"
            )
        return sign

    @field_validator("api_key_secret")
    @classmethod
    def _keys_for_the_router(cls, secret: ApiKeySecret | None, info: ValidationInfo) -> ApiKeySecret | None:
        if secret is not None and not info.data.get("enabled", False):
            raise ValueError(
                "apiKeySecret authenticates clients of kvbridge's router: set router.enabled: true, or drop "
                "apiKeySecret"
            )
        return secret


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


class InferencePoolSpec(CamelModel):
    enabled: bool = Field(
        default=False,
        description="Render a Gateway API Inference Extension InferencePool over both roles' pods "
        "(labelled llm-d.ai/role prefill or decode, for llm-d's P/D scheduler).",
    )
    endpoint_picker: str = Field(
        default="",
        max_length=253,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
        description="The Endpoint Picker's Service (e.g. llm-d's inference scheduler), installed separately.",
    )
    endpoint_picker_port: int = Field(default=9002, ge=1, le=65535, description="The Endpoint Picker's gRPC port.")
    gateway: str = Field(
        default="",
        max_length=253,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
        description="A Gateway of the namespace: an HTTPRoute from it to the pool is rendered too. Empty: none.",
    )

    @model_validator(mode="after")
    def _picker(self) -> InferencePoolSpec:
        if self.enabled and not self.endpoint_picker:
            raise ValueError("endpointPicker must name the Endpoint Picker's Service when the pool is enabled")
        return self


class Colocation(StrEnum):
    NONE = "None"  # no constraint between the roles
    PREFERRED = "Preferred"  # the scheduler tries to keep prefill and decode pods in one domain
    REQUIRED = "Required"  # a pod is scheduled only into the domain where the deployment's pods already run


class GangSpec(CamelModel):
    """All-or-nothing scheduling through the coscheduling plugin of Kubernetes' scheduler-plugins (SIG
    Scheduling): a PodGroup per deployment, both roles' pods labelled into it."""

    scheduler_name: str = Field(
        default="scheduler-plugins-scheduler",
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="The scheduler that runs the coscheduling plugin (scheduler-plugins' chart names its second "
        "scheduler so).",
    )
    min_member: int | None = Field(
        default=None,
        ge=2,
        le=2048,
        description="Pods that must be schedulable together before any is bound. Unset: every pod of the spec's "
        "engines, replicas x nodes of both roles (prefill GPUs are not taken while decode cannot be placed).",
    )
    schedule_timeout_seconds: int = Field(default=300, ge=1, le=86400, description="How long a gang may wait.")


class PlacementSpec(CamelModel):
    gpus_per_node: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="GPUs one node offers. A role's engine takes tensorParallelSize GPUs in one pod, so a larger "
        "TP can never be scheduled: the verdict refuses it (ROLE_DOES_NOT_FIT). Unset: the operator's gpusPerNode "
        "(the chart's gpu.perNode), else not checked.",
    )
    topology_key: str = Field(
        default="",
        max_length=316,
        pattern=r"^([-A-Za-z0-9_./]*)$",
        description="A node label naming the domain prefill and decode should share (a rack, an NVLink domain, a "
        "zone: e.g. topology.kubernetes.io/zone). Needed by colocation.",
    )
    colocation: Colocation = Field(
        default=Colocation.NONE,
        description="Keep the deployment's prefill and decode pods in one topologyKey domain: Preferred "
        "(scheduler's preference) or Required (pod affinity; pods wait rather than land elsewhere).",
    )
    spread_replicas: bool = Field(
        default=False, description="Spread each role's pods over nodes (one per node where it can)."
    )
    gang: GangSpec | None = Field(default=None, description="Gang scheduling of both roles' pods (coscheduling).")

    @model_validator(mode="after")
    def _domain(self) -> PlacementSpec:
        if self.colocation is not Colocation.NONE and not self.topology_key:
            raise ValueError("colocation needs topologyKey: the node label whose value names the shared domain")
        return self


class Memlock(StrEnum):
    UNCHECKED = "Unchecked"  # the container runtime's locked-memory limit, whatever it is
    REQUIRED = "Required"  # the engine starts only under an unlimited hard limit (RDMA registers pinned memory)


UCX_TRANSPORT_PATTERN = r"^\^?[A-Za-z0-9_]+(:[A-Za-z0-9_]+)?$"
#: one UCX transport (rc, ^ud, cuda_copy, ...)
UCXTransport = Annotated[
    str,
    Field(min_length=1, max_length=32, pattern=UCX_TRANSPORT_PATTERN),
    BeforeValidator(joined_item_check(UCX_TRANSPORT_PATTERN, 32, "a UCX transport's name")),
]
UCX_DEVICE_PATTERN = r"^\^?[A-Za-z0-9][A-Za-z0-9_.:-]*$"
#: one UCX network device (mlx5_0:1, eth0, ...)
UCXDevice = Annotated[
    str,
    Field(min_length=1, max_length=64, pattern=UCX_DEVICE_PATTERN),
    BeforeValidator(joined_item_check(UCX_DEVICE_PATTERN, 64, "a UCX device's name")),
]
#: one Multus network: [namespace/]name[@interface] (a DNS label, a DNS subdomain, a Linux interface name)
SECONDARY_NETWORK_PATTERN = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9.]*[a-z0-9])?(@[A-Za-z0-9_.-]{1,15})?$"
SECONDARY_NETWORK_MAX_LENGTH = 63 + 1 + 253 + 16
SecondaryNetwork = Annotated[
    str,
    Field(min_length=1, max_length=SECONDARY_NETWORK_MAX_LENGTH, pattern=SECONDARY_NETWORK_PATTERN),
    BeforeValidator(
        joined_item_check(
            SECONDARY_NETWORK_PATTERN, SECONDARY_NETWORK_MAX_LENGTH, "a Multus network ([namespace/]name[@interface])"
        )
    ),
]


class KVBufferDevice(StrEnum):
    """Where NIXL moves the KV cache from and to (vLLM's ``kv_buffer_device``, in vLLM's words)."""

    CUDA = "cuda"  # the KV cache in GPU memory, read and written in place: nodes with GPUDirect RDMA
    CPU = "cpu"  # a host buffer: the KV staged through host memory, for nodes without GPUDirect RDMA


class NetworkSpec(CamelModel):
    """What the KV data path needs between nodes on GPUs (vLLM's NixlConnector guide: UCX transports and devices;
    RDMA NICs as extended resources; pinned memory): rendered on the engine pods of both connectors."""

    ucx_transports: list[UCXTransport] = Field(
        default_factory=list,
        max_length=32,
        description="UCX_TLS: the UCX transports, in UCX's names (rc, ud, dc, tcp, sm, cuda_copy, cuda_ipc, "
        "gdr_copy, ... ; ^name excludes one). Empty: UCX chooses (all). A list that cannot reach another node "
        "is refused unless placement keeps both roles on one node.",
    )
    ucx_devices: list[UCXDevice] = Field(
        default_factory=list,
        max_length=64,
        description="UCX_NET_DEVICES: the devices UCX may use (e.g. mlx5_0:1). Empty: all.",
    )
    rdma_resources: dict[str, int] = Field(
        default_factory=dict,
        max_length=16,
        description="Extended resources each engine pod requests (and limits), e.g. rdma/ib: 1 or "
        "nvidia.com/hostdev: 8: what the RDMA device plugin advertises.",
    )
    ipc_lock: bool = Field(
        default=False, description="Add the IPC_LOCK capability to the engine container (RDMA memory registration)."
    )
    memlock: Memlock = Field(
        default=Memlock.UNCHECKED,
        description="Required: the engine container checks at start that its locked-memory hard limit is "
        "unlimited, raises the soft limit to it, and exits naming the fix if not (Kubernetes cannot set ulimits: "
        "the container runtime's default applies).",
    )
    kv_buffer_device: KVBufferDevice | None = Field(
        default=None,
        description="VLLM only: vLLM's kv_buffer_device, where NIXL moves the KV cache from and to. cuda: the KV "
        "cache in GPU memory, read in place (nodes with GPUDirect RDMA); cpu: a host buffer, the KV staged through "
        "host memory (GPU nodes without GPUDirect RDMA, and vLLM's CPU build). Unset: cuda on GPUs, cpu on CPUs.",
    )
    secondary_networks: list[SecondaryNetwork] = Field(
        default_factory=list,
        max_length=16,
        description="Multus networks to attach the engine pods to (k8s.v1.cni.cncf.io/networks), e.g. an RDMA "
        "network: [namespace/]name.",
    )

    @property
    def configured(self) -> bool:
        return self != NetworkSpec()


class TransferSpec(TransferSettings):
    """The agent's transfer settings, the network the data path runs on, and how long a terminating engine
    drains."""

    network: NetworkSpec = Field(default_factory=NetworkSpec, description=NetworkSpec.__doc__ or "")
    drain_seconds: int = Field(
        default=30,
        ge=0,
        le=3600,
        description="How long a terminating engine may finish the requests it has (vLLM: --shutdown-timeout). "
        "The pod's grace period adds the wait for routers to stop sending to it and, on a prefill pod that "
        "exports what it holds, for decode to read its KV (at most leaseSeconds).",
    )


class DisaggregatedDeploymentSpec(CamelModel):
    engine: EngineSpec = Field(default_factory=EngineSpec)
    model: ModelSpec
    transfer: TransferSpec = Field(default_factory=TransferSpec)
    prefill: RoleSpec = Field(default_factory=RoleSpec)
    decode: RoleSpec = Field(default_factory=RoleSpec)
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    inference_pool: InferencePoolSpec = Field(default_factory=InferencePoolSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    tracing: TracingSpec | None = Field(
        default=None, description="OpenTelemetry traces of every request; unset: off (no spans, no exporter)."
    )

    @model_validator(mode="after")
    def _bounds(self) -> DisaggregatedDeploymentSpec:
        for name in ("prefill", "decode"):
            role: RoleSpec = getattr(self, name)
            if not role.min_replicas <= role.replicas <= role.max_replicas:
                raise ValueError(
                    f"{name}: replicas {role.replicas} must lie within minReplicas {role.min_replicas} and "
                    f"maxReplicas {role.max_replicas}"
                )
        return self

    @model_validator(mode="after")
    def _planner_floor(self) -> DisaggregatedDeploymentSpec:
        """The planner cannot bring a role back from 0 (with decode at 0 the series it reads are gone, and nothing
        scales from zero): with it on, neither role's minimum may be 0."""
        if not self.autoscaling.enabled:
            return self
        for name in ("prefill", "decode"):
            if getattr(self, name).min_replicas < 1:
                raise PydanticCustomError(
                    PLANNER_MIN_REPLICAS,
                    "0 lets the planner (spec.autoscaling.enabled) scale this role to 0 when idle, and nothing "
                    "brings it back: set minReplicas: 1 or more; scale from zero is not supported",
                    {"field": f"spec.{name}.minReplicas"},
                )
        return self

    def role(self, role: Role) -> RoleSpec:
        """The settings of one role."""
        return self.prefill if role is Role.PREFILL else self.decode


#: a deployment's name must make valid children: ``<name>-prefill`` is a Service (a DNS-1035 label: a letter
#: first, no dots) and a StatefulSet, whose pods carry ``controller-revision-hash: <name>-prefill-<10 chars>``,
#: a label value of at most 63 characters; so at most 63 - 11 - len("-prefill") = 44 characters
MAX_NAME_LENGTH = 44
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class ObjectMeta(CamelModel):
    model_config = CamelModel.model_config | {"extra": "allow"}

    name: str = Field(min_length=1, max_length=253)
    namespace: str | None = None

    @field_validator("name")
    @classmethod
    def _child_names_fit(cls, name: str) -> str:
        if len(name) > MAX_NAME_LENGTH or not re.match(NAME_PATTERN, name):
            raise ValueError(
                f"{name[:64]!r} cannot name the deployment's children ({name[:64]}-prefill Services and "
                f"StatefulSets): use at most {MAX_NAME_LENGTH} lower-case letters, digits and '-', starting with a "
                "letter and ending with a letter or digit"
            )
        return name


class DisaggregatedDeployment(CamelModel):
    api_version: Literal["kvbridge.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["DisaggregatedDeployment"]
    metadata: ObjectMeta
    spec: DisaggregatedDeploymentSpec


def _location(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc)


#: how deeply a manifest may nest, the root being level 1 (a DisaggregatedDeployment with a pod template overlay
#: needs about 15); ``kvbridge plan`` reads YAML with the same bound
MAX_DEPTH = 64
NESTING_TOO_DEEP = "NESTING_TOO_DEEP"
#: the codes of the model's own checks (raised as PydanticCustomError of that type); any other is INVALID_SPEC
OWN_CODES = frozenset({TRACING_ENDPOINT_INVALID, TRACING_ENDPOINT_PATH, PROMETHEUS_URL_INVALID, PLANNER_MIN_REPLICAS})
#: the leading steps of a path that nests too deeply that its refusal names (the path goes on below them)
_NAMED_STEPS = 12


def nesting_error(document: object, limit: int = MAX_DEPTH) -> SpecError | None:
    """A refusal naming where ``document`` nests deeper than ``limit`` levels (each map, list and value a level,
    as the YAML reader counts them), else None.

    Walked with an explicit stack, so input of any depth (the API server stores JSON up to 10,000 levels deep)
    is refused here, before it reaches code that recurses once per level: JSON encoding, validation, the template
    merge, all of which would raise RecursionError instead."""
    stack: list[tuple[object, tuple[int | str, ...]]] = [(document, ())]
    while stack:
        value, path = stack.pop()
        if len(path) >= limit:
            named = _location(path[:_NAMED_STEPS]) + ("..." if len(path) > _NAMED_STEPS else "")
            return SpecError(
                f"{named} nests deeper than {limit} levels (a DisaggregatedDeployment, pod template overlay "
                "included, needs about 15): nothing Kubernetes or kvbridge reads there is that deep; write the "
                "value flatter",
                field=named,
                code=NESTING_TOO_DEEP,
            )
        children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        stack.extend((child, (*path, key)) for key, child in children)
    return None


def parse_deployment(document: object) -> DisaggregatedDeployment:
    """Parse one manifest, or raise :class:`SpecError` naming the first bad field."""
    if not isinstance(document, dict):
        raise SpecError(f"expected a mapping, got {type(document).__name__}", code="NOT_A_MAPPING")
    too_deep = nesting_error(document)
    if too_deep is not None:
        raise too_deep
    if document.get("apiVersion") != API_VERSION or document.get("kind") != KIND:
        raise SpecError(
            f"expected apiVersion {API_VERSION} and kind {KIND}, got apiVersion "
            f"{document.get('apiVersion')!r} and kind {document.get('kind')!r}",
            field="kind",
            code="WRONG_KIND",
        )
    resource = {key: document[key] for key in ("apiVersion", "kind", "metadata", "spec") if key in document}
    try:
        text = json.dumps(resource)
    except (TypeError, ValueError) as exc:  # YAML dates, sets, ...: nothing the API server would accept either
        raise SpecError(f"the manifest holds a value JSON cannot represent: {exc}", code="INVALID_SPEC") from exc
    try:
        # strict, as the API server's schema is: 2.0, "2" and true are not integers; status is the operator's
        return DisaggregatedDeployment.model_validate_json(text, strict=True)
    except ValidationError as exc:
        errors = exc.errors()
        message = "; ".join(f"{_field(e)}: {e['msg']}" for e in errors)
        # a check with a code of its own (TRACING_ENDPOINT_PATH, ...) raises it as the error's type
        code = errors[0]["type"] if errors[0]["type"] in OWN_CODES else "INVALID_SPEC"
        raise SpecError(message, field=_field(errors[0]), code=code) from exc


def _field(error: Any) -> str:
    """The field an error is about: where it was raised, or the field a check of several fields names in its
    context (PLANNER_MIN_REPLICAS)."""
    named = (error.get("ctx") or {}).get("field") if error["type"] in OWN_CODES else None
    return named if isinstance(named, str) else _location(error["loc"])


__all__ = [
    "DisaggregatedDeployment",
    "DisaggregatedDeploymentSpec",
    "EngineDevice",
    "EngineKind",
    "EngineSpec",
    "KVBridgeError",
    "KVBufferDevice",
    "RoleSpec",
    "TracingProtocol",
    "TracingSpec",
    "parse_deployment",
]
