"""A Kubernetes object as the API's JSON: the one alias the operator, the router and the simulation share,
setting fields of one by their dotted paths, and the time the API writes in one."""

import copy
import datetime
from collections.abc import Mapping
from typing import Any

Obj = dict[str, Any]


def now_rfc3339() -> str:
    """Now in UTC as the API writes times (RFC 3339, whole seconds, ``Z``): ``2025-01-31T12:00:00Z``."""
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def with_fields(obj: Obj, fields: Mapping[str, Any]) -> Obj:
    """A copy of ``obj`` with each dotted path (``spec.decode.blockSize``) set to its value, missing parents made;
    ``obj`` is left alone."""
    out = copy.deepcopy(obj)
    for path, value in fields.items():
        node = out
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out
