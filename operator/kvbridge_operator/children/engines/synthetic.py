"""The synthetic engine (``spec.engine.kind: Synthetic``, formerly ``Agent``): kvbridge's own engine worker,
``kvbridge-agent serve``.

It moves real KV bytes through kvbridge's transfer layer and serves no model: for tests and benchmarks, on GPUs or
on host memory (the operator's CPU mode, or ``engine.device: CPU``). Its data-parallel ranks run in its one pod; it
spans no nodes, takes no ``extraArgs`` and has no experts to shard.
"""

from __future__ import annotations

from typing import Final

from kvbridge_agent.core import Problem, Role, TransferPlan
from kvbridge_operator.api.names import ENGINE_CONTAINER, HTTP_PORT_NAME, KEYS_VOLUME
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import Connector, DisaggregatedDeployment, DisaggregatedDeploymentSpec, EngineDevice
from kvbridge_operator.children.engines.kind import ServedEngine, api_port
from kvbridge_operator.config import OperatorConfig

name: Final = "synthetic"
program: Final = "synthetic engine"
health_path: Final = "/healthz"  # the worker's HTTP API: 200 once its ranks hold their KV cache
metrics_prefix: Final = ""
takes_extra_args: Final = False
tracing_flag: Final = ""
serves_model: Final = False
pairing_name: Final = "Agent"  # its CRD value when its first pods ran (now Synthetic; Agent is still read)

#: expert parallelism asked of the synthetic engine, which serves no model (its DP ranks it runs)
EXPERT_PARALLEL_ON_SYNTHETIC = "EXPERT_PARALLEL_ON_SYNTHETIC"


def problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """Nothing beyond the shared checks: the worker runs whatever the compatibility rules allow."""
    return []


def parallelism_problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """Expert parallelism: the synthetic engine serves no model, so it has no experts (its DP ranks it runs)."""
    found: list[Problem] = []
    for role in Role:
        ep_field = f"spec.{role.value}.expertParallel"
        if spec.role(role).expert_parallel:
            found.append(
                Problem(
                    EXPERT_PARALLEL_ON_SYNTHETIC,
                    ep_field,
                    f"{role.value} asks for expert parallelism, and the synthetic engine (kind Synthetic) serves no "
                    f"model, so it has no experts to shard: set {ep_field}: false, or spec.engine.kind: VLLM",
                )
            )
    return found


def advisories(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """None: the worker runs what the spec asks."""
    return []


def spans_nodes(spec: DisaggregatedDeploymentSpec) -> bool:
    """An engine is one pod."""
    return False


def refused_extra_args(spec: DisaggregatedDeploymentSpec) -> list[str]:
    """None: ``spec.engine.extraArgs`` do not reach the worker."""
    return []


def on_cpu(spec: DisaggregatedDeploymentSpec, config: OperatorConfig) -> bool:
    """``engine.device: CPU``, or the operator's CPU mode (agents move host memory)."""
    return config.cpu_mode or spec.engine.device is EngineDevice.CPU


def connector(spec: DisaggregatedDeploymentSpec) -> Connector | None:
    """None: the worker is kvbridge's transfer layer itself (``spec.engine.connector`` does not apply)."""
    return None


def host_buffer(spec: DisaggregatedDeploymentSpec) -> bool:
    """Never: its ranks register their own KV memory."""
    return False


def kvbridge_transfer(spec: DisaggregatedDeploymentSpec) -> bool:
    """Always: the worker is built on kvbridge's transfer layer."""
    return True


def ports(spec: DisaggregatedDeploymentSpec, role: Role, config: OperatorConfig) -> dict[int, str]:
    """Its HTTP API alone."""
    return api_port(config)


def pod(
    dd: DisaggregatedDeployment,
    role: Role,
    plan: TransferPlan,
    config: OperatorConfig,
    env: list[Obj],
    side_channels: list[Obj],
    keys_volume: Obj,
) -> tuple[list[Obj], list[Obj]]:
    """The worker's container (:func:`container`) and the key Secret's volume."""
    return [container(dd, role, config, env, side_channels)], [keys_volume]


def container(
    dd: DisaggregatedDeployment, role: Role, config: OperatorConfig, env: list[Obj], side_channels: list[Obj]
) -> Obj:
    """The ``engine`` container running ``kvbridge-agent serve``: kvbridge's environment contract (``env``), its
    HTTP port and, on prefill, the side channels; GPUs unless on CPU."""
    # the worker needs little besides its KV cache; override with the role's template
    resources: Obj = {"requests": {"cpu": "1", "memory": "2Gi"}}
    if not on_cpu(dd.spec, config):
        role_spec = dd.spec.role(role)
        gpus = str(role_spec.world_size // role_spec.nodes)  # every DP rank's TP ranks (multinode.gpus_per_pod)
        resources = {
            "requests": {**resources["requests"], config.gpu_resource: gpus},
            "limits": {config.gpu_resource: gpus},
        }
    listened = [{"name": HTTP_PORT_NAME, "containerPort": config.engine_http_port, "protocol": "TCP"}]
    if role is Role.PREFILL:  # a side channel per data-parallel rank
        listened += side_channels
    probe = {"httpGet": {"path": health_path, "port": HTTP_PORT_NAME}, "periodSeconds": 5, "failureThreshold": 3}
    return {
        "name": ENGINE_CONTAINER,
        "image": dd.spec.engine.image or default_image(dd.spec, config)[0],
        "command": ["kvbridge-agent", "serve"],
        "env": env,
        "ports": listened,
        "resources": resources,
        "readinessProbe": probe,
        "livenessProbe": {**probe, "initialDelaySeconds": 30, "failureThreshold": 6},
        "volumeMounts": [{"name": KEYS_VOLUME, "mountPath": config.keys_mount_path, "readOnly": True}],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }


def pod_labels(
    spec: DisaggregatedDeploymentSpec, role: Role, config: OperatorConfig, deployment: str
) -> dict[str, str]:
    """None: llm-d's scheduler and the InferencePool select vLLM engines only."""
    return {}


def default_image(spec: DisaggregatedDeploymentSpec, config: OperatorConfig) -> tuple[str, str]:
    """The operator's image of the synthetic engine (``kvbridge-agent serve``)."""
    return config.synthetic_image, "synthetic_image"


def words(spec: DisaggregatedDeploymentSpec) -> str:
    """``synthetic engine on CPU, serves no model``."""
    return f"synthetic engine on {spec.engine.device.value}, serves no model"


def described(spec: DisaggregatedDeploymentSpec) -> dict[str, str]:
    """Nothing besides the kind and the device."""
    return {}


#: what the text report says of the synthetic engine right after its first line
SERVES_NO_MODEL = (
    "  the synthetic engine serves no model: kvbridge's own worker moves real KV bytes between prefill and decode "
    "and checks every byte, for tests and benchmarks; to serve the model set spec.engine.kind: VLLM"
)


def report_lines(spec: DisaggregatedDeploymentSpec) -> list[str]:
    """That it serves no model, and which kind does."""
    return [SERVES_NO_MODEL]


def served(dd: DisaggregatedDeployment, role: Role, plan: TransferPlan, config: OperatorConfig) -> ServedEngine | None:
    """None: the plan prints no command for the worker (its environment is the contract, docs/environment.md)."""
    return None
