"""Engines that span nodes: the rules a multi-node role must meet, and its LeaderWorkerSet as rendered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvbridge_agent.core import Role
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children.objects.workload import leader_worker_set
from kvbridge_operator.children.remedy import suggested_fix
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_operator.config import OperatorConfig

ROOT = Path(__file__).resolve().parents[2]
UID = "00000000-0000-0000-0000-0000000000cc"
#: what the LWS API (kubernetes-sigs/lws api/leaderworkerset/v1/leaderworkerset_types.go) requires: the fields
#: without ``omitempty``, by path from the object's spec
LWS_REQUIRED: tuple[tuple[str, ...], ...] = (
    ("leaderWorkerTemplate",),
    ("leaderWorkerTemplate", "workerTemplate"),
    ("startupPolicy",),
    ("rolloutStrategy", "type"),
)
LWS_ENUMS = {
    ("startupPolicy",): {"LeaderReady", "LeaderCreated"},
    ("rolloutStrategy", "type"): {"RollingUpdate"},
    ("leaderWorkerTemplate", "restartPolicy"): {
        "RecreateGroupOnPodRestart",
        "RecreateGroupAfterStart",
        "None",
        "Default",
    },
}


def deepseek(**roles: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "vllm" / "deepseek-v3-h200.yaml").read_text())
    for role, fields in roles.items():
        found["spec"][role].update(fields)
    return found


def at(obj: dict[str, Any], path: tuple[str, ...]) -> Any:
    for part in path:
        obj = obj[part]
    return obj


def test_a_prefill_spanning_two_nodes_fits_where_one_pod_would_not() -> None:
    one_pod = parse_deployment(deepseek(prefill={"tensorParallelSize": 16}))
    [problem] = verdict_for(one_pod)  # type: ignore[misc]
    assert problem.code == "ROLE_DOES_NOT_FIT"
    assert "set spec.prefill.nodes to 2 (8 GPUs per pod)" in problem.message
    assert suggested_fix(one_pod) == {"spec.prefill.nodes": 2}
    two_nodes = parse_deployment(deepseek(prefill={"tensorParallelSize": 16, "nodes": 2}))
    assert not isinstance(verdict_for(two_nodes), list)


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"engine": {"kind": "Synthetic"}}, "NODES_NEED_VLLM_ON_GPU"),
        ({"engine": {"kind": "VLLM", "device": "CPU"}}, "NODES_NEED_VLLM_ON_GPU"),
        ({"prefill": {"tensorParallelSize": 16, "nodes": 3}}, "NODES_DO_NOT_DIVIDE_TP"),
    ],
)
def test_what_a_multi_node_role_cannot_be(change: dict[str, Any], code: str) -> None:
    doc = deepseek(prefill={"tensorParallelSize": 16, "nodes": 2})
    for key, value in change.items():
        doc["spec"][key] = {**doc["spec"][key], **value}
    doc["spec"].pop("placement")  # the fit check aside: these are about nodes themselves
    problems = verdict_for(parse_deployment(doc))
    assert isinstance(problems, list)
    assert code in {p.code for p in problems}
    [problem] = [p for p in problems if p.code == code]
    assert problem.field == "spec.prefill.nodes"
    if code == "NODES_DO_NOT_DIVIDE_TP":
        assert "one of 2, 4, 8, 16" in problem.message


def test_a_gang_counts_every_pod_of_a_multi_node_engine() -> None:
    from kvbridge_operator.children.placement import min_member

    spec = parse_deployment(deepseek(prefill={"tensorParallelSize": 16, "nodes": 2})).spec
    assert min_member(spec) == 2 * 2 + 2  # two prefill engines of 2 pods, two decode engines of 1


def test_the_leader_worker_set_has_what_the_lws_api_requires_and_valid_pod_templates() -> None:
    dd = parse_deployment(deepseek(prefill={"tensorParallelSize": 16, "nodes": 2, "replicas": 3}))
    plan = verdict_for(dd)
    assert not isinstance(plan, list)
    lws = leader_worker_set(dd, UID, Role.PREFILL, plan, OperatorConfig())
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert lws["metadata"]["ownerReferences"][0]["uid"] == UID
    spec = lws["spec"]
    for path in LWS_REQUIRED:
        assert at(spec, path), path
    for path, allowed in LWS_ENUMS.items():
        assert at(spec, path) in allowed, path
    assert (spec["replicas"], spec["leaderWorkerTemplate"]["size"]) == (3, 2)
    group = spec["leaderWorkerTemplate"]
    for template in (group["leaderTemplate"], group["workerTemplate"]):  # each a valid PodTemplateSpec
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p", **template["metadata"]},
            "spec": template["spec"],
        }
        kubernetes_validate.validate(pod, "1.30", strict=True)
        assert template["metadata"]["labels"]["kvbridge.io/role"] == "prefill"
        [engine] = [c for c in template["spec"]["containers"] if c["name"] == "engine"]
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "8"  # 16 ranks over 2 nodes
    leader = next(c for c in group["leaderTemplate"]["spec"]["containers"] if c["name"] == "engine")
    worker = next(c for c in group["workerTemplate"]["spec"]["containers"] if c["name"] == "engine")
    assert leader["args"][-8:] == [
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "$(LWS_LEADER_ADDRESS)",
        "--master-port",
        "29500",
    ]
    assert worker["args"][-9:] == [
        "--nnodes",
        "2",
        "--node-rank",
        "$(LWS_WORKER_INDEX)",
        "--master-addr",
        "$(LWS_LEADER_ADDRESS)",
        "--master-port",
        "29500",
        "--headless",
    ]
    assert "--tensor-parallel-size" in worker["args"]
    assert {p["name"] for p in leader["ports"]} >= {"http", "side-channel", "rendezvous"}
    assert worker["ports"] == []  # headless: no API, no side channel
    assert "readinessProbe" not in worker
