"""Where a deployment's pods may run (``spec.placement``): what fits a node, and what stays together.

- **Fit.** A role's engine is one pod holding ``dataParallelSize x tensorParallelSize`` GPUs. With
  ``gpusPerNode`` known (the spec's, else the operator's ``--gpus-per-node``, the chart's ``gpu.perNode``), more is
  a pod no node can take: the verdict refuses it before anything is scheduled (``ROLE_DOES_NOT_FIT``). With
  ``nodes`` above 1 an engine's pod holds ``tensorParallelSize / nodes`` GPUs (multinode.py); the fix offered for
  vLLM is the fewest nodes that hold the TP evenly, or, with several DP ranks, the most DP ranks a node holds.
- **Colocation.** Pod affinity on ``topologyKey`` to the deployment's own pods (both roles): Preferred weighs
  the scheduler's choice, Required admits a pod only into the domain where the deployment's pods already run
  (the first pod matches itself, as Kubernetes allows). KV moves between the roles; across racks or NVLink
  domains it moves slower.
- **Spread.** Each role's pods over nodes (``kubernetes.io/hostname``, max skew 1, ScheduleAnyway): a node's
  loss takes one engine of a role, not all.
- **Gang.** The coscheduling plugin of scheduler-plugins (SIG Scheduling): a ``PodGroup``
  (``scheduling.x-k8s.io/v1alpha1``) with ``minMember``, both roles' pods labelled into it and scheduled by
  the scheduler that runs the plugin. Chosen over Volcano (a whole replacement scheduler with its own queues
  and job API) and Kueue (quota and admission of workloads; its plain-pod groups need a count annotation per
  pod): a PodGroup with a label is all the coscheduling plugin asks of a StatefulSet's pods.
"""

from __future__ import annotations

from kvbridge_agent.core import Problem, Role
from kvbridge_operator.api.names import LABEL_POD_GROUP, POD_GROUP_API
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.placement import Colocation
from kvbridge_operator.api.spec import MAX_NODES, DisaggregatedDeployment, DisaggregatedDeploymentSpec, EngineDevice
from kvbridge_operator.children import multinode
from kvbridge_operator.children.engines import engine_of

ROLE_DOES_NOT_FIT = "ROLE_DOES_NOT_FIT"
HOSTNAME = "kubernetes.io/hostname"


def with_gpus_per_node(dd: DisaggregatedDeployment, gpus_per_node: int) -> DisaggregatedDeployment:
    """``dd`` with the cluster's GPUs per node (the operator's setting, 0: unknown) where its spec states none:
    what the fit check reads. Not in the pairing key, so it changes no pod."""
    if gpus_per_node <= 0 or dd.spec.placement.gpus_per_node is not None:
        return dd
    placement = dd.spec.placement.model_copy(update={"gpus_per_node": gpus_per_node})
    return dd.model_copy(update={"spec": dd.spec.model_copy(update={"placement": placement})})


def problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    per_node = spec.placement.gpus_per_node
    if per_node is None or spec.engine.device is not EngineDevice.GPU:
        return []
    found = []
    for role in Role:
        tp, nodes, dp = spec.role(role).tensor_parallel_size, spec.role(role).nodes, spec.role(role).data_parallel_size
        gpus = multinode.gpus_per_pod(spec, role)
        if gpus > per_node and dp > 1:
            fits = per_node * nodes // tp
            fix = (
                f"set spec.{role.value}.dataParallelSize: {fits} and run more replicas"
                if fits >= 1
                else f"set spec.{role.value}.dataParallelSize: 1"
            )
            found.append(
                Problem(
                    ROLE_DOES_NOT_FIT,
                    f"spec.{role.value}.dataParallelSize",
                    f"{role.value} DP {dp} x TP {tp} over {nodes} node(s) needs {gpus} GPUs in one pod, and a node "
                    f"has {per_node} (spec.placement.gpusPerNode, else the operator's gpusPerNode): no node can take "
                    f"it; {fix}",
                )
            )
        elif gpus > per_node:
            spans = -(-tp // per_node)  # the fewest nodes that hold TP ranks
            while tp % spans:
                spans += 1
            fix = (
                f"set spec.{role.value}.nodes to {spans} ({tp // spans} GPUs per pod)"
                if engine_of(spec).spans_nodes(spec) and spans <= MAX_NODES
                else f"set spec.{role.value}.tensorParallelSize to at most {per_node * nodes}"
            )
            found.append(
                Problem(
                    ROLE_DOES_NOT_FIT,
                    f"spec.{role.value}.tensorParallelSize",
                    f"{role.value} TP {tp} over {nodes} node(s) needs {gpus} GPUs in one pod, and a node has "
                    f"{per_node} (spec.placement.gpusPerNode, else the operator's gpusPerNode): no node can take it; "
                    f"{fix}",
                )
            )
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
            fields["affinity"] = {
                "podAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]
                }
            }
    if placement.gang is not None:
        fields["schedulerName"] = placement.gang.scheduler_name
    if placement.spread_replicas:
        fields["topologySpreadConstraints"] = [
            {
                "maxSkew": 1,
                "topologyKey": HOSTNAME,
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": dict(role_selector)},
            }
        ]
    return fields


def pod_group_labels(spec: DisaggregatedDeploymentSpec, deployment: str) -> dict[str, str]:
    return {LABEL_POD_GROUP: deployment} if spec.placement.gang is not None else {}


def min_member(spec: DisaggregatedDeploymentSpec) -> int:
    gang = spec.placement.gang
    if gang is not None and gang.min_member is not None:
        return gang.min_member
    # pods, not engines: an engine that spans nodes is a group of `nodes` pods, all needed together
    return max(spec.prefill.replicas * spec.prefill.nodes + spec.decode.replicas * spec.decode.nodes, 1)


def pod_group(spec: DisaggregatedDeploymentSpec, metadata: Obj) -> Obj | None:
    """The deployment's PodGroup (``metadata`` as the other children's), or None without ``gang``."""
    gang = spec.placement.gang
    if gang is None:
        return None
    group_spec = {"minMember": min_member(spec), "scheduleTimeoutSeconds": gang.schedule_timeout_seconds}
    return {"apiVersion": POD_GROUP_API, "kind": "PodGroup", "metadata": metadata, "spec": group_spec}
