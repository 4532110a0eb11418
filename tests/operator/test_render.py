"""Rendered children: valid Kubernetes objects (kubernetes-validate, strict), owned, labelled, wired."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
import zmq

from kvbridge_agent.core import Role
from kvbridge_agent.core.contract import parse_environment
from kvbridge_operator.api.names import LABEL_FINGERPRINT, LABEL_REVISION
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children.objects.desired import desired_children
from kvbridge_operator.children.objects.secret import secret
from kvbridge_operator.children.objects.shared import overlay
from kvbridge_operator.children.objects.workload import stateful_set
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_operator.config import OperatorConfig

ROOT = Path(__file__).parents[2]
UID = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"


def deployment(name: str = "synthetic/llama3-8b-hetero-tp", **spec_changes: Any) -> Any:
    document = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    document["metadata"]["namespace"] = "team-a"
    for key, value in spec_changes.items():
        document["spec"][key] = {**document["spec"].get(key, {}), **value}
    return parse_deployment(document)


def rendered(config: OperatorConfig | None = None, **spec_changes: Any) -> list[dict[str, Any]]:
    dd = deployment(**spec_changes)
    plan = verdict_for(dd)
    return [*desired_children(dd, UID, plan, config or OperatorConfig()), secret(dd, UID)]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "example", ["synthetic/llama3-8b-hetero-tp", "synthetic/deepseek-mla", "synthetic/hetero-block-size"]
)
def test_children_validate_strictly(example: str) -> None:
    dd = deployment(example)
    for obj in [*desired_children(dd, UID, verdict_for(dd), OperatorConfig()), secret(dd, UID)]:  # type: ignore[arg-type]
        kubernetes_validate.validate(obj, "1.30", strict=True)


def test_every_child_is_owned_by_the_deployment() -> None:
    for obj in rendered():
        [owner] = obj["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "kvbridge.io/v1alpha1",
            "kind": "DisaggregatedDeployment",
            "name": "llama3-8b",
            "uid": UID,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert obj["metadata"]["namespace"] == "team-a"
        assert obj["metadata"]["labels"]["kvbridge.io/deployment"] == "llama3-8b"


def test_gpu_requests_are_tp_times_the_resource_and_none_in_cpu_mode() -> None:
    sets = {o["metadata"]["name"]: o for o in rendered() if o["kind"] == "StatefulSet"}
    prefill = sets["llama3-8b-prefill"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    decode = sets["llama3-8b-decode"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert prefill["limits"] == {"nvidia.com/gpu": "2"}
    assert decode["limits"] == {"nvidia.com/gpu": "1"}
    custom = {
        o["metadata"]["name"]: o
        for o in rendered(OperatorConfig(gpu_resource="amd.com/gpu"))
        if o["kind"] == "StatefulSet"
    }
    assert custom["llama3-8b-prefill"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "amd.com/gpu": "2"
    }
    for obj in rendered(OperatorConfig(cpu_mode=True)):
        if obj["kind"] == "StatefulSet":
            resources = obj["spec"]["template"]["spec"]["containers"][0]["resources"]
            assert "limits" not in resources
            assert not any("gpu" in key for key in resources["requests"])


def test_pods_carry_the_environment_contract_and_the_key_mount() -> None:
    sts = stateful_set(deployment(), UID, Role.DECODE, verdict_for(deployment()), OperatorConfig())  # type: ignore[arg-type]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["KVBRIDGE_SIDE_CHANNEL_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["KVBRIDGE_ENGINE_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    values = {name: e["value"] for name, e in env.items() if "value" in e}
    parsed = parse_environment({**values, "KVBRIDGE_ENGINE_ID": "pod-0", "KVBRIDGE_SIDE_CHANNEL_HOST": "10.1.2.3"})
    assert parsed.role is Role.DECODE
    assert (parsed.prefill.tensor_parallel_size, parsed.decode.tensor_parallel_size) == (2, 1)
    assert parsed.fingerprint == sts["spec"]["template"]["metadata"]["labels"][LABEL_FINGERPRINT]
    assert parsed.keys_dir == "/var/run/kvbridge/keys"
    assert container["volumeMounts"] == [
        {"name": "side-channel-keys", "mountPath": "/var/run/kvbridge/keys", "readOnly": True}
    ]
    assert container["command"] == ["kvbridge-agent", "serve"]


def test_secret_holds_a_curve_pair_the_agent_accepts() -> None:
    data = secret(deployment(), UID)["data"]
    public, private = (base64.b64decode(data[k]) for k in ("curve-public", "curve-secret"))
    assert zmq.curve_public(private) == public


def test_network_policy_admits_the_data_plane_within_the_deployment_and_limits_the_api() -> None:
    """Issue 13 #4: the policy admitted only the side-channel and HTTP ports on prefill (NIXL/UCX's ephemeral
    ports were dropped) and opened the unauthenticated HTTP API to any source."""
    [policy] = [o for o in rendered() if o["kind"] == "NetworkPolicy"]
    assert policy["metadata"]["name"] == "llama3-8b-pods"
    assert policy["spec"]["podSelector"]["matchLabels"] == {"kvbridge.io/deployment": "llama3-8b"}  # both roles
    data_plane, api = policy["spec"]["ingress"]
    assert data_plane == {"from": [{"podSelector": {"matchLabels": {"kvbridge.io/deployment": "llama3-8b"}}}]}
    assert "ports" not in data_plane  # every port: UCX listens where the rank processes choose
    assert api["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert api["from"] == [
        {"podSelector": {}},  # this namespace
        {"namespaceSelector": {"matchLabels": {"kvbridge.io/api-access": "allowed"}}},
    ]


def test_template_overlay_merges_by_name_and_changes_the_revision() -> None:
    plain = stateful_set(deployment(), UID, Role.PREFILL, verdict_for(deployment()), OperatorConfig())  # type: ignore[arg-type]
    overlaid_dd = deployment(
        prefill={
            "template": {
                "spec": {
                    "nodeSelector": {"pool": "h100"},
                    "containers": [
                        {
                            "name": "engine",
                            "image": "registry.local/agent:dev",
                            "env": [{"name": "KVBRIDGE_NUM_BLOCKS", "value": "4096"}],
                        }
                    ],
                }
            }
        }
    )
    overlaid = stateful_set(overlaid_dd, UID, Role.PREFILL, verdict_for(overlaid_dd), OperatorConfig())  # type: ignore[arg-type]
    spec = overlaid["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"pool": "h100"}
    [container] = spec["containers"]
    assert container["image"] == "registry.local/agent:dev"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVBRIDGE_NUM_BLOCKS"] == "4096"
    assert env["KVBRIDGE_ROLE"] == "prefill"  # the rest of the contract is kept
    labels = (plain["spec"]["template"]["metadata"]["labels"], overlaid["spec"]["template"]["metadata"]["labels"])
    assert labels[0][LABEL_REVISION] != labels[1][LABEL_REVISION]


def test_overlay_rules() -> None:
    assert overlay({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}}) == {"a": {"b": 1, "c": 3}}
    assert overlay({"l": [1, 2]}, {"l": [3]}) == {"l": [3]}
    assert overlay([{"name": "x", "v": 1}], [{"name": "y"}]) == [{"name": "x", "v": 1}, {"name": "y"}]


def test_overlay_merges_lists_by_their_strategic_merge_keys() -> None:
    """Issue 13 #11: a container port added by the overlay used to replace the http and side-channel ports."""
    dd = deployment(
        prefill={
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "engine",
                            "ports": [
                                {"containerPort": 9090, "name": "debug"},
                                {"containerPort": 5600, "hostPort": 5600},
                            ],
                            "volumeMounts": [{"mountPath": "/models", "name": "models"}],
                        }
                    ],
                    "volumes": [{"name": "models", "emptyDir": {}}],
                }
            }
        }
    )
    spec = stateful_set(dd, UID, Role.PREFILL, verdict_for(dd), OperatorConfig())["spec"]["template"]["spec"]  # type: ignore[arg-type]
    [container] = spec["containers"]
    ports = {p["containerPort"]: p for p in container["ports"]}
    assert ports[8000]["name"] == "http"
    assert ports[5600] == {"name": "side-channel", "containerPort": 5600, "protocol": "TCP", "hostPort": 5600}
    assert ports[9090]["name"] == "debug"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/var/run/kvbridge/keys", "/models"}
    assert {v["name"] for v in spec["volumes"]} == {"side-channel-keys", "models"}
    assert overlay({"ports": [{"containerPort": 1}]}, {"ports": [{"containerPort": 2}]}) == {
        "ports": [{"containerPort": 1}, {"containerPort": 2}]
    }
    assert overlay({"tolerations": [{"key": "a"}]}, {"tolerations": [{"key": "b"}]}) == {"tolerations": [{"key": "b"}]}
