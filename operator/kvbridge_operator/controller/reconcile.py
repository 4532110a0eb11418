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

import dataclasses
import datetime
import logging
from dataclasses import dataclass, field
from typing import Any

from kvbridge_agent.core import Role, SpecError, TransferPlan

from . import multinode, placement, revisions
from .config import OperatorConfig
from .kube import (
    BY_KIND,
    DEPLOYMENTS,
    EVENTS,
    HTTP_ROUTES,
    INFERENCE_POOLS,
    LEADER_WORKER_SETS,
    POD_GROUPS,
    PODS,
    ROLES,
    SECRETS,
    STATEFUL_SETS,
    ApiError,
    KubeClient,
    Resource,
)
from .observe import Event, Observation, observe, pod_ready
from .pairing import pairing
from .render import (
    LABEL_DEPLOYMENT,
    LABEL_PAIRING,
    LABEL_REVISION,
    LABEL_ROLE,
    WORKLOAD_KINDS,
    children,
    role_name,
    secret,
    template_revision,
)
from .rollout import Phase, PodState, RoleTarget, Step, Strategy, step
from .scaling import Scale, desired_of, effective_replicas, replicas_patch, role_resource, role_status
from .serving import optional_children, router_name, router_url
from .spec import API_VERSION, KIND, DisaggregatedDeployment, parse_deployment
from .status import Condition, ConditionType, Pairing, RolloutStatus, merge_conditions, now_rfc3339
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


def _stored(value: Any) -> Any:
    """A status as the API server keeps it after a merge patch: no null fields."""
    if isinstance(value, dict):
        return {k: _stored(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_stored(v) for v in value]
    return value


def _rolling_keys(workload: Obj) -> tuple[str, str]:
    """Where a workload keeps its rolling update's partition: a StatefulSet's ``updateStrategy.rollingUpdate``, a
    LeaderWorkerSet's ``rolloutStrategy.rollingUpdateConfiguration`` (both count ordinals: pods, or groups)."""
    if workload.get("kind") == multinode.LWS_KIND:
        return "rolloutStrategy", "rollingUpdateConfiguration"
    return "updateStrategy", "rollingUpdate"


def _state(workload: Obj | None) -> tuple[int, int] | None:
    """A workload's replicas and partition (``None``: none yet)."""
    if workload is None:
        return None
    spec = workload.get("spec") or {}
    strategy, rolling = _rolling_keys(workload)
    partition = ((spec.get(strategy) or {}).get(rolling) or {}).get("partition", 0)
    return int(spec.get("replicas", 0)), int(partition)


def _rollout(
    dd: DisaggregatedDeployment, rendered: list[Obj], scale: Scale, sets: dict[Role, Obj | None], pods: list[Obj],
    records: dict[str, Obj],
) -> Step:  # fmt: skip
    """The rollout's step for the pods that exist (rollout.py): each StatefulSet's replicas and partition."""
    name = dd.metadata.name
    targets, states = {}, {}
    for role in Role:
        new = template_revision(_workload_of(rendered, role))
        running, current = sets[role], _state(sets[role])
        partition = (
            current[1] if running is not None and current is not None and template_revision(running) == new else None
        )
        rollout = dd.spec.role(role).rollout
        targets[role] = RoleTarget(scale.effective[role], rollout.max_surge, rollout.max_unavailable, partition)
        prefix = role_name(name, role) + "-"
        states[role] = [
            PodState(int(pod["metadata"]["name"][len(prefix):]), labels.get(LABEL_REVISION) == new, pod_ready(pod),
                     str(labels.get(LABEL_PAIRING, "")))
            for pod in pods
            if (labels := pod["metadata"].get("labels") or {}).get(LABEL_ROLE) == role.value
            and pod["metadata"]["name"].startswith(prefix) and pod["metadata"]["name"][len(prefix):].isdigit()
        ]  # fmt: skip
    key = pairing(dd.spec)
    return step(targets, states, key, revisions.pairs_with({**records, key: revisions.record(dd)}, name))


def _workload_of(rendered: list[Obj], role: Role) -> Obj:
    """The role's workload among the rendered children: its StatefulSet or LeaderWorkerSet."""
    return next(
        c for c in rendered if c["kind"] in WORKLOAD_KINDS and c["metadata"]["labels"][LABEL_ROLE] == role.value
    )


def _stepped(rendered: list[Obj], roll: Step) -> list[Obj]:
    """The rendered children with each workload's replicas and partition as the rollout's step wants."""
    for role in Role:
        workload = _workload_of(rendered, role)
        strategy, rolling = _rolling_keys(workload)
        workload["spec"]["replicas"] = roll.replicas[role]
        workload["spec"][strategy][rolling]["partition"] = roll.partition[role]
    return rendered


def _rollout_status(roll: Step, key: str) -> Obj:
    return RolloutStatus(
        strategy=roll.strategy.value, phase=roll.phase.value, revision=key, reason=roll.reason[:4096],
        prefill=roll.progress.get(Role.PREFILL, ""), decode=roll.progress.get(Role.DECODE, ""),
        pairings=[Pairing(prefill=p, decode=d) for p, d in roll.pairings],
    ).model_dump(by_alias=True, mode="json")  # fmt: skip


def _rollout_events(previous: Obj, roll: Step) -> list[Event]:
    """An event when a rollout starts (with its strategy and why), per phase, and when it completes."""
    was, now = str(previous.get("phase") or Phase.COMPLETE.value), roll.phase.value
    if was == now:
        return []
    progress = f"prefill {roll.progress.get(Role.PREFILL, '')}, decode {roll.progress.get(Role.DECODE, '')}"
    if now == Phase.COMPLETE.value:
        return [Event("Normal", "RolloutComplete", f"every pod runs the current spec ({progress})")]
    events = []
    if was == Phase.COMPLETE.value:
        why = roll.reason or "old and new pods of both roles are compatible"
        events.append(Event("Normal", "RolloutStarted", f"{roll.strategy.value}: {why}"))
    events.append(Event("Normal", "RolloutPhase", f"{roll.strategy.value} {now}: {progress}"))
    return events


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
    if replicas_patch(dd, role, current) is None:
        return current
    # the spec's replicas changed: write them with the resourceVersion of a fresh read (the watch's copy may lag,
    # and a handler of this very role, waiting here, holds back the watch's next event of it)
    namespace = dd.metadata.namespace or "default"
    fresh = await client.get(ROLES, namespace, current["metadata"]["name"]) or current
    patch = replicas_patch(dd, role, fresh)
    if patch is None:
        return fresh
    return await client.patch(ROLES, namespace, current["metadata"]["name"], patch)


async def publish_role_status(client: KubeClient, dd: DisaggregatedDeployment, role: Role, current: Obj,
                              scale: Scale) -> None:  # fmt: skip
    """The DisaggregatedRole's status (the selector HPA needs; desired and effective), written when it changed."""
    wanted = role_status(dd, role, scale)
    if current.get("status") == wanted:
        return
    await client.patch(ROLES, dd.metadata.namespace or "default", current["metadata"]["name"], {"status": wanted},
                       "status")  # fmt: skip


#: what a cluster without the Gateway API (Inference Extension) CRDs answers for their objects
OPTIONAL_KINDS = ("InferencePool", "HTTPRoute", "PodGroup")


async def apply_optional_children(
    client: KubeClient, dd: DisaggregatedDeployment, uid: str, config: OperatorConfig, previous: Obj
) -> tuple[Obj, list[Event]]:
    """Apply the optional children (``spec.router``'s, ``spec.inferencePool``'s, ``spec.placement.gang``'s
    PodGroup); delete the ones the spec no longer asks for (known from the previous status, so a deployment that
    never had them costs no call). Returns their status fields and events; a cluster without the InferencePool,
    HTTPRoute or PodGroup CRD gets a Warning, not a failed reconcile."""
    events: list[Event] = []
    namespace = dd.metadata.namespace or "default"
    fields: Obj = {"router": None, "inferencePool": None, "placement": None}
    made: set[str] = set()
    missing: list[str] = []
    for child in optional_children(dd, uid, config):
        try:
            await apply(client, child)
            made.add(child["kind"])
        except ApiError as exc:
            if exc.status != 404 or child["kind"] not in OPTIONAL_KINDS:
                raise
            missing.append(child["kind"])
    pool_before = previous.get("inferencePool") or {}
    group_before = previous.get("placement") or {}
    if "PodGroup" in missing:
        missing.remove("PodGroup")
        message = (
            "the API has no PodGroup resource (scheduling.x-k8s.io): install scheduler-plugins' "
            "coscheduling, or remove spec.placement.gang (pods wait for a scheduler that may not run)"
        )
        fields["placement"] = {"podGroup": "", "message": message}
        if group_before.get("message") != message:
            events.append(Event("Warning", "GangSchedulingUnavailable", message))
    elif "PodGroup" in made:
        fields["placement"] = {"podGroup": dd.metadata.name, "message": ""}
    elif group_before.get("podGroup"):
        await client.delete(POD_GROUPS, namespace, str(group_before["podGroup"]))
    if missing:
        message = (f"the API has no {' or '.join(missing)} resource: install the Gateway API (Inference Extension) "
                   "CRDs, or set spec.inferencePool.enabled: false")  # fmt: skip
        fields["inferencePool"] = {"name": "", "httpRoute": "", "message": message}
        if pool_before.get("message") != message:
            events.append(Event("Warning", "ServingUnavailable", message))
    if dd.spec.router.enabled:
        fields["router"] = {"url": router_url(dd)}
    elif previous.get("router"):
        for kind in ("Deployment", "Service", "RoleBinding", "Role", "ServiceAccount"):
            await client.delete(_resource_of(kind), namespace, router_name(dd.metadata.name))
        events.append(Event("Normal", "RouterRemoved", f"{router_name(dd.metadata.name)} deleted (spec.router)"))
    if dd.spec.inference_pool.enabled and "InferencePool" in made:
        route = dd.metadata.name if "HTTPRoute" in made else ""
        note = fields["inferencePool"]["message"] if missing else ""
        fields["inferencePool"] = {"name": dd.metadata.name, "httpRoute": route, "message": note}
    if pool_before.get("httpRoute") and not (fields["inferencePool"] or {}).get("httpRoute"):
        await client.delete(HTTP_ROUTES, namespace, str(pool_before["httpRoute"]))
    if pool_before.get("name") and not fields["inferencePool"]:
        await client.delete(INFERENCE_POOLS, namespace, str(pool_before["name"]))
    return fields, events


def _resource_of(kind: str) -> Resource:
    return next(resource for (_, k), resource in BY_KIND.items() if k == kind)


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


@dataclass(frozen=True)
class Children:
    """What the reconcile reads of a deployment's children: its DisaggregatedRoles, StatefulSets, pods and, for
    roles whose engines span nodes, LeaderWorkerSets."""

    roles: dict[Role, Obj | None]
    sets: dict[Role, Obj | None]
    pods: list[Obj]
    groups: dict[Role, Obj | None] = field(default_factory=dict)


async def _retire_other_kind(client: KubeClient, dd: DisaggregatedDeployment, seen: Children,
                             keep: set[Role]) -> list[Event]:  # fmt: skip
    """A role whose ``nodes`` crossed 1 runs under the other workload kind now: the old one (and, through its
    owner references, its pods) goes at once, once the new one is written (not for the roles in ``keep``, whose
    new workload could not be). The old engines cannot serve beside the new kind's (one name, one Service), so the
    role is down until the new engines are ready; the event says so."""
    events = []
    namespace = dd.metadata.namespace or "default"
    for role in Role:
        if role in keep:
            continue
        spans = multinode.spans_nodes(dd.spec, role)
        stale = seen.sets[role] if spans else seen.groups.get(role)
        if stale is None:
            continue
        await client.delete(_resource_of(stale["kind"]), namespace, stale["metadata"]["name"])
        now = "a LeaderWorkerSet (engines spanning nodes)" if spans else "a StatefulSet (one pod per engine)"
        events.append(Event("Warning", "WorkloadReplaced", (
            f"{role.value}: spec.{role.value}.nodes is now {dd.spec.role(role).nodes}, so its engines run as {now}; "
            f"the {stale['kind']} {stale['metadata']['name']} and its pods were deleted (the role serves again "
            "once the new engines are ready)")))  # fmt: skip
    return events


async def read_children(client: KubeClient, namespace: str, name: str) -> Children:
    """From the API: five calls (the operator's own watches serve them instead: handlers.py)."""
    roles = {role: await client.get(ROLES, namespace, role_name(name, role)) for role in Role}
    sets = {role: await client.get(STATEFUL_SETS, namespace, role_name(name, role)) for role in Role}
    # without the LeaderWorkerSet CRD the API answers 404, which get reads as none
    groups = {role: await client.get(LEADER_WORKER_SETS, namespace, role_name(name, role)) for role in Role}
    return Children(roles, sets, await client.list(PODS, namespace, f"{LABEL_DEPLOYMENT}={name}"), groups)


async def reconcile(
    client: KubeClient, body: Obj, config: OperatorConfig, apply_children: bool = True,
    cached: Children | None = None,
) -> Outcome:  # fmt: skip
    """One reconcile; ``cached`` children (from the operator's watch indexes) spare their reads."""
    meta = body["metadata"]
    name, namespace, uid = meta["name"], meta.get("namespace") or "default", meta.get("uid", "")
    generation = int(meta.get("generation", 0))
    try:
        dd = parse_deployment({**body, "metadata": {**meta, "namespace": namespace}})
    except SpecError as exc:
        return await _invalid(client, body, exc)
    dd = placement.with_gpus_per_node(dd, config.gpus_per_node)
    verdict = verdict_for(dd)
    previous: Obj = body.get("status") or {}
    applied = False
    optional: Obj = {key: previous.get(key) for key in ("router", "inferencePool", "placement")}
    optional_events: list[Event] = []
    seen = cached if cached is not None else await read_children(client, namespace, name)
    roles, pods = dict(seen.roles), list(seen.pods)
    sets = {role: (seen.groups.get(role) if multinode.spans_nodes(dd.spec, role) else seen.sets[role]) for role in Role}
    annotations: dict[str, str] = dict(meta.get("annotations") or {})
    records = revisions.load(annotations.get(revisions.ANNOTATION))
    scale = effective_replicas(dd, {role: desired_of(roles[role], dd, role) for role in Role})
    plan = verdict if isinstance(verdict, TransferPlan) else None
    rendered = children(dd, uid, plan, config) if plan is not None else []
    roll = _rollout(dd, rendered, scale, sets, pods, records) if plan is not None else None
    # every child is applied on create, update, resume and resync, and when the spec is not applied yet (a pod
    # event racing the update handler: the status never describes a generation whose children were not written);
    # a status-only reconcile (a pod event, a DisaggregatedRole scaled) applies just the StatefulSets whose
    # replicas or partition are not what the effective counts and the rollout's step want
    full = apply_children or int(previous.get("observedGeneration", -1)) != generation
    wanted = {} if roll is None else {role: (roll.replicas[role], roll.partition[role]) for role in Role}
    moving = {role for role in wanted if sets[role] is not None and _state(sets[role]) != wanted[role]}
    if plan is not None and roll is not None and (full or moving):
        if full:
            await ensure_secret(client, secret(dd, uid))
            for role in Role:
                roles[role] = await ensure_role(client, dd, uid, role, roles[role])
            scale = effective_replicas(dd, {role: desired_of(roles[role], dd, role) for role in Role})
            roll = _rollout(dd, rendered, scale, sets, pods, records)
        not_applied: set[Role] = set()
        for child in _stepped(rendered, roll):
            role_of = str((child["metadata"].get("labels") or {}).get(LABEL_ROLE, ""))
            stateful = child["kind"] in WORKLOAD_KINDS
            if not full and not (stateful and Role(role_of) in moving):
                continue
            try:
                written = await apply(client, child)
            except ApiError as exc:
                if exc.status != 404 or child["kind"] != multinode.LWS_KIND:
                    raise
                optional_events.append(Event("Warning", "LeaderWorkerSetUnavailable", (
                    f"{role_of} spans {dd.spec.role(Role(role_of)).nodes} nodes, which runs as a LeaderWorkerSet, "
                    "and the API has no LeaderWorkerSet resource: install LeaderWorkerSet (kubernetes-sigs/lws) or "
                    f"set spec.{role_of}.nodes to 1")))  # fmt: skip
                not_applied.add(Role(role_of))
                continue
            if stateful:
                sets[Role(role_of)] = written
        if full:
            optional_events += await _retire_other_kind(client, dd, seen, keep=not_applied)
            optional, serving_events = await apply_optional_children(client, dd, uid, config, previous)
            optional_events += serving_events
        applied = True
    observation = observe(dd, generation, verdict, sets, pods, previous, annotations, now_rfc3339(), scale.effective)
    if applied and int(previous.get("observedGeneration", -1)) != generation:
        observation.events.insert(
            0, Event("Normal", "Reconciled", f"generation {generation}: prefill and decode workloads applied")
        )
    status = observation.status.model_dump(by_alias=True, mode="json")
    status.update(optional)
    observation.events.extend(optional_events)
    for role in Role:
        status[role.value]["desiredReplicas"] = scale.desired[role]
        was = (previous.get(role.value) or {}).get("replicas")
        if plan is not None and isinstance(was, int) and was != scale.effective[role]:
            why = "".join(f"; {note}" for note in scale.notes_for(role))
            message = f"{role.value}: {was} -> {scale.effective[role]} engines ({role_name(name, role)} asks "
            observation.events.append(Event("Normal", "Scaled", f"{message}{scale.desired[role]}{why})"))
        current = roles[role]
        if current is not None:
            await publish_role_status(client, dd, role, current, scale)
    if roll is not None:
        before = previous.get("rollout") or {}
        if roll.phase in (Phase.SCALING_IN, Phase.COMPLETE) and before.get("revision") == pairing(dd.spec):
            # no old pod is left, so the step alone cannot tell how they went: the strategy stays the rollout's
            roll = dataclasses.replace(roll, strategy=Strategy(before.get("strategy") or roll.strategy),
                                       reason=str(before.get("reason") or ""))  # fmt: skip
        status["rollout"] = _rollout_status(roll, pairing(dd.spec))
        observation.events.extend(_rollout_events(previous.get("rollout") or {}, roll))
        present = {str((p["metadata"].get("labels") or {}).get(LABEL_PAIRING, "")) for p in pods} | {pairing(dd.spec)}
        kept = revisions.dump({**records, pairing(dd.spec): revisions.record(dd)}, present)
        if annotations.get(revisions.ANNOTATION) != kept:
            observation.annotations[revisions.ANNOTATION] = kept
    else:
        status["rollout"] = previous.get("rollout")
    if _stored(status) != previous:  # unchanged, it is not written (a write is an event every watcher processes)
        await client.patch(DEPLOYMENTS, namespace, name, {"status": status}, "status")
    if observation.annotations:
        await client.patch(DEPLOYMENTS, namespace, name, {"metadata": {"annotations": observation.annotations}})
    for event in observation.events:
        await post_event(client, body, event)
    return Outcome(applied, observation)
