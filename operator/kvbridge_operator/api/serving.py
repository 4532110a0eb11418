"""``spec.router`` and ``spec.inferencePool``: kvbridge's router (its Deployment's pods, keys and policy) and the
Gateway API InferencePool over both roles."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from kvbridge_agent.core.model import CamelModel
from kvbridge_operator.api.router_settings import DEFAULTS as ROUTER
from kvbridge_operator.api.router_settings import RouterPolicy

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
    cold_timeout_seconds: int = Field(
        default=int(ROUTER.cold_timeout),
        ge=1,
        le=3600,
        description="A pod's first call of a kind of request (completions or chat; with logprobs, prompt logprobs or "
        "a structured output): its bound instead of prefillTimeoutSeconds and, for a stream's first chunk, 60 s. An "
        "engine compiles the paths a request takes the first time (vLLM's CPU build: its first logprobs request).",
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
        "least-loaded: the pod with the fewest requests in flight; round-robin: each pod in turn.",
    )
    sign_transfers: bool = Field(
        default=False,
        description="Decode engines accept kv_transfer_params only with this router's signature (HMAC-SHA256 under "
        "a token in the Secret <name>-router-token, created once and mounted into the router and the decode pods): "
        "a pod that reaches a decode engine's port cannot hand it forged or altered parameters. Needs enabled, and "
        "engines that check it: kind Synthetic, or VLLM with connector KVBridge.",
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
