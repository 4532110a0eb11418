"""DELETE as a Kubernetes API server serves it: its DeleteOptions (``propagationPolicy``, ``preconditions``,
``dryRun``; in the body or the query) and the garbage collector's part, which the emulator plays at once: the
dependents of a deleted object (those whose ``ownerReferences`` name its uid) are deleted after it (``Background``,
the default; ``Foreground`` is served the same way, the owner going first), or left with that reference removed
(``Orphan``). So ``kubectl delete dd NAME`` takes the deployment's StatefulSets and so its pods, as on a cluster."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge_operator.api.objects import Obj
from kvbridge_sim.api_errors import Key, bad_request, conflict

PROPAGATION_POLICIES = ("Background", "Foreground", "Orphan")


@dataclass(frozen=True)
class DeleteOptions:
    propagation: str = "Background"
    #: preconditions: the uid and resourceVersion the object must have
    uid: str | None = None
    resource_version: str | None = None
    dry_run: bool = False


def delete_options(params: Mapping[str, Any], body: Any) -> DeleteOptions:
    """The request's DeleteOptions: its body's, or its query's (``kubectl`` sends a body; other clients query)."""
    given = body if isinstance(body, dict) else {}
    preconditions = given.get("preconditions") or {}
    propagation = str(given.get("propagationPolicy") or params.get("propagationPolicy") or "Background")
    if propagation not in PROPAGATION_POLICIES:
        raise bad_request(
            f"propagationPolicy: Unsupported value: {propagation!r}: supported values: Background, Foreground, Orphan"
        )
    if given.get("orphanDependents") is True or str(params.get("orphanDependents", "")).lower() == "true":
        propagation = "Orphan"
    dry_run = given.get("dryRun") or params.get("dryRun") or []
    return DeleteOptions(
        propagation=propagation,
        uid=preconditions.get("uid"),
        resource_version=preconditions.get("resourceVersion"),
        dry_run="All" in ([dry_run] if isinstance(dry_run, str) else dry_run),
    )


def check_preconditions(options: DeleteOptions, obj: Obj, key: Key) -> None:
    """409, as Kubernetes words it, where the object is not the one the preconditions name."""
    meta = obj["metadata"]
    if options.uid is not None and options.uid != meta.get("uid"):
        why = f"Precondition failed: UID in precondition: {options.uid}, UID in object meta: {meta.get('uid')}"
        raise conflict(key, why)
    if options.resource_version is not None and options.resource_version != meta.get("resourceVersion"):
        why = (
            f"Precondition failed: ResourceVersion in precondition: {options.resource_version}, ResourceVersion in "
            f"object meta: {meta.get('resourceVersion')}"
        )
        raise conflict(key, why)


def dependents(store: Mapping[Key, Obj], uid: str) -> list[Key]:
    """The objects whose ``ownerReferences`` name ``uid``."""
    return [key for key, obj in store.items() if uid in _owner_uids(obj)]


def _owner_uids(obj: Obj) -> Iterable[str]:
    return (str(ref.get("uid")) for ref in obj["metadata"].get("ownerReferences") or [] if isinstance(ref, dict))


def orphaned(obj: Obj, uid: str) -> Obj:
    """``obj`` without its reference to the owner ``uid`` (``ownerReferences`` dropped where none is left)."""
    meta = obj["metadata"]
    kept = [ref for ref in meta.get("ownerReferences") or [] if not (isinstance(ref, dict) and ref.get("uid") == uid)]
    if kept:
        meta["ownerReferences"] = kept
    else:
        meta.pop("ownerReferences", None)
    return obj
