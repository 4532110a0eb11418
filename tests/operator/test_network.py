"""spec.transfer.network: the data path's UCX settings, RDMA resources, IPC_LOCK, memlock and secondary networks —
checked before scheduling and rendered on the engine pods of both engine kinds and both connectors."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge_agent.core import Role
from kvbridge_agent.core.contract import pair_from_spec
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.children import network
from kvbridge_operator.children.objects.pod import pod_template
from kvbridge_operator.children.remedy import apply_fix, suggested_fix
from kvbridge_operator.children.templates import TEMPLATE_MANAGED_FIELD
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_operator.config import OperatorConfig

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "examples" / "vllm" / "deepseek-v3-h200.yaml"


def manifest(kind: str = "VLLM", connector: str = "Nixl", **network_fields: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvbridge.io/v1alpha1",
        "kind": "DisaggregatedDeployment",
        "metadata": {"name": "net"},
        "spec": {
            "engine": {"kind": kind, **({"connector": connector} if kind == "VLLM" else {})},
            "model": {"name": "m", "numLayers": 4, "numKVHeads": 8, "headDim": 128},
            "transfer": {"network": network_fields},
            "prefill": {"tensorParallelSize": 2},
            "decode": {"tensorParallelSize": 1},
        },
    }


def codes(document: dict[str, Any]) -> list[tuple[str, str]]:
    result = verdict_for(DisaggregatedDeployment.model_validate(document))
    return [(p.code, p.field) for p in result] if isinstance(result, list) else []


def test_transports_between_nodes_unknown_names_and_bad_resources() -> None:
    assert codes(manifest(ucxTransports=["rc", "cuda_copy", "cuda_ipc"], rdmaResources={"rdma/ib": 1})) == []
    assert codes(manifest(ucxTransports=["^cuda_ipc"])) == []  # exclusions only: UCX takes the rest
    assert codes(manifest(ucxTransports=["tcp", "infiniband"])) == [
        (network.UCX_TRANSPORT_UNKNOWN, "spec.transfer.network.ucxTransports[1]")
    ]
    assert codes(manifest(ucxTransports=["sm", "cuda_ipc"])) == [
        (network.UCX_TRANSPORTS_NODE_LOCAL, "spec.transfer.network.ucxTransports")
    ]
    one_node = manifest(ucxTransports=["sm", "cuda_ipc"])
    one_node["spec"]["placement"] = {"colocation": "Required", "topologyKey": "kubernetes.io/hostname"}
    assert codes(one_node) == []
    assert codes(manifest(rdmaResources={"rdma/ib": 0, "ib": 1})) == [
        (network.RDMA_RESOURCE_INVALID, "spec.transfer.network.rdmaResources.rdma/ib"),
        (network.RDMA_RESOURCE_INVALID, "spec.transfer.network.rdmaResources.ib"),
    ]


@pytest.mark.parametrize(
    ("transports", "fixed"),
    [(["sm", "cuda_ipc"], ["sm", "cuda_ipc", "tcp"]), (["rc", "infiniband"], ["rc"]), (["shmem"], [])],
)
def test_the_fix_is_checked_and_does_not_loop(transports: list[str], fixed: list[str]) -> None:
    document = manifest(ucxTransports=transports)
    fix = suggested_fix(DisaggregatedDeployment.model_validate(document))
    assert fix == {"spec.transfer.network.ucxTransports": fixed}
    assert codes(apply_fix(document, fix)) == []


def container_and_template(document: dict[str, Any], role: Role = Role.DECODE) -> tuple[dict[str, Any], dict[str, Any]]:
    dd = DisaggregatedDeployment.model_validate(document)
    plan = verdict_for(dd)
    assert not isinstance(plan, list), plan
    template = pod_template(dd, role, plan, OperatorConfig())
    return next(c for c in template["spec"]["containers"] if c["name"] == "engine"), template


@pytest.mark.parametrize(("kind", "connector"), [("VLLM", "Nixl"), ("VLLM", "KVBridge"), ("Synthetic", "")])
def test_rendered_on_the_engine_container_of_every_engine(kind: str, connector: str) -> None:
    document = manifest(
        kind,
        connector or "Nixl",
        ucxTransports=["rc", "cuda_copy"],
        ucxDevices=["mlx5_0:1"],
        rdmaResources={"rdma/ib": 2},
        ipcLock=True,
        memlock="Required",
        secondaryNetworks=["rdma/ib-net", "storage"],
    )
    if kind == "VLLM" and connector == "KVBridge":
        document["spec"]["engine"]["device"] = "CPU"  # the KVBridge connector runs vLLM's CPU build (GPU: refused)
        document["spec"]["prefill"]["tensorParallelSize"] = 1
        document["spec"]["prefill"]["blockSize"] = document["spec"]["decode"]["blockSize"] = 32
        document["spec"]["transfer"]["network"]["ucxTransports"] = ["tcp", "sm"]
    container, template = container_and_template(document)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["UCX_TLS"] == ",".join(document["spec"]["transfer"]["network"]["ucxTransports"])
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1"
    assert container["resources"]["requests"]["rdma/ib"] == "2"
    assert container["resources"]["limits"]["rdma/ib"] == "2"
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    assert container["command"][:2] == ["/bin/sh", "-c"]
    assert template["metadata"]["annotations"][network.NETWORKS_ANNOTATION] == "rdma/ib-net,storage"
    plain, _ = container_and_template(
        manifest(kind, connector or "Nixl")
        if connector != "KVBridge"
        else {**document, "spec": {**document["spec"], "transfer": {}}}
    )
    assert "UCX_TLS" not in {e["name"] for e in plain["env"]}
    assert plain["command"][:2] != ["/bin/sh", "-c"]


def test_the_memlock_check_refuses_a_limited_container_and_runs_an_unlimited_one(tmp_path: Path) -> None:
    container, _ = container_and_template(manifest(memlock="Required"))
    wrapper = container["command"][: container["command"].index("vllm")]
    limited = subprocess.run(
        ["prlimit", "--memlock=65536:65536", *wrapper, "echo", "started"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert limited.returncode == 78
    assert "locked-memory hard limit is 64 KiB" in limited.stderr
    assert "memlock: Unchecked" in limited.stderr
    assert "started" not in limited.stdout
    unlimited = subprocess.run(
        ["prlimit", "--memlock=unlimited:unlimited", *wrapper, "sh", "-c", "ulimit -l; echo $0", "started"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if unlimited.returncode != 0 and "Operation not permitted" in unlimited.stderr:
        pytest.skip("this machine may not raise the locked-memory hard limit")
    assert unlimited.stdout.split() == ["unlimited", "started"], unlimited


def test_a_template_cannot_set_ucx_variables_behind_the_check() -> None:
    document = manifest(ucxTransports=["rc"])
    document["spec"]["decode"]["template"] = {
        "spec": {"containers": [{"name": "engine", "env": [{"name": "UCX_TLS", "value": "sm"}]}]}
    }
    assert (TEMPLATE_MANAGED_FIELD, "spec.decode.template.spec.containers[0].env[0]") in codes(document)


def test_the_example_renders_and_the_agent_reads_a_manifest_with_a_network() -> None:
    document = yaml.safe_load(H200.read_text())
    assert codes(document) == []
    pair = pair_from_spec(copy.deepcopy(document["spec"]))  # the agent's own reading ignores the pods' network
    assert pair.transfer.side_channel_port == 5600
