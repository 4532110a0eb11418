"""spec.placement: a role that no node can hold is refused before scheduling; colocation and spread as rendered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvbridge_agent.core import Role, SpecError
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children.objects.workload import stateful_set
from kvbridge_operator.children.pairing import pairing
from kvbridge_operator.children.placement import with_gpus_per_node
from kvbridge_operator.children.remedy import advice
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_operator.config import OperatorConfig

ROOT = Path(__file__).resolve().parents[2]
UID = "00000000-0000-0000-0000-0000000000bb"


def document(name: str = "synthetic/llama3-8b-hetero-tp", **spec: Any) -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    for key, value in spec.items():
        found["spec"][key] = {**found["spec"].get(key, {}), **value}
    return found


def test_a_tp_larger_than_a_node_is_refused_with_the_field_and_what_fits() -> None:
    doc = document(
        "synthetic/deepseek-mla",
        placement={"gpusPerNode": 8},
        prefill={"tensorParallelSize": 16},
        decode={"tensorParallelSize": 8},
    )
    dd = parse_deployment(doc)
    verdict = verdict_for(dd)
    assert isinstance(verdict, list)
    [problem] = verdict
    assert (problem.code, problem.field) == ("ROLE_DOES_NOT_FIT", "spec.prefill.tensorParallelSize")
    assert "a node has 8" in problem.message
    assert "at most 8" in problem.message
    fix = advice(dd)
    assert fix is not None
    assert "spec.prefill.tensorParallelSize: 8" in fix


def test_fit_is_checked_only_where_known_and_only_for_gpus() -> None:
    big = {"prefill": {"tensorParallelSize": 16}, "decode": {"tensorParallelSize": 8}}
    # gpusPerNode unset: not checked
    assert not isinstance(verdict_for(parse_deployment(document("synthetic/deepseek-mla", **big))), list)
    on_cpu = document("synthetic/deepseek-mla", engine={"device": "CPU"}, placement={"gpusPerNode": 8}, **big)
    assert not isinstance(verdict_for(parse_deployment(on_cpu)), list)
    fits = document(placement={"gpusPerNode": 8}, prefill={"tensorParallelSize": 8})
    assert not isinstance(verdict_for(parse_deployment(fits)), list)


def test_the_operators_gpus_per_node_applies_where_the_spec_states_none() -> None:
    tp = {"prefill": {"tensorParallelSize": 16}, "decode": {"tensorParallelSize": 8}}
    big = parse_deployment(document("synthetic/deepseek-mla", **tp))
    assert with_gpus_per_node(big, 0) is big  # unknown: not checked
    refused = verdict_for(with_gpus_per_node(big, 8))
    assert isinstance(refused, list)
    assert [(p.code, p.field) for p in refused] == [("ROLE_DOES_NOT_FIT", "spec.prefill.tensorParallelSize")]
    assert "operator's gpusPerNode" in refused[0].message
    assert pairing(with_gpus_per_node(big, 8).spec) == pairing(big.spec)  # no pod changes with the setting
    stated = parse_deployment(document("synthetic/deepseek-mla", placement={"gpusPerNode": 16}, **tp))
    assert not isinstance(verdict_for(with_gpus_per_node(stated, 8)), list)  # the spec's own value wins


def pod_spec(doc: dict[str, Any], role: Role) -> dict[str, Any]:
    dd = parse_deployment(doc)
    sts = stateful_set(dd, UID, role, verdict_for(dd), OperatorConfig())  # type: ignore[arg-type]
    kubernetes_validate.validate(sts, "1.30", strict=True)
    spec: dict[str, Any] = sts["spec"]["template"]["spec"]
    return spec


@pytest.mark.parametrize("colocation", ["Required", "Preferred"])
def test_colocation_keeps_both_roles_in_one_domain(colocation: str) -> None:
    doc = document(placement={"colocation": colocation, "topologyKey": "example.com/nvlink-domain"})
    for role in Role:
        affinity = pod_spec(doc, role)["affinity"]["podAffinity"]
        if colocation == "Required":
            [term] = affinity["requiredDuringSchedulingIgnoredDuringExecution"]
        else:
            [weighted] = affinity["preferredDuringSchedulingIgnoredDuringExecution"]
            term = weighted["podAffinityTerm"]
        # the same term for both roles: each pod is drawn to the deployment's pods of either role
        assert term == {
            "labelSelector": {"matchLabels": {"kvbridge.io/deployment": "llama3-8b"}},
            "topologyKey": "example.com/nvlink-domain",
        }


def test_spread_keeps_a_roles_pods_on_different_nodes() -> None:
    doc = document(placement={"spreadReplicas": True})
    [constraint] = pod_spec(doc, Role.PREFILL)["topologySpreadConstraints"]
    assert constraint["topologyKey"] == "kubernetes.io/hostname"
    assert constraint["labelSelector"]["matchLabels"] == {
        "kvbridge.io/deployment": "llama3-8b",
        "kvbridge.io/role": "prefill",
    }
    plain = pod_spec(document(), Role.PREFILL)
    assert "affinity" not in plain
    assert "topologySpreadConstraints" not in plain


def test_colocation_needs_a_topology_key() -> None:
    with pytest.raises(SpecError, match="colocation needs topologyKey"):
        parse_deployment(document(placement={"colocation": "Required"}))


def test_gang_scheduling_labels_both_roles_into_one_pod_group() -> None:
    from kvbridge_operator.children.objects.desired import optional_children

    doc = document(placement={"gang": {}})
    for role in Role:
        spec = pod_spec(doc, role)
        assert spec["schedulerName"] == "scheduler-plugins-scheduler"
    dd = parse_deployment(doc)
    sts = stateful_set(dd, UID, Role.DECODE, verdict_for(dd), OperatorConfig())  # type: ignore[arg-type]
    assert sts["spec"]["template"]["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "llama3-8b"
    [group] = optional_children(dd, UID, OperatorConfig())
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"] == {"minMember": 3, "scheduleTimeoutSeconds": 300}  # 2 prefill + 1 decode
    custom = parse_deployment(document(placement={"gang": {"minMember": 2, "schedulerName": "volcano-ish"}}))
    assert optional_children(custom, UID, OperatorConfig())[0]["spec"]["minMember"] == 2
    with pytest.raises(SpecError, match="minMember"):
        parse_deployment(document(placement={"gang": {"minMember": 1}}))


def test_the_deepseek_v3_example_is_compatible_and_its_tp16_variant_does_not_fit() -> None:
    doc = document("vllm/deepseek-v3-h200")
    assert not isinstance(verdict_for(parse_deployment(doc)), list)
    for role in Role:  # valid pods: affinity, spread, the scheduler, the weights' cache
        spec = pod_spec(doc, role)
        assert spec["schedulerName"] == "scheduler-plugins-scheduler"
    doc["spec"]["prefill"]["tensorParallelSize"] = 16
    verdict = verdict_for(parse_deployment(doc))
    assert isinstance(verdict, list)
    assert [p.code for p in verdict] == ["ROLE_DOES_NOT_FIT"]
