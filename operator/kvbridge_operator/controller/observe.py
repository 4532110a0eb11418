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
from kvbridge_agent.core.parallel import engine_id_of_rank, ranks_words, side_channel_port_of_rank
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
from kvbridge_operator.children.render import template_revision
from kvbridge_operator.children.scaling import Scale
from kvbridge_operator.children.verdict import advisories_for
from kvbridge_operator.controller.actions import Event


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


#: the reason of the Warning event that states the spec's advisories (status.advisories)
ADVISORY = "Advisory"
#: the longest message of a condition or event kvbridge writes (a condition's may hold 32,768 characters): a spec
#: with thousands of problems (a template of thousands of odd items) is summed up, not refused for its message
MAX_MESSAGE = 8192
_MORE = "; and {count} more problem(s) (kvbridge plan lists them all)"


def _bounded(message: str) -> str:
    if len(message) <= MAX_MESSAGE:
        return message
    cut = f"... ({len(message)} characters)"
    return message[: MAX_MESSAGE - len(cut)] + cut


def _problems_message(problems: Sequence[Problem], fix: str) -> str:
    """Every problem as far as :data:`MAX_MESSAGE` goes, then the checked fix for all of them at once (when the
    search finds one)."""
    fixed = f". A fix that passes every check: {fix}" if fix else ""
    parts = [f"{p.code} at {p.field}: {p.message}" for p in problems]
    room = MAX_MESSAGE - len(fixed) - len(_MORE.format(count=len(parts)))
    kept: list[str] = []
    length = -2  # the separators: one fewer than the parts
    for part in parts:
        length += len(part) + 2
        if length > room:
            break
        kept.append(part)
    more = _MORE.format(count=len(parts) - len(kept)) if len(kept) < len(parts) else ""
    return _bounded("; ".join(kept) + more + fixed)


def observe(
    dd: DisaggregatedDeployment,
    verdict: TransferPlan | Sequence[Problem],
    key: str,
    workloads: dict[Role, Obj | None],
    pods: Sequence[Obj],
    facts: Facts,
) -> Report:
    """The whole status, the events and the annotations (``key``: the spec's pairing key when it is compatible)."""
    generation, previous, annotations, now = facts.generation, facts.previous, facts.annotations, facts.now
    events: list[Event] = []
    spec = dd.spec
    by_role = {  # an engine is a pod, or a LeaderWorkerSet group's leader (its workers are part of it)
        role: [
            p
            for p in pods
            if p["metadata"].get("labels", {}).get(LABEL_ROLE) == role.value and not multinode.is_worker(p)
        ]
        for role in Role
    }
    roles: dict[Role, RoleStatus] = {}
    for role in Role:
        workload = workloads.get(role)
        revision = template_revision(workload) if workload else None
        roles[role] = _role_status(by_role[role], facts.scale.effective[role], revision)
    named = engine_of(spec).kvbridge_transfer(spec)  # kvbridge's side channel names its engines
    workers = [
        p
        for p in pods
        if p["metadata"].get("labels", {}).get(LABEL_ROLE) == Role.PREFILL.value and multinode.is_worker(p)
    ]
    current_endpoints = endpoints(by_role[Role.PREFILL], spec.transfer.side_channel_port, named=named, workers=workers)
    prefill = PrefillStatus(**dict(roles[Role.PREFILL]), endpoints=current_endpoints)
    decode = DecodeStatus(**dict(roles[Role.DECODE]), endpoints=serving_endpoints(by_role[Role.DECODE]))

    compatible = isinstance(verdict, TransferPlan)
    conditions: list[Condition] = []
    if isinstance(verdict, TransferPlan):
        plan_text = (
            f"prefill {ranks_words(spec.prefill)} -> decode {ranks_words(spec.decode)}, "
            f"{verdict.wire.block_size}-token {verdict.wire.layout.value} wire blocks, "
            f"{len(verdict.for_decode_rank(0).reads)} read(s) per decode rank"
        )
        conditions.append(
            Condition(
                type=ConditionType.COMPATIBLE,
                status="True",
                reason="PlanBuilt",
                message=plan_text,
                observed_generation=generation,
            )
        )
    else:
        conditions.append(
            Condition(
                type=ConditionType.COMPATIBLE,
                status="False",
                reason="Incompatible",
                message=_problems_message(verdict, facts.fix),
                observed_generation=generation,
            )
        )
    for role, kind in ((Role.PREFILL, ConditionType.PREFILL_READY), (Role.DECODE, ConditionType.DECODE_READY)):
        counts = roles[role]
        ok = counts.ready_replicas >= counts.replicas
        if workloads.get(role) is None:
            conditions.append(
                Condition(
                    type=kind,
                    status="False",
                    reason="NotCreated",
                    message=f"no {role.value} workload exists",
                    observed_generation=generation,
                )
            )
        else:
            conditions.append(
                Condition(
                    type=kind,
                    status="True" if ok else "False",
                    reason="AllReplicasReady" if ok else "ReplicasNotReady",
                    message=f"{counts.ready_replicas}/{counts.replicas} {role.value} pods ready",
                    observed_generation=generation,
                )
            )
    failing = [c for c in conditions if c.status != "True"]
    conditions.append(
        Condition(
            type=ConditionType.READY,
            status="False" if failing else "True",
            reason=(failing[0].reason if failing else "Ready"),
            message=(f"{failing[0].type.value}: {failing[0].message}" if failing else "prefill and decode are serving"),
            observed_generation=generation,
        )
    )
    old_conditions: list[Obj] = list(previous.get("conditions") or [])
    merged = merge_conditions(old_conditions, conditions, now)
    advisories = [Advisory(code=a.code, field=a.field, message=_bounded(a.message)) for a in advisories_for(spec)]

    status = DisaggregatedDeploymentStatus(
        observed_generation=generation,
        fingerprint=verdict.fingerprint if isinstance(verdict, TransferPlan) else str(previous.get("fingerprint", "")),
        pairing=key if isinstance(verdict, TransferPlan) else str(previous.get("pairing", "")),
        tp=f"{spec.prefill.tensor_parallel_size}→{spec.decode.tensor_parallel_size}",
        conditions=merged,
        plan=summary(verdict) if isinstance(verdict, TransferPlan) else _previous_plan(previous),
        prefill=prefill,
        decode=decode,
        advisories=advisories,
    )

    # -- events from what changed ----------------------------------------------
    was = {str(c.get("type")): c for c in old_conditions}
    old_compatible = was.get("Compatible", {})
    if not compatible and (
        old_compatible.get("status") != "False" or int(old_compatible.get("observedGeneration", -1)) != generation
    ):
        events.append(Event("Warning", "Incompatible", _problems_message(list(verdict), facts.fix)))  # type: ignore[arg-type]
    if advisories and (
        previous.get("advisories") != [a.model_dump(by_alias=True, mode="json") for a in advisories]
        or int(previous.get("observedGeneration", -1)) != generation
    ):
        # what runs other than the spec asks: said once per generation (and when it changes), never silently
        events.append(Event("Warning", ADVISORY, "; ".join(f"{a.code} at {a.field}: {a.message}" for a in advisories)))
    old_endpoints = [Endpoint.model_validate(e) for e in (previous.get("prefill") or {}).get("endpoints") or []]
    if old_endpoints != current_endpoints and (old_endpoints or current_endpoints):
        listed = ", ".join(f"{e.pod}={e.ip}:{e.port}" for e in current_endpoints) or "none"
        events.append(Event("Normal", "EndpointsChanged", f"prefill endpoints: {listed}"))
    seen = _load(annotations.get(PODS_ANNOTATION))
    current = {p["metadata"]["name"]: _incarnation(p) for p in by_role[Role.PREFILL]}
    for name, incarnation in sorted(current.items()):
        if name in seen and seen[name] != incarnation:
            events.append(
                Event(
                    "Normal",
                    "PrefillRestarted",
                    f"prefill pod {name} restarted; decode agents re-handshake with its new incarnation",
                )
            )
    for role in Role:
        old = previous.get(role.value) or {}
        now_role = roles[role]
        if (
            now_role.updated_replicas != old.get("updatedReplicas")
            and workloads.get(role) is not None
            and (now_role.updated_replicas < now_role.replicas or old.get("updatedReplicas") is not None)
        ):
            events.append(
                Event(
                    "Normal",
                    "RolloutProgress",
                    f"{role.value}: {now_role.updated_replicas}/{now_role.replicas} pods on the current "
                    f"revision, {now_role.ready_replicas} ready",
                )
            )
    new_annotations = {}
    encoded = json.dumps(current, sort_keys=True)
    if annotations.get(PODS_ANNOTATION) != encoded:
        new_annotations[PODS_ANNOTATION] = encoded
    whole = status.model_dump(by_alias=True, mode="json")
    del whole["autoscaling"]  # the planner's alone (a merge patch of null would delete it)
    whole.update(facts.serving)
    for role in Role:
        whole[role.value]["desiredReplicas"] = facts.scale.desired[role]
    whole["rollout"] = facts.rollout
    return Report(whole, events, new_annotations)


def invalid(
    previous: Obj, generation: int, exc: SpecError, now: str, reason: str = "InvalidSpec"
) -> tuple[Obj, list[Event]]:
    """A resource the schema should have rejected (or an older CRD), or one kvbridge's checks failed on
    (``reason`` CheckFailed): its status and events (reported, never a crash loop); nothing else of the status
    changes."""
    message = _bounded(f"{exc.field}: {exc.message}")
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


def _load(text: str | None) -> dict[str, str]:
    if not text:
        return {}
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return {str(k): str(v) for k, v in loaded.items()} if isinstance(loaded, dict) else {}
