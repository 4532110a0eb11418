"""The reconcile's pure half as tables: given what a reconcile read (``Observed``: the deployment with its previous
status, its children as the API returns them, the kinds found missing), the actions :func:`plan` lists, the status
it writes and the events it posts.

The children are plain dicts, as the API returns them: a tiny API in this file (:func:`written`) keeps what the
plan's writes leave and :func:`running` starts the pods each StatefulSet asks for, so a case starts from a world
the plan itself built (nothing hand-copied that could drift from the renderer).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge_agent.core import Role
from kvbridge_operator.api.names import LABEL_ROLE, LWS_KIND
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.controller import actions
from kvbridge_operator.controller.plan import Children, Observed, Plan, plan
from kvbridge_operator.controller.rollout import state_of
from kvbridge_operator.kube import (
    BY_KIND,
    DEPLOYMENTS,
    ROLES,
)

ROOT = Path(__file__).parents[2]
NAMESPACE = "team-a"
UID = "0f3a7c52-9d1e-4b8a-a6f0-5c2e8d9b1a47"
NOW = "2026-01-01T00:00:00Z"
CONFIG = OperatorConfig()
KIND_OF = {resource: kind for (_, kind), resource in BY_KIND.items()} | {DEPLOYMENTS: "DisaggregatedDeployment"}
POOL: Obj = {"enabled": True, "endpointPicker": "llm-d-epp", "gateway": "inference-gw"}


def document(name: str = "llama3-8b-hetero-tp", generation: int = 1, **spec: Obj) -> Obj:
    """An example as the API server hands it over: namespaced, with a uid and a generation; ``spec`` merges into
    the example's spec sections."""
    found: Obj = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    found["metadata"].update(namespace=NAMESPACE, uid=UID, generation=generation)
    for key, value in spec.items():
        found["spec"][key] = {**found["spec"].get(key, {}), **value}
    return found


def two_node_prefill() -> Obj:
    """The example with prefill spanning two nodes (a LeaderWorkerSet): only vLLM on GPUs does."""
    return document(engine={"kind": "VLLM", "device": "GPU"}, prefill={"nodes": 2})


# --- a world: the deployment as read and its children, as the API holds them ------------------------------------
@dataclass(frozen=True)
class World:
    body: Obj
    children: Children = field(default_factory=lambda: Children(dict.fromkeys(Role), dict.fromkeys(Role), []))


def observed(world: World, apply_children: bool = True, missing: frozenset[str] = frozenset()) -> Observed:
    """What a reconcile of ``world`` knows (a copy: a case cannot change a world another case shares)."""
    world = copy.deepcopy(world)
    return Observed(world.body, world.children, CONFIG, apply_children, NOW, missing)


def stored(value: Any) -> Any:
    """As the API server keeps a merge-patched status: no null fields."""
    if isinstance(value, dict):
        return {key: stored(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [stored(item) for item in value]
    return value


def role_of(obj: Obj) -> Role:
    return Role(obj["metadata"]["labels"][LABEL_ROLE])


def written(world: World, done: Plan) -> World:
    """``world`` once the plan's writes are done (what the tests need of them: roles, workloads, the deployment's
    status and annotations)."""
    world = copy.deepcopy(world)
    body, seen = world.body, world.children
    for action in done.actions:
        match action:
            case actions.EnsureRole(obj=obj, exists=False):
                seen.roles[role_of(obj)] = copy.deepcopy(obj)
            case actions.Apply(obj=obj) if obj["kind"] == "StatefulSet":
                seen.stateful_sets[role_of(obj)] = copy.deepcopy(obj)
            case actions.Apply(obj=obj) if obj["kind"] == LWS_KIND:
                seen.leader_worker_sets[role_of(obj)] = copy.deepcopy(obj)
            case actions.WriteStatus(resource=resource, name=name, status=status) if resource == ROLES:
                next(r for r in seen.roles.values() if r and r["metadata"]["name"] == name)["status"] = status
            case actions.WriteStatus(resource=resource, status=status) if resource == DEPLOYMENTS:
                body["status"] = stored(status)
            case actions.Annotate(annotations=annotations):
                body["metadata"]["annotations"] = {**(body["metadata"].get("annotations") or {}), **annotations}
            case _:
                pass
    return world


def pod(workload: Obj, ordinal: int) -> Obj:
    """A running, ready pod of a StatefulSet's current template."""
    name = f"{workload['metadata']['name']}-{ordinal}"
    template = workload["spec"]["template"]
    return {
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": f"uid-{name}",
            "labels": dict(template["metadata"]["labels"]),
        },
        "spec": copy.deepcopy(template["spec"]),
        "status": {
            "phase": "Running",
            "podIP": f"10.0.{ordinal}.{len(name)}",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def running(world: World) -> World:
    """Every pod the StatefulSets ask for that does not exist yet, started from its current template and ready."""
    world = copy.deepcopy(world)
    names = {p["metadata"]["name"] for p in world.children.pods}
    for workload in world.children.stateful_sets.values():
        for ordinal in range(workload["spec"]["replicas"] if workload else 0):
            if workload and f"{workload['metadata']['name']}-{ordinal}" not in names:
                world.children.pods.append(pod(workload, ordinal))
    return world


def changed(world: World, doc: Obj) -> World:
    """``world`` with the deployment's spec and generation now ``doc``'s (its status and annotations kept)."""
    world = copy.deepcopy(world)
    world.body["spec"] = copy.deepcopy(doc["spec"])
    world.body["metadata"]["generation"] = doc["metadata"]["generation"]
    return world


@functools.cache
def settled() -> World:
    """The example created, its pods running and ready, and the status that says so written: a pod event's
    reconcile of it has nothing to do (a test checks)."""
    world = World(document())
    for _ in range(4):
        world = running(written(world, plan(observed(world))))
    return world


@functools.cache
def rolling() -> World:
    """:func:`settled` with a new engine image (one pairing key: in place), after the rollout's first step, and
    the surge pod that step asked for running the new template and ready."""
    world = changed(settled(), document(generation=2, engine={"image": "example/engine:2"}))
    return running(written(world, plan(observed(world))))


def with_status(world: World, **fields: Obj) -> World:
    world = copy.deepcopy(world)
    world.body["status"].update(fields)
    return world


# --- the planner's table ------------------------------------------------------------------------------------------
Summary = tuple[str, str, str]


def summary(action: actions.Action) -> Summary:
    """(verb, kind, name) of an action; a Post is (post, event type, reason)."""
    match action:
        case actions.CreateOnce(resource=resource, obj=obj):
            return "create-once", KIND_OF[resource], obj["metadata"]["name"]
        case actions.EnsureRole(obj=obj, exists=exists):
            return "rescale" if exists else "create", "DisaggregatedRole", obj["metadata"]["name"]
        case actions.Apply(obj=obj, optional=optional):
            return "apply-optional" if optional else "apply", obj["kind"], obj["metadata"]["name"]
        case actions.Delete(resource=resource, name=name):
            return "delete", KIND_OF[resource], name
        case actions.WriteStatus(resource=resource, name=name):
            return "status", KIND_OF[resource], name
        case actions.Annotate(resource=resource, name=name):
            return "annotate", KIND_OF[resource], name
        case actions.Post(event=event):
            return "post", event.type, event.reason


#: a compatible spec's children before its workloads, as a full reconcile lists them
CHILDREN: list[Summary] = [
    ("apply", "Service", "llama3-8b-prefill"),
    ("apply", "Service", "llama3-8b-decode"),
    ("apply", "NetworkPolicy", "llama3-8b-pods"),
    ("apply", "PodDisruptionBudget", "llama3-8b-prefill"),
    ("apply", "PodDisruptionBudget", "llama3-8b-decode"),
]

SECRET: Summary = ("create-once", "Secret", "llama3-8b-side-channel")
ROLES_CREATED = [
    ("create", "DisaggregatedRole", "llama3-8b-prefill"),
    ("create", "DisaggregatedRole", "llama3-8b-decode"),
]
WORKLOADS = [("apply", "StatefulSet", "llama3-8b-prefill"), ("apply", "StatefulSet", "llama3-8b-decode")]
ROLE_STATUSES = [
    ("status", "DisaggregatedRole", "llama3-8b-prefill"),
    ("status", "DisaggregatedRole", "llama3-8b-decode"),
]
STATUS: Summary = ("status", "DisaggregatedDeployment", "llama3-8b")
ANNOTATE: Summary = ("annotate", "DisaggregatedDeployment", "llama3-8b")


def post(reason: str, kind: str = "Normal") -> Summary:
    return "post", kind, reason


@dataclass(frozen=True)
class Case:
    id: str
    observed: Callable[[], Observed]
    actions: list[Summary]
    applied: bool
    #: condition type -> (status, reason) in the deployment's status written
    conditions: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: dotted path -> value in the deployment's status written
    status: dict[str, Any] = field(default_factory=dict)
    #: StatefulSet or LeaderWorkerSet name -> (replicas, partition) as applied
    workloads: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: event reason -> text its message holds
    says: dict[str, str] = field(default_factory=dict)
    #: text the Compatible condition's message holds (a refused spec's stable code and field)
    why: str = ""


INCOMPATIBLE_HEADS = "PREFILL_HEADS_REPLICATED at spec.prefill.tensorParallelSize"
NOT_CREATED = ("False", "NotCreated")
NEGATIVE_REPLICAS = "spec.decode.replicas: Input should be greater than or equal to 0"


def refused_once() -> World:
    """A spec that is not valid, its status written by a first reconcile."""
    world = World(document(decode={"replicas": -1}))
    return written(world, plan(observed(world)))


CASES = [
    Case(
        "create-from-nothing",
        lambda: observed(World(document())),
        [
            SECRET,
            *ROLES_CREATED,
            *CHILDREN,
            *WORKLOADS,
            *ROLE_STATUSES,
            STATUS,
            ANNOTATE,
            post("Reconciled"),
            post("RolloutProgress"),
            post("RolloutProgress"),
        ],
        applied=True,
        conditions={
            "Compatible": ("True", "PlanBuilt"),
            "PrefillReady": ("False", "ReplicasNotReady"),
            "DecodeReady": ("False", "ReplicasNotReady"),
            "Ready": ("False", "ReplicasNotReady"),
        },
        status={
            "observedGeneration": 1,
            "tp": "2→1",
            "prefill.replicas": 2,
            "prefill.desiredReplicas": 2,
            "decode.replicas": 1,
            "prefill.ready": "0/2",
            "rollout.phase": "Complete",
            "rollout.strategy": "InPlace",
        },
        workloads={"llama3-8b-prefill": (2, 0), "llama3-8b-decode": (1, 0)},
        says={
            "Reconciled": "generation 1: prefill and decode workloads applied",
            "RolloutProgress": "prefill: 0/2 pods on the current revision, 0 ready",
        },
    ),
    Case(
        # a pod event when nothing changed: no write at all (every write is an event each watcher processes)
        "settled-pod-event-writes-nothing",
        lambda: observed(settled(), apply_children=False),
        [],
        applied=False,
    ),
    Case(
        # the periodic resync re-applies every child (no-ops on the API) and writes no status that did not change
        "settled-resync-reapplies-only",
        lambda: observed(settled()),
        [SECRET, *CHILDREN, *WORKLOADS],
        applied=True,
        workloads={"llama3-8b-prefill": (2, 0), "llama3-8b-decode": (1, 0)},
    ),
    Case(
        "scale-decode-1-to-2",
        lambda: observed(changed(settled(), document(generation=2, decode={"replicas": 2}))),
        [
            SECRET,
            ("rescale", "DisaggregatedRole", "llama3-8b-decode"),
            *CHILDREN,
            *WORKLOADS,
            ("status", "DisaggregatedRole", "llama3-8b-decode"),
            STATUS,
            post("Reconciled"),
            post("Scaled"),
        ],
        applied=True,
        conditions={
            "PrefillReady": ("True", "AllReplicasReady"),
            "DecodeReady": ("False", "ReplicasNotReady"),
            "Ready": ("False", "ReplicasNotReady"),
        },
        status={
            "observedGeneration": 2,
            "decode.replicas": 2,
            "decode.desiredReplicas": 2,
            "decode.ready": "1/2",
            "prefill.ready": "2/2",
            "rollout.phase": "Complete",
        },
        workloads={"llama3-8b-prefill": (2, 0), "llama3-8b-decode": (2, 0)},
        says={
            "Scaled": "decode: 1 -> 2 engines (llama3-8b-decode asks 2)",
            "Reconciled": "generation 2: prefill and decode workloads applied",
        },
    ),
    Case(
        # same pairing key, new template: in place, prefill first with one surge pod, decode held at its partition
        "rollout-first-step",
        lambda: observed(changed(settled(), document(generation=2, engine={"image": "example/engine:2"}))),
        [
            SECRET,
            *CHILDREN,
            *WORKLOADS,
            STATUS,
            ANNOTATE,
            post("Reconciled"),
            post("RolloutProgress"),
            post("RolloutProgress"),
            post("RolloutStarted"),
            post("RolloutPhase"),
        ],
        applied=True,
        conditions={"Compatible": ("True", "PlanBuilt"), "Ready": ("True", "Ready")},
        status={
            "rollout.phase": "RollingPrefill",
            "rollout.strategy": "InPlace",
            "prefill.updatedReplicas": 0,
            "prefill.ready": "2/2",
        },
        workloads={"llama3-8b-prefill": (3, 2), "llama3-8b-decode": (1, 1)},
        says={
            "RolloutStarted": "InPlace: old and new pods of both roles are compatible",
            "RolloutPhase": "InPlace RollingPrefill: prefill 0/2 new ready, 2 old, decode 0/1 new ready, 1 old",
        },
    ),
    Case(
        # the surge pod is ready: a pod event applies the one workload that moves, its partition one lower
        "rollout-next-step-on-a-pod-event",
        lambda: observed(rolling(), apply_children=False),
        [
            ("apply", "StatefulSet", "llama3-8b-prefill"),
            STATUS,
            ANNOTATE,
            post("EndpointsChanged"),
            post("RolloutProgress"),
        ],
        applied=True,
        status={
            "rollout.phase": "RollingPrefill",
            "rollout.prefill": "1/2 new ready, 2 old",
            "prefill.updatedReplicas": 1,
            "prefill.ready": "3/2",
        },
        workloads={"llama3-8b-prefill": (3, 1)},
        says={
            "RolloutProgress": "prefill: 1/2 pods on the current revision, 3 ready",
            "EndpointsChanged": "llama3-8b-prefill-2=10.0.2.19:5600",
        },
    ),
    Case(
        # refused before any child exists: no Secret, no role, no workload; the condition and event say why
        "incompatible-from-nothing",
        lambda: observed(World(document("incompatible-replicated-heads"))),
        [
            ("status", "DisaggregatedDeployment", "replicated-heads"),
            ("annotate", "DisaggregatedDeployment", "replicated-heads"),
            post("Incompatible", "Warning"),
        ],
        applied=False,
        conditions={
            "Compatible": ("False", "Incompatible"),
            "PrefillReady": NOT_CREATED,
            "DecodeReady": NOT_CREATED,
            "Ready": ("False", "Incompatible"),
        },
        status={"observedGeneration": 1, "pairing": "", "fingerprint": "", "tp": "4→1"},
        says={
            "Incompatible": f"{INCOMPATIBLE_HEADS}: prefill TP 4 exceeds the 2 KV heads",
        },
        why=f"{INCOMPATIBLE_HEADS}: prefill TP 4 exceeds the 2 KV heads",
    ),
    Case(
        # an incompatible update of a running deployment changes nothing that runs: the old pods keep serving
        "incompatible-update-keeps-what-runs",
        lambda: observed(changed(settled(), document(generation=2, prefill={"tensorParallelSize": 16}))),
        [STATUS, post("Incompatible", "Warning")],
        applied=False,
        conditions={
            "Compatible": ("False", "Incompatible"),
            "PrefillReady": ("True", "AllReplicasReady"),
            "Ready": ("False", "Incompatible"),
        },
        status={"observedGeneration": 2, "pairing": "3ccdfdce2d", "rollout.phase": "Complete"},
        says={
            "Incompatible": f"{INCOMPATIBLE_HEADS}: prefill TP 16 exceeds the 8 KV heads",
        },
        why=f"{INCOMPATIBLE_HEADS}: prefill TP 16 exceeds the 8 KV heads",
    ),
    Case(
        "invalid-spec",
        lambda: observed(World(document(decode={"replicas": -1}))),
        [STATUS, post("InvalidSpec", "Warning")],
        applied=False,
        conditions={"Compatible": ("False", "InvalidSpec"), "Ready": ("False", "InvalidSpec")},
        status={"observedGeneration": 1},
        says={"InvalidSpec": NEGATIVE_REPLICAS},
        why=NEGATIVE_REPLICAS,
    ),
    Case(
        # the same invalid generation again: the status is written, the event is not posted twice
        "invalid-spec-again-no-second-event",
        lambda: observed(refused_once()),
        [STATUS],
        applied=False,
        conditions={"Compatible": ("False", "InvalidSpec")},
        why=NEGATIVE_REPLICAS,
    ),
    Case(
        "inference-pool-served",
        lambda: observed(World(document(inferencePool=POOL))),
        [
            SECRET,
            *ROLES_CREATED,
            *CHILDREN,
            *WORKLOADS,
            ("apply-optional", "InferencePool", "llama3-8b"),
            ("apply-optional", "HTTPRoute", "llama3-8b"),
            *ROLE_STATUSES,
            STATUS,
            ANNOTATE,
            post("Reconciled"),
            post("RolloutProgress"),
            post("RolloutProgress"),
        ],
        applied=True,
        status={"inferencePool.name": "llama3-8b", "inferencePool.httpRoute": "llama3-8b", "inferencePool.message": ""},
    ),
    Case(
        "httproute-kind-missing",
        lambda: observed(World(document(inferencePool=POOL)), missing=frozenset({"HTTPRoute"})),
        [
            SECRET,
            *ROLES_CREATED,
            *CHILDREN,
            *WORKLOADS,
            ("apply-optional", "InferencePool", "llama3-8b"),
            *ROLE_STATUSES,
            STATUS,
            ANNOTATE,
            post("Reconciled"),
            post("RolloutProgress"),
            post("RolloutProgress"),
            post("ServingUnavailable", "Warning"),
        ],
        applied=True,
        status={
            "inferencePool.name": "llama3-8b",
            "inferencePool.httpRoute": "",
            "inferencePool.message": "the API has no HTTPRoute resource: install the Gateway API (Inference "
            "Extension) CRDs, or set spec.inferencePool.enabled: false",
        },
        says={"ServingUnavailable": "the API has no HTTPRoute resource"},
    ),
    Case(
        "inference-pool-kinds-missing",
        lambda: observed(World(document(inferencePool=POOL)), missing=frozenset({"InferencePool", "HTTPRoute"})),
        [
            SECRET,
            *ROLES_CREATED,
            *CHILDREN,
            *WORKLOADS,
            *ROLE_STATUSES,
            STATUS,
            ANNOTATE,
            post("Reconciled"),
            post("RolloutProgress"),
            post("RolloutProgress"),
            post("ServingUnavailable", "Warning"),
        ],
        applied=True,
        status={"inferencePool.name": "", "inferencePool.httpRoute": ""},
        says={"ServingUnavailable": "the API has no InferencePool or HTTPRoute resource"},
    ),
    Case(
        # spec.inferencePool switched off: what the previous status names is deleted (no read to find it)
        "inference-pool-removed",
        lambda: observed(with_status(settled(), inferencePool={"name": "llama3-8b", "httpRoute": "llama3-8b"})),
        [
            SECRET,
            *CHILDREN,
            *WORKLOADS,
            ("delete", "HTTPRoute", "llama3-8b"),
            ("delete", "InferencePool", "llama3-8b"),
            STATUS,
        ],
        applied=True,
        status={"observedGeneration": 1},
    ),
    Case(
        "pod-group-kind-missing",
        lambda: observed(World(document(placement={"gang": {}})), missing=frozenset({"PodGroup"})),
        [
            SECRET,
            *ROLES_CREATED,
            *CHILDREN,
            *WORKLOADS,
            *ROLE_STATUSES,
            STATUS,
            ANNOTATE,
            post("Reconciled"),
            post("RolloutProgress"),
            post("RolloutProgress"),
            post("GangSchedulingUnavailable", "Warning"),
        ],
        applied=True,
        status={"placement.podGroup": ""},
        says={"GangSchedulingUnavailable": "the API has no PodGroup resource (scheduling.x-k8s.io)"},
    ),
    Case(
        "leader-worker-set-served",
        lambda: observed(World(two_node_prefill())),
        [
            SECRET,
            *ROLES_CREATED,
            *CHILDREN,
            ("apply-optional", LWS_KIND, "llama3-8b-prefill"),
            ("apply", "StatefulSet", "llama3-8b-decode"),
            *ROLE_STATUSES,
            STATUS,
            ANNOTATE,
            post("Reconciled"),
            post("Advisory", "Warning"),
            post("RolloutProgress"),
            post("RolloutProgress"),
        ],
        applied=True,
        conditions={"PrefillReady": ("False", "ReplicasNotReady")},
        workloads={"llama3-8b-prefill": (2, 0), "llama3-8b-decode": (1, 0)},
    ),
    Case(
        # no LeaderWorkerSet CRD: the multi-node role is not written, the other one is, and the event says how
        "leader-worker-set-kind-missing",
        lambda: observed(World(two_node_prefill()), missing=frozenset({LWS_KIND})),
        [
            SECRET,
            *ROLES_CREATED,
            *CHILDREN,
            ("apply", "StatefulSet", "llama3-8b-decode"),
            *ROLE_STATUSES,
            STATUS,
            ANNOTATE,
            post("Reconciled"),
            post("Advisory", "Warning"),
            post("RolloutProgress"),
            post("LeaderWorkerSetUnavailable", "Warning"),
        ],
        applied=True,
        conditions={"PrefillReady": NOT_CREATED, "DecodeReady": ("False", "ReplicasNotReady")},
        workloads={"llama3-8b-decode": (1, 0)},
        says={
            "LeaderWorkerSetUnavailable": "prefill spans 2 nodes, which runs as a LeaderWorkerSet, and the API "
            "has no LeaderWorkerSet resource"
        },
    ),
]


def at(obj: Obj, path: str) -> Any:
    found: Any = obj
    for part in path.split("."):
        found = found[part]
    return found


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_the_plan_of_what_a_reconcile_read(case: Case) -> None:
    result = plan(case.observed())
    assert [summary(action) for action in result.actions] == case.actions
    assert result.applied is case.applied
    statuses = [a.status for a in result.actions if isinstance(a, actions.WriteStatus) and a.resource == DEPLOYMENTS]
    status = statuses[0] if statuses else {}
    conditions = {c["type"]: (c["status"], c["reason"]) for c in status.get("conditions", [])}
    assert {kind: conditions.get(kind) for kind in case.conditions} == case.conditions
    compatible = next((c["message"] for c in status.get("conditions", []) if c["type"] == "Compatible"), "")
    assert case.why in compatible
    assert {path: at(status, path) for path in case.status} == case.status
    applied = {
        a.obj["metadata"]["name"]: state_of(a.obj)
        for a in result.actions
        if isinstance(a, actions.Apply) and a.obj["kind"] in ("StatefulSet", LWS_KIND)
    }
    assert {name: applied.get(name) for name in case.workloads} == case.workloads
    events = [a.event for a in result.actions if isinstance(a, actions.Post)]
    for reason, text in case.says.items():
        assert any(text in event.message for event in events if event.reason == reason), (reason, text)
