"""What runs a role's engines: a StatefulSet (an engine is a pod), or a LeaderWorkerSet for an engine that spans
nodes (an engine is a group of pods)."""

from __future__ import annotations

from kvbridge_agent.core import Role, TransferPlan
from kvbridge_operator.api.names import (
    role_name,
)
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.children import multinode
from kvbridge_operator.children.objects.pod import pod_template
from kvbridge_operator.children.objects.shared import child_metadata, owner_reference, selector
from kvbridge_operator.config import OperatorConfig


def stateful_set(
    dd: DisaggregatedDeployment,
    uid: str,
    role: Role,
    plan: TransferPlan,
    config: OperatorConfig,
    key: str | None = None,
) -> Obj:
    """The role's StatefulSet with the spec's replicas and partition 0; the reconcile sets both to the rollout's
    step (the effective count of scaling.py plus a surge; the ordinal from which pods run this template)."""
    name = role_name(dd.metadata.name, role)
    namespace = dd.metadata.namespace or "default"
    role_spec = dd.spec.role(role)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": child_metadata(name, namespace, selector(dd.metadata.name, role), owner_reference(dd, uid)),
        "spec": {
            "replicas": role_spec.replicas,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}},
            "selector": {"matchLabels": selector(dd.metadata.name, role)},
            "template": pod_template(dd, role, plan, config, key),
        },
    }


def leader_worker_set(
    dd: DisaggregatedDeployment,
    uid: str,
    role: Role,
    plan: TransferPlan,
    config: OperatorConfig,
    key: str | None = None,
) -> Obj:
    """A multi-node role's LeaderWorkerSet (``spec.<role>.nodes`` above 1): the spec's replicas as groups of
    ``nodes`` pods, the role's rollout as the LWS's rolling update."""
    name = role_name(dd.metadata.name, role)
    role_spec = dd.spec.role(role)
    metadata = child_metadata(
        name, dd.metadata.namespace or "default", selector(dd.metadata.name, role), owner_reference(dd, uid)
    )
    return multinode.leader_worker_set(
        metadata,
        role_spec.replicas,
        role_spec.nodes,
        pod_template(dd, role, plan, config, key),
        role_spec.rollout.max_surge,
        role_spec.rollout.max_unavailable,
        data_parallel=role_spec.data_parallel_size,
    )


def workload(
    dd: DisaggregatedDeployment,
    uid: str,
    role: Role,
    plan: TransferPlan,
    config: OperatorConfig,
    key: str | None = None,
) -> Obj:
    """What runs the role's engines: a StatefulSet (an engine is a pod), or a LeaderWorkerSet for an engine that
    spans nodes (an engine is a group of pods)."""
    if multinode.spans_nodes(dd.spec, role):
        return leader_worker_set(dd, uid, role, plan, config, key)
    return stateful_set(dd, uid, role, plan, config, key)
