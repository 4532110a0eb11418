"""What a role's ``template`` overlay may change, checked before scheduling: the pod runs what was checked.

The overlay is merged into the rendered pod template as a strategic merge patch (render.py): containers and env by
name, ports by number, other lists replaced. Whatever kvbridge renders from the checked plan stays kvbridge's:

* the ``engine`` container's ``command`` and ``args`` (an overlay's list would replace the whole command line, KV
  transfer configuration, TP and block size included): vLLM arguments go in ``spec.engine.extraArgs`` or
  ``spec.<role>.extraArgs``, which are checked;
* the environment kvbridge sets on it (the agent's contract, ``KVBRIDGE_*``; vLLM's side channel, cache layout and
  CPU settings; the model source's ``HF_*``) and its ports (HTTP, side channel, rendezvous);
* the pod labels kvbridge reads (``kvbridge.io/*``: role, fingerprint, pairing, revision; llm-d's role; the pod
  group; LeaderWorkerSet's);
* the GPUs of the engine container, which must equal the ranks each pod runs.

Everything else (images, resources other than GPUs, node selection, tolerations, volumes, sidecars, other env and
labels) is the user's. Each refusal names the overlay's field and what to set instead.
"""

from __future__ import annotations

from typing import Any

from kvbridge_agent.core import Problem, Role
from kvbridge_operator.api.names import (
    ENGINE_CONTAINER,
    HTTP_PORT_NAME,
    LABEL_LLM_D_ROLE,
    LABEL_POD_GROUP,
    LABEL_WORKER_INDEX,
    SIDE_CHANNEL_PORT_NAME,
)
from kvbridge_operator.api.spec import DisaggregatedDeploymentSpec, EngineKind

TEMPLATE_MANAGED_FIELD = "TEMPLATE_MANAGED_FIELD"
TEMPLATE_GPUS = "TEMPLATE_GPUS"
TEMPLATE_INVALID = "TEMPLATE_INVALID"
EXTRA_ARGS_NEED_VLLM = "EXTRA_ARGS_NEED_VLLM"

#: environment variables kvbridge renders on the engine container (besides every KVBRIDGE_* of the agent's contract)
MANAGED_ENV = frozenset({
    "VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_KV_CACHE_LAYOUT", "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND", "HF_TOKEN", "HF_HOME", "UCX_TLS", "UCX_NET_DEVICES",
})  # fmt: skip
MANAGED_ENV_PREFIX = "KVBRIDGE_"
#: the KVBRIDGE_* variables that tune one engine without deciding anything the plan checked (capacity, checks,
#: allocation order, NIXL and UCX modes, a deadline, the bind address): a template may set them
TUNABLE_ENV = frozenset({
    "KVBRIDGE_NUM_BLOCKS", "KVBRIDGE_VERIFY", "KVBRIDGE_BLOCK_ALLOCATION", "KVBRIDGE_NIXL_PROGRESS_THREAD",
    "KVBRIDGE_UCX_ERROR_HANDLING", "KVBRIDGE_TRANSFER_TIMEOUT_SECONDS", "KVBRIDGE_HTTP_HOST",
})  # fmt: skip
#: container port names kvbridge renders (``vllm``: vLLM behind llm-d's routing sidecar)
MANAGED_PORTS = frozenset({HTTP_PORT_NAME, SIDE_CHANNEL_PORT_NAME, "rendezvous", "vllm"})
#: pod labels kvbridge or the schedulers it renders for read
MANAGED_LABEL_PREFIX = "kvbridge.io/"
MANAGED_LABELS = frozenset({LABEL_LLM_D_ROLE, LABEL_POD_GROUP, LABEL_WORKER_INDEX, "app.kubernetes.io/managed-by"})


def problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """Every change a role's template overlay makes to what kvbridge renders from the checked plan; and per-role
    ``extraArgs`` on an engine that takes none."""
    found: list[Problem] = []
    for role in Role:
        role_spec = spec.role(role)
        where = f"spec.{role.value}"
        if role_spec.extra_args and spec.engine.kind is not EngineKind.VLLM:
            found.append(Problem(EXTRA_ARGS_NEED_VLLM, f"{where}.extraArgs", (
                f"{where}.extraArgs passes arguments to vllm serve, and spec.engine.kind is "
                f"{spec.engine.kind.value}: remove them, or set spec.engine.kind: VLLM")))  # fmt: skip
        if role_spec.template:
            found += _template(role_spec.template, f"{where}.template",
                               role_spec.tensor_parallel_size // max(role_spec.nodes, 1))  # fmt: skip
    return found


def _template(template: dict[str, Any], where: str, gpus: int) -> list[Problem]:
    found: list[Problem] = []
    labels = (template.get("metadata") or {}).get("labels") or {}
    if not isinstance(labels, dict):
        return [Problem(TEMPLATE_INVALID, f"{where}.metadata.labels",
                        "labels must be a map of strings: write them as {key: value}")]  # fmt: skip
    for key in labels:
        if str(key).startswith(MANAGED_LABEL_PREFIX) or key in MANAGED_LABELS:
            found.append(Problem(TEMPLATE_MANAGED_FIELD, f"{where}.metadata.labels.{key}", (
                f"the label {key} is kvbridge's (routers, rollouts and schedulers pair and count pods by it); "
                "remove it from the template, or use a label of your own")))  # fmt: skip
    containers = (template.get("spec") or {}).get("containers")
    if containers is None:
        return found
    if not isinstance(containers, list) or not all(isinstance(c, dict) and "name" in c for c in containers):
        return [*found, Problem(TEMPLATE_INVALID, f"{where}.spec.containers", (
            f"containers must be a list of objects with a name: write them as [{{name: {ENGINE_CONTAINER}, ...}}] "
            f"(the overlay is merged by container name; the engine's is {ENGINE_CONTAINER!r})"))]  # fmt: skip
    for index, container in enumerate(containers):
        if container["name"] == ENGINE_CONTAINER:
            found += _engine(container, f"{where}.spec.containers[{index}]", gpus)
    return found


def _engine(container: dict[str, Any], where: str, gpus: int) -> list[Problem]:
    found: list[Problem] = []
    for field in ("command", "args"):
        if field in container:
            found.append(Problem(TEMPLATE_MANAGED_FIELD, f"{where}.{field}", (
                f"the engine's {field} is rendered from the checked plan (KV transfer configuration, TP, block "
                "size, layout, attention backend, side channel) and an overlay would replace all of it: remove "
                f"{field} from the template and put vLLM arguments in spec.engine.extraArgs or the role's "
                "extraArgs, which are checked before scheduling")))  # fmt: skip
    for position, variable in enumerate(container.get("env") or []):
        name = variable.get("name") if isinstance(variable, dict) else None
        managed = name.startswith(MANAGED_ENV_PREFIX) and name not in TUNABLE_ENV if isinstance(name, str) else False
        if isinstance(name, str) and (managed or name in MANAGED_ENV):
            found.append(Problem(TEMPLATE_MANAGED_FIELD, f"{where}.env[{position}]", (
                f"{name} is set by kvbridge from the spec; remove it from the template and set the spec field it "
                "comes from (docs/environment.md lists them)")))  # fmt: skip
    for position, port in enumerate(container.get("ports") or []):
        name = port.get("name") if isinstance(port, dict) else None
        if name in MANAGED_PORTS:
            found.append(Problem(TEMPLATE_MANAGED_FIELD, f"{where}.ports[{position}]", (
                f"the port {name} is kvbridge's (its number comes from the spec and is published in the status); "
                "remove it from the template (spec.transfer.sideChannelPort sets the side channel's)")))  # fmt: skip
    resources = container.get("resources") or {}
    for kind in ("requests", "limits"):
        for resource, amount in (resources.get(kind) or {}).items() if isinstance(resources, dict) else ():
            if str(resource).endswith("/gpu") and str(amount) != str(gpus):
                found.append(Problem(TEMPLATE_GPUS, f"{where}.resources.{kind}.{resource}", (
                    f"each pod of this role runs {gpus} TP rank(s), one per GPU, and the template asks {amount}: "
                    f"remove the GPU {kind} from the template (kvbridge sets {gpus}), or change "
                    "tensorParallelSize")))  # fmt: skip
    return found
