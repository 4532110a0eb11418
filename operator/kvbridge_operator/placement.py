"""Where a deployment's pods may run (``spec.placement``): what fits a node, and what stays together.

- **Fit.** A role's engine is one pod holding ``tensorParallelSize`` GPUs. With ``gpusPerNode`` known, a larger
  TP is a pod no node can take: the verdict refuses it before anything is scheduled (``ROLE_DOES_NOT_FIT``).
  A replica spanning nodes (LeaderWorkerSet) is not rendered yet, so the fix offered is the largest TP that fits.
- **Colocation.** Pod affinity on ``topologyKey`` to the deployment's own pods (both roles): Preferred weighs
  the scheduler's choice, Required admits a pod only into the domain where the deployment's pods already run
  (the first pod matches itself, as Kubernetes allows). KV moves between the roles; across racks or NVLink
  domains it moves slower.
- **Spread.** Each role's pods over nodes (``kubernetes.io/hostname``, max skew 1, ScheduleAnyway): a node's
  loss takes one engine of a role, not all.
"""

from __future__ import annotations

from typing import Any

from kvbridge_agent.core import Problem, Role

from .spec import Colocation, DisaggregatedDeploymentSpec, EngineDevice

Obj = dict[str, Any]
ROLE_DOES_NOT_FIT = "ROLE_DOES_NOT_FIT"
HOSTNAME = "kubernetes.io/hostname"


def problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    per_node = spec.placement.gpus_per_node
    if per_node is None or spec.engine.device is not EngineDevice.GPU:
        return []
    found = []
    for role in Role:
        tp = spec.role(role).tensor_parallel_size
        if tp > per_node:
            found.append(Problem(
                ROLE_DOES_NOT_FIT, f"spec.{role.value}.tensorParallelSize",
                f"{role.value} TP {tp} needs {tp} GPUs in one pod, and a node has {per_node} "
                f"(spec.placement.gpusPerNode): no node can take it. A replica spanning nodes (LeaderWorkerSet) is "
                f"not supported yet; set spec.{role.value}.tensorParallelSize to at most {per_node}",
            ))  # fmt: skip
    return found


def pod_fields(spec: DisaggregatedDeploymentSpec, deployment: str, role_selector: dict[str, str], own: str) -> Obj:
    """``affinity`` and ``topologySpreadConstraints`` of a role's pod template (empty when nothing is asked);
    ``own`` is the label that every pod of the deployment carries with the deployment's name."""
    placement = spec.placement
    fields: Obj = {}
    if placement.colocation is not Colocation.NONE:
        term = {"labelSelector": {"matchLabels": {own: deployment}}, "topologyKey": placement.topology_key}
        if placement.colocation is Colocation.REQUIRED:
            fields["affinity"] = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
        else:
            fields["affinity"] = {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "podAffinityTerm": term}]}}  # fmt: skip
    if placement.spread_replicas:
        fields["topologySpreadConstraints"] = [{"maxSkew": 1, "topologyKey": HOSTNAME,
                                                "whenUnsatisfiable": "ScheduleAnyway",
                                                "labelSelector": {"matchLabels": dict(role_selector)}}]  # fmt: skip
    return fields
