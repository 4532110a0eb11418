"""spec.router for a platform team: the router pods' placement (imagePullSecrets, nodeSelector, tolerations, affinity,
priorityClassName) and client API keys from a Secret, as rendered, checked (pydantic and CEL) and planned."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvbridge_agent.core import SpecError
from kvbridge_operator.api.crd import SPEC_RULES, crd
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children.objects.desired import optional_children
from kvbridge_operator.children.objects.router import API_KEYS_FILE
from kvbridge_operator.cli.main import main
from kvbridge_operator.config import OperatorConfig
from kvbridge_router import cli as router_cli

from .schema_tools import apply_defaults, cel_failures
from .test_serving import UID, document

AFFINITY = {
    "podAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {
                "weight": 100,
                "podAffinityTerm": {
                    "topologyKey": "kubernetes.io/hostname",
                    "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "router"}},
                },
            }
        ]
    }
}
PLATFORM = {
    "enabled": True,
    "replicas": 2,
    "imagePullSecrets": [{"name": "regcred"}],
    "nodeSelector": {"pool": "cpu", "kubernetes.io/os": "linux"},
    "tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "serving", "effect": "NoSchedule"},
        {"operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
    ],
    "affinity": AFFINITY,
    "priorityClassName": "serving-critical",
    "apiKeySecret": {"name": "router-clients", "key": "keys.txt"},
}


def router_pod(router: dict[str, Any]) -> dict[str, Any]:
    objects = optional_children(parse_deployment(document(router=router)), UID, OperatorConfig())
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    kubernetes_validate.validate(deployment, "1.30", strict=True)
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return pod


def test_the_placement_goes_into_the_router_pods_as_given() -> None:
    pod = router_pod(PLATFORM)
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == {"pool": "cpu", "kubernetes.io/os": "linux"}
    assert pod["tolerations"] == [
        {"key": "dedicated", "value": "serving", "effect": "NoSchedule"},  # Equal: Kubernetes' default too
        {"operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
    ]
    assert pod["affinity"] == AFFINITY
    assert pod["priorityClassName"] == "serving-critical"


def test_without_placement_the_router_pods_take_the_clusters_defaults() -> None:
    pod = router_pod({"enabled": True})
    for name in ("imagePullSecrets", "nodeSelector", "tolerations", "affinity", "priorityClassName", "volumes"):
        assert name not in pod, name
    assert "--api-key-file" not in " ".join(pod["containers"][0]["args"])


def test_the_api_key_secret_is_mounted_and_passed_to_the_router() -> None:
    pod = router_pod({**PLATFORM, "signTransfers": True})
    [container] = pod["containers"]
    secret = {"secretName": "router-clients", "items": [{"key": "keys.txt", "path": "api-keys"}], "defaultMode": 0o444}
    assert {"name": "router-api-keys", "secret": secret} in pod["volumes"]
    # a directory mount, not a subPath: the kubelet updates the file when the Secret changes
    mount = {"name": "router-api-keys", "mountPath": "/var/run/kvbridge/router-api-keys", "readOnly": True}
    assert mount in container["volumeMounts"]
    assert all("subPath" not in m for m in container["volumeMounts"])
    assert len(container["volumeMounts"]) == 3  # and the transfer token's, and the replicas' key
    settings = router_cli.chosen(router_cli.build_parser().parse_args(container["args"]))
    assert settings.api_key_file == API_KEYS_FILE


def test_the_cold_timeout_reaches_the_router_only_when_set_apart_from_its_default() -> None:
    """spec.router.coldTimeoutSeconds: a pod's first call of a kind of request (docs/router.md, "A cold engine")."""
    for given, expected in (({}, 300.0), ({"coldTimeoutSeconds": 900}, 900.0)):
        [container] = router_pod({"enabled": True, **given})["containers"]
        assert ("--cold-timeout=900" in container["args"]) is bool(given)
        assert router_cli.chosen(router_cli.build_parser().parse_args(container["args"])).cold_timeout == expected


@pytest.mark.parametrize(
    ("router", "said"),
    [
        ({"apiKeySecret": {"name": "k"}}, "apiKeySecret authenticates clients of kvbridge's router"),
        ({"enabled": True, "tolerations": [{"operator": "Exists", "value": "x"}]}, "takes no value"),
        ({"enabled": True, "tolerations": [{"value": "x"}]}, "needs a key"),
        ({"enabled": True, "tolerations": [{"key": "k", "effect": "Sometimes"}]}, "effect"),
        ({"enabled": True, "priorityClassName": "Not_A_Name"}, "priorityClassName"),
        ({"enabled": True, "imagePullSecrets": ["regcred"]}, "imagePullSecrets"),
        ({"enabled": True, "apiKeySecret": {"name": "k", "key": "a/b"}}, "apiKeySecret.key"),
    ],
)
def test_a_bad_router_spec_names_its_field(router: dict[str, Any], said: str) -> None:
    with pytest.raises(SpecError, match=said) as caught:
        parse_deployment(document(router=router))
    assert caught.value.code == "INVALID_SPEC"
    assert caught.value.field.startswith("spec.router")


SPEC_SCHEMA = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


@pytest.mark.parametrize(
    ("router", "field_path"),
    [
        ({"apiKeySecret": {"name": "k"}}, ".router.apiKeySecret"),
        ({"enabled": True, "tolerations": [{"operator": "Exists", "value": "x"}]}, ".router.tolerations"),
        ({"enabled": True, "tolerations": [{"value": "x"}]}, ".router.tolerations"),
    ],
)
def test_the_api_server_refuses_what_the_operator_refuses(router: dict[str, Any], field_path: str) -> None:
    spec = apply_defaults(SPEC_SCHEMA, document(router=router)["spec"])
    assert [rule["fieldPath"] for rule in cel_failures(SPEC_RULES, spec)] == [field_path]


def test_the_api_server_takes_a_platform_teams_router() -> None:
    spec = apply_defaults(SPEC_SCHEMA, document(router=PLATFORM)["spec"])
    assert cel_failures(SPEC_RULES, spec) == []


def test_plan_shows_the_routers_clients_and_placement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for label, router in (("platform", PLATFORM), ("plain", {"enabled": True})):
        (tmp_path / f"{label}.yaml").write_text(yaml.safe_dump(document(router=router)))
    assert main(["plan", "-f", str(tmp_path / "platform.yaml")]) == 0
    out = capsys.readouterr().out
    clients = "router clients: only with an API key of Secret router-clients, key keys.txt (Authorization: Bearer;"
    assert clients in out
    placement = (
        "router pods: 2 replicas spread over nodes where possible, each telling the others every 0.05 s what it "
        "routes (Service llama3-8b-vllm-router-peers, reports signed with the key of the Secret of that name); "
        "placement: imagePullSecrets regcred; "
        "nodeSelector kubernetes.io/os=linux, pool=cpu; "
        "2 tolerations; affinity podAntiAffinity; priorityClassName serving-critical"
    )
    assert placement in out
    assert main(["plan", "-f", str(tmp_path / "plain.yaml")]) == 0
    out = capsys.readouterr().out
    assert "router clients: any client that reaches its Service (no apiKeySecret)" in out
    assert "router pods: 1 replica; placement: the cluster's defaults" in out
    assert main(["plan", "-f", str(tmp_path / "platform.yaml"), "--json"]) == 0
    [entry] = json.loads(capsys.readouterr().out)
    router = entry["router"]
    assert router["auth"] == {"apiKeys": True, "secret": "router-clients", "key": "keys.txt"}
    assert router["replicas"] == 2
    assert router["peers"] == "llama3-8b-vllm-router-peers"
    assert router["placement"]["priorityClassName"] == "serving-critical"
    assert router["placement"]["tolerations"][1] == {
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": 30,
    }
    assert main(["plan", "-f", str(tmp_path / "plain.yaml"), "--json"]) == 0
    [entry] = json.loads(capsys.readouterr().out)
    assert (entry["router"]["auth"], entry["router"]["placement"]) == ({"apiKeys": False}, {})
    assert "peers" not in entry["router"]


def test_two_or_more_routers_report_to_each_other_through_a_headless_service_with_the_token() -> None:
    objects = optional_children(parse_deployment(document(router=PLATFORM)), UID, OperatorConfig())
    peers = next(o for o in objects if o["metadata"]["name"] == "llama3-8b-vllm-router-peers")
    kubernetes_validate.validate(peers, "1.30", strict=True)
    service = next(o for o in objects if o["metadata"]["name"] == "llama3-8b-vllm-router" and o["kind"] == "Service")
    assert peers["spec"]["clusterIP"] == "None"
    assert peers["spec"]["publishNotReadyAddresses"] is True
    assert peers["spec"]["selector"] == service["spec"]["selector"]
    pod = router_pod(PLATFORM)
    [container] = pod["containers"]
    settings = router_cli.chosen(router_cli.build_parser().parse_args(container["args"]))
    assert settings.peers == "dns:llama3-8b-vllm-router-peers.team-a.svc:8000"
    assert settings.peer_key_file == "/var/run/kvbridge/router-peers/key"
    assert settings.transfer_token_file == ""
    # a key of its own, not the router token (which decode pods mount with signTransfers)
    volume = {"secretName": "llama3-8b-vllm-router-peers", "defaultMode": 0o444}
    assert {"name": "router-peers-key", "secret": volume} in pod["volumes"]
    assert "router-token" not in json.dumps(pod)
    assert settings.problems() == []
    assert settings.peer_interval == 0.05
    # more replicas report less often: each takes at most 60 reports a second
    many = router_pod({"enabled": True, "replicas": 16})["containers"][0]["args"]
    assert router_cli.chosen(router_cli.build_parser().parse_args(many)).peer_interval == 0.25
    # one replica: no peers, no Service, no token
    single = optional_children(parse_deployment(document(router={"enabled": True})), UID, OperatorConfig())
    assert not any(o["metadata"]["name"].endswith("-router-peers") for o in single)
    assert "--peers" not in " ".join(router_pod({"enabled": True})["containers"][0]["args"])
