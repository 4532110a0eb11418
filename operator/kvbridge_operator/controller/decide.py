"""The pure half of a reconcile: from what was read, everything it will do.

:func:`decide` takes the deployment as read, its children as the operator's watches (or a read) saw them and the
operator's settings, and returns the reconcile's actions in order: the Secret and DisaggregatedRoles, the children to
apply (each workload with the rollout's step), the children to delete, the roles' and the deployment's status, the
annotations and the events. Nothing here calls the API; apply.py carries the actions out.

Reading order: :func:`decide` — parse, the verdict, the DisaggregatedRoles (scaling.py's ``decide_roles``), for a
compatible spec :func:`_work` (which older specs pods may still pair with: revisions.py; the children the spec
renders; the rollout's step: rollout.py; the optional children: optional.py), then the status and events
(observe.py) and the writes (:func:`_writes`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvbridge_agent.core import Role, SpecError, TransferPlan
from kvbridge_operator.api.names import LABEL_PAIRING, LABEL_ROLE, LWS_KIND, WORKLOAD_KINDS
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment, parse_deployment
from kvbridge_operator.children import multinode, peer_key, placement, transfer_token
from kvbridge_operator.children.objects.desired import desired_children
from kvbridge_operator.children.objects.router import router_token_secret
from kvbridge_operator.children.objects.secret import secret
from kvbridge_operator.children.pairing import pairing
from kvbridge_operator.children.remedy import advice
from kvbridge_operator.children.scaling import Roles, decide_roles
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
class ExistingChildren:
    """What a reconcile reads of a deployment's children, per role: its DisaggregatedRole, StatefulSet and (for engines
    spanning nodes) LeaderWorkerSet, and the deployment's pods."""

    roles: dict[Role, Obj | None]
    stateful_sets: dict[Role, Obj | None]
    pods: list[Obj]
    leader_worker_sets: dict[Role, Obj | None] = field(default_factory=dict)

    def workloads(self, dd: DisaggregatedDeployment) -> dict[Role, Obj | None]:
        """Each role's workload of the kind its spec runs: a LeaderWorkerSet for engines spanning nodes, else a
        StatefulSet."""
        return {
            role: (
                self.leader_worker_sets.get(role) if multinode.spans_nodes(dd.spec, role) else self.stateful_sets[role]
            )
            for role in Role
        }


@dataclass(frozen=True)
class Observed:
    """Everything :func:`decide` knows."""

    body: Obj  # the DisaggregatedDeployment as read
    existing: ExistingChildren
    config: OperatorConfig
    #: every child (create, update, resume, resync); else only the workloads whose replicas or partition must move
    apply_children: bool
    now: str  # RFC 3339, for condition transitions
    #: kinds the API turned out not to serve (their CRDs missing), learned from an earlier try of this reconcile
    missing: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Decision:
    actions: list[Action]
    applied: bool  # the spec's children are written (False: invalid or incompatible, nothing that runs changes)


@dataclass
class Work:
    """What a compatible spec makes the reconcile do to the children, and what the status says of it."""

    actions: list[Action] = field(default_factory=list)
    applied: bool = False
    workloads: dict[Role, Obj | None] = field(default_factory=dict)  # each role's, once the actions are done
    serving: Obj = field(default_factory=dict)  # status.router, status.inferencePool, status.placement
    rollout: Obj | None = None  # status.rollout
    events: list[Event] = field(default_factory=list)  # of applying, then of the rollout
    annotations: dict[str, str] = field(default_factory=dict)


#: the reason of the conditions and event of a spec kvbridge's own checks or rendering failed on (a bug)
CHECK_FAILED = "CheckFailed"
_CHECK_FAILED_MESSAGE = (
    "kvbridge could not check this spec ({error}): this is a bug in kvbridge, please report it with the manifest "
    "(the operator's log has the traceback); nothing that runs was changed"
)


def decide(observed: Observed) -> Decision:
    """Everything the reconcile does. A spec that is not valid, or one kvbridge's checks or rendering fail on (a
    bug: no retry would mend a pure function), is reported in the status and an event instead of failing the
    reconcile, which Kopf would retry forever."""
    try:
        return _decide(observed)
    except SpecError as exc:
        return _refused(observed, exc, "InvalidSpec")
    except Exception as exc:
        logging.getLogger(__name__).exception("checking %s failed", observed.body["metadata"].get("name"))
        error = SpecError(_CHECK_FAILED_MESSAGE.format(error=f"{type(exc).__name__}: {str(exc)[:500]}"), field="spec")
        return _refused(observed, error, CHECK_FAILED)


def _refused(observed: Observed, exc: SpecError, reason: str) -> Decision:
    """Only the status and events of a spec that is not applied: ``exc`` says why."""
    meta = observed.body["metadata"]
    namespace = meta.get("namespace") or "default"
    previous: Obj = observed.body.get("status") or {}
    status, events = invalid(previous, int(meta.get("generation", 0)), exc, observed.now, reason)
    actions: list[Action] = [WriteStatus(DEPLOYMENTS, namespace, meta["name"], status)]
    return Decision(actions + [Post(meta, event) for event in events], applied=False)


def _decide(observed: Observed) -> Decision:
    body = observed.body
    meta = body["metadata"]
    namespace = meta.get("namespace") or "default"
    generation = int(meta.get("generation", 0))
    previous: Obj = body.get("status") or {}
    dd = parse_deployment({**body, "metadata": {**meta, "namespace": namespace}})
    dd = placement.with_gpus_per_node(dd, observed.config.gpus_per_node)
    verdict = verdict_for(dd, observed.config)
    seen = observed.existing
    # every child is applied on create, update, resume and resync, and when the spec is not applied yet (a pod event
    # racing the update handler: the status never describes a generation whose children were not written); a
    # status-only reconcile (a pod event, a DisaggregatedRole scaled) applies just the workloads whose replicas or
    # partition are not what the effective counts and the rollout's step want. An incompatible spec changes nothing
    # that runs: the status says why, with the children as they are.
    full = observed.apply_children or int(previous.get("observedGeneration", -1)) != generation
    compatible = isinstance(verdict, TransferPlan)
    roles = decide_roles(dd, meta.get("uid", ""), seen.roles, full and compatible, previous)
    annotations = _annotations(body)
    if isinstance(verdict, TransferPlan):
        key = pairing(dd.spec)
        work = _work(observed, dd, verdict, key, roles, previous, annotations, full)
        fix = ""
    else:
        key, fix = "", advice(dd)
        work = Work(workloads=seen.workloads(dd), serving=_serving_as_before(previous), rollout=previous.get("rollout"))
    facts = Facts(generation, previous, annotations, observed.now, roles.scale, work.serving, work.rollout, fix)
    report = observe(dd, verdict, key, work.workloads, seen.pods, facts)
    if work.applied and int(previous.get("observedGeneration", -1)) != generation:
        report.events.insert(
            0, Event("Normal", "Reconciled", f"generation {generation}: prefill and decode workloads applied")
        )
    report.events.extend(work.events)
    report.annotations.update(work.annotations)
    return Decision(work.actions + _writes(body, roles, report.status, report.annotations, report.events), work.applied)


def _work(
    observed: Observed,
    dd: DisaggregatedDeployment,
    transfer: TransferPlan,
    key: str,
    roles: Roles,
    previous: Obj,
    annotations: dict[str, str],
    full: bool,
) -> Work:
    """A compatible spec's children: the Secrets and roles (on a full reconcile), each child rendered and applied
    with the rollout's step, the optional ones, and what the rollout and the revisions annotation say."""
    seen, config = observed.existing, observed.config
    uid = observed.body["metadata"].get("uid", "")
    present = {str((p["metadata"].get("labels") or {}).get(LABEL_PAIRING, "")) for p in seen.pods} | {key}
    memory = revisions.remember(dd, key, annotations.get(revisions.ANNOTATION), present)
    rendered, keys = desired_children(dd, uid, transfer, config, key), secret(dd, uid)
    work = Work(workloads=seen.workloads(dd), serving=_serving_as_before(previous))
    if full:
        work.actions.append(CreateOnce(SECRETS, keys))
        if transfer_token.signs(dd.spec):  # before the pods that mount it (the router's, decode's)
            work.actions.append(CreateOnce(SECRETS, router_token_secret(dd, uid)))
        if peer_key.peers(dd.spec):  # before the router's pods, which mount it
            work.actions.append(CreateOnce(SECRETS, peer_key.secret(dd, uid)))
        for role in Role:
            if role in roles.create:
                work.actions.append(EnsureRole(roles.create[role], exists=False, replicas=dd.spec.role(role).replicas))
            elif role in roles.rescale:
                work.actions.append(EnsureRole(roles.held[role] or {}, exists=True, replicas=roles.rescale[role]))
    roll = rollout.advance(
        dd, key, rendered, roles.scale, work.workloads, seen.pods, memory.pairs_with, previous.get("rollout") or {}
    )
    work.applied = full or bool(roll.moving)
    if work.applied:
        lacking = {role for role in Role if multinode.spans_nodes(dd.spec, role) and LWS_KIND in observed.missing}
        for child in roll.rendered:
            runs = Role(child["metadata"]["labels"][LABEL_ROLE]) if child["kind"] in WORKLOAD_KINDS else None
            if not full and runs not in roll.moving:
                continue
            if runs in lacking:
                work.events.append(_lws_unavailable(dd, runs))
                continue
            work.actions.append(Apply(child, optional=child["kind"] == LWS_KIND))
            if runs is not None:
                work.workloads[runs] = child  # what the API holds once it is applied
        if full:
            retired, retire_events = _retire_other_kind(dd, seen, keep=lacking)
            extra = optional.decide(dd, uid, config, previous, observed.missing)
            work.actions += retired + [Apply(c, optional=c["kind"] in optional.OPTIONAL_KINDS) for c in extra.apply]
            work.actions += [
                Delete(resource_of(kind), dd.metadata.namespace or "default", name) for kind, name in extra.delete
            ]
            work.events += retire_events + extra.events
            work.serving = extra.status
    work.events += [Event("Normal", "Scaled", message) for message in roles.scaled] + roll.events
    work.rollout = roll.status
    if memory.annotation is not None:
        work.annotations[revisions.ANNOTATION] = memory.annotation
    return work


def _serving_as_before(previous: Obj) -> Obj:
    """The optional children's status fields as the previous status has them (a reconcile that applies none)."""
    return {name: previous.get(name) for name in optional.STATUS_FIELDS}


def _annotations(body: Obj) -> dict[str, str]:
    return dict(body["metadata"].get("annotations") or {})


def _lws_unavailable(dd: DisaggregatedDeployment, role: Role) -> Event:
    return Event(
        "Warning",
        "LeaderWorkerSetUnavailable",
        (
            f"{role.value} spans {dd.spec.role(role).nodes} nodes, which runs as a LeaderWorkerSet, and the API has no "
            f"LeaderWorkerSet resource: install LeaderWorkerSet (kubernetes-sigs/lws) or set spec.{role.value}.nodes "
            "to 1"
        ),
    )


def _retire_other_kind(
    dd: DisaggregatedDeployment, seen: ExistingChildren, keep: set[Role]
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
        events.append(
            Event(
                "Warning",
                "WorkloadReplaced",
                (
                    f"{role.value}: spec.{role.value}.nodes is now {dd.spec.role(role).nodes}, so its engines run as "
                    f"{now}; the {stale['kind']} {stale['metadata']['name']} and its pods were deleted (the role "
                    "serves again once the new engines are ready)"
                ),
            )
        )
    return actions, events


def _writes(body: Obj, roles: Roles, status: Obj, annotations: dict[str, str], events: list[Event]) -> list[Action]:
    """The reconcile's writes, each only when it changes something (a write is an event every watcher processes):
    the roles' status (the selector HPA needs; desired and effective), the deployment's status and annotations, then
    the events."""
    meta = body["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    writes: list[Action] = [
        WriteStatus(ROLES, namespace, (roles.held[role] or {})["metadata"]["name"], wanted)
        for role, wanted in roles.status.items()
    ]
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
