"""The thin half of a reconcile: carry out the decision's actions, in order, one API call (or two) each."""

from __future__ import annotations

import logging

from kvbridge_operator.api.names import API_VERSION, KIND
from kvbridge_operator.api.objects import Obj, now_rfc3339
from kvbridge_operator.children.scaling import spec_replicas_patch
from kvbridge_operator.controller import actions
from kvbridge_operator.kube import BY_KIND, EVENTS, ROLES, ApiError, KubeClient

log = logging.getLogger(__name__)


class KindMissingError(Exception):
    """The API does not serve an optional kind (its CRD is not installed): the reconcile decides again without it."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


async def execute(client: KubeClient, todo: list[actions.Action], done: list[actions.Action]) -> None:
    """Carry out ``todo`` in order, skipping those in ``done`` (a decision made again after a :class:`KindMissingError`
    repeats what was already done) and appending each one carried out to it."""
    for action in todo:
        if action in done:
            continue
        await _carry_out(client, action)
        done.append(action)


async def _carry_out(client: KubeClient, action: actions.Action) -> None:
    match action:
        case actions.Apply(obj=obj, optional=optional):
            try:
                await client.apply(BY_KIND[(obj["apiVersion"], obj["kind"])], obj)
            except ApiError as exc:
                if exc.status == 404 and optional:
                    raise KindMissingError(str(obj["kind"])) from exc
                raise
        case actions.CreateOnce(resource=resource, obj=obj):
            try:
                await client.create(resource, obj["metadata"]["namespace"], obj)
            except ApiError as exc:
                if exc.status != 409:  # it exists: keep it
                    raise
        case actions.EnsureRole():
            await _ensure_role(client, action)
        case actions.Delete(resource=resource, namespace=namespace, name=name):
            await client.delete(resource, namespace, name)
        case actions.WriteStatus(resource=resource, namespace=namespace, name=name, status=status):
            await client.patch(resource, namespace, name, {"status": status}, "status")
        case actions.Annotate(resource=resource, namespace=namespace, name=name, annotations=annotations):
            await client.patch(resource, namespace, name, {"metadata": {"annotations": annotations}})
        case actions.Post(involved=involved, event=event):
            await post_event(client, involved, event)


async def _ensure_role(client: KubeClient, action: actions.EnsureRole) -> None:
    meta = action.obj["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    if not action.exists:
        try:
            await client.create(ROLES, namespace, action.obj)
            return
        except ApiError as exc:
            if exc.status != 409:  # created in between: its replicas are checked below
                raise
    # the spec's replicas changed: write them with the resourceVersion of a fresh read (the watch's copy may lag,
    # and a handler of this very role, waiting here, holds back the watch's next event of it)
    fresh = await client.get(ROLES, namespace, name)
    if fresh is None:  # deleted in between: its deletion's event brings the reconcile that creates it
        return
    patch = spec_replicas_patch(action.replicas, fresh)
    if patch is not None:
        await client.patch(ROLES, namespace, name, patch)


async def post_event(client: KubeClient, involved: Obj, event: actions.Event) -> None:
    """Post an event about ``involved`` (its metadata: name, namespace, uid); a failure is logged, never raised."""
    now = now_rfc3339()
    namespace = involved.get("namespace") or "default"
    payload = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{involved['name']}.", "namespace": namespace},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": involved["name"],
            "namespace": namespace,
            "uid": involved.get("uid", ""),
        },
        "type": event.type,
        "reason": event.reason,
        "message": event.message[:1000],
        "source": {"component": "kvbridge-operator"},
        "reportingComponent": "kvbridge.io/operator",
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        await client.create(EVENTS, namespace, payload)
    except ApiError as exc:  # events help, they must not fail the reconcile
        log.warning("posting event %s failed: %s", event.reason, exc)
