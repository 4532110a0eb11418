"""vLLM engines (``spec.engine.kind: VLLM``): the engine kind that serves the model with ``vllm serve``.

What the kind answers (:class:`~.kind.EngineKindModule`): the problems vLLM refuses (:mod:`.vllm_problems`), the
pod it renders (``vllm serve``'s container from :mod:`.vllm_serve`, and on decode llm-d's routing sidecar in front
of it), its ports, health and metrics, and how ``kvbridge plan`` describes it. Specs on ``engine.device: CPU`` run
vLLM's CPU build (:mod:`.vllm_cpu`).
"""

from __future__ import annotations

from typing import Final

from kvbridge_agent.core import Role, TransferPlan
from kvbridge_operator.api.names import ENGINE_CONTAINER, LABEL_INFERENCE_POOL, LABEL_LLM_D_ROLE
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import (
    Connector,
    DisaggregatedDeployment,
    DisaggregatedDeploymentSpec,
    EngineDevice,
    RoleSpec,
)
from kvbridge_operator.api.transfer import KVBufferDevice
from kvbridge_operator.children import tracing
from kvbridge_operator.children.engines.kind import ServedEngine, api_port
from kvbridge_operator.children.engines.vllm_cpu import CPU_BASE_MEMORY_GIB, cpu_build
from kvbridge_operator.children.engines.vllm_problems import advisories as advisories
from kvbridge_operator.children.engines.vllm_problems import parallelism_problems as parallelism_problems
from kvbridge_operator.children.engines.vllm_problems import problems as problems
from kvbridge_operator.children.engines.vllm_problems import refused_extra_args as refused_extra_args
from kvbridge_operator.children.engines.vllm_serve import (
    DATA_PARALLEL_RPC_PORT,
    MASTER_PORT,
    VLLM_PORT_BEHIND_SIDECAR,
    behind_sidecar,
    engine,
    kv_buffer_device,
    uses_kvbridge,
)
from kvbridge_operator.children.model_source import Weights, weights
from kvbridge_operator.config import OperatorConfig

name: Final = "vllm"
program: Final = "vLLM"
health_path: Final = "/health"  # vLLM's OpenAI server: 200 once the engine is up
metrics_prefix: Final = "vllm:"
takes_extra_args: Final = True
tracing_flag: Final = tracing.VLLM_FLAG
serves_model: Final = True
pairing_name: Final = "VLLM"


def spans_nodes(spec: DisaggregatedDeploymentSpec) -> bool:
    """vLLM's multi-node launch spans nodes on GPUs (not on its CPU build)."""
    return spec.engine.device is EngineDevice.GPU


def on_cpu(spec: DisaggregatedDeploymentSpec, config: OperatorConfig) -> bool:
    """vLLM pods follow the spec alone (its CPU rules are part of the verdict), not the operator's CPU mode."""
    return cpu_build(spec)


def connector(spec: DisaggregatedDeploymentSpec) -> Connector:
    """``spec.engine.connector``: vLLM's NixlConnector or kvbridge's."""
    return spec.engine.connector


def host_buffer(spec: DisaggregatedDeploymentSpec) -> bool:
    """On GPUs with ``kv_buffer_device: cpu`` (its CPU build keeps the whole cache in host memory: no buffer)."""
    return not cpu_build(spec) and kv_buffer_device(spec) is KVBufferDevice.CPU


def kvbridge_transfer(spec: DisaggregatedDeploymentSpec) -> bool:
    """kvbridge's connector moves KV with kvbridge's transfer layer; vLLM's NixlConnector with its own."""
    return uses_kvbridge(spec)


def ports(spec: DisaggregatedDeploymentSpec, role: Role, config: OperatorConfig) -> dict[int, str]:
    """The HTTP API (the routing sidecar's on decode, when one is set, with vLLM behind it), with several
    data-parallel ranks vLLM's coordination, and for an engine over several nodes its leader's rendezvous."""
    found = api_port(config)
    if behind_sidecar(role, config):
        found[config.engine_http_port] = "the routing sidecar (the operator's engineHttpPort)"
        found[VLLM_PORT_BEHIND_SIDECAR] = "vLLM behind the routing sidecar"
    if spec.role(role).data_parallel_size > 1:
        found[DATA_PARALLEL_RPC_PORT] = "vLLM's data-parallel RPC port (--data-parallel-rpc-port)"
    if spec.role(role).nodes > 1:
        found[MASTER_PORT] = "torch.distributed's rendezvous on the engine's leader pod (--master-port)"
    return found


def pod_labels(
    spec: DisaggregatedDeploymentSpec, role: Role, config: OperatorConfig, deployment: str
) -> dict[str, str]:
    """llm-d's role label, what its scheduler (and the routing sidecar's) selects prefill and decode pods by; the
    InferencePool's label, what the pool selects: engines only."""
    labels: dict[str, str] = {}
    if config.routing_sidecar_image or spec.inference_pool.enabled:
        labels[LABEL_LLM_D_ROLE] = role.value.lower()
    if spec.inference_pool.enabled:
        labels[LABEL_INFERENCE_POOL] = deployment
    return labels


def words(spec: DisaggregatedDeploymentSpec) -> str:
    """``vLLM on GPU, NixlConnector``."""
    return f"vLLM on {spec.engine.device.value}, {spec.engine.connector.value}Connector"


def described(spec: DisaggregatedDeploymentSpec) -> dict[str, str]:
    """The connector and ``kvBufferDevice`` (vLLM's ``kv_buffer_device``)."""
    return {"connector": spec.engine.connector.value, "kvBufferDevice": kv_buffer_device(spec).value}


def report_lines(spec: DisaggregatedDeploymentSpec) -> list[str]:
    """None: vLLM serves the model the spec names."""
    return []


def served(dd: DisaggregatedDeployment, role: Role, plan: TransferPlan, config: OperatorConfig) -> ServedEngine:
    """``vllm serve`` as the role's pods run it."""
    return engine(dd, role, plan, config, weights(dd.spec.model))


def default_image(spec: DisaggregatedDeploymentSpec, config: OperatorConfig) -> tuple[str, str]:
    """The operator's vLLM image for the connector and device: with kvbridge's connector kvbridge's engine image
    (vLLM with kvbridge installed), else vLLM's own."""
    if uses_kvbridge(spec):
        if cpu_build(spec):
            return config.kvbridge_vllm_cpu_image, "kvbridge_vllm_cpu_image"
        return config.kvbridge_vllm_image, "kvbridge_vllm_image"
    if cpu_build(spec):
        return config.vllm_cpu_image, "vllm_cpu_image"
    return config.vllm_image, "vllm_image"


def image(spec: DisaggregatedDeploymentSpec, config: OperatorConfig) -> str:
    """The spec's image, else the operator's default (:func:`default_image`)."""
    return spec.engine.image or default_image(spec, config)[0]


def resources(spec: DisaggregatedDeploymentSpec, role_spec: RoleSpec, config: OperatorConfig) -> Obj:
    """GPU pods: DP x TP GPUs (/ nodes for an engine spanning nodes) and room to load weights; CPU pods: one core per
    TP rank (requests = limits, so a static CPU manager can give the pod whole cores) and the KV cache space on top of
    the process memory."""
    tp = role_spec.tensor_parallel_size
    if cpu_build(spec):
        amount = {"cpu": str(tp), "memory": f"{spec.engine.cpu_kv_cache_gib + CPU_BASE_MEMORY_GIB * tp}Gi"}
        return {"requests": amount, "limits": dict(amount)}
    # every DP rank's TP ranks; an engine spanning nodes: each node's pod holds its share of the ranks
    gpus = str(role_spec.world_size // role_spec.nodes)
    return {
        "requests": {"cpu": "4", "memory": "32Gi", config.gpu_resource: gpus},
        "limits": {config.gpu_resource: gpus},
    }


def pod(
    dd: DisaggregatedDeployment,
    role: Role,
    plan: TransferPlan,
    config: OperatorConfig,
    env: list[Obj],
    side_channels: list[Obj],
    keys_volume: Obj,
) -> tuple[list[Obj], list[Obj]]:
    """A vLLM pod's containers — ``vllm serve`` (and, on decode with the routing sidecar, the sidecar in front of it)
    — and its volumes. With NixlConnector no key Secret: its side channel has no CURVE, the NetworkPolicy is what
    limits who reaches it; kvbridge's connector gets the Secret (``keys_volume``), as the synthetic engine does."""
    loaded = weights(dd.spec.model)
    served = container(dd, role, plan, config, env, loaded)
    served["ports"].extend(side_channels)
    served["securityContext"] = {"allowPrivilegeEscalation": False}
    volumes: list[Obj] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}, *loaded.volumes]
    if uses_kvbridge(dd.spec):
        volumes.append(keys_volume)
        served["volumeMounts"].append(
            {"name": keys_volume["name"], "mountPath": config.keys_mount_path, "readOnly": True}
        )
    return ([routing_sidecar(config), served] if behind_sidecar(role, config) else [served]), volumes


def container(
    dd: DisaggregatedDeployment,
    role: Role,
    plan: TransferPlan,
    config: OperatorConfig,
    base_env: list[Obj],
    loaded: Weights,
) -> Obj:
    """The ``engine`` container running ``vllm serve`` with its HTTP port (named ``http``, or ``vllm`` behind the
    routing sidecar), its GPUs or CPUs; further ports are the caller's."""
    vllm = engine(dd, role, plan, config, loaded)
    env = [*base_env, *({"name": k, "value": v} for k, v in vllm.env.items())]
    env += [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": v}}} for k, v in vllm.downward.items()]
    env += loaded.env
    probe = {"httpGet": {"path": health_path, "port": vllm.port}}
    return {
        "name": ENGINE_CONTAINER,
        "image": image(dd.spec, config),
        "command": [*vllm.launcher, *vllm.program],
        "args": vllm.args,
        "env": env,
        "ports": [
            {"name": "vllm" if behind_sidecar(role, config) else "http", "containerPort": vllm.port, "protocol": "TCP"}
        ],
        # loading weights and compiling take minutes: the startup probe allows 30 min before liveness applies
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
        "resources": resources(dd.spec, dd.spec.role(role), config),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, *loaded.mounts],  # dshm: NCCL, TP ranks' memory
    }


def routing_sidecar(config: OperatorConfig) -> Obj:
    """llm-d's routing sidecar in front of a decode vLLM: it takes the pod's HTTP port, asks the prefill pod
    named by the router (``x-prefiller-host-port``) to prefill, then forwards to vLLM behind it."""
    return {
        "name": "routing-sidecar",
        "image": config.routing_sidecar_image,
        "args": [
            f"--port={config.engine_http_port}",
            f"--vllm-port={VLLM_PORT_BEHIND_SIDECAR}",
            *config.routing_sidecar_args,
        ],
        "ports": [{"name": "http", "containerPort": config.engine_http_port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": config.engine_http_port}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
