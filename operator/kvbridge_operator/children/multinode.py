"""Engines that span nodes: a LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``) per role whose ``nodes`` is above 1.

One engine is one LWS group of ``nodes`` pods: the leader (group's worker index 0) runs ``vllm serve`` with its
HTTP API, its engine core and the NIXL side channel (vLLM 0.32's scheduler serves every rank's metadata there, so
the leader's address is the engine's one endpoint); each worker pod runs ``vllm serve --headless`` for its node's
ranks. vLLM's multi-node launch (multiprocessing backend): ``--nnodes``, ``--node-rank`` (the LWS worker index),
``--master-addr`` (the leader's address, which LWS gives every pod as ``LWS_LEADER_ADDRESS``) and
``--master-port``. Each pod holds ``tensorParallelSize / nodes`` GPUs.

Pure: renders objects, checks specs; the reconcile decides when to apply them.
"""

from __future__ import annotations

import copy

from kvbridge_agent.core import Problem, Role
from kvbridge_operator.api.names import LABEL_INFERENCE_POOL, LABEL_WORKER_INDEX, LWS_API, LWS_KIND
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import MAX_NODES, DisaggregatedDeploymentSpec, EngineDevice, EngineKind

#: torch.distributed's rendezvous on the leader (vLLM's --master-port)
MASTER_PORT = 29500
MASTER_PORT_NAME = "rendezvous"
NODES_NEED_VLLM_ON_GPU = "NODES_NEED_VLLM_ON_GPU"
NODES_DO_NOT_DIVIDE_TP = "NODES_DO_NOT_DIVIDE_TP"


def spans_nodes(spec: DisaggregatedDeploymentSpec, role: Role) -> bool:
    return spec.role(role).nodes > 1


def is_worker(pod: Obj) -> bool:
    """A group's non-leader pod: part of an engine, not an engine (no API, no side channel of its own)."""
    labels: dict[str, str] = pod.get("metadata", {}).get("labels") or {}
    return labels.get(LABEL_WORKER_INDEX, "0") != "0"


def gpus_per_pod(spec: DisaggregatedDeploymentSpec, role: Role) -> int:
    """GPUs each pod of one engine holds (every DP rank's TP ranks when the engine is one pod)."""
    role_spec = spec.role(role)
    return role_spec.world_size // role_spec.nodes


def problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """What a multi-node role cannot be: only vLLM on GPUs spans nodes, and every node holds as many ranks."""
    found = []
    for role in Role:
        role_spec = spec.role(role)
        if role_spec.nodes == 1:
            continue
        field = f"spec.{role.value}.nodes"
        if spec.engine.kind is not EngineKind.VLLM or spec.engine.device is not EngineDevice.GPU:
            found.append(
                Problem(
                    NODES_NEED_VLLM_ON_GPU,
                    field,
                    f"{role.value} spans {role_spec.nodes} nodes, which only engine kind VLLM on device GPU does "
                    f"(vLLM's multi-node launch); set spec.{role.value}.nodes to 1",
                )
            )
        elif role_spec.tensor_parallel_size % role_spec.nodes:
            tp = role_spec.tensor_parallel_size
            even = [n for n in range(2, min(tp, MAX_NODES) + 1) if tp % n == 0]
            found.append(
                Problem(
                    NODES_DO_NOT_DIVIDE_TP,
                    field,
                    f"{role.value} TP {tp} over {role_spec.nodes} nodes leaves nodes with different numbers of ranks "
                    f"(vLLM requires --nnodes to divide the world size); set spec.{role.value}.nodes to one of "
                    f"{', '.join(map(str, even)) or '1'}",
                )
            )
    return found


def launch_args(nodes: int, leader: bool) -> list[str]:
    """vLLM's multi-node arguments of one pod of a group (Kubernetes expands ``$(VAR)`` from the pod's env, which
    LWS fills in)."""
    rank = "0" if leader else "$(LWS_WORKER_INDEX)"
    args = [
        "--nnodes",
        str(nodes),
        "--node-rank",
        rank,
        "--master-addr",
        "$(LWS_LEADER_ADDRESS)",
        "--master-port",
        str(MASTER_PORT),
    ]
    return args if leader else [*args, "--headless"]


def group_templates(template: Obj, nodes: int) -> tuple[Obj, Obj]:
    """The leader's and the workers' pod templates from a role's single-pod template: the leader keeps the
    API, its probes and the side channel and opens the rendezvous port; a worker has no API (``--headless``), so
    no HTTP port, no probes and no side channel of its own."""
    leader = copy.deepcopy(template)
    worker = copy.deepcopy(template)
    for pod, is_leader in ((leader, True), (worker, False)):
        engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
        engine["args"] = [*engine.get("args", []), *launch_args(nodes, is_leader)]
        if is_leader:
            engine["ports"] = [
                *engine.get("ports", []),
                {"name": MASTER_PORT_NAME, "containerPort": MASTER_PORT, "protocol": "TCP"},
            ]
        else:
            engine["ports"] = []
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                engine.pop(probe, None)
            pod["spec"]["containers"] = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
            pod["metadata"].get("labels", {}).pop(LABEL_INFERENCE_POOL, None)  # serves no API: not in the pool
    return leader, worker


def leader_worker_set(
    metadata: Obj, replicas: int, nodes: int, template: Obj, max_surge: int, max_unavailable: int, partition: int = 0
) -> Obj:
    """A role's LeaderWorkerSet: ``replicas`` engines of ``nodes`` pods each. A pod's restart recreates its whole
    group (one engine's ranks live or die together: vLLM cannot take a rank back), the workers start once the
    leader exists (they need its address), and rolling updates move whole groups, from the highest index down to
    ``partition``."""
    leader, worker = group_templates(template, nodes)
    return {
        "apiVersion": LWS_API,
        "kind": LWS_KIND,
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {
                    "partition": partition,
                    "maxSurge": max_surge,
                    "maxUnavailable": max_unavailable,
                },
            },
            "leaderWorkerTemplate": {
                "size": nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }
