"""Decode connects only to its deployment's prefill pods: the operator renders the prefill role's headless Service
into decode pods of kvbridge's transfer as ``KVBRIDGE_PREFILL_SERVICE`` (setting ``serviceDomain``), and that Service
publishes prefill pods before they are ready and while they drain (docs/protocol.md §5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvbridge_agent.core import SpecError
from kvbridge_agent.core.contract import parse_environment
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children.objects.desired import desired_children
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_operator.config import OperatorConfig

ROOT = Path(__file__).parents[2]
UID = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"


def children(example: str, config: OperatorConfig, namespace: str = "team-a") -> list[dict[str, Any]]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "examples" / f"{example}.yaml").read_text())
    document["metadata"]["namespace"] = namespace
    dd = parse_deployment(document)
    found = list(desired_children(dd, UID, verdict_for(dd), config))  # type: ignore[arg-type]
    for obj in found:
        kubernetes_validate.validate(obj, "1.30", strict=True)
    return found


def named(found: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    [obj] = [o for o in found if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    return obj


def engine_env(workload: dict[str, Any]) -> dict[str, str]:
    [engine] = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    return {e["name"]: e.get("value", "from-downward-api") for e in engine["env"]}


@pytest.mark.parametrize("example", ["synthetic/llama3-8b-hetero-tp", "vllm/small-cpu-kv-aware"])
def test_decode_pods_of_kvbridge_s_transfer_name_their_prefill_service_which_selects_the_prefill_pods(
    example: str,
) -> None:
    found = children(example, OperatorConfig())
    service = named(found, "Service", "-prefill")
    decode = engine_env(named(found, "StatefulSet", "-decode"))
    name = service["metadata"]["name"]
    assert decode["KVBRIDGE_PREFILL_SERVICE"] == f"{name}.team-a.svc"
    assert parse_environment(decode).prefill_service == f"{name}.team-a.svc"
    assert service["spec"]["clusterIP"] == "None"  # headless: its name resolves to the pods' own addresses
    assert service["spec"]["publishNotReadyAddresses"] is True  # a pod is known as it starts and while it drains
    prefill = named(found, "StatefulSet", "-prefill")
    labels = prefill["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()  # it selects the prefill pods ...
    decode_labels = named(found, "StatefulSet", "-decode")["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= decode_labels.items()  # ... and no decode pod
    assert prefill["spec"]["serviceName"] == name  # the pods' own names lie under it
    assert "KVBRIDGE_PREFILL_SERVICE" not in engine_env(prefill)
    assert named(found, "Service", "-decode")["spec"]["publishNotReadyAddresses"] is False


def test_the_service_domain_setting_names_it_fully_or_turns_it_off() -> None:
    example = "synthetic/llama3-8b-hetero-tp"
    full = engine_env(
        named(children(example, OperatorConfig(service_domain="svc.cluster.local")), "StatefulSet", "-decode")
    )
    assert full["KVBRIDGE_PREFILL_SERVICE"].endswith("-prefill.team-a.svc.cluster.local")
    off = engine_env(named(children(example, OperatorConfig(service_domain="")), "StatefulSet", "-decode"))
    assert "KVBRIDGE_PREFILL_SERVICE" not in off
    assert {k: v for k, v in full.items() if k != "KVBRIDGE_PREFILL_SERVICE"} == off
    assert OperatorConfig.from_env({"KVBRIDGE_OPERATOR_SERVICE_DOMAIN": ""}).service_domain == ""
    with pytest.raises(SpecError) as caught:
        OperatorConfig(service_domain="svc/cluster")
    assert caught.value.field == "KVBRIDGE_OPERATOR_SERVICE_DOMAIN"


def test_vllm_s_own_connector_is_not_told_what_it_does_not_read() -> None:
    """NixlConnector engines (the golden files' examples) move KV without kvbridge's side channel."""
    decode = engine_env(named(children("vllm/llama3-8b-hetero-tp", OperatorConfig()), "StatefulSet", "-decode"))
    assert "KVBRIDGE_PREFILL_SERVICE" not in decode
