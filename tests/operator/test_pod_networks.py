"""The operator's ``podNetworks``: rendered into decode pods (both engine kinds that run kvbridge's side channel) as
``KVBRIDGE_PREFILL_HOSTS``, where decode admits only prefill hosts in them; prefill pods, and every pod without the
setting, keep their environment (and their template revision)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvbridge_agent.core import Role, SpecError
from kvbridge_agent.core.admission import PrefillHosts
from kvbridge_agent.core.contract import parse_environment
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children.objects.workload import stateful_set
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_operator.config import OperatorConfig

ROOT = Path(__file__).parents[2]
UID = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
NETWORKS = ("10.244.0.0/16", "fd00:10:244::/56")


def engine_env(example: str, role: Role, config: OperatorConfig) -> dict[str, str]:
    path = ROOT / "examples" / f"{example}.yaml"
    if not path.exists():  # the synthetic engine's examples, before they had a folder of their own
        path = ROOT / "examples" / f"{example.removeprefix('synthetic/')}.yaml"
    document: dict[str, Any] = yaml.safe_load(path.read_text())
    dd = parse_deployment(document)
    sts = stateful_set(dd, UID, role, verdict_for(dd), config)  # type: ignore[arg-type]
    kubernetes_validate.validate(sts, "1.30", strict=True)
    template = sts["spec"]["template"]
    engine = next(c for c in template["spec"]["containers"] if c["name"] == "engine")
    # what the pod sees: the downward API's pod name and IP filled in
    return {e["name"]: e.get("value", "p-0" if "ENGINE_ID" in e["name"] else "10.244.1.7") for e in engine["env"]}


@pytest.mark.parametrize(
    "example", ["synthetic/llama3-8b-hetero-tp", "vllm/small-cpu-kv-aware"]
)  # synthetic; vLLM + KVBridge
def test_decode_pods_are_told_the_pod_networks_prefill_pods_are_not(example: str) -> None:
    config = OperatorConfig(pod_networks=NETWORKS)
    decode = engine_env(example, Role.DECODE, config)
    assert decode["KVBRIDGE_PREFILL_HOSTS"] == "10.244.0.0/16,fd00:10:244::/56"
    hosts = PrefillHosts(parse_environment(decode).prefill_hosts or ())
    prefill = engine_env(example, Role.PREFILL, config)
    assert "KVBRIDGE_PREFILL_HOSTS" not in prefill
    assert hosts.admits(prefill["KVBRIDGE_SIDE_CHANNEL_HOST"])  # what prefill advertises: its pod IP
    assert not hosts.admits("169.254.169.254")
    unset = engine_env(example, Role.DECODE, OperatorConfig())
    assert "KVBRIDGE_PREFILL_HOSTS" not in unset  # the default renders nothing: templates unchanged
    assert {k: v for k, v in decode.items() if k != "KVBRIDGE_PREFILL_HOSTS"} == unset


@pytest.mark.parametrize("network", ["pods.example", "10.0.0.0/33", ""])
def test_a_pod_network_that_is_not_a_range_stops_the_operator(network: str) -> None:
    with pytest.raises(SpecError) as caught:
        OperatorConfig.from_env({"KVBRIDGE_OPERATOR_POD_NETWORKS": f"10.0.0.0/8,{network}x"})
    assert caught.value.field == "KVBRIDGE_OPERATOR_POD_NETWORKS"
    assert OperatorConfig.from_env({"KVBRIDGE_OPERATOR_POD_NETWORKS": "10.0.0.0/8, fd00::/8"}).pod_networks == (
        "10.0.0.0/8",
        "fd00::/8",
    )
