"""The emulated API's patches, by content type, as a Kubernetes API server applies them: JSON patches (RFC 6902), JSON
merge patches (RFC 7386) and strategic merge patches, which only built-in kinds take (a custom resource answers
415, as on a cluster: ``kubectl patch`` of one needs ``--type=merge``).

A strategic merge patch merges the lists Kubernetes' types mark with a merge key (a pod's ``containers`` by
``name``, their ``ports`` by ``containerPort``, ``env`` by ``name``, ...: :data:`MERGE_KEYS`) item by item instead
of replacing them, and reads its directives: ``$patch: replace|delete``, ``$retainKeys``,
``$setElementOrder/FIELD`` and ``$deleteFromPrimitiveList/FIELD`` (what ``kubectl apply``, ``edit``,
``set image`` and ``rollout restart`` send). Lists without a key are replaced, as there.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import kmock

from kvbridge_operator.api.objects import Obj
from kvbridge_sim import api_errors, kinds
from kvbridge_sim.api_errors import Key
from kvbridge_sim.selectors import merge_patch

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

#: the merge key of each list a strategic merge patch merges item by item, by (the field holding it, its field);
#: ``""`` for any holder
MERGE_KEYS = {
    ("", "containers"): "name",
    ("", "initContainers"): "name",
    ("", "ephemeralContainers"): "name",
    ("", "env"): "name",
    ("", "volumes"): "name",
    ("", "volumeMounts"): "mountPath",
    ("", "volumeDevices"): "devicePath",
    ("", "imagePullSecrets"): "name",
    ("", "conditions"): "type",
    ("", "ownerReferences"): "uid",
    ("", "hostAliases"): "ip",
    ("", "topologySpreadConstraints"): "topologyKey",
    ("", "resourceClaims"): "name",
    ("", "readinessGates"): "conditionType",
    ("containers", "ports"): "containerPort",
    ("initContainers", "ports"): "containerPort",
    ("spec", "ports"): "port",  # a Service's
}
#: lists of plain values a strategic merge patch adds to (``patchStrategy: merge`` without a key)
MERGED_VALUES = {"finalizers"}
_ORDER = "$setElementOrder/"
_DELETE_VALUES = "$deleteFromPrimitiveList/"


#: the metadata a write cannot change
SYSTEM_METADATA = ("uid", "creationTimestamp", "generation", "namespace", "name", "deletionTimestamp")


def changed(current: Obj, data: Any, how: tuple[str | None, str | None, str], info: dict[str, Any], key: Key) -> Obj:
    """What a PATCH or a PUT (``how``: the verb, ``replace`` for a PUT; the subresource; the content type) makes of
    ``current``: the whole of it (its status kept where the kind has a status subresource), its status only
    (``/status``), or its replicas (``/scale``). A stale ``metadata.resourceVersion`` is a conflict; a PUT of a
    custom resource must name one, as on a cluster."""
    verb, subresource, content_type = how
    if subresource == "scale" and info.get("scale"):
        return kinds.scaled(current, data, info["scale"])
    if verb == "replace":
        if not isinstance(data, dict):
            raise api_errors.bad_request("the body of an update must be an object")
        wanted = (data.get("metadata") or {}).get("resourceVersion")
        if info.get("custom") and not wanted:
            why = "Invalid value: 0x0: must be specified for an update"
            raise api_errors.invalid(info["kind"], key, "metadata.resourceVersion", why)
        result = copy.deepcopy(data)
    else:
        result = patched(current, data, content_type, bool(info.get("custom")))
        wanted = (data.get("metadata") or {}).get("resourceVersion") if isinstance(data, dict) else None
    if wanted and wanted != current["metadata"].get("resourceVersion"):
        raise api_errors.conflict(key)
    if subresource == "status":
        return {**copy.deepcopy(current), "status": result.get("status", {})}
    with_status = "status" in info["subresources"]
    updated = {k: v for k, v in result.items() if k != "status" or not with_status}
    if with_status and "status" in current:
        updated["status"] = copy.deepcopy(current["status"])
    kept = {f: current["metadata"][f] for f in SYSTEM_METADATA if f in current["metadata"]}
    updated["metadata"] = {**(result.get("metadata") or {}), **kept}
    return updated


def _invalid(message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=422, reason="Invalid", message=message)


def patched(current: Obj, patch: Any, content_type: str, custom: bool) -> Obj:
    """``current`` with ``patch`` applied as ``content_type`` says (``custom``: a kind a CRD defines)."""
    if content_type == JSON_PATCH:
        try:
            result: Obj = jsonpatch.apply_patch(current, patch)
        except jsonpatch.JsonPatchTestFailed as exc:
            raise _invalid(f"test failed: {exc}") from exc
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, TypeError) as exc:
            raise _invalid(str(exc)) from exc
        return result
    if not isinstance(patch, dict):
        raise kmock.KubernetesError(status=400, reason="BadRequest", message="the patch is not a JSON object")
    if content_type == MERGE_PATCH:
        merged: Obj = merge_patch(current, patch)
        return merged
    if content_type == STRATEGIC_MERGE_PATCH and not custom:
        return strategic_merge(current, patch)
    accepted = [JSON_PATCH, MERGE_PATCH, APPLY_PATCH] + ([] if custom else [STRATEGIC_MERGE_PATCH])
    raise kmock.KubernetesError(
        status=415,
        reason="UnsupportedMediaType",
        message=f"the body of the request was in an unknown format - accepted media types include: "
        f"{', '.join(accepted)}",
    )


def strategic_merge(current: Obj, patch: Obj, holder: str = "") -> Obj:
    """A map with a strategic merge patch applied (``holder``: the field that holds it)."""
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = copy.deepcopy(current)
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None or (isinstance(value, dict) and value.get("$patch") == "delete"):
            result.pop(key, None)
        elif isinstance(value, dict):
            result[key] = strategic_merge(result[key] if isinstance(result.get(key), dict) else {}, value, key)
        elif isinstance(value, list):
            result[key] = _merge_list(result.get(key), value, holder, key)
        else:
            result[key] = copy.deepcopy(value)
    for key, values in patch.items():
        if key.startswith(_DELETE_VALUES) and isinstance(result.get(key[len(_DELETE_VALUES) :]), list):
            field = key[len(_DELETE_VALUES) :]
            result[field] = [v for v in result[field] if v not in values]
        elif key.startswith(_ORDER) and isinstance(result.get(key[len(_ORDER) :]), list):
            field = key[len(_ORDER) :]
            result[field] = _ordered(result[field], values, _key_of(holder, field))
    if isinstance(patch.get("$retainKeys"), list):
        result = {k: v for k, v in result.items() if k in patch["$retainKeys"]}
    return result


def _key_of(holder: str, field: str) -> str | None:
    return MERGE_KEYS.get((holder, field)) or MERGE_KEYS.get(("", field))


def _merge_list(current: Any, patch: list[Any], holder: str, field: str) -> list[Any]:
    """A list with a strategic merge patch's list applied: merged by key, added to, or replaced."""
    have = copy.deepcopy(current) if isinstance(current, list) else []
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [copy.deepcopy(item) for item in patch if not (isinstance(item, dict) and "$patch" in item)]
    key = _key_of(holder, field)
    if key is None:
        if field in MERGED_VALUES:
            return have + [copy.deepcopy(item) for item in patch if item not in have]
        return [strategic_merge({}, item, field) if isinstance(item, dict) else item for item in patch]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise _invalid(f"{field}: an item without its merge key {key!r}: {item!r}")
        at = next((i for i, old in enumerate(have) if isinstance(old, dict) and old.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if at is not None:
                del have[at]
        elif at is None:
            have.append(strategic_merge({}, item, field))
        else:
            have[at] = strategic_merge(have[at], item, field)
    return have


def _ordered(items: list[Any], order: list[Any], key: str | None) -> list[Any]:
    """``items`` in the order ``$setElementOrder`` gives (by merge key, or by value), the rest after them."""

    def rank(item: Any) -> int:
        ident = item.get(key) if key is not None and isinstance(item, dict) else item
        wanted = [o.get(key) if key is not None and isinstance(o, dict) else o for o in order]
        return wanted.index(ident) if ident in wanted else len(wanted)

    return sorted(items, key=rank)
