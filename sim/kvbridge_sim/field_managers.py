"""Field ownership for the emulated API server: server-side apply and ``metadata.managedFields``.

What Kubernetes does (https://kubernetes.io/docs/reference/using-api/server-side-apply/), as far as the
operator and its tests rely on it:

* every write records which fields its manager set: an apply (``application/apply-patch+yaml``, operation
  ``Apply``) owns exactly the fields of its configuration; any other write (create, update, merge patch, a
  ``/scale`` or ``/status`` write; operation ``Update``) takes the fields it changed away from everyone else;
  the manager is the ``fieldManager`` parameter, else the client's User-Agent up to its first ``/``;
* an apply that sets a field another manager owns to a different value is a conflict (409) unless
  ``force=true``, which moves the field to the applier; the same value is shared ownership;
* a field an applier owned and leaves out of its next apply is removed, unless another manager owns it too;
* fields no apply mentions are left as they are.

Simplifications, said where they show: lists are atomic (Kubernetes merges ``containers``, ``ports`` ... by
their keys), ownership is by leaf (a scalar, a list or an empty map), and ``managedFields`` lists those
leaves as ``FieldsV1`` without the ``.`` entries for their parents.
"""

from __future__ import annotations

import copy
from typing import Any

from kvbridge_operator.api.objects import Obj, now_rfc3339

Path = tuple[str, ...]

APPLY = "Apply"
UPDATE = "Update"
#: metadata fields a manager can own (the rest are the server's)
OWNABLE_METADATA = ("labels", "annotations", "ownerReferences", "finalizers")


class ConflictError(Exception):
    def __init__(self, conflicts: list[tuple[str, Path]]) -> None:
        listed = "; ".join(f'conflict with "{manager}": .{".".join(path)}' for manager, path in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflict(s): {listed}")


def leaves(obj: Any, prefix: Path = ()) -> dict[Path, Any]:
    """Every leaf of ``obj`` by its path: scalars, lists (atomic) and empty maps."""
    if isinstance(obj, dict) and obj:
        found: dict[Path, Any] = {}
        for key, value in obj.items():
            found.update(leaves(value, (*prefix, str(key))))
        return found
    return {prefix: obj} if prefix else {}


def ownable(obj: Obj, status_is_subresource: bool) -> Obj:
    """The part of an object managers own: no identity, no server-set metadata, no status behind a subresource."""
    kept = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    if status_is_subresource:
        kept.pop("status", None)
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k in OWNABLE_METADATA}
    return {**kept, "metadata": meta} if meta else kept


def lookup(obj: Any, path: Path) -> Any:
    for part in path:
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _remove(obj: Obj, path: Path) -> None:
    parents = [obj]
    for part in path[:-1]:
        child = parents[-1].get(part)
        if not isinstance(child, dict):
            return
        parents.append(child)
    parents[-1].pop(path[-1], None)
    for depth in range(len(parents) - 1, 0, -1):  # drop maps the removal emptied
        if parents[depth]:
            break
        parents[depth - 1].pop(path[depth - 1], None)


def _merge(target: Obj, patch: Obj) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and value and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def _to_fields(paths: set[Path]) -> Obj:
    root: Obj = {}
    for path in sorted(paths):
        node = root
        for part in path:
            node = node.setdefault(f"f:{part}", {})
    return root


def _from_fields(fields: Obj, prefix: Path = ()) -> set[Path]:
    found: set[Path] = set()
    for key, value in fields.items():
        if not key.startswith("f:"):
            continue
        path = (*prefix, key[2:])
        found |= _from_fields(value, path) if value else {path}
    return found


def owners(obj: Obj) -> dict[tuple[str, str], set[Path]]:
    """(manager, operation) -> the leaves it owns, read from ``metadata.managedFields``."""
    return {
        (str(entry.get("manager")), str(entry.get("operation"))): _from_fields(entry.get("fieldsV1") or {})
        for entry in (obj.get("metadata") or {}).get("managedFields") or []
    }


def _write_owners(obj: Obj, table: dict[tuple[str, str], set[Path]], api_version: str) -> None:
    now = now_rfc3339()
    previous = {(str(e.get("manager")), str(e.get("operation"))): e for e in obj["metadata"].get("managedFields") or []}
    entries = []
    for (manager, operation), paths in table.items():
        if not paths:
            continue
        entry = previous.get((manager, operation), {})
        fields = _to_fields(paths)
        entries.append(
            {
                "manager": manager,
                "operation": operation,
                "apiVersion": api_version,
                "fieldsType": "FieldsV1",
                "fieldsV1": fields,
                "time": now if entry.get("fieldsV1") != fields else entry.get("time", now),
            }
        )
    obj["metadata"]["managedFields"] = entries


def record_update(before: Obj | None, after: Obj, manager: str, status_is_subresource: bool) -> None:
    """A write that is not an apply: ``manager`` owns the leaves it added or changed (taken from the others);
    leaves it removed are nobody's."""
    old = leaves(ownable(before or {}, status_is_subresource))
    new = leaves(ownable(after, status_is_subresource))
    changed = {path for path, value in new.items() if old.get(path, ...) != value}
    removed = set(old) - set(new)
    table = owners(before or {})
    for key in table:
        table[key] -= changed | removed
    table[(manager, UPDATE)] = table.get((manager, UPDATE), set()) | changed
    _write_owners(after, table, str(after.get("apiVersion", "")))


def apply(current: Obj | None, config: Obj, manager: str, force: bool, status_is_subresource: bool) -> Obj:
    """The object after ``manager`` applies ``config`` to ``current`` (``None``: it does not exist yet); raises
    :class:`ConflictError` for fields other managers own with other values, unless ``force``."""
    applied = leaves(ownable(config, status_is_subresource))
    table = owners(current or {})
    base = current or {}
    conflicts = [
        (other, path)
        for (other, _operation), paths in table.items()
        if other != manager
        for path in paths & set(applied)
        if lookup(base, path) != applied[path]
    ]
    if conflicts and not force:
        raise ConflictError(conflicts)
    result = copy.deepcopy(base)
    result.setdefault("metadata", {})
    mine = table.get((manager, APPLY), set())
    others = set().union(*(paths for (m, _op), paths in table.items() if m != manager)) if table else set()
    for path in mine - set(applied) - others:
        _remove(result, path)
    body = ownable(config, status_is_subresource)
    _merge(result, {k: v for k, v in body.items() if k != "metadata"})
    _merge(result["metadata"], body.get("metadata", {}))
    for key in ("apiVersion", "kind"):
        if key in config:
            result[key] = config[key]
    forced = {path for _other, path in conflicts}
    for owner in list(table):
        if owner[0] != manager:
            table[owner] -= forced
    table[(manager, APPLY)] = set(applied)
    _write_owners(result, table, str(result.get("apiVersion", "")))
    return result
