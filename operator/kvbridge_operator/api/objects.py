"""A Kubernetes object as the API's JSON: the one alias the operator, the router and the simulation share, and
setting fields of one by their dotted paths."""

import copy
from collections.abc import Mapping
from typing import Any

Obj = dict[str, Any]


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
