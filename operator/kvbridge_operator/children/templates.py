"""What a role's ``template`` overlay may change, checked before scheduling: the pod runs what was checked.

The overlay is merged into the rendered pod template as a strategic merge patch (objects/shared.py): containers, env and
volumes by name, ports by number, mounts by path, other lists replaced. Whatever kvbridge renders from the checked
plan stays kvbridge's:

* the ``engine`` container's ``command`` and ``args`` (an overlay's list would replace the whole command line, KV
  transfer configuration, TP and block size included): vLLM arguments go in ``spec.engine.extraArgs`` or
  ``spec.<role>.extraArgs``, which are checked;
* the environment kvbridge sets on it (the agent's contract, ``KVBRIDGE_*``; vLLM's side channel, cache layout and
  CPU settings; the model source's ``HF_*``) and its ports (HTTP, side channel, rendezvous);
* the pod labels kvbridge reads (``kvbridge.io/*``: role, fingerprint, pairing, revision; llm-d's role; the pod
  group; LeaderWorkerSet's);
* the GPUs of the engine container, which must equal the ranks each pod runs;
* the RDMA resources, the ``IPC_LOCK`` capability and Multus' annotation that ``spec.transfer.network`` renders;
* the volumes and mounts kvbridge renders (shared memory, the key Secret, the model's).

Everything else (images, resources other than GPUs, node selection, tolerations, probes, other volumes, sidecars,
other env and labels) is the user's. Each refusal names the overlay's field and what to write instead.

What the user writes is what runs, for nulls and odd values too: a null in a strategic merge patch deletes the
field, and an item without its merge key (an env variable without a name, a port without its number) makes the
overlay's list replace kvbridge's whole list, so a null over a field that holds kvbridge's values is refused
(``TEMPLATE_NULL``), as are items without their merge key, duplicates and values of the wrong type
(``TEMPLATE_INVALID``). A null over a field of the user's (``nodeSelector: null``, ``livenessProbe: null``)
is merged as written. Then, once the spec is compatible, template_changes.py renders each role's pod with
and without its overlay and refuses any value kvbridge rendered that the overlay changed or removed (an item
that merges into kvbridge's by its key: a port on kvbridge's number, a mount on its path, a volume of its name),
for the operator's settings (its HTTP port, GPU resource, key mount path): the pod runs what was checked.
"""

from __future__ import annotations

import json
from typing import Any

from kvbridge_agent.core import Problem, Role
from kvbridge_agent.core import tracing as trace_words
from kvbridge_operator.api.names import (
    ENGINE_CONTAINER,
    HTTP_PORT_NAME,
    LABEL_LLM_D_ROLE,
    LABEL_POD_GROUP,
    LABEL_WORKER_INDEX,
    SIDE_CHANNEL_PORT_NAME,
    is_side_channel_port_name,
)
from kvbridge_operator.api.spec import DisaggregatedDeploymentSpec
from kvbridge_operator.children.engines import engine_of
from kvbridge_operator.children.network import NETWORKS_ANNOTATION, is_gpu_resource

TEMPLATE_MANAGED_FIELD = "TEMPLATE_MANAGED_FIELD"
TEMPLATE_GPUS = "TEMPLATE_GPUS"
TEMPLATE_INVALID = "TEMPLATE_INVALID"
TEMPLATE_NULL = "TEMPLATE_NULL"
EXTRA_ARGS_NEED_VLLM = "EXTRA_ARGS_NEED_VLLM"

#: environment variables kvbridge renders on the engine container (besides every KVBRIDGE_* of the agent's contract)
MANAGED_ENV = frozenset(
    {
        "VLLM_NIXL_SIDE_CHANNEL_PORT",
        "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "VLLM_KV_CACHE_LAYOUT",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_CPU_OMP_THREADS_BIND",
        "HF_TOKEN",
        "HF_HOME",
        "UCX_TLS",
        "UCX_NET_DEVICES",
        # spec.tracing's OpenTelemetry variables (children/tracing.py)
        trace_words.ENV_ENDPOINT,
        trace_words.ENV_PROTOCOL,
        trace_words.ENV_SAMPLER,
        trace_words.ENV_SAMPLER_ARG,
        trace_words.ENV_SERVICE_NAME,
    }
)
MANAGED_ENV_PREFIX = "KVBRIDGE_"
#: the KVBRIDGE_* variables that tune one engine without deciding anything the plan checked (capacity, checks,
#: allocation order, NIXL and UCX modes, deadlines, the bind address, the HTTP server's cap): a template may set them
TUNABLE_ENV = frozenset(
    {
        "KVBRIDGE_NUM_BLOCKS",
        "KVBRIDGE_VERIFY",
        "KVBRIDGE_BLOCK_ALLOCATION",
        "KVBRIDGE_NIXL_PROGRESS_THREAD",
        "KVBRIDGE_UCX_ERROR_HANDLING",
        "KVBRIDGE_TRANSFER_TIMEOUT_SECONDS",
        "KVBRIDGE_HTTP_HOST",
        "KVBRIDGE_HTTP_REQUEST_SECONDS",
        "KVBRIDGE_HTTP_MAX_CONNECTIONS",
        # the synthetic engine's set speed (agent synthetic/pace.py)
        "KVBRIDGE_SYNTHETIC_PREFILL_MS_PER_TOKEN",
        "KVBRIDGE_SYNTHETIC_DECODE_ITL_MS",
        "KVBRIDGE_SYNTHETIC_DECODE_ITL_MS_PER_SEQUENCE",
    }
)
#: container port names kvbridge renders (``vllm``: vLLM behind llm-d's routing sidecar)
MANAGED_PORTS = frozenset({HTTP_PORT_NAME, SIDE_CHANNEL_PORT_NAME, "rendezvous", "vllm"})
#: pod labels kvbridge or the schedulers it renders for read
MANAGED_LABEL_PREFIX = "kvbridge.io/"
MANAGED_LABELS = frozenset({LABEL_LLM_D_ROLE, LABEL_POD_GROUP, LABEL_WORKER_INDEX, "app.kubernetes.io/managed-by"})


def problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """Every change a role's template overlay makes to what kvbridge renders from the checked plan that can be
    seen without rendering (nulls, odd items, kvbridge's names); and per-role ``extraArgs`` on an engine that takes
    none."""
    found: list[Problem] = []
    for role in Role:
        role_spec = spec.role(role)
        where = f"spec.{role.value}"
        if role_spec.extra_args and not engine_of(spec).takes_extra_args:
            message = _EXTRA_ARGS.format(where=where, kind=spec.engine.kind.value)
            found.append(Problem(EXTRA_ARGS_NEED_VLLM, f"{where}.extraArgs", message))
        if role_spec.template:
            gpus = role_spec.world_size // max(role_spec.nodes, 1)
            found += _template(role_spec.template, f"{where}.template", gpus, spec)
    return found


_EXTRA_ARGS = (
    "{where}.extraArgs passes arguments to vllm serve, and spec.engine.kind is {kind}: remove them, or set "
    "spec.engine.kind: VLLM"
)
_NULL = (
    "{field} is null, and a null in the overlay deletes the field (a strategic merge patch's null), {what} with it; "
    "leave the key out to keep kvbridge's, or write the value you want"
)
_NOT_A_MAP = "{field} must be a map: write it as {{key: value}}, or leave it out"
_NOT_A_LIST = "{field} must be a list of {items}: write it as [{example}], or leave it out"
_NOT_A_STRING = 'the {what} {name} is {value}, and {kind} are strings: write it quoted ({name}: "{text}")'
_NULL_STRING = 'the {what} {name} is null, and {kind} are strings: write one ({name}: "VALUE"), or leave it out'
_ENV_NOT_A_STRING = 'the value of {name} is {value}, and environment values are strings: write value: "{text}"'
_TWICE = "{what} is listed twice in the overlay ({field}); write it once"
_NO_KEY = (
    "each item of {field} needs its {key} ({example}): the overlay merges {items} by {key}, and a list with an "
    "item without one replaces kvbridge's whole list; write {example}"
)
_CONTAINERS = (
    "containers must be a list of objects with a name: write them as [{{name: {engine}, ...}}] (the overlay is "
    "merged by container name; the engine's is {engine!r})"
)
_MANAGED_LABEL = (
    "the label {name} is kvbridge's (routers, rollouts and schedulers pair and count pods by it); remove it from "
    "the template, or use a label of your own"
)
_MANAGED_ANNOTATION = (
    "the annotation {name} is rendered from spec.transfer.network.secondaryNetworks; remove it from the template "
    "and list the networks there"
)
_MANAGED_COMMAND = (
    "the engine's {field} is rendered from the checked plan (KV transfer configuration, TP, block size, layout, "
    "attention backend, side channel) and an overlay would replace all of it: remove {field} from the template "
    "and put vLLM arguments in spec.engine.extraArgs or the role's extraArgs, which are checked before scheduling"
)
_MANAGED_ENV = (
    "{name} is set by kvbridge from the spec; remove it from the template and set the spec field it comes from "
    "(docs/environment.md lists them)"
)
_MANAGED_PORT = (
    "the port {name} is kvbridge's (its number comes from the spec and is published in the status); remove it "
    "from the template (spec.transfer.sideChannelPort sets the side channel's)"
)
_GPUS = (
    "each pod of this role runs {gpus} rank(s) (DP x TP / nodes), one per GPU, and the template asks {amount}: "
    "remove the GPU {kind} from the template (kvbridge sets {gpus}), or change tensorParallelSize or "
    "dataParallelSize"
)
_MANAGED_RDMA = (
    "{resource} is rendered from spec.transfer.network.rdmaResources ({count}), and the template asks {amount}: "
    "remove it from the template and change rdmaResources"
)
#: what kvbridge renders under each field of a template whose null would delete it
_HOLDS = {
    "metadata": "kvbridge's labels",
    "labels": "kvbridge's labels (routers, rollouts and schedulers pair and count pods by them)",
    "annotations": "kvbridge's annotations (Multus' networks)",
    "spec": "kvbridge's containers and volumes",
    "containers": "the engine container",
    "volumes": "kvbridge's volumes (shared memory, the key Secret, the model's)",
    "env": "kvbridge's environment (the agent's contract, vLLM's side channel and cache layout)",
    "ports": "kvbridge's ports (HTTP, side channel)",
    "resources": "the GPUs the ranks need",
    "requests": "the GPUs the ranks need",
    "limits": "the GPUs the ranks need",
    "volumeMounts": "kvbridge's mounts (shared memory, the key Secret, the model's)",
}


def _null(field: str, key: str) -> Problem:
    return Problem(TEMPLATE_NULL, field, _NULL.format(field=field, what=_HOLDS.get(key, "kvbridge's value")))


def _invalid(field: str, message: str) -> Problem:
    return Problem(TEMPLATE_INVALID, field, message)


def _managed(field: str, message: str) -> Problem:
    return Problem(TEMPLATE_MANAGED_FIELD, field, message)


def _template(template: dict[str, Any], where: str, gpus: int, spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    found: list[Problem] = []
    for key in ("metadata", "spec"):
        if key in template and template[key] is None:
            found.append(_null(f"{where}.{key}", key))
        elif key in template and not isinstance(template[key], dict):
            found.append(_invalid(f"{where}.{key}", _NOT_A_MAP.format(field=f"{where}.{key}")))
    metadata = template.get("metadata")
    if isinstance(metadata, dict):
        found += _metadata(metadata, f"{where}.metadata")
    pod = template.get("spec")
    if isinstance(pod, dict):
        found += _pod(pod, f"{where}.spec", gpus, spec)
    return found


def _metadata(metadata: dict[str, Any], where: str) -> list[Problem]:
    found: list[Problem] = []
    for key, what in (("labels", "label"), ("annotations", "annotation")):
        if key not in metadata:
            continue
        values = metadata[key]
        field = f"{where}.{key}"
        if values is None:
            found.append(_null(field, key))
        elif not isinstance(values, dict):
            found.append(_invalid(field, _NOT_A_MAP.format(field=field)))
        for name, value in values.items() if isinstance(values, dict) else ():
            if not isinstance(value, str):
                wrong = _NULL_STRING if value is None else _NOT_A_STRING
                message = wrong.format(what=what, name=name, value=json.dumps(value), kind=key, text=value)
                found.append(_invalid(f"{field}.{name}", message))
            elif key == "labels" and (name.startswith(MANAGED_LABEL_PREFIX) or name in MANAGED_LABELS):
                found.append(_managed(f"{field}.{name}", _MANAGED_LABEL.format(name=name)))
            elif key == "annotations" and name == NETWORKS_ANNOTATION:
                found.append(_managed(f"{field}.{name}", _MANAGED_ANNOTATION.format(name=name)))
    return found


def _pod(pod: dict[str, Any], where: str, gpus: int, spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    found: list[Problem] = []
    for key in ("containers", "volumes"):
        if key in pod and pod[key] is None:
            found.append(_null(f"{where}.{key}", key))
    if pod.get("volumes") is not None:
        found += _keyed(pod["volumes"], f"{where}.volumes", "name", "volumes", "{name: NAME, emptyDir: {}}")
    containers = pod.get("containers")
    if containers is None:
        return found
    if not isinstance(containers, list) or not all(_named(c) for c in containers):
        return [*found, _invalid(f"{where}.containers", _CONTAINERS.format(engine=ENGINE_CONTAINER))]
    seen: set[str] = set()
    for index, container in enumerate(containers):
        field = f"{where}.containers[{index}]"
        if container["name"] in seen:
            found.append(_invalid(field, _TWICE.format(what=f"the container {container['name']}", field=field)))
        elif container["name"] == ENGINE_CONTAINER:
            found += _engine(container, field, gpus, spec)
        seen.add(container["name"])
    return found


def _named(item: Any) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str) and bool(item["name"])


def _keyed(items: Any, where: str, key: str, what: str, example: str) -> list[Problem]:
    """A list the overlay merges by ``key`` (volumes by name, mounts by path): a list, each item a map with a
    non-empty string ``key``, none twice."""
    if not isinstance(items, list):
        return [_invalid(where, _NOT_A_LIST.format(field=where, items=what, example=example))]
    found: list[Problem] = []
    seen: set[str] = set()
    for index, item in enumerate(items):
        value = item.get(key) if isinstance(item, dict) else None
        field = f"{where}[{index}]"
        if not isinstance(value, str) or not value:
            found.append(_invalid(field, _NO_KEY.format(field=where, key=key, items=what, example=example)))
            continue
        if value in seen:
            found.append(_invalid(field, _TWICE.format(what=f"{key} {value}", field=field)))
        seen.add(value)
    return found


def _engine(container: dict[str, Any], where: str, gpus: int, spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    found: list[Problem] = []
    for field in ("command", "args"):
        if field in container:
            found.append(_managed(f"{where}.{field}", _MANAGED_COMMAND.format(field=field)))
    for field in ("env", "ports", "resources", "volumeMounts"):
        if field in container and container[field] is None:
            found.append(_null(f"{where}.{field}", field))
    if container.get("env") is not None:
        found += _env(container["env"], f"{where}.env")
    if container.get("ports") is not None:
        found += _ports(container["ports"], f"{where}.ports")
    if container.get("resources") is not None:
        found += _resources(container["resources"], f"{where}.resources", gpus, spec)
    if container.get("volumeMounts") is not None:
        example = "{name: NAME, mountPath: /PATH}"
        found += _keyed(container["volumeMounts"], f"{where}.volumeMounts", "mountPath", "volumeMounts", example)
    return found


def _env(env: Any, where: str) -> list[Problem]:
    example = "{name: NAME, value: VALUE}"
    if not isinstance(env, list):
        return [_invalid(where, _NOT_A_LIST.format(field=where, items="variables", example=example))]
    found: list[Problem] = []
    seen: set[str] = set()
    for position, variable in enumerate(env):
        field = f"{where}[{position}]"
        name = variable.get("name") if isinstance(variable, dict) else None
        if not isinstance(variable, dict) or not isinstance(name, str) or not name:
            found.append(_invalid(field, _NO_KEY.format(field=where, key="name", items="env", example=example)))
            continue
        value = variable.get("value")
        if name in seen:
            what = f"the variable {name} (the pod would run only the later one)"
            found.append(_invalid(field, _TWICE.format(what=what, field=field)))
        elif (name.startswith(MANAGED_ENV_PREFIX) and name not in TUNABLE_ENV) or name in MANAGED_ENV:
            found.append(_managed(field, _MANAGED_ENV.format(name=name)))
        elif value is not None and not isinstance(value, str):
            message = _ENV_NOT_A_STRING.format(name=name, value=json.dumps(value), text=value)
            found.append(_invalid(field, message))
        seen.add(name)
    return found


def _ports(ports: Any, where: str) -> list[Problem]:
    example = "{name: NAME, containerPort: NUMBER}"
    if not isinstance(ports, list):
        return [_invalid(where, _NOT_A_LIST.format(field=where, items="ports", example=example))]
    found: list[Problem] = []
    seen: set[int] = set()
    for position, port in enumerate(ports):
        field = f"{where}[{position}]"
        number = port.get("containerPort") if isinstance(port, dict) else None
        if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= 65535:
            key = "containerPort (1-65535)"
            found.append(_invalid(field, _NO_KEY.format(field=where, key=key, items="ports", example=example)))
            continue
        if number in seen:
            found.append(_invalid(field, _TWICE.format(what=f"the port {number}", field=field)))
        elif port.get("name") in MANAGED_PORTS or is_side_channel_port_name(port.get("name")):
            found.append(_managed(field, _MANAGED_PORT.format(name=port["name"])))
        seen.add(number)
    return found


def _resources(resources: Any, where: str, gpus: int, spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    if not isinstance(resources, dict):
        return [_invalid(where, _NOT_A_MAP.format(field=where))]
    found: list[Problem] = []
    rdma = spec.transfer.network.rdma_resources
    for kind in ("requests", "limits"):
        amounts = resources.get(kind)
        field = f"{where}.{kind}"
        if kind in resources and amounts is None:
            found.append(_null(field, kind))
        elif kind in resources and not isinstance(amounts, dict):
            found.append(_invalid(field, _NOT_A_MAP.format(field=field)))
        for resource, amount in amounts.items() if isinstance(amounts, dict) else ():
            if (is_gpu_resource(resource) or resource in rdma) and amount is None:
                found.append(_null(f"{field}.{resource}", kind))
            elif is_gpu_resource(resource) and str(amount) != str(gpus):
                message = _GPUS.format(gpus=gpus, amount=amount, kind=kind)
                found.append(Problem(TEMPLATE_GPUS, f"{field}.{resource}", message))
            elif resource in rdma and str(amount) != str(rdma[resource]):
                message = _MANAGED_RDMA.format(resource=resource, count=rdma[resource], amount=amount)
                found.append(_managed(f"{field}.{resource}", message))
    return found
