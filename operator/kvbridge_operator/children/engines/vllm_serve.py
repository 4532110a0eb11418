"""``vllm serve``'s arguments and environment for one role: what the plan decided, in vLLM's words.

The renderer targets one vLLM release (:data:`VLLM_RELEASE`, also the chart's default image): its flags, its
environment variables and its names of KV layouts. Everything the compatibility rules decided shows up here: each
role's TP size, block size and KV layout, the decode-side permute the plan lists, the cross-layer cache kind, the
side-channel port, the NIXL backends.

The ``--kv-transfer-config`` JSON is always generated (``json.dumps`` of a dict), never written by hand, and
``extraArgs`` may not override any argument this module sets (:data:`MANAGED_ARGUMENTS`, checked by
:mod:`.vllm_problems`).
"""

from __future__ import annotations

import json

from kvbridge_agent.core import CacheKind, KVCacheDtype, Role, TransferPlan
from kvbridge_agent.core.layout import rendered_order
from kvbridge_agent.core.model import LayerType
from kvbridge_agent.core.wire import ConversionKind
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import Connector, DisaggregatedDeployment, DisaggregatedDeploymentSpec, RoleSpec
from kvbridge_operator.api.transfer import KVBufferDevice
from kvbridge_operator.children import tracing
from kvbridge_operator.children.engines.kind import ServedEngine
from kvbridge_operator.children.engines.vllm_cpu import CPU_BIND_LAUNCHER, CPU_LAUNCHER_NOTE, cpu_build
from kvbridge_operator.children.model_source import Weights

# the vLLM release this renderer targets (config.VLLM_VERSION's minor release): the flags, variables and layout names
# below are that release's
from kvbridge_operator.config import VLLM_RELEASE as VLLM_RELEASE
from kvbridge_operator.config import OperatorConfig

#: what runs the engine: vLLM's API server
PROGRAM = ["vllm", "serve"]
#: vLLM 0.32's MLA backend kvbridge renders on GPUs, and the only block size it runs (with another, vLLM would pick
#: another MLA backend by itself, whose cache the plan did not describe)
MLA_BACKEND = "FLASHMLA"
MLA_BLOCK_SIZE = 64

#: vLLM's data-parallel arguments (long and short names): kvbridge sets them from ``spec.<role>.dataParallelSize``
DATA_PARALLEL_ARGUMENTS = (
    "--data-parallel-size",
    "-dp",
    "--data-parallel-size-local",
    "-dpl",
    "--data-parallel-rank",
    "-dpn",
    "--data-parallel-start-rank",
    "-dpr",
    "--data-parallel-address",
    "-dpa",
    "--data-parallel-rpc-port",
    "-dpp",
    "--data-parallel-backend",
    "-dpb",
    "--data-parallel-hybrid-lb",
    "-dph",
    "--data-parallel-external-lb",
    "-dpe",
    "--data-parallel-multi-port-external-lb",
    "-dpm",
)
#: the port of vLLM's data-parallel coordination (its default, rendered so the pod says it)
DATA_PARALLEL_RPC_PORT = 29550
#: torch.distributed's rendezvous on a multi-node engine's leader (vLLM's --master-port)
MASTER_PORT = 29500
#: arguments kvbridge sets from the spec; ``extraArgs`` naming one of them is refused
MANAGED_ARGUMENTS = (
    "--port",
    "--tensor-parallel-size",
    "-tp",
    "--block-size",
    "--kv-transfer-config",
    "--kv-cache-dtype",
    "--dtype",
    "--model",
    "--attention-backend",
    "--nnodes",
    "-n",
    "--node-rank",
    "-r",
    "--master-addr",
    "--master-port",
    "--headless",
    "--shutdown-timeout",
    *DATA_PARALLEL_ARGUMENTS,
    "--enable-expert-parallel",
    "-ep",
)
#: the spec field each managed argument comes from (what to change instead)
MANAGED_BY_FIELD = {
    "--port": "the operator's HTTP port setting",
    "--tensor-parallel-size": "spec.<role>.tensorParallelSize",
    "-tp": "spec.<role>.tensorParallelSize",
    "--block-size": "spec.<role>.blockSize",
    "--kv-transfer-config": "spec.transfer",
    "--kv-cache-dtype": "spec.model.kvCacheDtype",
    "--dtype": "spec.model.kvCacheDtype",
    "--model": "spec.model.name",
    "--attention-backend": "spec.model.attention",
    "--shutdown-timeout": "spec.transfer.drainSeconds",
    **dict.fromkeys(
        ("--nnodes", "-n", "--node-rank", "-r", "--master-addr", "--master-port", "--headless"), "spec.<role>.nodes"
    ),
    **dict.fromkeys(DATA_PARALLEL_ARGUMENTS, "spec.<role>.dataParallelSize"),
    **dict.fromkeys(("--enable-expert-parallel", "-ep"), "spec.<role>.expertParallel"),
}
#: why pipeline parallelism is refused rather than modelled
PIPELINE_STAGES = (
    "splits the layers over pipeline stages, each stage a KV cache of its own layers that prefill and decode would "
    "have to pair stage by stage (use spec.<role>.tensorParallelSize and spec.<role>.dataParallelSize instead)"
)
#: arguments that change what the plan and the pod's resources assume, and that kvbridge does not model yet
UNMODELLED_ARGUMENTS = {
    "--pipeline-parallel-size": PIPELINE_STAGES,
    "-pp": PIPELINE_STAGES,
    "--decode-context-parallel-size": "shards the KV cache over context-parallel ranks",
    "-dcp": "shards the KV cache over context-parallel ranks",
    "--config": "reads further arguments from a file kvbridge cannot check",
}


def argument_name(arg: str) -> str:
    """An argument's name as vLLM's parser reads it: ``--tensor_parallel_size=16`` is ``--tensor-parallel-size``
    (argparse there accepts underscores and the ``=`` form; the later of two flags wins)."""
    name = arg.split("=", 1)[0]
    if name.startswith("--"):
        return "--" + name[2:].replace("_", "-")
    return name


#: the port vLLM serves on behind the routing sidecar (the sidecar takes the pod's HTTP port)
VLLM_PORT_BEHIND_SIDECAR = 8200


def kv_buffer_device(spec: DisaggregatedDeploymentSpec) -> KVBufferDevice:
    """vLLM's ``kv_buffer_device``: ``spec.transfer.network.kvBufferDevice``, else the engine's own memory."""
    chosen = spec.transfer.network.kv_buffer_device
    if chosen is not None:
        return chosen
    return KVBufferDevice.CPU if cpu_build(spec) else KVBufferDevice.CUDA


#: where vLLM finds kvbridge's connector (``kv_connector_module_path``)
KVBRIDGE_CONNECTOR_MODULE = "kvbridge_agent.vllm_connector"


def uses_kvbridge(spec: DisaggregatedDeploymentSpec) -> bool:
    """Whether vLLM runs kvbridge's connector (``engine.connector: KVBridge``), not its own NixlConnector."""
    return spec.engine.connector is Connector.KVBRIDGE


def one_cache_group(spec: DisaggregatedDeploymentSpec) -> bool:
    """Whether vLLM runs without its hybrid allocator (``--disable-hybrid-kv-cache-manager``, one KV cache group)
    with kvbridge's connector, where the connector could not move the groups vLLM would make: the roles' block sizes
    differing in a model of several layer kinds (several groups move between equal block sizes only; one group
    converts between them), on any device; on vLLM's CPU build also chunked local attention layers (groups of
    their own, refused at start; in one group vLLM runs them as full attention). Otherwise vLLM keeps the
    allocator, as for NixlConnector, and the connector moves each group's blocks."""
    if not uses_kvbridge(spec):
        return False
    kinds = set(spec.model.layer_kinds)
    if spec.prefill.block_size != spec.decode.block_size and (len(kinds) > 1 or cpu_build(spec)):
        return True
    return cpu_build(spec) and LayerType.CHUNKED_LOCAL in kinds


def kv_transfer_config(spec: DisaggregatedDeploymentSpec, plan: TransferPlan, role: Role) -> Obj:
    """vLLM's ``KVTransferConfig`` for one role (vLLM 0.32): NixlConnector's, or kvbridge's connector, which reads
    everything else from kvbridge's environment contract."""
    if uses_kvbridge(spec):
        return {
            "kv_connector": "KVBridgeConnector",
            "kv_connector_module_path": KVBRIDGE_CONNECTOR_MODULE,
            "kv_role": "kv_producer" if role is Role.PREFILL else "kv_consumer",
            "kv_buffer_device": kv_buffer_device(spec).value,
        }
    extra: Obj = {"backends": list(spec.transfer.backends), "kv_lease_duration": spec.transfer.lease_seconds}
    config: Obj = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if role is Role.PREFILL else "kv_consumer",
        "kv_buffer_device": kv_buffer_device(spec).value,
        "kv_connector_extra_config": extra,
    }
    if role is Role.DECODE and any(s.kind is ConversionKind.PERMUTE for s in plan.wire.steps(Role.DECODE)):
        config["enable_permute_local_kv"] = True  # decode is NHD, the wire (prefill) HND: permute after reading
    return config


def kv_cache_layout(spec: DisaggregatedDeploymentSpec, role_spec: RoleSpec) -> str:
    """``VLLM_KV_CACHE_LAYOUT`` in vLLM 0.32's words (its ``KVCacheLayout`` member names)."""
    return rendered_order(role_spec.kv_layout, spec.model.cache_kind).value


def attention_backend(spec: DisaggregatedDeploymentSpec) -> str | None:
    """``--attention-backend``: the backend whose cache layout the spec describes (MLA on GPUs: FlashMLA)."""
    if cpu_build(spec):
        return "CPU_ATTN"
    if spec.model.is_mla:
        return MLA_BACKEND  # chosen, not left to vLLM: the block size the plan checked must be one it runs
    return "FLASHINFER" if spec.model.cache_kind is CacheKind.BLOCKS_FIRST else "FLASH_ATTN"


def behind_sidecar(role: Role, config: OperatorConfig) -> bool:
    """Whether this role's vLLM sits behind the routing sidecar (decode pods, when a sidecar image is set)."""
    return role is Role.DECODE and bool(config.routing_sidecar_image)


def engine(
    dd: DisaggregatedDeployment, role: Role, plan: TransferPlan, config: OperatorConfig, loaded: Weights
) -> ServedEngine:
    """What ``vllm serve`` runs with (``loaded``: the model's weights, ``model_source.weights``)."""
    spec = dd.spec
    role_spec: RoleSpec = spec.role(role)
    port = VLLM_PORT_BEHIND_SIDECAR if behind_sidecar(role, config) else config.engine_http_port
    transfer_config = kv_transfer_config(spec, plan, role)
    backend = attention_backend(spec)
    args = [
        loaded.model,
        *loaded.args,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(role_spec.tensor_parallel_size),
        "--block-size",
        str(role_spec.block_size),
        *_dtype_args(spec.model.kv_cache_dtype),
        *(["--attention-backend", backend] if backend else []),
        "--kv-transfer-config",
        json.dumps(transfer_config, separators=(",", ":"), sort_keys=True),
        # a block that prefill re-lays for the wire no longer matches its prefix-cache hash
        *(["--no-enable-prefix-caching"] if role is Role.PREFILL and plan.wire.steps(Role.PREFILL) else []),
        *(["--disable-hybrid-kv-cache-manager"] if one_cache_group(spec) else []),
        # SIGTERM drains the requests the engine has (children/termination.py: the pod's whole sequence)
        "--shutdown-timeout",
        str(spec.transfer.drain_seconds),
        *parallel_args(role_spec),
        *tracing.vllm_args(spec),
        *spec.engine.extra_args,
        *role_spec.extra_args,
    ]
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.transfer.side_channel_port),
        "VLLM_KV_CACHE_LAYOUT": kv_cache_layout(spec, role_spec),
    }
    launcher: list[str] = []
    if cpu_build(spec):
        env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.engine.cpu_kv_cache_gib)
        launcher = ["python3", "-c", CPU_BIND_LAUNCHER, str(role_spec.tensor_parallel_size)]
    return ServedEngine(
        program=PROGRAM,
        args=args,
        env=env,
        downward={"VLLM_NIXL_SIDE_CHANNEL_HOST": "status.podIP"},
        port=port,
        kv_transfer_config=transfer_config,
        launcher=launcher,
        launcher_note=CPU_LAUNCHER_NOTE if launcher else "",
    )


def parallel_args(role_spec: RoleSpec) -> list[str]:
    """vLLM's data- and expert-parallel arguments of one role's engine (none for DP 1 without EP). The engine's one
    API server spreads requests over its DP ranks (vLLM's internal load balancing); the DP ranks run in its one pod
    and coordinate on localhost, or over ``nodes`` pods of a LeaderWorkerSet group, each running its share
    (``--data-parallel-size-local``) and coordinating at the leader's address (multinode.py adds a worker's
    ``--headless`` and start rank). Each rank's NIXL side channel is on base port + its rank."""
    args: list[str] = []
    dp = role_spec.data_parallel_size
    if dp > 1:
        address = "$(LWS_LEADER_ADDRESS)" if role_spec.nodes > 1 else "127.0.0.1"
        args += [
            "--data-parallel-size",
            str(dp),
            "--data-parallel-size-local",
            str(dp // role_spec.nodes),
            "--data-parallel-address",
            address,
            "--data-parallel-rpc-port",
            str(DATA_PARALLEL_RPC_PORT),
        ]
    if role_spec.expert_parallel:
        args.append("--enable-expert-parallel")
    return args


def _dtype_args(dtype: KVCacheDtype) -> list[str]:
    """The KV cache element type: fp8 is a KV-cache setting, the 16/32-bit types follow the model dtype."""
    if dtype.value.startswith("fp8"):
        return ["--kv-cache-dtype", dtype.value]
    return ["--dtype", dtype.value, "--kv-cache-dtype", "auto"]
