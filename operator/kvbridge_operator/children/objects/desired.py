"""Every child a compatible spec renders, as tables of the child kinds: those every spec has
(:data:`CHILD_KINDS`) and those the spec asks for (:data:`OPTIONAL_KINDS`: the router, the InferencePool, the
gang's PodGroup). The Secret (created once) and the DisaggregatedRoles (scaling.py) are apart."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvbridge_agent.core import Role, TransferPlan
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.children.objects.disruption_budget import pod_disruption_budget
from kvbridge_operator.children.objects.inference_pool import inference_pool_children
from kvbridge_operator.children.objects.network_policy import network_policy
from kvbridge_operator.children.objects.pod_group import pod_group_children
from kvbridge_operator.children.objects.router import router_children
from kvbridge_operator.children.objects.service import service
from kvbridge_operator.children.objects.workload import workload
from kvbridge_operator.config import OperatorConfig


@dataclass(frozen=True)
class Render:
    """What a child kind's renderer is given."""

    dd: DisaggregatedDeployment
    uid: str
    plan: TransferPlan
    config: OperatorConfig
    key: str | None  # the pairing key pods are labelled with (None: the spec's own)


@dataclass(frozen=True)
class ChildKind:
    """One kind of child: its name in words, and its objects for a spec."""

    name: str
    render: Callable[[Render], list[Obj]]


def _per_role(render: Callable[[Render, Role], Obj]) -> Callable[[Render], list[Obj]]:
    return lambda given: [render(given, role) for role in Role]


#: the child kinds, in the order they are applied (the workloads last: what they need exists first)
CHILD_KINDS: tuple[ChildKind, ...] = (
    ChildKind("Service", _per_role(lambda r, role: service(r.dd, r.uid, role, r.config))),
    ChildKind("NetworkPolicy", lambda r: [network_policy(r.dd, r.uid, r.config)]),
    ChildKind("PodDisruptionBudget", _per_role(lambda r, role: pod_disruption_budget(r.dd, r.uid, role))),
    ChildKind("workload", _per_role(lambda r, role: workload(r.dd, r.uid, role, r.plan, r.config, r.key))),
)


def desired_children(
    dd: DisaggregatedDeployment, uid: str, plan: TransferPlan, config: OperatorConfig, key: str | None = None
) -> list[Obj]:
    """Every child of :data:`CHILD_KINDS`, in order."""
    given = Render(dd, uid, plan, config, key)
    return [child for kind in CHILD_KINDS for child in kind.render(given)]


@dataclass(frozen=True)
class OptionalKind:
    """A kind of child the spec asks for: whether it does, and the objects (a kind may render none)."""

    name: str
    wanted: Callable[[DisaggregatedDeployment], bool]
    render: Callable[[DisaggregatedDeployment, str, OperatorConfig], list[Obj]]


#: the optional child kinds, in the order they are applied
OPTIONAL_KINDS: tuple[OptionalKind, ...] = (
    OptionalKind("router", lambda dd: dd.spec.router.enabled, router_children),
    OptionalKind("InferencePool", lambda dd: dd.spec.inference_pool.enabled, inference_pool_children),
    OptionalKind("PodGroup", lambda dd: True, lambda dd, uid, config: pod_group_children(dd, uid)),
)


def optional_children(dd: DisaggregatedDeployment, uid: str, config: OperatorConfig) -> list[Obj]:
    """The optional children the spec asks for: the router's, the InferencePool's, and the gang's PodGroup."""
    return [child for kind in OPTIONAL_KINDS if kind.wanted(dd) for child in kind.render(dd, uid, config)]
