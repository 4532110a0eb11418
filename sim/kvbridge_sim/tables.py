"""Server-side ``Table`` output, as ``kubectl get`` asks for it (``Accept: application/json;as=Table;...``).

Kubernetes renders tables on the server: a CRD's ``additionalPrinterColumns`` (JSONPath cells, ``date`` columns as
ages), and its own columns for built-in kinds. This module renders the same for the emulated API: the columns of
every CRD, Events' and Pods' columns (``kubectl get events``, ``kubectl get pods``), and Name/Age for other
built-in kinds.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvbridge_operator.api.objects import Obj

TABLE_ACCEPT = "as=Table"
_NAME: Obj = {
    "name": "Name",
    "type": "string",
    "format": "name",
    "priority": 0,
    "description": "Name must be unique within a namespace.",
}
_AGE: Obj = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
#: the columns the real API server prints for core/v1 Events (kubectl get events)
EVENT_COLUMNS: list[Obj] = [
    {"name": "Last Seen", "type": "date", "jsonPath": ".lastTimestamp"},
    {"name": "Type", "type": "string", "jsonPath": ".type"},
    {"name": "Reason", "type": "string", "jsonPath": ".reason"},
    {"name": "Object", "type": "string", "jsonPath": ".involvedObject"},
    {"name": "Message", "type": "string", "jsonPath": ".message"},
    {"name": "Name", "type": "string", "format": "name", "priority": 1, "jsonPath": ".metadata.name"},
]

#: the columns the real API server prints for Pods (kubectl get pods); ``computed`` cells are derived below
POD_COLUMNS: list[Obj] = [
    {"name": "Ready", "type": "string", "computed": "ready"},
    {"name": "Status", "type": "string", "computed": "phase"},
    {"name": "Restarts", "type": "string", "computed": "restarts"},
    _AGE,
]


def _pod_cell(what: str, pod: Obj) -> str:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    containers = (pod.get("spec") or {}).get("containers") or []
    if what == "ready":
        return f"{sum(bool(s.get('ready')) for s in statuses)}/{len(containers)}"
    if what == "restarts":
        return str(sum(int(s.get("restartCount") or 0) for s in statuses))
    if pod["metadata"].get("deletionTimestamp"):
        return "Terminating"
    return str((pod.get("status") or {}).get("phase") or "Pending")


def wants_table(accept: str) -> bool:
    """Whether a request's ``Accept`` header asks for a ``meta.k8s.io`` Table before anything else."""
    first = accept.split(",")[0]
    return TABLE_ACCEPT in first.replace(" ", "")


class JSONPathError(ValueError):
    """A printer column's JSONPath uses syntax this subset does not evaluate."""


_STEP = re.compile(r"""\.([A-Za-z0-9_-]+)|\[\?\(@\.([A-Za-z0-9_.-]+)\s*==\s*["']([^"']*)["']\)\]|\[(\d+)\]""")


def evaluate(path: str, obj: Any) -> list[Any]:
    """The values at a printer column's JSONPath: ``.a.b``, ``[N]`` and ``[?(@.k=="v")]`` (what CRD columns use)."""
    values = [obj]
    position = 0
    while position < len(path):
        step = _STEP.match(path, position)
        if step is None:
            raise JSONPathError(f"unsupported JSONPath {path!r} at {path[position:]!r}")
        key, filter_key, filter_value, index = step.groups()
        found: list[Any] = []
        for value in values:
            if key is not None:
                if isinstance(value, dict) and key in value:
                    found.append(value[key])
            elif index is not None:
                if isinstance(value, list) and int(index) < len(value):
                    found.append(value[int(index)])
            elif isinstance(value, list):
                for item in value:
                    current: Any = item
                    for part in filter_key.split("."):
                        current = current.get(part) if isinstance(current, dict) else None
                    if current is not None and str(current) == filter_value:
                        found.append(item)
        values = found
        position = step.end()
    return values


def human_duration(seconds: float) -> str:
    """A duration as kubectl prints ages (k8s.io/apimachinery's ``HumanDuration``)."""
    if seconds < -1:
        return "<invalid>"
    s = max(int(seconds), 0)
    minutes, hours = s // 60, s // 3600
    if s < 120:
        return f"{s}s"
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d{hours % 24}h" if hours % 24 else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = hours // 24
        return f"{days // 365}y{days % 365}d" if days % 365 else f"{days // 365}y"
    return f"{hours // 24 // 365}y"


def _age(value: Any, now: datetime.datetime) -> Any:
    if not isinstance(value, str):
        return value
    try:
        when = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return value
    return human_duration((now - when).total_seconds())


def _cell(column: Obj, obj: Obj, now: datetime.datetime) -> Any:
    if "computed" in column:
        return _pod_cell(column["computed"], obj)
    values = evaluate(column["jsonPath"], obj)
    if not values:
        return None
    value = values[0] if len(values) == 1 else ",".join(str(v) for v in values)
    if column["type"] == "date":
        return _age(value, now)
    if column["jsonPath"] == ".involvedObject" and isinstance(value, dict):  # Events' OBJECT: kind/name
        return f"{str(value.get('kind', '')).lower()}/{value.get('name', '')}"
    if column["type"] == "integer" and isinstance(value, int):
        return value
    return value if isinstance(value, str | int | float | bool) else str(value)


def columns_for(kind: str, printer_columns: Sequence[Obj] | None) -> list[Obj]:
    """A kind's columns: its CRD's printer columns (an Age column when it has none, as the API server does),
    Events' own, or Name and Age."""
    if printer_columns:
        return list(printer_columns)
    if kind == "Event":
        return EVENT_COLUMNS
    if kind == "Pod":
        return POD_COLUMNS
    return [_AGE]


def table(objects: Sequence[Obj], columns: Sequence[Obj], resource_version: str, *, whole: bool) -> Obj:
    """A ``meta.k8s.io/v1`` Table of ``objects``; each row carries its object (``whole``) or its metadata."""
    now = datetime.datetime.now(datetime.UTC)
    named = any(c.get("format") == "name" for c in columns)  # Events name their rows last, in -o wide only
    definitions = ([] if named else [_NAME]) + [
        {
            "name": c["name"],
            "type": c["type"],
            "format": c.get("format", ""),
            "priority": c.get("priority", 0),
            "description": c.get("description", ""),
        }
        for c in columns
    ]
    rows = []
    for obj in objects:
        cells = ([] if named else [obj["metadata"]["name"]]) + [_cell(c, obj, now) for c in columns]
        partial = (
            obj
            if whole
            else {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
        )
        rows.append({"cells": cells, "object": partial})
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": definitions,
        "rows": rows,
    }


def for_request(info: Mapping[str, Any], params: Mapping[str, Any], objects: list[Obj], resource_version: str) -> Obj:
    """The ``Table`` a request for a kind (its ``info``: kind, printer columns) asked for (``includeObject``)."""
    whole = str(params.get("includeObject", "Metadata")) == "Object"
    return table(objects, columns_for(info["kind"], info.get("columns")), resource_version, whole=whole)
