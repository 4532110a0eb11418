"""What a role's ``template`` overlay changed of what kvbridge rendered, found by rendering the pod with and without it.

Once the spec is compatible, :func:`rendered_problems` renders each role's pod (for an engine spanning nodes, the
leader's and the workers') with and without its overlay and refuses, as ``TEMPLATE_MANAGED_FIELD``, any value
kvbridge rendered that the overlay changed or removed, named at the overlay's field that changes it. The checks
of the overlay as written (nulls, merge keys, types, GPUs) are templates.py's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from kvbridge_agent.core import Problem, Role, TransferPlan
from kvbridge_operator.api.names import ENGINE_CONTAINER, LABEL_REVISION
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.children import multinode
from kvbridge_operator.children.objects.pod import rendered_template
from kvbridge_operator.children.objects.shared import overlay
from kvbridge_operator.children.templates import TEMPLATE_MANAGED_FIELD, TUNABLE_ENV
from kvbridge_operator.config import OperatorConfig

#: one value kvbridge rendered: (kind, key within its kind, the value)
Managed = tuple[str, Any, Any]
_SHOWN = 160


def rendered_problems(dd: DisaggregatedDeployment, plan: TransferPlan, config: OperatorConfig) -> list[Problem]:
    """Every value kvbridge renders in a role's pod that the role's overlay changes or removes, found by rendering
    the pod without and with it (for the operator's settings: its HTTP port, GPU resource, key mount path): the
    engine container's command, arguments, environment, ports, mounts, GPUs and RDMA resources and added
    capabilities, the routing sidecar's arguments and ports, the pod's volumes, labels and annotations. Each is
    named at the overlay's field that changes it (the item merged into kvbridge's by its key, else the nearest
    field the overlay sets)."""
    found: list[Problem] = []
    for role in Role:
        template = dd.spec.role(role).template
        if not template:
            continue
        base = rendered_template(dd, role, plan, config)
        merged = overlay(base, template)
        seen: set[tuple[str, str]] = set()  # the leader's and the workers' pods lose the same values
        for before, after in zip(_pods(dd, role, base), _pods(dd, role, merged), strict=True):
            kept = list(_values(after))
            for kind, key, value in _values(before):
                now = [v for k, n, v in kept if (k, n) == (kind, key)]
                if (len(now) != 1 or not _keeps(kind, value, now[0])) and (kind, str(key)) not in seen:
                    found.append(_changed(template, f"spec.{role.value}.template", kind, key, value, now))
                    seen.add((kind, str(key)))
    return found


def _pods(dd: DisaggregatedDeployment, role: Role, template: Obj) -> tuple[Obj, ...]:
    """The pod templates a role's workload gets from its template: itself, or for an engine spanning nodes the
    leader's (which opens the rendezvous port after the overlay is merged) and the workers'."""
    engines = [
        c for c in _list(_map(template.get("spec")).get("containers")) if _map(c).get("name") == ENGINE_CONTAINER
    ]
    if not multinode.spans_nodes(dd.spec, role) or len(engines) != 1:
        return (template,)  # one pod; or no single engine, which _values reports
    role_spec = dd.spec.role(role)
    return multinode.group_templates(template, role_spec.nodes, role_spec.data_parallel_size)


def _keeps(kind: str, value: Any, now: Any) -> bool:
    """Whether ``now`` is kvbridge's ``value`` still: the same, or for a port, with its name, number and protocol
    as they were (the overlay may add a hostPort to kvbridge's port)."""
    if kind in ("port", "sidecar port") and isinstance(value, dict) and isinstance(now, dict):
        return value.items() <= now.items()
    return bool(now == value)


def _values(template: Obj) -> Iterator[Managed]:
    """What kvbridge manages in a pod template, read defensively: the template may be what an odd overlay made."""
    metadata = _map(template.get("metadata"))
    for name, value in _map(metadata.get("labels")).items():
        if name != LABEL_REVISION:
            yield "label", name, value
    for name, value in _map(metadata.get("annotations")).items():
        yield "annotation", name, value
    pod = _map(template.get("spec"))
    for volume in _list(pod.get("volumes")):
        yield "volume", _map(volume).get("name"), volume
    containers = [_map(c) for c in _list(pod.get("containers"))]
    for container in containers:
        if container.get("name") == ENGINE_CONTAINER:
            yield from _engine_values(container)
        elif container.get("name") == ROUTING_SIDECAR:
            yield "sidecar args", None, container.get("args")
            for port in _list(container.get("ports")):
                yield "sidecar port", _map(port).get("containerPort"), port
    yield "engine container", None, sum(c.get("name") == ENGINE_CONTAINER for c in containers)


def _engine_values(engine: Obj) -> Iterator[Managed]:
    yield "command", None, engine.get("command")
    yield "args", None, engine.get("args")
    for variable in _list(engine.get("env")):
        if _map(variable).get("name") not in TUNABLE_ENV:  # the user's to tune
            yield "env", _map(variable).get("name"), variable
    for port in _list(engine.get("ports")):
        yield "port", _map(port).get("containerPort"), port
    for mount in _list(engine.get("volumeMounts")):
        yield "mount", _map(mount).get("mountPath"), mount
    resources = _map(engine.get("resources"))
    for kind in ("requests", "limits"):
        for name, amount in _map(resources.get(kind)).items():
            if "/" in name:  # extended resources: the GPUs and the RDMA NICs (cpu and memory are the user's)
                yield "resource", f"{kind}.{name}", amount if amount is None else str(amount)  # 1 is "1"
    for capability in _list(_map(_map(engine.get("securityContext")).get("capabilities")).get("add")):
        yield "capability", capability, capability


def _map(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


#: the routing sidecar's container name (engines/vllm.py, routing_sidecar)
ROUTING_SIDECAR = "routing-sidecar"
#: in a path: the managed value's own key (a variable's name, a port's number, a mount's path, ...)
_KEY = object()
#: in a path: a resource's key, ``requests.NAME`` or ``limits.NAME``: two steps
_RESOURCE = object()
_ENGINE: tuple[str, str, Any] = ("containers", "name", ENGINE_CONTAINER)
_SIDECAR: tuple[str, str, Any] = ("containers", "name", ROUTING_SIDECAR)
#: for each kind of managed value: what it is in words, and the overlay's path to it (map keys, and list items
#: found by a merge key: (list, merge key, value))
_PATHS: dict[str, tuple[str, list[Any]]] = {
    "label": ("the label {key}", ["metadata", "labels", _KEY]),
    "annotation": ("the annotation {key}", ["metadata", "annotations", _KEY]),
    "volume": ("the volume {key}", ["spec", ("volumes", "name", _KEY)]),
    "engine container": ("the engine container", ["spec", "containers"]),
    "sidecar args": ("the routing sidecar's args", ["spec", _SIDECAR, "args"]),
    "sidecar port": ("the routing sidecar's port {key}", ["spec", _SIDECAR, ("ports", "containerPort", _KEY)]),
    "command": ("the engine's command", ["spec", _ENGINE, "command"]),
    "args": ("the engine's args", ["spec", _ENGINE, "args"]),
    "env": ("the variable {key}", ["spec", _ENGINE, ("env", "name", _KEY)]),
    "port": ("the port {key}", ["spec", _ENGINE, ("ports", "containerPort", _KEY)]),
    "mount": ("the mount at {key}", ["spec", _ENGINE, ("volumeMounts", "mountPath", _KEY)]),
    "resource": ("the resource {key}", ["spec", _ENGINE, "resources", _RESOURCE]),
    "capability": ("the capability {key}", ["spec", _ENGINE, "securityContext", "capabilities", "add"]),
}


def _changed(template: Obj, where: str, kind: str, key: Any, value: Any, now: list[Any]) -> Problem:
    what, steps = _PATHS[kind]
    after = ", ".join(_shown(v) for v in now) if now else "nothing"
    message = _CHANGED.format(what=what.format(key=key), before=_shown(value), after=after)
    return Problem(TEMPLATE_MANAGED_FIELD, _field(template, where, steps, key), message)


_CHANGED = (
    "the template changes {what}, which kvbridge renders from the spec: {before} without the template, {after} "
    "with it; remove what changes it from the template (the spec field it comes from sets it)"
)


def _shown(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _field(template: Obj, where: str, steps: list[Any], key: Any) -> str:
    """The deepest field along ``steps`` that the overlay sets."""
    expanded: list[Any] = []
    for step in steps:
        expanded += str(key).split(".", 1) if step is _RESOURCE else [step]
    field, node = where, template
    for step in expanded:
        if isinstance(step, tuple):
            name, merge_key, wanted = step
            items = node.get(name) if isinstance(node, dict) else None
            if not isinstance(items, list):
                return field
            wanted = key if wanted is _KEY else wanted
            index = next((i for i, item in enumerate(items) if _map(item).get(merge_key) == wanted), None)
            if index is None:
                return f"{field}.{name}"
            field, node = f"{field}.{name}[{index}]", items[index]
        else:
            name = str(key) if step is _KEY else step
            if not isinstance(node, dict) or name not in node:
                return field
            field, node = f"{field}.{name}", node[name]
    return field
