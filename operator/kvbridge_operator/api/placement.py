"""``spec.placement``: where pods may run: what fits a node, what stays together (gang scheduling)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator

from kvbridge_agent.core.model import CamelModel


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
