"""A role's PodDisruptionBudget: voluntary disruptions take one pod of a role at a time."""

from __future__ import annotations

from kvbridge_agent.core import Role
from kvbridge_operator.api.names import (
    role_name,
)
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.children.objects.shared import child_metadata, owner_reference, selector


def pod_disruption_budget(dd: DisaggregatedDeployment, uid: str, role: Role) -> Obj:
    """Voluntary disruptions (node drains) take one pod of a role at a time. A role of one replica can still be
    drained (a budget that forbids it would block the drain forever): give it two to keep it up."""
    name = role_name(dd.metadata.name, role)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(
            name, dd.metadata.namespace or "default", selector(dd.metadata.name, role), owner_reference(dd, uid)
        ),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(dd.metadata.name, role)}},
    }
