"""What the emulated API server reads in a request: JSON merge patches (RFC 7386), label and field selectors."""

from __future__ import annotations

import copy
import re
from typing import Any

import kmock

from kvbridge_operator.api.objects import Obj


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


_REQUIREMENT = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w./-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$")


def _split_selector(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current] if current.strip() else parts


def label_match(selector: str, labels: dict[str, str]) -> bool:
    for requirement in _split_selector(selector):
        found = _REQUIREMENT.match(requirement)
        if not found:
            raise kmock.KubernetesError(status=400, reason="BadRequest", message=f"bad selector {requirement!r}")
        negate, key, operator, value, set_operator, values = found.groups()
        if negate:
            if key in labels:
                return False
        elif operator in ("=", "=="):
            if labels.get(key) != value:
                return False
        elif operator == "!=":
            if labels.get(key) == value:
                return False
        elif set_operator:
            options = {v.strip() for v in values.split(",")}
            if (labels.get(key) in options) != (set_operator == "in"):
                return False
        elif key not in labels:
            return False
    return True


def field_match(selector: str, obj: Obj) -> bool:
    for requirement in filter(None, (p.strip() for p in selector.split(","))):
        path, _, value = requirement.replace("==", "=").partition("=")
        negate = path.endswith("!")
        current: Any = obj
        for part in path.rstrip("!").split("."):
            current = current.get(part) if isinstance(current, dict) else None
        if (str(current) == value) == negate:
            return False
    return True


def event_wanted(namespace: str | None, event: Obj, labels: str, fields: str) -> bool:
    """Whether a watch asked for this event: its namespace (if it named one), label and field selectors."""
    obj = event["object"]
    if namespace and obj["metadata"].get("namespace") != namespace:
        return False
    if labels and not label_match(labels, obj["metadata"].get("labels") or {}):
        return False
    return not (fields and not field_match(fields, obj))
