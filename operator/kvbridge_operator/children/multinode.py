"""Engines that span nodes: a LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``) per role whose ``nodes`` is above 1.

One engine is one LWS group of ``nodes`` pods: the leader (group's worker index 0) runs ``vllm serve`` with its
HTTP API, its engine core and the NIXL side channel (vLLM 0.32's scheduler serves every rank's metadata there, so
the leader's address is the engine's one endpoint); each worker pod runs ``vllm serve --headless`` for its node's
ranks. vLLM's multi-node launch (multiprocessing backend): ``--nnodes``, ``--node-rank`` (the LWS worker index),
``--master-addr`` (the leader's address, which LWS gives every pod as ``LWS_LEADER_ADDRESS``) and
``--master-port``. Each pod holds ``tensorParallelSize / nodes`` GPUs.

An engine of several data-parallel ranks spans nodes the other way (vLLM's multi-node data parallelism): each pod
holds ``dataParallelSize / nodes`` whole DP ranks (their TP stays inside the node), the leader runs the API server
and its DP ranks (``--data-parallel-size-local``, ``--data-parallel-address`` the leader's), each worker runs its
DP ranks ``--headless`` from ``--data-parallel-start-rank`` = worker index x ranks per pod (a shell computes it from
``LWS_WORKER_INDEX``). Every DP rank keeps its own side channel on base port + its global rank, on the pod it runs
in: the workers' ranks are KV peers at the workers' addresses.

Pure: renders objects, checks specs; the reconcile decides when to apply them.
"""

from __future__ import annotations

import copy

from kvbridge_agent.core import Problem, Role
from kvbridge_operator.api.names import LABEL_INFERENCE_POOL, LABEL_WORKER_INDEX, LWS_API, LWS_KIND
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import MAX_NODES, DisaggregatedDeploymentSpec, RoleSpec
from kvbridge_operator.children.engines import engine_of
from kvbridge_operator.children.engines.vllm_serve import MASTER_PORT

MASTER_PORT_NAME = "rendezvous"
NODES_NEED_VLLM_ON_GPU = "NODES_NEED_VLLM_ON_GPU"
NODES_DO_NOT_DIVIDE_TP = "NODES_DO_NOT_DIVIDE_TP"


def spans_nodes(spec: DisaggregatedDeploymentSpec, role: Role) -> bool:
    return spec.role(role).nodes > 1


def is_worker(pod: Obj) -> bool:
    """A group's non-leader pod: part of an engine, not an engine (no API, no side channel of its own)."""
    labels: dict[str, str] = pod.get("metadata", {}).get("labels") or {}
    return labels.get(LABEL_WORKER_INDEX, "0") != "0"


#: the shell that starts a data-parallel worker at its first DP rank (``$0 "$@"`` is the command and its arguments;
#: ``{per_pod}`` is filled in)
START_RANK = 'exec "$0" "$@" --data-parallel-start-rank "$((LWS_WORKER_INDEX * {per_pod}))"'
DATA_PARALLEL_NODES_DO_NOT_DIVIDE = "DATA_PARALLEL_NODES_DO_NOT_DIVIDE"


def data_parallel_per_pod(role_spec: RoleSpec) -> int:
    """The DP ranks each pod of one engine runs: all of them, or an even share over ``nodes``."""
    return max(role_spec.data_parallel_size // role_spec.nodes, 1)


def gpus_per_pod(spec: DisaggregatedDeploymentSpec, role: Role) -> int:
    """GPUs each pod of one engine holds (every DP rank's TP ranks when the engine is one pod)."""
    role_spec = spec.role(role)
    return role_spec.world_size // role_spec.nodes


def problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """What a multi-node role cannot be: only an engine kind that spans nodes on the spec's device does (vLLM on
    GPUs), and every node holds as many ranks."""
    found = []
    spans = engine_of(spec).spans_nodes(spec)
    for role in Role:
        role_spec = spec.role(role)
        if role_spec.nodes == 1:
            continue
        field = f"spec.{role.value}.nodes"
        if not spans:
            found.append(
                Problem(
                    NODES_NEED_VLLM_ON_GPU,
                    field,
                    f"{role.value} spans {role_spec.nodes} nodes, which only engine kind VLLM on device GPU does "
                    f"(vLLM's multi-node launch); set spec.{role.value}.nodes to 1",
                )
            )
        elif role_spec.data_parallel_size > 1:
            dp = role_spec.data_parallel_size
            if dp % role_spec.nodes:
                even = [n for n in range(2, min(dp, MAX_NODES) + 1) if dp % n == 0]
                found.append(
                    Problem(
                        DATA_PARALLEL_NODES_DO_NOT_DIVIDE,
                        field,
                        f"{role.value} runs {dp} data-parallel ranks over {role_spec.nodes} nodes, which leaves nodes "
                        f"with different numbers of ranks (each pod runs dataParallelSize / nodes whole DP ranks); "
                        f"set spec.{role.value}.nodes to one of {', '.join(map(str, even)) or '1'}",
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


def group_templates(template: Obj, nodes: int, data_parallel: int = 1) -> tuple[Obj, Obj]:
    """The leader's and the workers' pod templates from a role's single-pod template: the leader keeps the
    API, its probes and the side channel and opens the rendezvous port; a worker has no API (``--headless``), so
    no HTTP port, no probes and no side channel of its own. With several data-parallel ranks (``data_parallel``)
    the pods share no TP group: no rendezvous, and each worker starts at its first DP rank (:data:`START_RANK`);
    its DP ranks' side channels listen on its own address (their ports differ per worker, so none is declared)."""
    leader = copy.deepcopy(template)
    worker = copy.deepcopy(template)
    for pod, is_leader in ((leader, True), (worker, False)):
        engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
        if data_parallel > 1:
            if not is_leader:
                script = START_RANK.format(per_pod=data_parallel // nodes)
                engine["command"] = ["/bin/sh", "-c", script, *engine.get("command", [])]
                engine["args"] = [*engine.get("args", []), "--headless"]
        else:
            engine["args"] = [*engine.get("args", []), *launch_args(nodes, is_leader)]
        if is_leader and data_parallel > 1:
            continue
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
    metadata: Obj,
    replicas: int,
    nodes: int,
    template: Obj,
    max_surge: int,
    max_unavailable: int,
    partition: int = 0,
    data_parallel: int = 1,
) -> Obj:
    """A role's LeaderWorkerSet: ``replicas`` engines of ``nodes`` pods each. A pod's restart recreates its whole
    group (one engine's ranks live or die together: vLLM cannot take a rank back), the workers start once the
    leader exists (they need its address), and rolling updates move whole groups, from the highest index down to
    ``partition``."""
    leader, worker = group_templates(template, nodes, data_parallel)
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
