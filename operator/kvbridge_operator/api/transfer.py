"""``spec.transfer``: the agent's transfer settings, the KV data path's network (UCX, RDMA) and the drain."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BeforeValidator, Field

from kvbridge_agent.core import TransferSettings
from kvbridge_agent.core.model import CamelModel, joined_item_check


class Memlock(StrEnum):
    UNCHECKED = "Unchecked"  # the container runtime's locked-memory limit, whatever it is
    REQUIRED = "Required"  # the engine starts only under an unlimited hard limit (RDMA registers pinned memory)


UCX_TRANSPORT_PATTERN = r"^\^?[A-Za-z0-9_]+(:[A-Za-z0-9_]+)?$"
#: one UCX transport (rc, ^ud, cuda_copy, ...)
UCXTransport = Annotated[
    str,
    Field(min_length=1, max_length=32, pattern=UCX_TRANSPORT_PATTERN),
    BeforeValidator(joined_item_check(UCX_TRANSPORT_PATTERN, 32, "a UCX transport's name")),
]
UCX_DEVICE_PATTERN = r"^\^?[A-Za-z0-9][A-Za-z0-9_.:-]*$"
#: one UCX network device (mlx5_0:1, eth0, ...)
UCXDevice = Annotated[
    str,
    Field(min_length=1, max_length=64, pattern=UCX_DEVICE_PATTERN),
    BeforeValidator(joined_item_check(UCX_DEVICE_PATTERN, 64, "a UCX device's name")),
]
#: one Multus network: [namespace/]name[@interface] (a DNS label, a DNS subdomain, a Linux interface name)
SECONDARY_NETWORK_PATTERN = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9.]*[a-z0-9])?(@[A-Za-z0-9_.-]{1,15})?$"
SECONDARY_NETWORK_MAX_LENGTH = 63 + 1 + 253 + 16
SecondaryNetwork = Annotated[
    str,
    Field(min_length=1, max_length=SECONDARY_NETWORK_MAX_LENGTH, pattern=SECONDARY_NETWORK_PATTERN),
    BeforeValidator(
        joined_item_check(
            SECONDARY_NETWORK_PATTERN, SECONDARY_NETWORK_MAX_LENGTH, "a Multus network ([namespace/]name[@interface])"
        )
    ),
]


class KVBufferDevice(StrEnum):
    """Where NIXL moves the KV cache from and to (vLLM's ``kv_buffer_device``, in vLLM's words)."""

    CUDA = "cuda"  # the KV cache in GPU memory, read and written in place: nodes with GPUDirect RDMA
    CPU = "cpu"  # a host buffer: the KV staged through host memory, for nodes without GPUDirect RDMA


class NetworkSpec(CamelModel):
    """What the KV data path needs between nodes on GPUs (vLLM's NixlConnector guide: UCX transports and devices;
    RDMA NICs as extended resources; pinned memory): rendered on the engine pods of both connectors."""

    ucx_transports: list[UCXTransport] = Field(
        default_factory=list,
        max_length=32,
        description="UCX_TLS: the UCX transports, in UCX's names (rc, ud, dc, tcp, sm, cuda_copy, cuda_ipc, "
        "gdr_copy, ... ; ^name excludes one). Empty: UCX chooses (all). A list that cannot reach another node "
        "is refused unless placement keeps both roles on one node.",
    )
    ucx_devices: list[UCXDevice] = Field(
        default_factory=list,
        max_length=64,
        description="UCX_NET_DEVICES: the devices UCX may use (e.g. mlx5_0:1). Empty: all.",
    )
    rdma_resources: dict[str, int] = Field(
        default_factory=dict,
        max_length=16,
        description="Extended resources each engine pod requests (and limits), e.g. rdma/ib: 1 or "
        "nvidia.com/hostdev: 8: what the RDMA device plugin advertises.",
    )
    ipc_lock: bool = Field(
        default=False, description="Add the IPC_LOCK capability to the engine container (RDMA memory registration)."
    )
    memlock: Memlock = Field(
        default=Memlock.UNCHECKED,
        description="Required: the engine container checks at start that its locked-memory hard limit is "
        "unlimited, raises the soft limit to it, and exits naming the fix if not (Kubernetes cannot set ulimits: "
        "the container runtime's default applies).",
    )
    kv_buffer_device: KVBufferDevice | None = Field(
        default=None,
        description="VLLM only: vLLM's kv_buffer_device, where NIXL moves the KV cache from and to. cuda: the KV "
        "cache in GPU memory, read in place (nodes with GPUDirect RDMA); cpu: a host buffer, the KV staged through "
        "host memory (GPU nodes without GPUDirect RDMA, and vLLM's CPU build). Unset: cuda on GPUs, cpu on CPUs.",
    )
    secondary_networks: list[SecondaryNetwork] = Field(
        default_factory=list,
        max_length=16,
        description="Multus networks to attach the engine pods to (k8s.v1.cni.cncf.io/networks), e.g. an RDMA "
        "network: [namespace/]name.",
    )

    @property
    def configured(self) -> bool:
        return self != NetworkSpec()


class TransferSpec(TransferSettings):
    """The agent's transfer settings, the network the data path runs on, and how long a terminating engine
    drains."""

    network: NetworkSpec = Field(default_factory=NetworkSpec, description=NetworkSpec.__doc__ or "")
    drain_seconds: int = Field(
        default=30,
        ge=0,
        le=3600,
        description="How long a terminating engine may finish the requests it has (vLLM: --shutdown-timeout). "
        "The pod's grace period adds the wait for routers to stop sending to it and, on a prefill pod that "
        "exports what it holds, for decode to read its KV (at most leaseSeconds).",
    )
