"""Pure: a DisaggregatedDeployment's whole status, its conditions and the events they call for.

The one place the status is built. Input: the parsed resource, the compatibility verdict, each role's workload
(StatefulSet or LeaderWorkerSet, as it is once the reconcile's writes are done), the pods, and the facts the decision
already worked out (effective and desired replicas, the optional children's fields, the rollout); output: the status
to write, the events to post and the annotation that remembers prefill pod incarnations (for PrefillRestarted).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvbridge_agent.core import Problem, Role, SpecError, TransferPlan
from kvbridge_agent.core.parallel import engine_id_of_rank, side_channel_port_of_rank
from kvbridge_operator.api.names import (
    LABEL_DP,
    LABEL_DP_LOCAL,
    LABEL_FINGERPRINT,
    LABEL_PAIRING,
    LABEL_REVISION,
    LABEL_ROLE,
    LABEL_TP,
    PODS_ANNOTATION,
)
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.api.status import (
    Advisory,
    Condition,
    ConditionType,
    DataParallelRank,
    DecodeStatus,
    DisaggregatedDeploymentStatus,
    Endpoint,
    PlanSummary,
    PrefillStatus,
    RoleStatus,
    ServingEndpoint,
    merge_conditions,
)
from kvbridge_operator.children import multinode
from kvbridge_operator.children.engines import engine_of
from kvbridge_operator.children.objects.shared import template_revision
from kvbridge_operator.children.scaling import Scale
from kvbridge_operator.children.verdict import advisories_for
from kvbridge_operator.controller import status_rules
from kvbridge_operator.controller.actions import Event
from kvbridge_operator.controller.status_rules import Seen, bounded


@dataclass(frozen=True)
class Facts:
    """What the decision worked out before the status is built."""

    generation: int
    previous: Obj  # the status as read (maybe empty)
    annotations: dict[str, str]  # the deployment's, as read
    now: str
    scale: Scale  # each role's effective count (what Ready means; a rollout's surge is not counted) and desired
    serving: Obj  # status.router, status.inferencePool, status.placement
    rollout: Obj | None  # status.rollout
    fix: str = ""  # an incompatible spec's checked fix (remedy.advice), "" when the search found none


@dataclass
class Report:
    status: Obj
    events: list[Event] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)


def pod_ready(pod: Obj) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    status = pod.get("status", {})
    if status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))


def _restarts(pod: Obj) -> int:
    return sum(int(c.get("restartCount", 0)) for c in pod.get("status", {}).get("containerStatuses", []))


def _incarnation(pod: Obj) -> str:
    return f"{pod.get('metadata', {}).get('uid', '')}:{_restarts(pod)}"


def _role_status(pods: Sequence[Obj], replicas: int, revision: str | None) -> RoleStatus:
    ready = sum(1 for p in pods if pod_ready(p))
    updated = sum(1 for p in pods if revision and p["metadata"].get("labels", {}).get(LABEL_REVISION) == revision)
    return RoleStatus(replicas=replicas, ready_replicas=ready, updated_replicas=updated, ready=f"{ready}/{replicas}")


def _http_port(pod: Obj) -> int | None:
    """The container port named ``http`` (the engine's API, or the routing sidecar in front of it)."""
    for container in pod.get("spec", {}).get("containers", []):
        for port in container.get("ports", []):
            if port.get("name") == "http" and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return None


def _ready_addresses(pods: Sequence[Obj]) -> list[tuple[Obj, str, dict[str, str]]]:
    return sorted(
        (
            (pod, pod["status"]["podIP"], pod["metadata"].get("labels", {}))
            for pod in pods
            if pod_ready(pod) and pod.get("status", {}).get("podIP")
        ),
        key=lambda found: str(found[0]["metadata"]["name"]),
    )


def data_parallel_ranks(
    pod: str, labels: dict[str, str], port: int, named: bool, workers: dict[str, str]
) -> list[DataParallelRank] | None:
    """A prefill engine's data-parallel ranks (its leader's ``kvbridge.io/data-parallel-size`` label), each on base
    port + rank and, where kvbridge names engines (``named``), with its engine id; None for one rank. With the ranks
    spread over a LeaderWorkerSet group (``kvbridge.io/data-parallel-size-local`` per pod), a worker's ranks are at
    its address (``workers``: ready worker pods' IPs by name, ``<leader>-<index>``); a worker not ready leaves its
    ranks out."""
    size = int(labels.get(LABEL_DP, "1"))
    if size <= 1:
        return None
    per_pod = int(labels.get(LABEL_DP_LOCAL, str(size)))
    found = []
    for rank in range(size):
        index = rank // per_pod
        host = pod if index == 0 else f"{pod}-{index}"
        if index and host not in workers:
            continue
        found.append(
            DataParallelRank(
                rank=rank,
                port=side_channel_port_of_rank(port, rank),
                engine_id=engine_id_of_rank(host, rank, size) if named else "",
                pod=host if index else "",
                ip=workers.get(host, "") if index else "",
            )
        )
    return found


def endpoints(pods: Sequence[Obj], port: int, *, named: bool = True, workers: Sequence[Obj] = ()) -> list[Endpoint]:
    """Ready prefill pods: side channel (decode agents) and HTTP (routers), every data-parallel rank's side channel
    where an engine has several (``named``: kvbridge names their engine ids, as its connector and the synthetic
    engine do; ``workers``: the non-leader pods of engines that span nodes, where some of the ranks run)."""
    addresses = {str(worker["metadata"]["name"]): ip for worker, ip, _ in _ready_addresses(workers)}
    return [
        Endpoint(
            pod=pod["metadata"]["name"],
            ip=ip,
            port=port,
            data_parallel_ranks=data_parallel_ranks(pod["metadata"]["name"], labels, port, named, addresses),
            ranks=int(labels.get(LABEL_TP, "1")),
            fingerprint=labels.get(LABEL_FINGERPRINT, ""),
            pairing=labels.get(LABEL_PAIRING, ""),
            http_port=_http_port(pod),
            revision=labels.get(LABEL_REVISION, ""),
            incarnation=_incarnation(pod),
        )
        for pod, ip, labels in _ready_addresses(pods)
    ]


def serving_endpoints(pods: Sequence[Obj]) -> list[ServingEndpoint]:
    """Ready decode pods' HTTP addresses (routers)."""
    return [
        ServingEndpoint(
            pod=pod["metadata"]["name"],
            ip=ip,
            http_port=_http_port(pod),
            pairing=labels.get(LABEL_PAIRING, ""),
            revision=labels.get(LABEL_REVISION, ""),
            incarnation=_incarnation(pod),
        )
        for pod, ip, labels in _ready_addresses(pods)
    ]


def summary(plan: TransferPlan) -> PlanSummary:
    return PlanSummary.model_validate(plan.summary())


def observe(
    dd: DisaggregatedDeployment,
    verdict: TransferPlan | Sequence[Problem],
    key: str,
    workloads: dict[Role, Obj | None],
    pods: Sequence[Obj],
    facts: Facts,
) -> Report:
    """The whole status, the events and the annotations (``key``: the spec's pairing key when it is compatible):
    what runs counted here, the conditions and events by status_rules.py's tables."""
    spec, previous = dd.spec, facts.previous
    by_role = {  # an engine is a pod, or a LeaderWorkerSet group's leader (its workers are part of it)
        role: [p for p in pods if _role_of(p) == role.value and not multinode.is_worker(p)] for role in Role
    }
    roles = {
        role: _role_status(by_role[role], facts.scale.effective[role], _revision(workloads.get(role))) for role in Role
    }
    named = engine_of(spec).kvbridge_transfer(spec)  # kvbridge's side channel names its engines
    workers = [p for p in pods if _role_of(p) == Role.PREFILL.value and multinode.is_worker(p)]
    current_endpoints = endpoints(by_role[Role.PREFILL], spec.transfer.side_channel_port, named=named, workers=workers)
    incarnations = {p["metadata"]["name"]: _incarnation(p) for p in by_role[Role.PREFILL]}
    decode_endpoints = serving_endpoints(by_role[Role.DECODE])
    seen = Seen(
        spec=spec,
        verdict=verdict,
        generation=facts.generation,
        previous=previous,
        annotations=facts.annotations,
        fix=facts.fix,
        roles=roles,
        created={role: workloads.get(role) is not None for role in Role},
        endpoints=current_endpoints,
        advisories=[Advisory(code=a.code, field=a.field, message=bounded(a.message)) for a in advisories_for(spec)],
        incarnations=incarnations,
        decode_endpoints=decode_endpoints,
        pairings=_pairings(facts.rollout),
    )
    plan = isinstance(verdict, TransferPlan)
    status = DisaggregatedDeploymentStatus(
        observed_generation=facts.generation,
        fingerprint=verdict.fingerprint if isinstance(verdict, TransferPlan) else str(previous.get("fingerprint", "")),
        pairing=key if plan else str(previous.get("pairing", "")),
        tp=f"{spec.prefill.tensor_parallel_size}→{spec.decode.tensor_parallel_size}",
        conditions=merge_conditions(seen.old_conditions, status_rules.conditions(seen), facts.now),
        plan=summary(verdict) if isinstance(verdict, TransferPlan) else _previous_plan(previous),
        prefill=PrefillStatus(**dict(roles[Role.PREFILL]), endpoints=current_endpoints),
        decode=DecodeStatus(**dict(roles[Role.DECODE]), endpoints=decode_endpoints),
        advisories=seen.advisories,
    )
    new_annotations = {}
    encoded = json.dumps(incarnations, sort_keys=True)
    if facts.annotations.get(PODS_ANNOTATION) != encoded:
        new_annotations[PODS_ANNOTATION] = encoded
    whole = status.model_dump(by_alias=True, mode="json")
    del whole["autoscaling"]  # the planner's alone (a merge patch of null would delete it)
    whole.update(facts.serving)
    for role in Role:
        whole[role.value]["desiredReplicas"] = facts.scale.desired[role]
    whole["rollout"] = facts.rollout
    return Report(whole, status_rules.events(seen), new_annotations)


def _pairings(rollout: Obj | None) -> frozenset[tuple[str, str]]:
    """The pairs of pairing keys status.rollout lists (routers pair those pods too)."""
    listed = (rollout or {}).get("pairings") or []
    return frozenset((str(p.get("prefill", "")), str(p.get("decode", ""))) for p in listed if isinstance(p, dict))


def _role_of(pod: Obj) -> str | None:
    role = pod["metadata"].get("labels", {}).get(LABEL_ROLE)
    return None if role is None else str(role)


def _revision(workload: Obj | None) -> str | None:
    return template_revision(workload) if workload else None


def invalid(
    previous: Obj, generation: int, exc: SpecError, now: str, reason: str = "InvalidSpec"
) -> tuple[Obj, list[Event]]:
    """A resource the schema should have rejected (or an older CRD), or one kvbridge's checks failed on
    (``reason`` CheckFailed): its status and events (reported, never a crash loop); nothing else of the status
    changes."""
    message = bounded(f"{exc.field}: {exc.message}")
    conditions = [
        Condition(type=kind, status="False", reason=reason, message=message, observed_generation=generation)
        for kind in (ConditionType.COMPATIBLE, ConditionType.READY)
    ]
    merged = merge_conditions(previous.get("conditions") or [], conditions, now)
    status = {
        "observedGeneration": generation,
        "conditions": [c.model_dump(by_alias=True, mode="json") for c in merged],
    }
    old = {str(c.get("type")): c for c in previous.get("conditions") or []}.get("Compatible", {})
    if old.get("reason") != reason or int(old.get("observedGeneration", -1)) != generation:
        return status, [Event("Warning", reason, message)]
    return status, []


def _previous_plan(previous: Obj) -> PlanSummary | None:
    plan = previous.get("plan")
    return PlanSummary.model_validate(plan) if plan else None
