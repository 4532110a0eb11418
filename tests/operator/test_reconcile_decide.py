"""The reconcile's pure half as tables: given what a reconcile read (``Observed``: the deployment with its previous
status, its children as the API returns them, the kinds found missing), the actions :func:`decide` lists, the status
it writes and the events it posts; then :func:`apply.execute` and :func:`reconcile` against a fake client that
records every call: deciding again after the API turns out not to serve a kind, and the reads a reconcile makes.

The children are plain dicts, as the API returns them: a tiny API in this file (:func:`written`) keeps what the
decision's writes leave and :func:`running` starts the pods each StatefulSet asks for, so a case starts from a world
the decision itself built (nothing hand-copied that could drift from the renderer).
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
from kubernetes_asyncio.client.rest import ApiException

from kvbridge_agent.core import Role
from kvbridge_operator.api.names import ANNOTATION_SPEC_REPLICAS, LABEL_ROLE, LWS_KIND
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.controller import actions
from kvbridge_operator.controller.apply import KindMissingError, execute
from kvbridge_operator.controller.decide import Decision, ExistingChildren, Observed, decide
from kvbridge_operator.controller.reconcile import read_children, reconcile
from kvbridge_operator.controller.rollout import state_of
from kvbridge_operator.kube import (
    BY_KIND,
    DEPLOYMENTS,
    FIELD_MANAGER,
    HTTP_ROUTES,
    ROLES,
    SECRETS,
    ApiError,
    KubeClient,
    Resource,
)

ROOT = Path(__file__).parents[2]
NAMESPACE = "team-a"
UID = "0f3a7c52-9d1e-4b8a-a6f0-5c2e8d9b1a47"
NOW = "2026-01-01T00:00:00Z"
CONFIG = OperatorConfig()
KIND_OF = {resource: kind for (_, kind), resource in BY_KIND.items()} | {DEPLOYMENTS: "DisaggregatedDeployment"}
POOL: Obj = {"enabled": True, "endpointPicker": "llm-d-epp", "gateway": "inference-gw"}


def document(name: str = "synthetic/llama3-8b-hetero-tp", generation: int = 1, **spec: Obj) -> Obj:
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
    existing: ExistingChildren = field(
        default_factory=lambda: ExistingChildren(dict.fromkeys(Role), dict.fromkeys(Role), [])
    )


def observed(world: World, apply_children: bool = True, missing: frozenset[str] = frozenset()) -> Observed:
    """What a reconcile of ``world`` knows (a copy: a case cannot change a world another case shares)."""
    world = copy.deepcopy(world)
    return Observed(world.body, world.existing, CONFIG, apply_children, NOW, missing)


def stored(value: Any) -> Any:
    """As the API server keeps a merge-patched status: no null fields."""
    if isinstance(value, dict):
        return {key: stored(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [stored(item) for item in value]
    return value


def role_of(obj: Obj) -> Role:
    return Role(obj["metadata"]["labels"][LABEL_ROLE])


def written(world: World, done: Decision) -> World:
    """``world`` once the decision's writes are done (what the tests need of them: roles, workloads, the deployment's
    status and annotations)."""
    world = copy.deepcopy(world)
    body, seen = world.body, world.existing
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
    names = {p["metadata"]["name"] for p in world.existing.pods}
    for workload in world.existing.stateful_sets.values():
        for ordinal in range(workload["spec"]["replicas"] if workload else 0):
            if workload and f"{workload['metadata']['name']}-{ordinal}" not in names:
                world.existing.pods.append(pod(workload, ordinal))
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
        world = running(written(world, decide(observed(world))))
    return world


@functools.cache
def rolling() -> World:
    """:func:`settled` with a new engine image (one pairing key: in place), after the rollout's first step, and
    the surge pod that step asked for running the new template and ready."""
    world = changed(settled(), document(generation=2, engine={"image": "example/engine:2"}))
    return running(written(world, decide(observed(world))))


def with_status(world: World, **fields: Obj) -> World:
    world = copy.deepcopy(world)
    world.body["status"].update(fields)
    return world


# --- the decisions' table ------------------------------------------------------------------------------------------
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
    return written(world, decide(observed(world)))


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
        lambda: observed(World(document("synthetic/incompatible-replicated-heads"))),
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
        status={"observedGeneration": 2, "pairing": "d17a158943", "rollout.phase": "Complete"},
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
def test_the_decision_on_what_a_reconcile_read(case: Case) -> None:
    result = decide(case.observed())
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


# --- apply.execute and reconcile against a fake client -------------------------------------------------------------
Call = tuple[str, str, str]  # (verb, resource plural, name); a patch of a subresource is "patch/<subresource>"


def not_served(body: bytes = b"404 page not found\n") -> ApiError:
    """The real client's error for a kind the API does not serve: kube-apiserver answers a path under a group or
    version it does not know with a plain-text 404 (no Status object), and :class:`KubeClient` turns it into this."""
    exc = ApiException(status=404, reason="Not Found")
    exc.body = body
    return ApiError.from_exception(exc)


FORBIDDEN = ApiError(403, "Forbidden", "events is forbidden")


class FakeClient(KubeClient):
    """Records every call and answers from ``objects`` ((plural, name) -> object); ``fails`` maps (verb, plural) to
    the error that call raises. A create of an object that exists answers 409, as the API does."""

    def __init__(
        self, objects: dict[tuple[str, str], Obj] | None = None, fails: dict[tuple[str, str], ApiError] | None = None
    ) -> None:
        super().__init__(KubeClient.for_url("http://127.0.0.1:9").connection)
        self.objects = copy.deepcopy(objects or {})
        self.fails = dict(fails or {})
        self.log: list[Call] = []
        self.bodies: list[tuple[Call, Obj]] = []

    def _call(self, verb: str, resource: Resource, name: str, body: Obj | None = None) -> None:
        self.log.append((verb, resource.plural, name))
        if body is not None:
            self.bodies.append(((verb, resource.plural, name), copy.deepcopy(body)))
        error = self.fails.get((verb.split("/")[0], resource.plural))
        if error is not None:
            raise error

    async def get(self, resource: Resource, namespace: str, name: str, subresource: str | None = None) -> Obj | None:
        self._call("get", resource, name)
        found = self.objects.get((resource.plural, name))
        return copy.deepcopy(found) if found is not None else None

    async def list(self, resource: Resource, namespace: str | None, label_selector: str = "") -> list[Obj]:
        self._call("list", resource, label_selector)
        return []

    async def create(self, resource: Resource, namespace: str, body: Obj) -> Obj:
        name = body["metadata"].get("name") or body["metadata"]["generateName"]
        self._call("create", resource, name, body)
        if (resource.plural, name) in self.objects:
            raise ApiError(409, "AlreadyExists", f'{resource.plural} "{name}" already exists')
        if "name" in body["metadata"]:  # a generateName is made unique by the API
            self.objects[(resource.plural, name)] = copy.deepcopy(body)
        return body

    async def patch(
        self, resource: Resource, namespace: str, name: str, body: Obj, subresource: str | None = None
    ) -> Obj:
        self._call(f"patch/{subresource}" if subresource else "patch", resource, name, body)
        return body

    async def apply(self, resource: Resource, obj: Obj, *, field_manager: str = FIELD_MANAGER) -> Obj:
        self._call("apply", resource, obj["metadata"]["name"], obj)
        return obj

    async def delete(self, resource: Resource, namespace: str, name: str) -> None:
        self._call("delete", resource, name)
        self.objects.pop((resource.plural, name), None)


def role_obj(replicas_written: int) -> Obj:
    """The decode DisaggregatedRole as the API holds it, its replicas last written from the spec as
    ``replicas_written``."""
    return {
        "apiVersion": "kvbridge.io/v1alpha1",
        "kind": "DisaggregatedRole",
        "metadata": {
            "name": "llama3-8b-decode",
            "namespace": NAMESPACE,
            "resourceVersion": "41",
            "annotations": {ANNOTATION_SPEC_REPLICAS: str(replicas_written)},
        },
        "spec": {"deployment": "llama3-8b", "role": "decode", "replicas": replicas_written},
    }


STS: Obj = {
    "apiVersion": "apps/v1",
    "kind": "StatefulSet",
    "metadata": {"name": "llama3-8b-decode", "namespace": NAMESPACE},
}
POOL_OBJ: Obj = {
    "apiVersion": "inference.networking.k8s.io/v1",
    "kind": "InferencePool",
    "metadata": {"name": "llama3-8b", "namespace": NAMESPACE},
}
KEYS: Obj = {
    "apiVersion": "v1",
    "kind": "Secret",
    "metadata": {"name": "llama3-8b-side-channel", "namespace": NAMESPACE},
}
DECODE_ROLE = ("disaggregatedroles", "llama3-8b-decode")


@dataclass(frozen=True)
class Execution:
    id: str
    action: actions.Action
    calls: list[Call]
    objects: dict[tuple[str, str], Obj] = field(default_factory=dict)
    fails: dict[tuple[str, str], ApiError] = field(default_factory=dict)
    raises: type[Exception] | None = None
    #: the body of the last call, where it matters
    body: Obj | None = None


EXECUTIONS = [
    Execution("apply", actions.Apply(STS), [("apply", "statefulsets", "llama3-8b-decode")], body=STS),
    Execution(
        "apply-optional-kind-not-served",
        actions.Apply(POOL_OBJ, optional=True),
        [("apply", "inferencepools", "llama3-8b")],
        fails={("apply", "inferencepools"): not_served()},
        raises=KindMissingError,
    ),
    Execution(
        "apply-optional-kind-not-served-status-object",
        actions.Apply(POOL_OBJ, optional=True),
        [("apply", "inferencepools", "llama3-8b")],
        fails={
            ("apply", "inferencepools"): not_served(
                b'{"kind":"Status","status":"Failure","reason":"NotFound","code":404,'
                b'"message":"the server could not find the requested resource"}'
            )
        },
        raises=KindMissingError,
    ),
    # a 404 of a kind every cluster serves is no missing CRD: it fails the reconcile (Kopf retries it)
    Execution(
        "apply-required-404-fails",
        actions.Apply(STS),
        [("apply", "statefulsets", "llama3-8b-decode")],
        fails={("apply", "statefulsets"): not_served()},
        raises=ApiError,
    ),
    Execution("create-once", actions.CreateOnce(SECRETS, KEYS), [("create", "secrets", "llama3-8b-side-channel")]),
    Execution(
        "create-once-exists-is-kept",
        actions.CreateOnce(SECRETS, KEYS),
        [("create", "secrets", "llama3-8b-side-channel")],
        objects={("secrets", "llama3-8b-side-channel"): KEYS},
    ),
    Execution(
        "create-once-forbidden-fails",
        actions.CreateOnce(SECRETS, KEYS),
        [("create", "secrets", "llama3-8b-side-channel")],
        fails={("create", "secrets"): FORBIDDEN},
        raises=ApiError,
    ),
    Execution(
        "ensure-role-created", actions.EnsureRole(role_obj(1), exists=False, replicas=1), [("create", *DECODE_ROLE)]
    ),
    # created in between (the watch had not seen it): its replicas checked from a fresh read, and written
    Execution(
        "ensure-role-created-in-between",
        actions.EnsureRole(role_obj(2), exists=False, replicas=2),
        [("create", *DECODE_ROLE), ("get", *DECODE_ROLE), ("patch", *DECODE_ROLE)],
        objects={DECODE_ROLE: role_obj(1)},
        body={
            "metadata": {"resourceVersion": "41", "annotations": {ANNOTATION_SPEC_REPLICAS: "2"}},
            "spec": {"replicas": 2},
        },
    ),
    Execution(
        "ensure-role-rescaled",
        actions.EnsureRole(role_obj(1), exists=True, replicas=2),
        [("get", *DECODE_ROLE), ("patch", *DECODE_ROLE)],
        objects={DECODE_ROLE: role_obj(1)},
        body={
            "metadata": {"resourceVersion": "41", "annotations": {ANNOTATION_SPEC_REPLICAS: "2"}},
            "spec": {"replicas": 2},
        },
    ),
    # another reconcile wrote them already: the fresh read says so, no write
    Execution(
        "ensure-role-already-rescaled",
        actions.EnsureRole(role_obj(1), exists=True, replicas=2),
        [("get", *DECODE_ROLE)],
        objects={DECODE_ROLE: role_obj(2)},
    ),
    Execution(
        "ensure-role-deleted-in-between",
        actions.EnsureRole(role_obj(1), exists=True, replicas=2),
        [("get", *DECODE_ROLE)],
    ),
    Execution("delete", actions.Delete(HTTP_ROUTES, NAMESPACE, "llama3-8b"), [("delete", "httproutes", "llama3-8b")]),
    Execution(
        "write-status",
        actions.WriteStatus(DEPLOYMENTS, NAMESPACE, "llama3-8b", {"observedGeneration": 3}),
        [("patch/status", "disaggregateddeployments", "llama3-8b")],
        body={"status": {"observedGeneration": 3}},
    ),
    Execution(
        "annotate",
        actions.Annotate(DEPLOYMENTS, NAMESPACE, "llama3-8b", {"kvbridge.io/x": "1"}),
        [("patch", "disaggregateddeployments", "llama3-8b")],
        body={"metadata": {"annotations": {"kvbridge.io/x": "1"}}},
    ),
    Execution(
        "post",
        actions.Post(
            {"name": "llama3-8b", "namespace": NAMESPACE, "uid": UID}, actions.Event("Warning", "Incompatible", "why")
        ),
        [("create", "events", "llama3-8b.")],
    ),
    # an event that cannot be posted is logged: it never fails the reconcile
    Execution(
        "post-forbidden-is-logged",
        actions.Post({"name": "llama3-8b", "namespace": NAMESPACE}, actions.Event("Normal", "Reconciled", "ok")),
        [("create", "events", "llama3-8b.")],
        fails={("create", "events"): FORBIDDEN},
    ),
]


@pytest.mark.parametrize("case", EXECUTIONS, ids=[case.id for case in EXECUTIONS])
async def test_execute_makes_one_call_per_action_and_reads_only_to_rescale(case: Execution) -> None:
    client = FakeClient(case.objects, case.fails)
    done: list[actions.Action] = []
    if case.raises is None:
        await execute(client, [case.action], done)
        assert done == [case.action]
    else:
        with pytest.raises(case.raises) as caught:
            await execute(client, [case.action], done)
        assert done == []
        if isinstance(caught.value, KindMissingError):
            assert caught.value.kind == "InferencePool"
    assert client.log == case.calls
    if case.body is not None:
        assert client.bodies[-1][1] == case.body


async def test_a_posted_event_names_the_deployment() -> None:
    client = FakeClient()
    involved = {"name": "llama3-8b", "namespace": NAMESPACE, "uid": UID}
    await execute(client, [actions.Post(involved, actions.Event("Warning", "Incompatible", "x" * 1500))], [])
    [(_, event)] = client.bodies
    assert event["involvedObject"] == {
        "apiVersion": "kvbridge.io/v1alpha1",
        "kind": "DisaggregatedDeployment",
        "name": "llama3-8b",
        "namespace": NAMESPACE,
        "uid": UID,
    }
    assert (event["type"], event["reason"], len(event["message"])) == ("Warning", "Incompatible", 1000)


async def test_execute_skips_what_was_done_and_records_the_rest() -> None:
    first = actions.CreateOnce(SECRETS, KEYS)
    second = actions.Apply(STS)
    done: list[actions.Action] = [first]
    client = FakeClient()
    await execute(client, [first, second], done)
    assert client.log == [("apply", "statefulsets", "llama3-8b-decode")]
    assert done == [first, second]


def deployment_status(client: FakeClient) -> Obj:
    status: Obj
    [status] = [
        body["status"]
        for (verb, plural, _), body in client.bodies
        if (verb, plural) == ("patch/status", "disaggregateddeployments")
    ]
    return status


def posted(client: FakeClient) -> list[str]:
    return [body["reason"] for (verb, plural, _), body in client.bodies if (verb, plural) == ("create", "events")]


ROLE_CREATES: list[Call] = [("create", "disaggregatedroles", "llama3-8b-prefill"), ("create", *DECODE_ROLE)]
CHILD_APPLIES: list[Call] = [
    ("apply", "services", "llama3-8b-prefill"),
    ("apply", "services", "llama3-8b-decode"),
    ("apply", "networkpolicies", "llama3-8b-pods"),
    ("apply", "poddisruptionbudgets", "llama3-8b-prefill"),
    ("apply", "poddisruptionbudgets", "llama3-8b-decode"),
]
STATUS_WRITES: list[Call] = [
    ("patch/status", "disaggregatedroles", "llama3-8b-prefill"),
    ("patch/status", *DECODE_ROLE),
    ("patch/status", "disaggregateddeployments", "llama3-8b"),
    ("patch", "disaggregateddeployments", "llama3-8b"),
]


async def test_a_kind_the_api_does_not_serve_is_decided_again_without_it() -> None:
    """The LeaderWorkerSet CRD is not installed: its apply answers 404, the reconcile decides again knowing it, does
    nothing twice (the Secret, the roles, the children already applied) and says why in the status and an event."""
    client = FakeClient(fails={("apply", "leaderworkersets"): not_served()})
    outcome = await reconcile(client, two_node_prefill(), CONFIG, cached=World(document()).existing)
    writes = [call for call in client.log if call[1] != "events"]
    assert writes == [
        ("create", "secrets", "llama3-8b-side-channel"),
        *ROLE_CREATES,
        *CHILD_APPLIES,
        ("apply", "leaderworkersets", "llama3-8b-prefill"),  # 404: decide again
        # the decision made again renders a fresh key pair, so its CreateOnce is not the one done: the create is made
        # again, answered 409, and the Secret created first is kept
        ("create", "secrets", "llama3-8b-side-channel"),
        ("apply", "statefulsets", "llama3-8b-decode"),
        *STATUS_WRITES,
    ]
    assert outcome.applied
    assert "LeaderWorkerSetUnavailable" in posted(client)
    conditions = {c["type"]: c["reason"] for c in deployment_status(client)["conditions"]}
    assert conditions["PrefillReady"] == "NotCreated"


async def test_a_missing_route_kind_keeps_the_pool_applied_once() -> None:
    """The InferencePool is applied before the HTTPRoute's 404: the decision made again applies it no second time."""
    client = FakeClient(fails={("apply", "httproutes"): not_served()})
    outcome = await reconcile(client, document(inferencePool=POOL), CONFIG, cached=World(document()).existing)
    writes = [call for call in client.log if call[1] != "events"]
    assert writes == [
        ("create", "secrets", "llama3-8b-side-channel"),
        *ROLE_CREATES,
        *CHILD_APPLIES,
        ("apply", "statefulsets", "llama3-8b-prefill"),
        ("apply", "statefulsets", "llama3-8b-decode"),
        ("apply", "inferencepools", "llama3-8b"),
        ("apply", "httproutes", "llama3-8b"),  # 404: decide again
        # the decision made again renders a fresh key pair, so its CreateOnce is not the one done: the create is made
        # again, answered 409, and the Secret created first is kept
        ("create", "secrets", "llama3-8b-side-channel"),
        *STATUS_WRITES,
    ]
    assert outcome.applied
    assert "ServingUnavailable" in posted(client)
    assert deployment_status(client)["inferencePool"]["httpRoute"] == ""


def reads(client: FakeClient) -> list[Call]:
    return [call for call in client.log if call[0] in ("get", "list")]


async def test_without_the_watches_a_reconcile_reads_its_children_in_seven_calls() -> None:
    """The count reconcile.py's docstring states: each role's DisaggregatedRole, StatefulSet and LeaderWorkerSet,
    and one list of the deployment's pods."""
    client = FakeClient()
    await reconcile(client, document(), CONFIG)
    assert reads(client) == [
        ("get", "disaggregatedroles", "llama3-8b-prefill"),
        ("get", *DECODE_ROLE),
        ("get", "statefulsets", "llama3-8b-prefill"),
        ("get", "statefulsets", "llama3-8b-decode"),
        ("get", "leaderworkersets", "llama3-8b-prefill"),
        ("get", "leaderworkersets", "llama3-8b-decode"),
        ("list", "pods", "kvbridge.io/deployment=llama3-8b"),
    ]
    direct = FakeClient()
    nothing = dict.fromkeys(Role)
    assert await read_children(direct, NAMESPACE, "llama3-8b") == ExistingChildren(nothing, nothing, [], nothing)
    assert len(reads(direct)) == 7


async def test_with_the_watches_a_reconcile_reads_only_a_role_it_rescales() -> None:
    created = FakeClient()
    await reconcile(created, document(), CONFIG, cached=World(document()).existing)
    assert reads(created) == []
    world = changed(settled(), document(generation=2, decode={"replicas": 2}))
    role = world.existing.roles[Role.DECODE]
    assert role is not None
    scaled = FakeClient({DECODE_ROLE: role})
    await reconcile(scaled, world.body, CONFIG, cached=world.existing)
    assert reads(scaled) == [("get", *DECODE_ROLE)]


async def test_a_resync_of_a_settled_deployment_makes_eight_calls() -> None:
    """With the handler's fresh read of the deployment, the nine calls handlers.py and docs/operator.md count: the
    Secret's create answered 409 and seven server-side applies that change nothing; no status write."""
    world = settled()
    client = FakeClient({("secrets", "llama3-8b-side-channel"): KEYS})
    await reconcile(client, copy.deepcopy(world.body), CONFIG, cached=copy.deepcopy(world.existing))
    assert client.log == [
        ("create", "secrets", "llama3-8b-side-channel"),
        *CHILD_APPLIES,
        ("apply", "statefulsets", "llama3-8b-prefill"),
        ("apply", "statefulsets", "llama3-8b-decode"),
    ]
