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
from .kube import BY_KIND, DEPLOYMENTS, EVENTS, PODS, SECRETS, STATEFUL_SETS, ApiError, KubeClient
from .observe import Event, Observation, observe
from .render import LABEL_DEPLOYMENT, children, role_name, secret
from .spec import API_VERSION, KIND, parse_deployment
from .status import Condition, ConditionType, merge_conditions, now_rfc3339
from .verdict import verdict_for

log = logging.getLogger(__name__)

Obj = dict[str, Any]


@dataclass
class Outcome:
    applied: bool
    observation: Observation | None


async def apply(client: KubeClient, obj: Obj) -> None:
    """Server-side apply under kvbridge's field manager: one call, create or update, others' fields kept."""
    await client.apply(BY_KIND[(obj["apiVersion"], obj["kind"])], obj)


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
    # a status-only reconcile of a spec not applied yet (a pod event racing the update handler) applies it first:
    # the status must never describe a generation whose children were not written
    apply_children = apply_children or int(previous.get("observedGeneration", -1)) != generation
    if isinstance(verdict, TransferPlan) and apply_children:
        await ensure_secret(client, secret(dd, uid))
        for child in children(dd, uid, verdict, config):
            await apply(client, child)
        applied = True
    sets = {role: await client.get(STATEFUL_SETS, namespace, role_name(name, role)) for role in Role}
    pods = await client.list(PODS, namespace, f"{LABEL_DEPLOYMENT}={name}")
    annotations: dict[str, str] = dict(meta.get("annotations") or {})
    observation = observe(dd, generation, verdict, sets, pods, previous, annotations, now_rfc3339())
    if applied and int(previous.get("observedGeneration", -1)) != generation:
        observation.events.insert(
            0, Event("Normal", "Reconciled", f"generation {generation}: prefill and decode workloads applied")
        )
    status = observation.status.model_dump(by_alias=True, mode="json")
    await client.patch(DEPLOYMENTS, namespace, name, {"status": status}, "status")
    if observation.annotations:
        await client.patch(DEPLOYMENTS, namespace, name, {"metadata": {"annotations": observation.annotations}})
    for event in observation.events:
        await post_event(client, body, event)
    return Outcome(applied, observation)
