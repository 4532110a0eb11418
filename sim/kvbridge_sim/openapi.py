"""OpenAPI v3 for the emulated API, as ``kubectl apply`` and ``kubectl explain`` read it, and the strict field
validation that ``kubectl apply`` then asks the server for (``?fieldValidation=Strict``).

``/openapi/v3`` lists one document per group-version; each document has a path per resource whose PATCH operation
names its kind (``x-kubernetes-group-version-kind``) and the ``fieldValidation`` parameter (so kubectl leaves
validation to the server), and a schema per kind: a CRD's ``openAPIV3Schema``, or an open object for built-in
kinds (the emulator holds no built-in schemas: kubectl's own validation and kubernetes-validate cover those).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import kmock

from kvbridge_operator.api.objects import Obj

GroupVersionPlural = tuple[str, str, str]
_FIELD_VALIDATION = {
    "name": "fieldValidation",
    "in": "query",
    "schema": {"type": "string", "uniqueItems": True},
    "description": "Ignore, Warn or Strict: what to do with unknown fields",
}


def group_version_path(group: str, version: str) -> str:
    """``api/v1`` or ``apis/GROUP/VERSION``: a group-version's key in ``/openapi/v3``."""
    return f"api/{version}" if not group else f"apis/{group}/{version}"


def _schema_name(group: str, version: str, kind: str) -> str:
    reversed_group = ".".join(reversed(group.split("."))) if group else "io.k8s.api.core"
    return f"{reversed_group}.{version}.{kind}"


def document(
    group: str, version: str, kinds: Mapping[GroupVersionPlural, Obj], schemas: Mapping[GroupVersionPlural, Obj]
) -> Obj:
    """The OpenAPI v3 document of one group-version: ``kinds`` by (group, version, plural) as the emulator declares
    them, ``schemas`` the CRDs' ``openAPIV3Schema`` by the same key."""
    paths: dict[str, Obj] = {}
    components: dict[str, Obj] = {}
    for (g, v, plural), info in sorted(kinds.items()):
        if (g, v) != (group, version):
            continue
        gvk = {"group": g, "version": v, "kind": info["kind"]}
        name = _schema_name(g, v, info["kind"])
        schema = dict(schemas.get((g, v, plural)) or {"type": "object", "x-kubernetes-preserve-unknown-fields": True})
        components[name] = {**schema, "x-kubernetes-group-version-kind": [gvk]}
        prefix = "/" + group_version_path(g, v) + ("/namespaces/{namespace}" if info["namespaced"] else "")
        reference = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}
        for suffix in ("", "/status", "/scale") if info.get("subresources") else ("",):
            if suffix and suffix[1:] not in info["subresources"]:
                continue
            operation = {
                "x-kubernetes-group-version-kind": gvk,
                "x-kubernetes-action": "patch",
                "parameters": [_FIELD_VALIDATION],
                "responses": {"200": reference},
            }
            paths[f"{prefix}/{plural}/{{name}}{suffix}"] = {
                "get": {
                    "x-kubernetes-group-version-kind": gvk,
                    "x-kubernetes-action": "get",
                    "responses": {"200": reference},
                },
                "patch": operation,
                "parameters": [_FIELD_VALIDATION],
            }
        paths[f"{prefix}/{plural}"] = {
            "post": {
                "x-kubernetes-group-version-kind": gvk,
                "x-kubernetes-action": "post",
                "parameters": [_FIELD_VALIDATION],
                "responses": {"201": reference},
            },
            "parameters": [_FIELD_VALIDATION],
        }
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (kvbridge's emulated API)", "version": "v1.32"},
        "paths": paths,
        "components": {"schemas": components},
    }


def root(group_versions: Iterable[tuple[str, str]], documents: Mapping[str, Obj]) -> Obj:
    """``/openapi/v3``: every group-version's document URL, with a hash of its content (as the real server)."""
    paths = {}
    for group, version in sorted(set(group_versions)):
        key = group_version_path(group, version)
        digest = hashlib.sha256(json.dumps(documents[key], sort_keys=True).encode()).hexdigest()[:32].upper()
        paths[key] = {"serverRelativeURL": f"/openapi/v3/{key}?hash={digest}"}
    return {"paths": paths}


def unknown_fields(obj: Any, schema: Obj, path: str = "") -> list[str]:
    """The fields of ``obj`` its structural schema does not declare (what ``fieldValidation=Strict`` refuses);
    ``metadata`` and ``x-kubernetes-preserve-unknown-fields`` subtrees are not checked, as on a real server."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or path == ".metadata":
        return []
    found: list[str] = []
    if isinstance(obj, dict):
        properties = schema.get("properties")
        additional = schema.get("additionalProperties")
        for key, value in obj.items():
            where = f"{path}.{key}"
            if properties is not None and key in properties:
                found += unknown_fields(value, properties[key], where)
            elif isinstance(additional, dict):
                found += unknown_fields(value, additional, where)
            elif properties is not None or additional is False:
                found.append(where.lstrip("."))
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(obj):
            found += unknown_fields(item, schema["items"], f"{path}[{index}]")
    return found


def validate_fields(directive: str, body: Any, info: Obj, version: str) -> list[str]:
    """``fieldValidation`` of a create or an update's body (``info``: its kind's, with the CRD's ``schema``):
    ``Strict`` refuses unknown fields (HTTP 400, as Kubernetes), ``Warn`` (the API's default) answers them as
    warnings, ``Ignore`` drops the check. Returns the warnings."""
    if directive == "Ignore" or not info.get("schema") or not isinstance(body, dict):
        return []
    unknown = unknown_fields(body, info["schema"])
    if unknown and directive == "Strict":
        kind = info["kind"]
        fields = ", ".join(f'unknown field "{f}"' for f in unknown)
        raise kmock.KubernetesError(
            status=400,
            reason="BadRequest",
            message=f'{kind} in version "{version}" cannot be handled as a {kind}: strict decoding error: {fields}',
        )
    return [f'unknown field "{f}"' for f in unknown]
