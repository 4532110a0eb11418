"""What every child kind's renderer shares: the owner reference, the metadata and selector, the strategic
merge of an overlay, the pod template's revision."""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from kvbridge_agent.core import Role
from kvbridge_operator.api.names import (
    API_VERSION,
    KIND,
    LABEL_DEPLOYMENT,
    LABEL_REVISION,
    LABEL_ROLE,
    MANAGED_BY,
)
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment


def selector(deployment: str, role: Role) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: deployment, LABEL_ROLE: role.value}


def owner_reference(dd: DisaggregatedDeployment, uid: str) -> Obj:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": dd.metadata.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(name: str, namespace: str, labels: dict[str, str], owner: Obj) -> Obj:
    return {"name": name, "namespace": namespace, "labels": {**MANAGED_BY, **labels}, "ownerReferences": [owner]}


#: Kubernetes' strategic-merge keys of the lists in a pod template (what `kubectl patch` merges by)
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "imagePullSecrets": "name",
    "resourceClaims": "name",
    "ports": "containerPort",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
    "readinessGates": "conditionType",
}


def overlay(base: Any, patch: Any, key: str = "") -> Any:
    """Merge a user overlay into a rendered object as a strategic merge patch would: dicts deeply, lists of a
    pod template by their merge key (containers and env by name, ports by containerPort, mounts by mountPath,
    ...), other lists replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for name, value in patch.items():
            merged[name] = overlay(base[name], value, name) if name in base else copy.deepcopy(value)
        return merged
    merge_key = MERGE_KEYS.get(key, "name")
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and merge_key in x for x in [*base, *patch])
    ):
        merged_list = [copy.deepcopy(x) for x in base]
        index = {x[merge_key]: i for i, x in enumerate(merged_list)}
        for item in patch:
            if item[merge_key] in index:
                merged_list[index[item[merge_key]]] = overlay(merged_list[index[item[merge_key]]], item)
            else:
                merged_list.append(copy.deepcopy(item))
        return merged_list
    return copy.deepcopy(patch)


def revision(template: Obj) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def template_revision(workload: Obj) -> str:
    """The revision label of a workload's pod template (what its pods carry once they run it; a LeaderWorkerSet's
    leader and workers are rendered from one template and carry the same)."""
    spec = workload["spec"]
    template = spec["leaderWorkerTemplate"]["workerTemplate"] if "leaderWorkerTemplate" in spec else spec["template"]
    return str(template["metadata"].get("labels", {}).get(LABEL_REVISION, ""))
