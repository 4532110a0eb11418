"""The DisaggregatedDeployment resource (``kvbridge.io/v1alpha1``), built from the agent core's models.

These pydantic models are the one source of truth for the CRD schema; a
manifest parsed here is checked exactly as the operator checks it.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings, SpecError
from kvbridge_agent.core.model import CamelModel
from kvbridge_operator.api.autoscaling import (
    PLANNER_MIN_REPLICAS,
    PROMETHEUS_URL_INVALID,
    AutoscalingSpec,
    ScalingSpec,
)
from kvbridge_operator.api.field_errors import message_of
from kvbridge_operator.api.images import IMAGE_LACKS_CONNECTOR, lacks_connector, lacks_connector_message, overlay_image
from kvbridge_operator.api.names import API_VERSION, KIND
from kvbridge_operator.api.placement import PlacementSpec
from kvbridge_operator.api.serving import InferencePoolSpec, RouterSpec
from kvbridge_operator.api.tracing import TRACING_ENDPOINT_INVALID, TRACING_ENDPOINT_PATH, TracingSpec
from kvbridge_operator.api.transfer import TransferSpec


class EngineKind(StrEnum):
    SYNTHETIC = "Synthetic"  # kvbridge's synthetic engine worker: moves real KV bytes, serves no model
    VLLM = "VLLM"  # vLLM serving the model


#: engine kinds' former names, still accepted and read as the kind they name (``kvbridge plan`` warns of them)
DEPRECATED_KINDS = {"Agent": EngineKind.SYNTHETIC}
#: the engine kinds that load the KV connector ``spec.engine.connector`` names (with ``KVBridge`` their image must
#: carry kvbridge): what this model's check and the CRD's rule know of the kinds, which cannot ask the kinds' modules
#: (``children/engines``: each kind's ``connector``; a test keeps the two equal)
CONNECTOR_KINDS = frozenset({EngineKind.VLLM})


class EngineDevice(StrEnum):
    GPU = "GPU"  # one GPU per TP rank; the KV cache in GPU memory
    CPU = "CPU"  # CPU cores per TP rank; the KV cache in host memory (vLLM's CPU build)


class Connector(StrEnum):
    NIXL = "Nixl"  # vLLM's own NixlConnector
    KVBRIDGE = "KVBridge"  # kvbridge's KVBridgeConnector (kvbridge_agent.vllm_connector) inside vLLM


class EngineSpec(CamelModel):
    kind: EngineKind = Field(
        default=EngineKind.VLLM,
        description="VLLM (vLLM serving the model, the default) or Synthetic (kvbridge's synthetic engine worker: "
        "moves real KV bytes, serves no model; for tests and benchmarks). Agent, its former name, is read as "
        "Synthetic (deprecated).",
        json_schema_extra={"enum": [*(kind.value for kind in EngineKind), *DEPRECATED_KINDS]},
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
        default="",
        max_length=512,
        description="Container image; empty takes the operator's default per kind, connector and device. With "
        "connector KVBridge it must carry kvbridge (vLLM's own images are refused: IMAGE_LACKS_CONNECTOR).",
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

    @field_validator("kind", mode="before")
    @classmethod
    def _former_names(cls, kind: object) -> object:
        """A former name of a kind (``Agent``) is read as the kind it names."""
        return DEPRECATED_KINDS.get(kind, kind) if isinstance(kind, str) else kind


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

    @model_validator(mode="after")
    def _image_has_connector(self) -> DisaggregatedDeploymentSpec:
        """kvbridge's connector needs kvbridge in the engine's image: vLLM's own images are refused (api/images.py),
        whether spec.engine.image or a role's template overlay names them."""
        if self.engine.kind not in CONNECTOR_KINDS or self.engine.connector is not Connector.KVBRIDGE:
            return self
        named = [("spec.engine.image", self.engine.image)]
        named += [(f"spec.{r.value}.template", overlay_image(self.role(r).template)) for r in Role]
        for field, image in named:
            if image and lacks_connector(image):
                raise PydanticCustomError(
                    IMAGE_LACKS_CONNECTOR, lacks_connector_message(image, field), {"field": field}
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
OWN_CODES = frozenset(
    {
        TRACING_ENDPOINT_INVALID,
        TRACING_ENDPOINT_PATH,
        PROMETHEUS_URL_INVALID,
        PLANNER_MIN_REPLICAS,
        IMAGE_LACKS_CONNECTOR,
    }
)
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
        message = "; ".join(_said(e, document) for e in errors)
        # a check with a code of its own (TRACING_ENDPOINT_PATH, ...) raises it as the error's type
        code = errors[0]["type"] if errors[0]["type"] in OWN_CODES else "INVALID_SPEC"
        raise SpecError(message, field=_field(errors[0]), code=code) from exc


def _said(error: Any, document: object) -> str:
    """One error as the refusal says it: the field, then what is wrong (a typo with the field likely meant)."""
    return f"{_field(error)}: {message_of(DisaggregatedDeployment, error, document)}"


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
    "RoleSpec",
    "parse_deployment",
]
