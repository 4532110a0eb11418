"""One idempotent reconcile for every path (create, update, resume, resync, pod events).

It renders the desired children from pure functions, applies them
(server-side apply under kvbridge's field manager; the Secret is created
once and never patched), observes
the StatefulSets and pods, and writes the status, the pod-incarnation
annotation and the events.  An incompatible spec changes nothing that runs.
A pod event changes no spec, so it only observes and writes the status
(``apply_children=False``); the periodic resync re-applies the children.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

from kvbridge_agent.core import Role, SpecError, TransferPlan

from .config import OperatorConfig
from .kube import BY_KIND, DEPLOYMENTS, EVENTS, PODS, ROLES, SECRETS, STATEFUL_SETS, ApiError, KubeClient
from .observe import Event, Observation, observe
from .render import LABEL_DEPLOYMENT, LABEL_ROLE, children, role_name, secret
from .scaling import Scale, desired_of, effective_replicas, replicas_patch, role_resource, role_status
from .spec import API_VERSION, KIND, DisaggregatedDeployment, parse_deployment
from .status import Condition, ConditionType, merge_conditions, now_rfc3339
from .verdict import verdict_for

log = logging.getLogger(__name__)

Obj = dict[str, Any]


@dataclass
class Outcome:
    applied: bool
    observation: Observation | None


async def apply(client: KubeClient, obj: Obj) -> Obj:
    """Server-side apply under kvbridge's field manager: one call, create or update, others' fields kept."""
    return await client.apply(BY_KIND[(obj["apiVersion"], obj["kind"])], obj)


def _notes(scale: Scale, role: Role) -> list[str]:
    """The scaling notes about one role (its bounds, or a ratio that raised it or cannot be kept)."""
    return [note for note in scale.notes if note.startswith(role.value) or "cannot" in note]


def _replicas(stateful_set: Obj | None) -> int | None:
    return None if stateful_set is None else int((stateful_set.get("spec") or {}).get("replicas", 0))


async def ensure_role(client: KubeClient, dd: DisaggregatedDeployment, uid: str, role: Role,
                      current: Obj | None) -> Obj:  # fmt: skip
    """The role's DisaggregatedRole: created with the spec's replicas; afterwards its replicas change only when the
    spec's do (scaling.replicas_patch), so what an autoscaler set stays."""
    if current is None:
        try:
            return await client.create(ROLES, dd.metadata.namespace or "default", role_resource(dd, uid, role))
        except ApiError as exc:
            if exc.status != 409:
                raise
            found = await client.get(ROLES, dd.metadata.namespace or "default", role_name(dd.metadata.name, role))
            if found is None:  # deleted in between: the next reconcile creates it
                raise
            current = found
    patch = replicas_patch(dd, role, current)
    if patch is None:
        return current
    return await client.patch(ROLES, dd.metadata.namespace or "default", current["metadata"]["name"], patch)


async def publish_role_status(client: KubeClient, dd: DisaggregatedDeployment, role: Role, current: Obj,
                              scale: Scale, ready: int, pods: int) -> None:  # fmt: skip
    """The DisaggregatedRole's status (the selector HPA needs; desired, effective, ready), written when it changed."""
    wanted = role_status(dd, role, scale, pods, ready)
    wanted["message"] = "; ".join(_notes(scale, role))
    if current.get("status") == wanted:
        return
    await client.patch(ROLES, dd.metadata.namespace or "default", current["metadata"]["name"], {"status": wanted},
                       "status")  # fmt: skip


async def ensure_secret(client: KubeClient, obj: Obj) -> None:
    try:
        await client.create(SECRETS, obj["metadata"]["namespace"], obj)
    except ApiError as exc:
        if exc.status != 409:  # it exists: keep it (rotation is an explicit action)
            raise


async def post_event(client: KubeClient, body: Obj, event: Event) -> None:
    meta = body["metadata"]
    now = datetime.datetime.now(datetime.UTC).isoformat()
    namespace = meta.get("namespace") or "default"
    payload = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": namespace},
        "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "namespace": namespace,
                           "uid": meta.get("uid", "")},
        "type": event.type,
        "reason": event.reason,
        "message": event.message[:1000],
        "source": {"component": "kvbridge-operator"},
        "reportingComponent": "kvbridge.io/operator",
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }  # fmt: skip
    try:
        await client.create(EVENTS, namespace, payload)
    except ApiError as exc:  # events help, they must not fail the reconcile
        log.warning("posting event %s failed: %s", event.reason, exc)


async def _invalid(client: KubeClient, body: Obj, exc: SpecError) -> Outcome:
    """A resource the schema should have rejected (or an older CRD): report, never crash-loop."""
    meta = body["metadata"]
    generation = int(meta.get("generation", 0))
    previous = body.get("status") or {}
    condition = Condition(
        type=ConditionType.COMPATIBLE,
        status="False",
        reason="InvalidSpec",
        message=f"{exc.field}: {exc.message}",
        observed_generation=generation,
    )
    ready = Condition(
        type=ConditionType.READY,
        status="False",
        reason="InvalidSpec",
        message=condition.message,
        observed_generation=generation,
    )
    conditions = merge_conditions(previous.get("conditions") or [], [condition, ready], now_rfc3339())
    status = {
        "observedGeneration": generation,
        "conditions": [c.model_dump(by_alias=True, mode="json") for c in conditions],
    }
    await client.patch(DEPLOYMENTS, meta.get("namespace") or "default", meta["name"], {"status": status}, "status")
    old = {str(c.get("type")): c for c in previous.get("conditions") or []}.get("Compatible", {})
    if old.get("reason") != "InvalidSpec" or int(old.get("observedGeneration", -1)) != generation:
        await post_event(client, body, Event("Warning", "InvalidSpec", condition.message))
    return Outcome(False, None)


async def reconcile(client: KubeClient, body: Obj, config: OperatorConfig, apply_children: bool = True) -> Outcome:
    meta = body["metadata"]
    name, namespace, uid = meta["name"], meta.get("namespace") or "default", meta.get("uid", "")
    generation = int(meta.get("generation", 0))
    try:
        dd = parse_deployment({**body, "metadata": {**meta, "namespace": namespace}})
    except SpecError as exc:
        return await _invalid(client, body, exc)
    verdict = verdict_for(dd)
    previous: Obj = body.get("status") or {}
    applied = False
    roles = {role: await client.get(ROLES, namespace, role_name(name, role)) for role in Role}
    sets = {role: await client.get(STATEFUL_SETS, namespace, role_name(name, role)) for role in Role}
    scale = effective_replicas(dd, {role: desired_of(roles[role], dd, role) for role in Role})
    # a status-only reconcile (a pod event, a DisaggregatedRole scaled) applies when the running counts are not
    # the effective ones, and when the spec is not applied yet (a pod event racing the update handler): the
    # status never describes a generation whose children were not written
    apply_children = (
        apply_children
        or int(previous.get("observedGeneration", -1)) != generation
        or any(_replicas(sets[role]) != scale.effective[role] for role in Role)
    )
    before = {role: _replicas(sets[role]) for role in Role}
    if isinstance(verdict, TransferPlan) and apply_children:
        await ensure_secret(client, secret(dd, uid))
        for role in Role:
            roles[role] = await ensure_role(client, dd, uid, role, roles[role])
        scale = effective_replicas(dd, {role: desired_of(roles[role], dd, role) for role in Role})
        for child in children(dd, uid, verdict, config, scale.effective):
            written = await apply(client, child)
            if child["kind"] == "StatefulSet":
                sets[Role(child["metadata"]["labels"][LABEL_ROLE])] = written
        applied = True
    pods = await client.list(PODS, namespace, f"{LABEL_DEPLOYMENT}={name}")
    annotations: dict[str, str] = dict(meta.get("annotations") or {})
    observation = observe(dd, generation, verdict, sets, pods, previous, annotations, now_rfc3339())
    if applied and int(previous.get("observedGeneration", -1)) != generation:
        observation.events.insert(
            0, Event("Normal", "Reconciled", f"generation {generation}: prefill and decode workloads applied")
        )
    status = observation.status.model_dump(by_alias=True, mode="json")
    for role in Role:
        status[role.value]["desiredReplicas"] = scale.desired[role]
        if applied and before[role] is not None and before[role] != scale.effective[role]:
            why = "".join(f"; {note}" for note in _notes(scale, role))
            observation.events.append(Event("Normal", "Scaled", f"{role.value}: {before[role]} -> "
                                            f"{scale.effective[role]} engines ({role_name(name, role)} asks "
                                            f"{scale.desired[role]}{why})"))  # fmt: skip
        current = roles[role]
        if current is not None:
            counts = observation.status.role(role)
            of_role = sum(1 for p in pods if (p["metadata"].get("labels") or {}).get(LABEL_ROLE) == role.value)
            await publish_role_status(client, dd, role, current, scale, counts.ready_replicas, of_role)
    await client.patch(DEPLOYMENTS, namespace, name, {"status": status}, "status")
    if observation.annotations:
        await client.patch(DEPLOYMENTS, namespace, name, {"metadata": {"annotations": observation.annotations}})
    for event in observation.events:
        await post_event(client, body, event)
    return Outcome(applied, observation)
