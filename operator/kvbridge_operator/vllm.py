"""vLLM engines (``spec.engine.kind: VLLM``): what vLLM's NixlConnector cannot honour, and the engine each role runs.

Pure functions from a DisaggregatedDeployment and its plan to ``vllm serve`` arguments, the environment and
the container; :mod:`render` puts them into the pod template and ``kvbridge plan`` prints them. Everything the
compatibility rules decided shows up here: each role's TP size, block size and KV layout, the decode-side
permute the plan lists, the cross-layer cache kind, the side-channel port, the NIXL backends.

The ``--kv-transfer-config`` JSON is always generated (``json.dumps`` of a dict), never written by hand, and
``extraArgs`` may not override any argument this module sets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvbridge_agent.core import CacheKind, KVCacheDtype, Problem, Role, TransferPlan
from kvbridge_agent.core.wire import ConversionKind

from .config import OperatorConfig
from .spec import DisaggregatedDeployment, DisaggregatedDeploymentSpec, RoleSpec

VLLM_PREFILL_CONVERSION = "VLLM_PREFILL_CONVERSION"
VLLM_MANAGED_ARGUMENT = "VLLM_MANAGED_ARGUMENT"

#: arguments kvbridge sets from the spec; ``extraArgs`` naming one of them is refused
MANAGED_ARGUMENTS = (
    "--port", "--tensor-parallel-size", "-tp", "--block-size", "--kv-transfer-config", "--kv-cache-dtype",
    "--dtype", "--model",
)  # fmt: skip
#: the port vLLM serves on behind the routing sidecar (the sidecar takes the pod's HTTP port)
VLLM_PORT_BEHIND_SIDECAR = 8200
HEALTH_PATH = "/health"  # vLLM's OpenAI server: 200 once the engine is up

Obj = dict[str, Any]


def problems(spec: DisaggregatedDeploymentSpec, plan: TransferPlan | None) -> list[Problem]:
    """What vLLM's NixlConnector cannot run of an otherwise compatible spec (or of any spec, for extraArgs)."""
    found: list[Problem] = []
    for arg in spec.engine.extra_args:
        name = arg.split("=", 1)[0]
        if name in MANAGED_ARGUMENTS:
            found.append(Problem(
                VLLM_MANAGED_ARGUMENT, "spec.engine.extraArgs",
                f"{name} is set by kvbridge from the spec (it must agree with the compatibility plan); "
                "remove it from extraArgs and change the spec field instead",
            ))  # fmt: skip
    if plan is not None:
        for step in plan.wire.steps(Role.PREFILL):
            where = "blockSize" if step.kind is ConversionKind.SPLIT_BLOCKS else "kvLayout"
            found.append(Problem(
                VLLM_PREFILL_CONVERSION, f"spec.prefill.{where}",
                f"the plan needs the prefill side to {step.kind.value} ({step.source} -> {step.target}), which "
                "vLLM's NixlConnector cannot do (only the decode side re-lays blocks there); use a prefill "
                f"{where} that the decode side can convert (prefill blockSize <= decode blockSize, or the same "
                "kvLayout), or engine.kind Agent",
            ))  # fmt: skip
    return found


@dataclass(frozen=True)
class VLLMEngine:
    """One role's vLLM engine: the ``vllm serve`` arguments and environment, as a pod gets them."""

    args: list[str]
    env: dict[str, str]
    #: environment variables filled in by the downward API: name -> fieldPath
    downward: dict[str, str] = field(default_factory=dict)
    port: int = 8000
    kv_transfer_config: Obj = field(default_factory=dict)


def kv_transfer_config(
    spec: DisaggregatedDeploymentSpec, plan: TransferPlan, role: Role, config: OperatorConfig
) -> Obj:
    """vLLM's ``KVTransferConfig`` for one role (NixlConnector)."""
    extra: Obj = {"backends": list(spec.transfer.backends)}
    if role is Role.DECODE and any(s.kind is ConversionKind.PERMUTE for s in plan.wire.steps(Role.DECODE)):
        extra["enable_permute_local_kv"] = True  # decode is NHD, the wire (prefill) HND: permute after reading
    if spec.model.cache_kind is CacheKind.CROSS_LAYER:
        extra["enable_cross_layers_blocks"] = True  # one block-major tensor for all layers: 1 descriptor per block
    return {
        # vLLM's NixlConnector takes the P or D part per request from kv_transfer_params; its own docs and
        # tests run both roles as kv_both. The role is in the pod labels and in KVBRIDGE_ROLE.
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu" if config.cpu_mode else "cuda",
        "kv_connector_extra_config": extra,
    }


def behind_sidecar(role: Role, config: OperatorConfig) -> bool:
    """Whether this role's vLLM sits behind the routing sidecar (decode pods, when a sidecar image is set)."""
    return role is Role.DECODE and bool(config.routing_sidecar_image)


def engine(dd: DisaggregatedDeployment, role: Role, plan: TransferPlan, config: OperatorConfig) -> VLLMEngine:
    spec = dd.spec
    role_spec: RoleSpec = spec.prefill if role is Role.PREFILL else spec.decode
    port = VLLM_PORT_BEHIND_SIDECAR if behind_sidecar(role, config) else config.agent_http_port
    transfer_config = kv_transfer_config(spec, plan, role, config)
    args = [
        spec.model.name,
        "--port", str(port),
        "--tensor-parallel-size", str(role_spec.tensor_parallel_size),
        "--block-size", str(role_spec.block_size),
        *_dtype_args(spec.model.kv_cache_dtype),
        "--kv-transfer-config", json.dumps(transfer_config, separators=(",", ":"), sort_keys=True),
        *spec.engine.extra_args,
    ]  # fmt: skip
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.transfer.side_channel_port),
        "VLLM_KV_CACHE_LAYOUT": role_spec.kv_layout.value,
    }
    if not spec.model.is_mla:  # MLA picks its own attention backend
        backend = "FLASHINFER" if spec.model.cache_kind is CacheKind.BLOCKS_FIRST else "FLASH_ATTN"
        env["VLLM_ATTENTION_BACKEND"] = backend
    return VLLMEngine(
        args=args,
        env=env,
        downward={"VLLM_NIXL_SIDE_CHANNEL_HOST": "status.podIP"},
        port=port,
        kv_transfer_config=transfer_config,
    )


def _dtype_args(dtype: KVCacheDtype) -> list[str]:
    """The KV cache element type: fp8 is a KV-cache setting, the 16/32-bit types follow the model dtype."""
    if dtype.value.startswith("fp8"):
        return ["--kv-cache-dtype", dtype.value]
    return ["--dtype", dtype.value, "--kv-cache-dtype", "auto"]


def container(
    dd: DisaggregatedDeployment, role: Role, plan: TransferPlan, config: OperatorConfig, base_env: list[Obj]
) -> Obj:
    """The ``engine`` container running ``vllm serve`` with its HTTP port (named ``http``, or ``vllm`` behind the
    routing sidecar); further ports and GPUs are the caller's."""
    vllm = engine(dd, role, plan, config)
    env = [*base_env, *({"name": k, "value": v} for k, v in vllm.env.items())]
    env += [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": v}}} for k, v in vllm.downward.items()]
    probe = {"httpGet": {"path": HEALTH_PATH, "port": vllm.port}}
    return {
        "name": "engine",
        "image": dd.spec.engine.image or config.vllm_image,
        "command": ["vllm", "serve"],
        "args": vllm.args,
        "env": env,
        "ports": [
            {"name": "vllm" if behind_sidecar(role, config) else "http", "containerPort": vllm.port, "protocol": "TCP"}
        ],
        # loading weights and compiling take minutes: the startup probe allows 30 min before liveness applies
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],  # NCCL between TP ranks
    }


def routing_sidecar(config: OperatorConfig) -> Obj:
    """llm-d's routing sidecar in front of a decode vLLM: it takes the pod's HTTP port, asks the prefill pod
    named by the router (``x-prefiller-host-port``) to prefill, then forwards to vLLM behind it."""
    return {
        "name": "routing-sidecar",
        "image": config.routing_sidecar_image,
        "args": [
            f"--port={config.agent_http_port}",
            f"--vllm-port={VLLM_PORT_BEHIND_SIDECAR}",
            *config.routing_sidecar_args,
        ],
        "ports": [{"name": "http", "containerPort": config.agent_http_port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": config.agent_http_port}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
