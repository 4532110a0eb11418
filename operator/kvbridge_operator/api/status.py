"""The DisaggregatedDeployment status: models (part of the CRD schema) and conditions.

Conditions are a list map keyed by ``type``; ``lastTransitionTime`` changes
only when a condition's status flips.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from kvbridge_agent.core import Role
from kvbridge_agent.core.model import CamelModel


# the conditions' types, stable (docs/operator.md, "Conditions"): Available while the deployment serves (a ready
# prefill and decode pod that pair), Ready once every replica of both roles is ready as well
class ConditionType(StrEnum):
    COMPATIBLE = "Compatible"
    PREFILL_READY = "PrefillReady"
    DECODE_READY = "DecodeReady"
    AVAILABLE = "Available"
    READY = "Ready"


class Condition(CamelModel):
    type: ConditionType
    status: str = Field(pattern="^(True|False|Unknown)$")
    reason: str = Field(default="", max_length=128)
    message: str = Field(default="", max_length=32768)
    observed_generation: int = Field(default=0, ge=0)
    last_transition_time: str = Field(default="", description="RFC 3339; changes only when status flips.")


class ServingEndpoint(CamelModel):
    """A ready engine's HTTP address, as routers use it."""

    pod: str
    ip: str
    http_port: int | None = Field(
        default=None, ge=1, le=65535, description="The pod's HTTP port (engine API, or the routing sidecar in front)."
    )
    pairing: str = Field(
        default="",
        description="The pod's pairing key: a router pairs it only with pods of the other role whose key "
        "is equal or listed with it in status.rollout.pairings.",
    )
    revision: str = Field(
        default="", description="The pod's template revision (kvbridge.io/revision): old or new during a rollout."
    )
    incarnation: str = Field(
        default="",
        max_length=128,
        description="The pod's uid and its containers' restarts (uid:restarts): another value under the same name "
        "is another engine, its caches empty (routers forget what they sent it).",
    )


class DataParallelRank(CamelModel):
    """One data-parallel rank of a prefill engine: a KV peer of its own."""

    rank: int = Field(ge=0, description="The DP rank (vLLM's data_parallel_index).")
    port: int = Field(ge=1, le=65535, description="Its side channel's port: base port + rank.")
    engine_id: str = Field(
        default="",
        description="Its engine id, <pod>_dp<rank> (kvbridge's connector, the agent); empty with vLLM's "
        "NixlConnector, which draws a new one on every start (the transfer parameters carry it).",
    )
    pod: str = Field(default="", description="The worker pod it runs in, when not the endpoint's own (DP over nodes).")
    ip: str = Field(default="", description="That worker pod's address; empty: the endpoint's own ip.")


class Endpoint(ServingEndpoint):
    """A prefill engine's side-channel endpoint, as decode agents and routers use it."""

    port: int = Field(ge=1, le=65535, description="The side channel's port (data-parallel rank 0's).")
    ranks: int = Field(ge=1, description="TP ranks served by this endpoint (by each DP rank's side channel).")
    fingerprint: str
    data_parallel_ranks: list[DataParallelRank] | None = Field(
        default=None,
        description="With spec.prefill.dataParallelSize above 1: every DP rank's side channel (each a KV peer with "
        "its own KV cache); absent with one.",
    )

    @model_serializer(mode="wrap")
    def _absent_with_one_rank(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Left out, not null, for a pod of one data-parallel rank: its status is what it was before DP existed."""
        dumped: dict[str, Any] = handler(self)
        if self.data_parallel_ranks is None:
            dumped.pop("dataParallelRanks", None)
            dumped.pop("data_parallel_ranks", None)
        return dumped


class RoleStatus(CamelModel):
    desired_replicas: int = Field(
        default=0, ge=0, description="What the role's DisaggregatedRole asks (an autoscaler, kubectl scale, the spec)."
    )
    replicas: int = Field(default=0, ge=0, description="Engines run: desired within the bounds and the ratio.")
    ready_replicas: int = Field(default=0, ge=0)
    updated_replicas: int = Field(default=0, ge=0)
    ready: str = Field(default="", max_length=32, description="readyReplicas/replicas, for the printer column.")


class PrefillStatus(RoleStatus):
    endpoints: list[Endpoint] | None = Field(default=None, description="Ready prefill engines: side channel and HTTP.")


class DecodeStatus(RoleStatus):
    endpoints: list[ServingEndpoint] | None = Field(default=None, description="Ready decode engines' HTTP addresses.")


class RouterStatus(CamelModel):
    url: str = Field(default="", description="The router's Service URL inside the cluster (OpenAI-compatible API).")
    peers: str = Field(
        default="",
        description="Two or more replicas: the headless Service (and Secret) of their reports to each other.",
    )


class InferencePoolStatus(CamelModel):
    name: str = Field(default="", description="The InferencePool rendered for the deployment's pods.")
    http_route: str = Field(default="", description="The HTTPRoute from spec.inferencePool.gateway, if any.")
    message: str = Field(default="", max_length=1024, description="Why they could not be made, when not.")


class PlanSummary(CamelModel):
    tp_ratio: int
    block_size_ratio: int = Field(ge=1)
    reads_per_decode_rank: int = Field(ge=0)
    notifications_per_prefill_rank: int = Field(ge=1)
    wire_block_size: int = Field(ge=1)
    wire_layout: str
    conversions: list[dict[str, str | int]] = Field(default_factory=list)
    descriptors_per_block: int = Field(ge=0)
    prefill_prefix_caching_allowed: bool = True


class Pairing(CamelModel):
    prefill: str = Field(description="A prefill pod's pairing key.")
    decode: str = Field(description="A decode pod's pairing key checked compatible with it.")


class RolloutStatus(CamelModel):
    strategy: str = Field(default="", description="InPlace (old and new pods of both roles compatible) or BlueGreen.")
    phase: str = Field(
        default="",
        description="Complete, RollingPrefill, RollingDecode, SurgingPrefill, "
        "SurgingDecode, RetiringDecode, RetiringPrefill or ScalingIn.",
    )
    revision: str = Field(default="", description="The pairing key being rolled out (the spec's).")
    reason: str = Field(default="", max_length=4096, description="Why not in place, when blue/green.")
    prefill: str = Field(default="", max_length=64, description="Prefill progress.")
    decode: str = Field(default="", max_length=64, description="Decode progress.")
    pairings: list[Pairing] = Field(
        default_factory=list,
        description="Every pair of pairing keys present that the operator checked compatible: a router pairs a "
        "prefill and a decode pod only when their keys are listed together.",
    )


class PlacementStatus(CamelModel):
    pod_group: str = Field(default="", description="The PodGroup of spec.placement.gang.")
    message: str = Field(default="", max_length=1024, description="Why it could not be made, when not.")


class Advisory(CamelModel):
    """Something the engines run other than the spec asks, without the spec being refused for it."""

    code: str = Field(max_length=128, description="A stable code (docs/troubleshooting.md).")
    field: str = Field(max_length=256, description="The spec field the advisory is about.")
    message: str = Field(max_length=8192, description="What runs instead, and the fix.")


class PlannedSize(CamelModel):
    at: float = Field(description="When it was recommended (Unix seconds).")
    prefill: int = Field(ge=0)
    decode: int = Field(ge=0)


class SizeChange(CamelModel):
    at: float = Field(description="When the planner changed the role's size (Unix seconds).")
    direction: Literal["up", "down"]


class AutoscalingStatus(CamelModel):
    """What kvbridge's planner (spec.autoscaling) saw and decided on its last pass (written by the planner alone)."""

    state: str = Field(
        default="",
        max_length=64,
        description="Sized, TargetUnreachable, or why it holds the sizes: MetricsMissing, MetricsStale, "
        "MetricsImplausible, ProfileInvalid (docs/autoscaling.md).",
    )
    message: str = Field(default="", max_length=4096)
    held: bool = Field(default=False, description="The sizes were left as they were (see state).")
    targets: str = Field(default="", max_length=128, description="The targets, for reading.")
    planned: str = Field(default="", max_length=32, description="prefill/decode engines asked for, for the column.")
    prefill: int = Field(default=0, ge=0, description="Prefill engines asked for (the role's /scale).")
    decode: int = Field(default=0, ge=0, description="Decode engines asked for (the role's /scale).")
    request_rate: float | None = Field(default=None, description="Requests per second over the window.")
    predicted_rate: float | None = Field(default=None, description="Requests per second predicted for next interval.")
    prompt_tokens: float | None = Field(default=None, description="Mean prompt tokens per request.")
    output_tokens: float | None = Field(default=None, description="Mean output tokens per request.")
    prefix_hit_rate: float | None = Field(default=None, description="Share of prompt tokens found cached by prefill.")
    ttft_ms: float | None = Field(default=None, description="Time to first token at the target's percentile.")
    itl_ms: float | None = Field(default=None, description="Inter-token latency at the target's percentile.")
    prefill_correction: float = Field(default=1.0, description="Observed over profiled prefill latency (damped).")
    decode_correction: float = Field(default=1.0, description="Observed over profiled decode latency (damped).")
    history: list[PlannedSize] = Field(
        default_factory=list, max_length=1024, description="Sizes recommended within the stabilization window."
    )
    prefill_change: SizeChange | None = Field(default=None, description="Prefill's last change of size.")
    decode_change: SizeChange | None = Field(default=None, description="Decode's last change of size.")
    last_pass_at: float = Field(default=0.0, description="The last pass (Unix seconds).")
    traffic_since: float | None = Field(
        default=None, description="The first pass of the present run of passes that saw traffic (Unix seconds)."
    )


class DisaggregatedDeploymentStatus(CamelModel):
    observed_generation: int = Field(default=0, ge=0)
    fingerprint: str = ""
    pairing: str = Field(default="", description="The pairing key of the current spec (pods' kvbridge.io/pairing).")
    tp: str = Field(default="", max_length=32, description="prefill TP -> decode TP, for the printer column.")
    conditions: list[Condition] = Field(default_factory=list)
    plan: PlanSummary | None = None
    prefill: PrefillStatus = Field(default_factory=PrefillStatus)
    decode: DecodeStatus = Field(default_factory=DecodeStatus)
    rollout: RolloutStatus | None = None
    router: RouterStatus | None = Field(default=None, description="spec.router's Deployment and Service, when on.")
    inference_pool: InferencePoolStatus | None = Field(default=None, description="spec.inferencePool's objects.")
    placement: PlacementStatus | None = Field(default=None, description="spec.placement's PodGroup, when gang.")
    autoscaling: AutoscalingStatus | None = Field(
        default=None, description="kvbridge's planner (spec.autoscaling): written by the planner, not the reconcile."
    )
    advisories: list[Advisory] = Field(
        default_factory=list,
        max_length=64,
        description="What the engines run other than the spec asks, without refusing it (e.g. verification with a "
        "connector that has no transfer digest): each with its code, field and fix; kvbridge plan lists the same.",
    )

    def role(self, role: Role) -> RoleStatus:
        return self.prefill if role is Role.PREFILL else self.decode


def merge_conditions(previous: Sequence[dict[str, object]], current: Sequence[Condition], now: str) -> list[Condition]:
    """Carry ``lastTransitionTime`` over unless the status flipped (or the condition is new)."""
    before = {str(c.get("type")): c for c in previous}
    merged = []
    for condition in current:
        old = before.get(condition.type.value)
        flipped = old is None or old.get("status") != condition.status or not old.get("lastTransitionTime")
        stamp = now if flipped else str(old.get("lastTransitionTime")) if old is not None else now
        merged.append(condition.model_copy(update={"last_transition_time": stamp}))
    return merged
