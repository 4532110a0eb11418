"""The status's rules (controller/status_rules.py): each condition and event rule on its own, and the tables."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge_agent.core import Problem, Role, TransferPlan
from kvbridge_operator.api.names import PODS_ANNOTATION
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.api.status import Advisory, ConditionType, Endpoint, RoleStatus, ServingEndpoint
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_operator.controller import status_rules
from kvbridge_operator.controller.status_rules import (
    ADVISORY,
    CONDITION_RULES,
    EVENT_RULES,
    MAX_MESSAGE,
    Seen,
    advised,
    available,
    compatible,
    decode_ready,
    endpoints_changed,
    incompatible,
    prefill_ready,
    ready,
    rollout_progress,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm" / "tiny-cpu.yaml"
PROBLEM = Problem("TP_MISMATCH", "spec.decode.tensorParallelSize", "does not divide")


def _deployment() -> Any:
    documents = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d and d.get("kind") == "DisaggregatedDeployment"]
    return parse_deployment(documents[0])


def _plan() -> TransferPlan:
    verdict = verdict_for(_deployment())
    assert isinstance(verdict, TransferPlan)
    return verdict


def _counts(replicas: int, ready_replicas: int, updated: int = 0) -> RoleStatus:
    return RoleStatus(
        replicas=replicas,
        ready_replicas=ready_replicas,
        updated_replicas=updated,
        ready=f"{ready_replicas}/{replicas}",
    )


def _seen(**changes: Any) -> Seen:
    base = Seen(
        spec=_deployment().spec,
        verdict=[PROBLEM],
        generation=2,
        previous={},
        annotations={},
        fix="",
        roles={role: _counts(1, 1) for role in Role},
        created=dict.fromkeys(Role, True),
        endpoints=[],
        advisories=[],
        incarnations={},
    )
    return dataclasses.replace(base, **changes)


def _endpoint(ip: str, pod: str = "p-0", pairing: str = "k") -> Endpoint:
    return Endpoint(pod=pod, ip=ip, port=5600, ranks=1, fingerprint="f", pairing=pairing, http_port=8000)


def _decode(pod: str, pairing: str = "k") -> ServingEndpoint:
    return ServingEndpoint(pod=pod, ip="10.0.1.1", http_port=8000, pairing=pairing)


def _serving(**changes: Any) -> Seen:
    """A compatible deployment with one ready prefill and one ready decode pod of one pairing key."""
    base = _seen(verdict=_plan(), endpoints=[_endpoint("10.0.0.1")], decode_endpoints=[_decode("d-0")])
    return dataclasses.replace(base, **changes)


def test_compatible_states_the_plan() -> None:
    condition = compatible(_seen(verdict=_plan()))
    assert (condition.type, condition.status, condition.reason) == (ConditionType.COMPATIBLE, "True", "PlanBuilt")
    assert condition.message.startswith("prefill ")
    assert "read(s) per decode rank" in condition.message
    assert condition.observed_generation == 2


def test_incompatible_lists_the_problems_and_the_fix() -> None:
    condition = compatible(_seen(fix="spec.decode.tensorParallelSize: 1"))
    assert (condition.status, condition.reason) == ("False", "Incompatible")
    assert condition.message == (
        "TP_MISMATCH at spec.decode.tensorParallelSize: does not divide. A fix that passes every check: "
        "spec.decode.tensorParallelSize: 1"
    )


def test_a_long_message_is_bounded() -> None:
    condition = compatible(_seen(verdict=[PROBLEM] * 2000))
    assert len(condition.message) <= MAX_MESSAGE
    assert condition.message.endswith("more problem(s) (kvbridge plan lists them all)")


@pytest.mark.parametrize(
    ("created", "counts", "status", "reason"),
    [
        (False, _counts(1, 0), "False", "NotCreated"),
        (True, _counts(2, 1), "False", "ReplicasNotReady"),
        (True, _counts(2, 2), "True", "AllReplicasReady"),
    ],
)
def test_role_ready(created: bool, counts: RoleStatus, status: str, reason: str) -> None:
    seen = _seen(created={Role.PREFILL: created, Role.DECODE: True}, roles={Role.PREFILL: counts, Role.DECODE: counts})
    condition = prefill_ready(seen)
    assert (condition.type, condition.status, condition.reason) == (ConditionType.PREFILL_READY, status, reason)
    assert decode_ready(seen).type is ConditionType.DECODE_READY


def test_ready_names_the_first_failing_condition() -> None:
    seen = _seen(verdict=_plan(), roles={Role.PREFILL: _counts(2, 1), Role.DECODE: _counts(1, 1)})
    found = [rule.observe(seen) for rule in CONDITION_RULES]
    condition = ready(seen, found)
    assert (condition.status, condition.reason) == ("False", "ReplicasNotReady")
    assert condition.message == "PrefillReady is False: 1/2 prefill pods ready"
    serving = _serving()
    assert ready(serving, [rule.observe(serving) for rule in CONDITION_RULES]).reason == "Ready"


def test_a_scale_up_keeps_the_deployment_available_and_says_why_it_is_not_ready() -> None:
    """Issue 59: Ready flapped to False for two minutes on every decode scale-up while the router served on.
    Available (a ready pair serves) stays True; Ready, every replica ready, says which role is short and that the
    ready pods serve."""
    scaling = _serving(roles={Role.PREFILL: _counts(1, 1), Role.DECODE: _counts(3, 1)})
    found = status_rules.conditions(scaling)
    by_type = {c.type: c for c in found}
    assert [c.type for c in found] == [
        ConditionType.COMPATIBLE,
        ConditionType.PREFILL_READY,
        ConditionType.DECODE_READY,
        ConditionType.AVAILABLE,
        ConditionType.READY,
    ]
    assert (by_type[ConditionType.AVAILABLE].status, by_type[ConditionType.AVAILABLE].reason) == (
        "True",
        "MinimumReplicasAvailable",
    )
    assert by_type[ConditionType.AVAILABLE].message == (
        "serving: 1 prefill and 1 decode pods in pairs (1/1 prefill, 1/3 decode pods ready)"
    )
    not_ready = by_type[ConditionType.READY]
    assert (not_ready.status, not_ready.reason) == ("False", "ReplicasNotReady")
    assert not_ready.message == (
        "DecodeReady is False: 1/3 decode pods ready; the ready pods serve meanwhile (Available is True)"
    )


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"decode_endpoints": []}, "NoDecodeReady"),
        ({"endpoints": []}, "NoPrefillReady"),
        ({"decode_endpoints": [_decode("d-0", pairing="other")]}, "NoPairReady"),
        ({"decode_endpoints": [_decode("d-0", pairing="")]}, "NoDecodeReady"),  # routers skip a pod without a key
    ],
)
def test_a_deployment_without_a_ready_pair_is_not_available(changes: dict[str, Any], reason: str) -> None:
    seen = _serving(**changes)
    condition = available(seen)
    assert (condition.type, condition.status, condition.reason) == (ConditionType.AVAILABLE, "False", reason)
    assert ready(seen, status_rules.conditions(seen)[:-1]).status == "False"


def test_pairs_a_rollout_lists_are_available_and_an_incompatible_update_does_not_take_serving_away() -> None:
    mixed = _serving(decode_endpoints=[_decode("d-0", pairing="new")], pairings=frozenset({("k", "new")}))
    assert available(mixed).status == "True"
    refused = _serving(verdict=[PROBLEM])  # nothing that runs changed: the pods as they were still serve
    assert available(refused).status == "True"
    assert ready(refused, status_rules.conditions(refused)[:-1]).reason == "Incompatible"


def test_incompatible_is_said_once_per_generation() -> None:
    assert [e.reason for e in incompatible(_seen())] == ["Incompatible"]
    said = {"conditions": [{"type": "Compatible", "status": "False", "observedGeneration": 2}]}
    assert incompatible(_seen(previous=said)) == []
    assert incompatible(_seen(previous=said, generation=3)) != []
    assert incompatible(_seen(verdict=_plan())) == []


def test_advisories_are_said_when_they_change() -> None:
    advisories = [Advisory(code="A", field="spec.x", message="m")]
    assert [(e.type, e.reason) for e in advised(_seen(advisories=advisories))] == [("Warning", ADVISORY)]
    stated = {"advisories": [a.model_dump(by_alias=True, mode="json") for a in advisories], "observedGeneration": 2}
    assert advised(_seen(advisories=advisories, previous=stated)) == []
    assert advised(_seen()) == []


def test_endpoints_changed() -> None:
    previous = {"prefill": {"endpoints": [_endpoint("10.0.0.1").model_dump(by_alias=True, mode="json")]}}
    assert endpoints_changed(_seen(previous=previous, endpoints=[_endpoint("10.0.0.1")])) == []
    assert endpoints_changed(_seen()) == []
    [event] = endpoints_changed(_seen(previous=previous, endpoints=[_endpoint("10.0.0.2")]))
    assert event.message == "prefill endpoints: p-0=10.0.0.2:5600"
    [gone] = endpoints_changed(_seen(previous=previous))
    assert gone.message == "prefill endpoints: none"


def test_prefill_restarted() -> None:
    annotations = {PODS_ANNOTATION: json.dumps({"p-0": "u:0", "p-1": "u1:0"})}
    events = status_rules.prefill_restarted(_seen(annotations=annotations, incarnations={"p-0": "u:1", "p-1": "u1:0"}))
    assert [e.message for e in events] == [
        "prefill pod p-0 restarted; decode agents re-handshake with its new incarnation"
    ]
    assert (
        status_rules.prefill_restarted(_seen(annotations={PODS_ANNOTATION: "not json"}, incarnations={"p": "x"})) == []
    )


def test_rollout_progress() -> None:
    rolling = {Role.PREFILL: _counts(2, 2, updated=1), Role.DECODE: _counts(1, 1, updated=1)}
    previous = {"prefill": {"updatedReplicas": 0}, "decode": {"updatedReplicas": 1}}
    [event] = rollout_progress(_seen(roles=rolling, previous=previous))
    assert event.message == "prefill: 1/2 pods on the current revision, 2 ready"
    created = {Role.PREFILL: False, Role.DECODE: True}
    assert rollout_progress(_seen(roles=rolling, previous=previous, created=created)) == []


def test_every_rule_says_what_its_row_names() -> None:
    seen = _seen(
        previous={"prefill": {"endpoints": [], "updatedReplicas": 0}},
        endpoints=[_endpoint("10.0.0.1")],
        advisories=[Advisory(code="A", field="f", message="m")],
        annotations={PODS_ANNOTATION: json.dumps({"p-0": "a"})},
        incarnations={"p-0": "b"},
        roles={role: _counts(2, 1, updated=1) for role in Role},
    )
    for condition_rule in CONDITION_RULES:
        assert condition_rule.observe(seen).type is condition_rule.type
    for event_rule in EVENT_RULES:
        found = event_rule.observe(seen)
        assert found
        assert {e.reason for e in found} == {event_rule.reason}
    assert [c.type for c in status_rules.conditions(seen)][-1] is ConditionType.READY
