"""Per-role scaling: the DisaggregatedRole resources autoscalers target, and how many engines each role runs.

Each role of a DisaggregatedDeployment ``x`` has a small child resource, the
DisaggregatedRole ``x-prefill`` / ``x-decode`` (``kvbridge.io/v1alpha1``), with a
``/scale`` subresource: HPA, KEDA and ``kubectl scale`` write its
``spec.replicas`` (the *desired* count) and read the label selector of the
role's pods from its status. The operator never writes that count back
except when the deployment's own ``spec.<role>.replicas`` changes (a person's
explicit choice); it runs the *effective* count, which is the desired count
within ``minReplicas``/``maxReplicas`` and the optional decode-per-prefill
ratio. A ratio is kept by raising the other role, never by lowering what an
autoscaler asked.

Why a child resource and not the StatefulSets' own ``/scale``: the
StatefulSets are the operator's implementation (a blue/green rollout brings up
new ones, a multi-node role is a LeaderWorkerSet), while the role is what a
user scales; an HPA aimed at a StatefulSet would lose its target on the first
blue/green rollout, and the operator could not apply bounds or a ratio
without fighting it. The anchors do the same (Dynamo's
DynamoGraphDeploymentScalingAdapter, LWS DisaggregatedSet's RoleScaler).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvbridge_agent.core import Role
from kvbridge_operator.api.names import ANNOTATION_SPEC_REPLICAS, API_VERSION, MANAGED_BY, ROLE_KIND, role_name
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.children.objects.shared import owner_reference, selector


@dataclass(frozen=True)
class Scale:
    """How many engines each role runs, and why where it differs from what was asked."""

    desired: dict[Role, int]
    effective: dict[Role, int]
    notes: list[str] = field(default_factory=list)

    def notes_for(self, role: Role) -> list[str]:
        """The notes about one role: its bounds, or a ratio that raised it or cannot be kept."""
        return [note for note in self.notes if note.startswith(role.value) or "cannot" in note]


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def effective_replicas(dd: DisaggregatedDeployment, desired: dict[Role, int]) -> Scale:
    """The counts to run for the desired ones: each within its role's bounds, then the decode-per-prefill ratio
    kept by raising the smaller side (within its maximum; a ratio the maxima make impossible is noted)."""
    spec = dd.spec
    counts = {role: _clamp(desired[role], spec.role(role).min_replicas, spec.role(role).max_replicas) for role in Role}
    notes = [
        f"{role.value} {desired[role]} -> {counts[role]}: within minReplicas {spec.role(role).min_replicas} and "
        f"maxReplicas {spec.role(role).max_replicas}"
        for role in Role
        if counts[role] != desired[role]
    ]
    ratio = spec.scaling.decode_per_prefill
    prefill, decode = counts[Role.PREFILL], counts[Role.DECODE]
    if ratio is not None and ratio.min is not None and decode < math.ceil(ratio.min * prefill - 1e-9):
        wanted = math.ceil(ratio.min * prefill - 1e-9)
        decode = min(wanted, spec.decode.max_replicas)
        notes.append(
            f"decode {counts[Role.DECODE]} -> {decode}: decodePerPrefill.min {ratio.min} with {prefill} prefill"
        )
    if ratio is not None and ratio.max is not None and decode > ratio.max * prefill + 1e-9:
        wanted = math.ceil(decode / ratio.max - 1e-9)
        before, prefill = prefill, min(wanted, spec.prefill.max_replicas)
        notes.append(f"prefill {before} -> {prefill}: decodePerPrefill.max {ratio.max} with {decode} decode")
    if ratio is not None and not _within(ratio.min, ratio.max, prefill, decode):
        notes.append(f"decodePerPrefill cannot be kept with {prefill} prefill and {decode} decode: raise maxReplicas")
    return Scale(desired=dict(desired), effective={Role.PREFILL: prefill, Role.DECODE: decode}, notes=notes)


def _within(low: float | None, high: float | None, prefill: int, decode: int) -> bool:
    if low is not None and decode < low * prefill - 1e-9:
        return False
    return not (high is not None and decode > high * prefill + 1e-9)


def pod_selector(deployment: str, role: Role) -> str:
    """The role's pods as a label-selector string (what HPA reads from the scale subresource)."""
    return ",".join(f"{key}={value}" for key, value in selector(deployment, role).items())


def role_resource(dd: DisaggregatedDeployment, uid: str, role: Role) -> Obj:
    """A new DisaggregatedRole, its replicas the deployment's (created once; afterwards its replicas are the
    autoscaler's, see :func:`spec_replicas_patch`)."""
    name, replicas = dd.metadata.name, dd.spec.role(role).replicas
    return {
        "apiVersion": API_VERSION,
        "kind": ROLE_KIND,
        "metadata": {
            "name": role_name(name, role),
            "namespace": dd.metadata.namespace or "default",
            "labels": {**MANAGED_BY, **selector(name, role)},
            "annotations": {ANNOTATION_SPEC_REPLICAS: str(replicas)},
            "ownerReferences": [owner_reference(dd, uid)],
        },
        "spec": {"deployment": name, "role": role.value, "replicas": replicas},
    }


def spec_replicas_patch(wanted: int, current: Obj) -> Obj | None:
    """A merge patch that sets a role's replicas to the deployment's ``wanted``, unless they were last written as
    that (a person's choice wins over an autoscaler's then, as with ``kubectl scale``). It carries the
    resourceVersion read, so an autoscaler's write in between makes it fail and be retried."""
    meta = current.get("metadata") or {}
    if (meta.get("annotations") or {}).get(ANNOTATION_SPEC_REPLICAS) == str(wanted):
        return None
    annotations = {ANNOTATION_SPEC_REPLICAS: str(wanted)}
    return {
        "metadata": {"resourceVersion": meta.get("resourceVersion"), "annotations": annotations},
        "spec": {"replicas": wanted},
    }


def desired_of(current: Obj | None, dd: DisaggregatedDeployment, role: Role) -> int:
    if current is None:
        return dd.spec.role(role).replicas
    replicas = (current.get("spec") or {}).get("replicas")
    return (
        int(replicas) if isinstance(replicas, int) and not isinstance(replicas, bool) else dd.spec.role(role).replicas
    )


def role_status(dd: DisaggregatedDeployment, role: Role, scale: Scale) -> Obj:
    """What the DisaggregatedRole's status says: the selector for HPA, the desired and the effective count (its
    ``replicas``, the scale subresource's current count), and why they differ. It changes only when the role
    scales, not with every pod: readiness is the deployment's status (``kubectl get dd``)."""
    return {
        "replicas": scale.effective[role],
        "desiredReplicas": scale.desired[role],
        "effectiveReplicas": scale.effective[role],
        "selector": pod_selector(dd.metadata.name, role),
        "message": "; ".join(scale.notes_for(role)),
    }


def _merged(obj: Obj, patch: Obj) -> Obj:
    """``obj`` with a merge patch of maps applied (RFC 7386, without deletions: the patches here set values)."""
    return {
        **obj,
        **{
            key: _merged(obj.get(key) or {}, value) if isinstance(value, dict) else value
            for key, value in patch.items()
        },
    }


@dataclass(frozen=True)
class Roles:
    """What a reconcile does with the deployment's DisaggregatedRoles, and the engine counts that follow."""

    create: dict[Role, Obj]  # roles that do not exist yet
    rescale: dict[Role, int]  # roles whose replicas the spec's changed: the new value
    held: dict[Role, Obj | None]  # each role as the API will hold it once those writes are done
    scale: Scale
    status: dict[Role, Obj]  # the status of each role whose status changes
    scaled: list[str]  # a message for each role whose effective count changed since the previous status


def decide_roles(
    dd: DisaggregatedDeployment, uid: str, current: dict[Role, Obj | None], write: bool, previous: Obj
) -> Roles:
    """Each role created with the spec's replicas when missing; afterwards its replicas change only when the spec's
    do, so what an autoscaler set stays (``write``: a full reconcile, which creates and rescales roles; else the
    roles are only read). ``previous``: the deployment's status, for the Scaled messages."""
    create: dict[Role, Obj] = {}
    rescale: dict[Role, int] = {}
    held = dict(current)
    for role in Role if write else ():
        wanted = dd.spec.role(role).replicas
        role_obj = current[role]
        if role_obj is None:
            create[role] = held[role] = role_resource(dd, uid, role)
        elif (patch := spec_replicas_patch(wanted, role_obj)) is not None:
            rescale[role] = wanted
            held[role] = _merged(role_obj, patch)  # as the API holds it once the patch is written
    scale = effective_replicas(dd, {role: desired_of(held[role], dd, role) for role in Role})
    status = {role: role_status(dd, role, scale) for role in Role if held[role] is not None}
    scaled = []
    for role in Role:
        was = (previous.get(role.value) or {}).get("replicas")
        if isinstance(was, int) and was != scale.effective[role]:
            why = "".join(f"; {note}" for note in scale.notes_for(role))
            scaled.append(
                f"{role.value}: {was} -> {scale.effective[role]} engines ({dd.metadata.name}-{role.value} "
                f"asks {scale.desired[role]}{why})"
            )
    return Roles(
        create,
        rescale,
        held,
        scale,
        {role: wanted for role, wanted in status.items() if (held[role] or {}).get("status") != wanted},
        scaled,
    )
