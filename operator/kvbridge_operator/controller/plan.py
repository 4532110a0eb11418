"""The pure half of a reconcile: from what was read, everything it will do.

:func:`plan` takes the deployment as read, its children as the operator's watches (or a read) saw them and the
operator's settings, and returns the reconcile's actions in order: the Secret and DisaggregatedRoles, the children to
apply (each workload with the rollout's step), the children to delete, the roles' and the deployment's status, the
annotations and the events. Nothing here calls the API; apply.py carries the actions out.

Reading order: :func:`plan`, then the steps it takes — :func:`_roles` (what the DisaggregatedRoles will hold),
rollout.py's :func:`~kvbridge_operator.controller.rollout.for_workloads` (the step), :func:`_children`, optional.py
(the optional children), observe.py (the status and events).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvbridge_agent.core import Problem, Role, SpecError, TransferPlan
from kvbridge_operator.api.names import ANNOTATION_SPEC_REPLICAS, LABEL_PAIRING, LABEL_ROLE, LWS_KIND, WORKLOAD_KINDS
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment, parse_deployment
from kvbridge_operator.children import multinode, placement
from kvbridge_operator.children.pairing import pairing
from kvbridge_operator.children.render import children, secret
from kvbridge_operator.children.scaling import (
    Scale,
    desired_of,
    effective_replicas,
    role_resource,
    role_status,
    spec_replicas_patch,
)
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.controller import optional, revisions, rollout
from kvbridge_operator.controller.actions import (
    Action,
    Annotate,
    Apply,
    CreateOnce,
    Delete,
    EnsureRole,
    Event,
    Post,
    WriteStatus,
)
from kvbridge_operator.controller.observe import Facts, invalid, observe
from kvbridge_operator.kube import DEPLOYMENTS, ROLES, SECRETS, resource_of


@dataclass(frozen=True)
class Children:
    """What a reconcile reads of a deployment's children, per role: its DisaggregatedRole, StatefulSet and (for engines
    spanning nodes) LeaderWorkerSet, and the deployment's pods."""

    roles: dict[Role, Obj | None]
    stateful_sets: dict[Role, Obj | None]
    pods: list[Obj]
    leader_worker_sets: dict[Role, Obj | None] = field(default_factory=dict)

    def workloads(self, dd: DisaggregatedDeployment) -> dict[Role, Obj | None]:
        """Each role's workload of the kind its spec runs: a LeaderWorkerSet for engines spanning nodes, else a
        StatefulSet."""
        return {role: (self.leader_worker_sets.get(role) if multinode.spans_nodes(dd.spec, role)
                       else self.stateful_sets[role]) for role in Role}  # fmt: skip


@dataclass(frozen=True)
class Observed:
    """Everything :func:`plan` knows."""

    body: Obj  # the DisaggregatedDeployment as read
    children: Children
    config: OperatorConfig
    #: every child (create, update, resume, resync); else only the workloads whose replicas or partition must move
    apply_children: bool
    now: str  # RFC 3339, for condition transitions
    #: kinds the API turned out not to serve (their CRDs missing), learned from an earlier try of this reconcile
    missing: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Plan:
    actions: list[Action]
    applied: bool  # the spec's children are written (False: invalid or incompatible, nothing that runs changes)


def plan(observed: Observed) -> Plan:
    body = observed.body
    meta = body["metadata"]
    namespace = meta.get("namespace") or "default"
    generation = int(meta.get("generation", 0))
    previous: Obj = body.get("status") or {}
    try:
        dd = parse_deployment({**body, "metadata": {**meta, "namespace": namespace}})
    except SpecError as exc:
        status, events = invalid(previous, generation, exc, observed.now)
        return Plan([WriteStatus(DEPLOYMENTS, namespace, meta["name"], status), *(Post(meta, e) for e in events)],
                    applied=False)  # fmt: skip
    dd = placement.with_gpus_per_node(dd, observed.config.gpus_per_node)
    verdict = verdict_for(dd)
    if isinstance(verdict, TransferPlan):
        return _compatible(observed, dd, verdict, previous, generation)
    return _incompatible(observed, dd, verdict, previous, generation)


def _incompatible(observed: Observed, dd: DisaggregatedDeployment, problems: list[Problem], previous: Obj,
                  generation: int) -> Plan:  # fmt: skip
    """Nothing that runs changes: the status says why, with the children as they are."""
    seen = observed.children
    scale = effective_replicas(dd, {role: desired_of(seen.roles[role], dd, role) for role in Role})
    facts = Facts(generation, previous, _annotations(observed.body), observed.now, scale,
                  {key: previous.get(key) for key in optional.STATUS_FIELDS}, previous.get("rollout"))  # fmt: skip
    report = observe(dd, problems, "", seen.workloads(dd), seen.pods, facts)
    return Plan(_writes(observed.body, dd, seen.roles, scale, report.status, report.annotations, report.events), False)


def _compatible(observed: Observed, dd: DisaggregatedDeployment, transfer: TransferPlan, previous: Obj,
                generation: int) -> Plan:  # fmt: skip
    seen, config = observed.children, observed.config
    uid = observed.body["metadata"].get("uid", "")
    key = pairing(dd.spec)
    annotations = _annotations(observed.body)
    records = revisions.load(annotations.get(revisions.ANNOTATION))
    pairs_with = revisions.pairs_with({**records, key: revisions.record(dd)}, dd.metadata.name)
    workloads = seen.workloads(dd)
    rendered = children(dd, uid, transfer, config, key)
    # every child is applied on create, update, resume and resync, and when the spec is not applied yet (a pod event
    # racing the update handler: the status never describes a generation whose children were not written); a
    # status-only reconcile (a pod event, a DisaggregatedRole scaled) applies just the workloads whose replicas or
    # partition are not what the effective counts and the rollout's step want
    full = observed.apply_children or int(previous.get("observedGeneration", -1)) != generation
    actions: list[Action] = []
    roles = dict(seen.roles)
    if full:
        actions.append(CreateOnce(SECRETS, secret(dd, uid)))
        ensured = [_role(dd, uid, role, roles[role]) for role in Role]
        actions += [action for action, _ in ensured if action is not None]
        roles = {role: role_obj for role, (_, role_obj) in zip(Role, ensured, strict=True)}
    scale = effective_replicas(dd, {role: desired_of(roles[role], dd, role) for role in Role})
    step = rollout.for_workloads(dd, key, rendered, scale, workloads, seen.pods, pairs_with)
    moving = {role for role in Role
              if workloads[role] is not None and rollout.state_of(workloads[role]) != step.target(role)}  # fmt: skip
    events: list[Event] = []
    serving_fields: Obj = {name: previous.get(name) for name in optional.STATUS_FIELDS}
    applied = full or bool(moving)
    if applied:
        lacking = {role for role in Role if multinode.spans_nodes(dd.spec, role) and LWS_KIND in observed.missing}
        for child in rollout.stepped(rendered, step):
            role = Role(child["metadata"]["labels"][LABEL_ROLE]) if child["kind"] in WORKLOAD_KINDS else None
            if not full and role not in moving:
                continue
            if role in lacking:
                events.append(_lws_unavailable(dd, role))
                continue
            actions.append(Apply(child, optional=child["kind"] == LWS_KIND))
            if role is not None:
                workloads[role] = child  # what the API holds once it is applied
        if full:
            retired, retire_events = _retire_other_kind(dd, seen, keep=lacking)
            extra = optional.decide(dd, uid, config, previous, observed.missing)
            actions += retired + [Apply(c, optional=c["kind"] in optional.OPTIONAL_KINDS) for c in extra.apply]
            actions += [Delete(resource_of(kind), dd.metadata.namespace or "default", name)
                        for kind, name in extra.delete]  # fmt: skip
            events += retire_events + extra.events
            serving_fields = extra.status
    before = previous.get("rollout") or {}
    if step.phase in (rollout.Phase.SCALING_IN, rollout.Phase.COMPLETE) and before.get("revision") == key:
        # no old pod is left, so the step alone cannot tell how they went: the strategy stays the rollout's
        step = dataclasses.replace(step, strategy=rollout.Strategy(before.get("strategy") or step.strategy),
                                   reason=str(before.get("reason") or ""))  # fmt: skip
    facts = Facts(generation, previous, annotations, observed.now, scale, serving_fields,
                  rollout.status_of(step, key))  # fmt: skip
    report = observe(dd, transfer, key, workloads, seen.pods, facts)
    if applied and int(previous.get("observedGeneration", -1)) != generation:
        report.events.insert(0, Event("Normal", "Reconciled",
                                      f"generation {generation}: prefill and decode workloads applied"))  # fmt: skip
    report.events.extend(events + _scaled(dd, previous, scale) + rollout.events_of(before, step))
    present = {str((p["metadata"].get("labels") or {}).get(LABEL_PAIRING, "")) for p in seen.pods} | {key}
    kept = revisions.dump({**records, key: revisions.record(dd)}, present)
    if annotations.get(revisions.ANNOTATION) != kept:
        report.annotations[revisions.ANNOTATION] = kept
    writes = _writes(observed.body, dd, roles, scale, report.status, report.annotations, report.events)
    return Plan(actions + writes, applied)


def _annotations(body: Obj) -> dict[str, str]:
    return dict(body["metadata"].get("annotations") or {})


def _role(dd: DisaggregatedDeployment, uid: str, role: Role, current: Obj | None) -> tuple[EnsureRole | None, Obj]:
    """The action that makes the role's DisaggregatedRole what the spec asks (none when it already is) and the role as
    the API will hold it: created with the spec's replicas; afterwards its replicas change only when the spec's do,
    so what an autoscaler set stays."""
    wanted = dd.spec.role(role).replicas
    made = role_resource(dd, uid, role)
    if current is None:
        return EnsureRole(made, exists=False, replicas=wanted), made
    patch = spec_replicas_patch(wanted, current)
    if patch is None:
        return None, current
    meta = current.get("metadata") or {}
    patched = {**current, "metadata": {**meta, "annotations": {**(meta.get("annotations") or {}),
                                                               ANNOTATION_SPEC_REPLICAS: str(wanted)}},
               "spec": {**(current.get("spec") or {}), "replicas": wanted}}  # fmt: skip
    return EnsureRole(made, exists=True, replicas=wanted), patched


def _lws_unavailable(dd: DisaggregatedDeployment, role: Role) -> Event:
    return Event("Warning", "LeaderWorkerSetUnavailable", (
        f"{role.value} spans {dd.spec.role(role).nodes} nodes, which runs as a LeaderWorkerSet, and the API has no "
        f"LeaderWorkerSet resource: install LeaderWorkerSet (kubernetes-sigs/lws) or set spec.{role.value}.nodes "
        "to 1"))  # fmt: skip


def _retire_other_kind(
    dd: DisaggregatedDeployment, seen: Children, keep: set[Role]
) -> tuple[list[Action], list[Event]]:
    """A role whose ``nodes`` crossed 1 runs under the other workload kind now: the old one (and, through its owner
    references, its pods) goes at once, once the new one is written (not for the roles in ``keep``, whose new
    workload could not be). The old engines cannot serve beside the new kind's (one name, one Service), so the role
    is down until the new engines are ready; the event says so."""
    actions: list[Action] = []
    events = []
    for role in Role:
        spans = multinode.spans_nodes(dd.spec, role)
        stale = seen.stateful_sets[role] if spans else seen.leader_worker_sets.get(role)
        if role in keep or stale is None:
            continue
        actions.append(
            Delete(resource_of(stale["kind"]), dd.metadata.namespace or "default", stale["metadata"]["name"])
        )
        now = "a LeaderWorkerSet (engines spanning nodes)" if spans else "a StatefulSet (one pod per engine)"
        events.append(Event("Warning", "WorkloadReplaced", (
            f"{role.value}: spec.{role.value}.nodes is now {dd.spec.role(role).nodes}, so its engines run as {now}; "
            f"the {stale['kind']} {stale['metadata']['name']} and its pods were deleted (the role serves again "
            "once the new engines are ready)")))  # fmt: skip
    return actions, events


def _scaled(dd: DisaggregatedDeployment, previous: Obj, scale: Scale) -> list[Event]:
    """An event per role whose effective engine count changed, with why when a bound or the ratio held it."""
    events = []
    for role in Role:
        was = (previous.get(role.value) or {}).get("replicas")
        if isinstance(was, int) and was != scale.effective[role]:
            why = "".join(f"; {note}" for note in scale.notes_for(role))
            events.append(Event("Normal", "Scaled", (
                f"{role.value}: {was} -> {scale.effective[role]} engines ({dd.metadata.name}-{role.value} asks "
                f"{scale.desired[role]}{why})")))  # fmt: skip
    return events


def _writes(body: Obj, dd: DisaggregatedDeployment, roles: dict[Role, Obj | None], scale: Scale, status: Obj,
            annotations: dict[str, str], events: list[Event]) -> list[Action]:  # fmt: skip
    """The reconcile's writes, each only when it changes something (a write is an event every watcher processes):
    the roles' status (the selector HPA needs; desired and effective), the deployment's status and annotations, then
    the events."""
    meta = body["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    writes: list[Action] = []
    for role in Role:
        current = roles[role]
        wanted = role_status(dd, role, scale)
        if current is not None and current.get("status") != wanted:
            writes.append(WriteStatus(ROLES, namespace, current["metadata"]["name"], wanted))
    if _stored(status) != (body.get("status") or {}):
        writes.append(WriteStatus(DEPLOYMENTS, namespace, name, status))
    if annotations:
        writes.append(Annotate(DEPLOYMENTS, namespace, name, annotations))
    return writes + [Post(meta, event) for event in events]


def _stored(value: object) -> object:
    """A status as the API server keeps it after a merge patch: no null fields."""
    if isinstance(value, dict):
        return {k: _stored(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_stored(v) for v in value]
    return value
