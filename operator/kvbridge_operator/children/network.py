"""The KV data path's network (``spec.transfer.network``): checked before scheduling, rendered on engine pods.

vLLM's NixlConnector guide asks users to configure UCX (``UCX_TLS``, ``UCX_NET_DEVICES``); on Kubernetes an RDMA
data path also needs the NICs (extended resources of the RDMA device plugin), permission to pin memory
(``IPC_LOCK``, an unlimited locked-memory limit) and often a secondary network (Multus). Both connectors read
the same UCX variables (NIXL's UCX backend), so this renders the same on vLLM and synthetic engines.

- **Checked:** transport names UCX knows (``UCX_TRANSPORT_UNKNOWN``); a transport list that cannot leave the
  node while prefill and decode may run on different nodes (``UCX_TRANSPORTS_NODE_LOCAL``); resource names
  and counts (``RDMA_RESOURCE_INVALID``), and no GPUs among them (``RDMA_RESOURCE_GPU``: the ranks' GPUs are
  kvbridge's to request).
- **Rendered:** ``UCX_TLS``/``UCX_NET_DEVICES`` on the engine container, the resources as requests and limits,
  ``IPC_LOCK`` added to its capabilities, the memlock check wrapped around its command, the
  ``k8s.v1.cni.cncf.io/networks`` annotation on the pod.
- **Not checkable here:** that the nodes have the NICs, the device plugin and the network — the scheduler (the
  resources) and Multus (the annotation) refuse pods that cannot get them, and the memlock check refuses to run
  under a runtime limit.
"""

from __future__ import annotations

import re
from typing import Any

from kvbridge_agent.core import Problem
from kvbridge_operator.api.names import ENGINE_CONTAINER
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.placement import Colocation
from kvbridge_operator.api.spec import DisaggregatedDeploymentSpec
from kvbridge_operator.api.transfer import Memlock

UCX_TRANSPORT_UNKNOWN = "UCX_TRANSPORT_UNKNOWN"
UCX_TRANSPORTS_NODE_LOCAL = "UCX_TRANSPORTS_NODE_LOCAL"
RDMA_RESOURCE_INVALID = "RDMA_RESOURCE_INVALID"
RDMA_RESOURCE_GPU = "RDMA_RESOURCE_GPU"
FIELD = "spec.transfer.network"
TRANSPORTS_FIELD = f"{FIELD}.ucxTransports"
NETWORKS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"

#: UCX transports (and aliases) that stay inside one node: shared memory, kernel copies, GPU copies and IPC
NODE_LOCAL = frozenset(
    {
        "self",
        "sm",
        "shm",
        "mm",
        "posix",
        "sysv",
        "xpmem",
        "cma",
        "knem",
        "cuda",
        "cuda_copy",
        "cuda_ipc",
        "gdr_copy",
        "rocm",
        "rocm_copy",
        "rocm_ipc",
        "rocm_gdr",
        "ze_copy",
        "ze_ipc",
        "ze_gpu",
    }
)
#: UCX transports (and aliases) that reach other nodes
NETWORK = frozenset(
    {
        "all",
        "tcp",
        "ib",
        "rc",
        "rc_v",
        "rc_x",
        "rc_verbs",
        "rc_mlx5",
        "ud",
        "ud_v",
        "ud_x",
        "ud_verbs",
        "ud_mlx5",
        "dc",
        "dc_x",
        "dc_mlx5",
        "srd",
        "ugni",
        "ugni_rdma",
        "ugni_udt",
        "ugni_smsg",
    }
)
_RESOURCE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_MEMLOCK_CHECK = (
    'limit="$(ulimit -H -l)"; if [ "$limit" != unlimited ]; then echo "kvbridge: spec.transfer.network.memlock is '
    "Required but this container's locked-memory hard limit is $limit KiB: RDMA cannot pin the KV cache. Raise the "
    "container runtime's default (containerd: LimitMEMLOCK=infinity in its service unit, or the runtime's default "
    'ulimits), or set memlock: Unchecked" >&2; exit 78; fi; ulimit -S -l unlimited; exec "$0" "$@"'
)


_GPU_IN_RDMA_RESOURCES = (
    "{name} is a GPU resource: kvbridge requests each pod's GPUs itself, one per TP rank it runs "
    "(tensorParallelSize / nodes, checked against the nodes' GPUs), and asked here they would go around that "
    "check; remove {name} from rdmaResources (change tensorParallelSize for more GPUs): rdmaResources is for the "
    "NICs the RDMA device plugin advertises (rdma/ib, nvidia.com/hostdev)"
)


def is_gpu_resource(name: str) -> bool:
    """Whether an extended resource is a GPU or a share of one, as the common device plugins name them:
    ``<vendor>/gpu`` (nvidia.com, amd.com), NVIDIA's shared GPUs and MIG slices (``nvidia.com/gpu.shared``,
    ``nvidia.com/mig-1g.10gb``), Intel's ``gpu.intel.com/*``."""
    vendor, _, kind = name.lower().partition("/")
    return kind.startswith(("gpu", "mig-")) or vendor.startswith("gpu.")


def _name(transport: str) -> str:
    return transport.strip().lstrip("^").split(":", 1)[0].lower()


def gpu_resource_problems(spec: DisaggregatedDeploymentSpec, gpu_resource: str) -> list[Problem]:
    """The operator's own GPU resource (its ``gpuResource`` setting, whatever its name) among the RDMA resources:
    the names :func:`problems` does not know as a GPU's."""
    named = gpu_resource in spec.transfer.network.rdma_resources and not is_gpu_resource(gpu_resource)
    message = _GPU_IN_RDMA_RESOURCES.format(name=gpu_resource)
    return [Problem(RDMA_RESOURCE_GPU, f"{FIELD}.rdmaResources.{gpu_resource}", message)] if named else []


def problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    network = spec.transfer.network
    found = []
    for position, transport in enumerate(network.ucx_transports):
        if _name(transport) not in NODE_LOCAL | NETWORK:
            found.append(
                Problem(
                    UCX_TRANSPORT_UNKNOWN,
                    f"{TRANSPORTS_FIELD}[{position}]",
                    (
                        f"UCX has no transport {transport!r}: UCX would refuse to start the engine. Use UCX's names: "
                        f"{', '.join(sorted(NETWORK))} (between nodes) or {', '.join(sorted(NODE_LOCAL))} "
                        "(inside one node); ^name excludes one"
                    ),
                )
            )
    chosen = {_name(t) for t in network.ucx_transports if not t.strip().startswith("^")}
    known = chosen & (NODE_LOCAL | NETWORK)
    if known and not known & NETWORK and not one_node(spec):
        found.append(
            Problem(
                UCX_TRANSPORTS_NODE_LOCAL,
                TRANSPORTS_FIELD,
                (
                    f"UCX transports {sorted(known)} stay inside one node, but nothing keeps prefill and decode pods "
                    "on one node: decode could not read KV from a prefill pod elsewhere. Add a transport between "
                    "nodes (rc on InfiniBand/RoCE, tcp anywhere), or keep the roles on one node "
                    "(spec.placement.colocation: Required, topologyKey: kubernetes.io/hostname)"
                ),
            )
        )
    for name, count in network.rdma_resources.items():
        if is_gpu_resource(name):
            message = _GPU_IN_RDMA_RESOURCES.format(name=name)
            found.append(Problem(RDMA_RESOURCE_GPU, f"{FIELD}.rdmaResources.{name}", message))
        elif not _RESOURCE.match(name) or name.startswith(("kubernetes.io/", "requests.")) or count < 1:
            found.append(
                Problem(
                    RDMA_RESOURCE_INVALID,
                    f"{FIELD}.rdmaResources.{name}",
                    (
                        f"{name}: {count} is not an extended resource request: a name prefix/name as the RDMA device "
                        "plugin advertises it (e.g. rdma/ib, nvidia.com/hostdev) and a count of at least 1"
                    ),
                )
            )
    return found


def one_node(spec: DisaggregatedDeploymentSpec) -> bool:
    """Whether placement keeps every pod of the deployment on one node."""
    placement = spec.placement
    return placement.colocation is Colocation.REQUIRED and placement.topology_key == "kubernetes.io/hostname"


def fixed_transports(spec: DisaggregatedDeploymentSpec) -> list[str] | None:
    """The transport list with unknown names dropped and, where only node-local ones are left, ``tcp`` added
    (reaches any node; rc is faster on RDMA fabrics, which kvbridge cannot see from here); ``None`` when the
    list has no problem."""
    codes = {p.code for p in problems(spec)}
    if not codes & {UCX_TRANSPORT_UNKNOWN, UCX_TRANSPORTS_NODE_LOCAL}:
        return None
    kept = [t for t in spec.transfer.network.ucx_transports if _name(t) in NODE_LOCAL | NETWORK]
    chosen = {_name(t) for t in kept if not t.strip().startswith("^")}
    if chosen and not chosen & NETWORK and not one_node(spec):
        kept.append("tcp")
    return kept


def apply(template: Obj, spec: DisaggregatedDeploymentSpec) -> Obj:
    """``template`` (a pod template, changed in place and returned) with the network's settings on its engine
    container and pod."""
    network = spec.transfer.network
    if not network.configured:
        return template
    if network.secondary_networks:
        annotations = template["metadata"].setdefault("annotations", {})
        annotations[NETWORKS_ANNOTATION] = ",".join(network.secondary_networks)
    for container in template["spec"]["containers"]:
        if container.get("name") == ENGINE_CONTAINER:
            _engine(container, spec)
    return template


def environment(spec: DisaggregatedDeploymentSpec) -> dict[str, str]:
    """The UCX variables the engine container gets (both connectors' NIXL reads them)."""
    network = spec.transfer.network
    found = {}
    if network.ucx_transports:
        found["UCX_TLS"] = ",".join(network.ucx_transports)
    if network.ucx_devices:
        found["UCX_NET_DEVICES"] = ",".join(network.ucx_devices)
    return found


def _engine(container: dict[str, Any], spec: DisaggregatedDeploymentSpec) -> None:
    network = spec.transfer.network
    container.setdefault("env", []).extend({"name": k, "value": v} for k, v in environment(spec).items())
    if network.rdma_resources:
        resources = container.setdefault("resources", {})
        counts = {name: str(count) for name, count in network.rdma_resources.items()}
        resources["requests"] = {**resources.get("requests", {}), **counts}
        resources["limits"] = {**resources.get("limits", {}), **counts}
    if network.ipc_lock:
        capabilities = container.setdefault("securityContext", {}).setdefault("capabilities", {})
        capabilities["add"] = sorted({*capabilities.get("add", []), "IPC_LOCK"})
    if network.memlock is Memlock.REQUIRED:
        container["command"] = ["/bin/sh", "-c", _MEMLOCK_CHECK, *container["command"]]
