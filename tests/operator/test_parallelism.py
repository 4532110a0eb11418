"""Data and expert parallelism (issue 37, single node): modelled in the verdict, the fingerprint, the pairing key
and ``kvbridge plan``, refused where impossible with a checked fix, rendered as vLLM runs it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge_agent.core import Problem, Role, TransferPlan
from kvbridge_agent.core.fingerprint import fingerprint
from kvbridge_agent.core.model import ModelGeometry
from kvbridge_operator.api.names import LABEL_DP, LABEL_DP_LOCAL, LABEL_TP
from kvbridge_operator.api.objects import with_fields
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children.objects.service import service
from kvbridge_operator.children.objects.workload import leader_worker_set, stateful_set
from kvbridge_operator.children.remedy import suggested_fix
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_operator.cli.main import main
from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.controller.observe import endpoints

ROOT = Path(__file__).parents[2]
WIDE_EP = ROOT / "examples" / "vllm" / "deepseek-v3-wide-ep.yaml"
UID = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"


def wide_ep() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(WIDE_EP.read_text())
    return loaded


def problems(doc: dict[str, Any]) -> list[Problem]:
    result = verdict_for(parse_deployment(doc))
    assert isinstance(result, list), "expected a refusal"
    return result


def codes(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p.code, p.field) for p in problems(doc)]


def engine(doc: dict[str, Any], role: Role) -> dict[str, Any]:
    dd = parse_deployment(doc)
    plan = verdict_for(dd)
    assert isinstance(plan, TransferPlan)
    sts = stateful_set(dd, UID, role, plan, OperatorConfig())
    [found] = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    return {**found, "labels": sts["spec"]["template"]["metadata"]["labels"]}


def fixed(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its suggested fix applied (the fix must exist)."""
    fix = suggested_fix(parse_deployment(doc))
    assert fix is not None
    return with_fields(doc, fix)


def test_the_wide_ep_example_is_planned_with_every_dp_rank_a_kv_peer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "-f", str(WIDE_EP), "--json"]) == 0
    [entry] = json.loads(capsys.readouterr().out)
    parallelism = entry["parallelism"]
    assert parallelism["prefill"] == {
        "dataParallelSize": 4,
        "tensorParallelSize": 2,
        "worldSize": 8,
        "expertParallel": True,
        "expertParallelSize": 8,
        "kvCaches": 4,
        "sideChannelPorts": [5600, 5601, 5602, 5603],
    }
    assert parallelism["decode"]["sideChannelPorts"] == list(range(5600, 5616))
    assert parallelism["prefillPeersPerEngine"] == 4
    assert parallelism["numExperts"] == 256
    assert any("MLA with DP attention" in words for words in parallelism["kv"])
    # TP inside a DP rank follows the pair rules: MLA prefill TP 2 -> decode TP 1 reads rank 0, notifies rank 1
    assert [read["prefillRank"] for read in entry["reads"]] == [0]
    assert entry["notifyOnlyRanks"] == [1]
    prefill = entry["vllm"]["prefill"]["command"]
    assert prefill[prefill.index("--data-parallel-size") + 1] == "4"
    assert prefill[prefill.index("--data-parallel-size-local") + 1] == "4"
    assert prefill[prefill.index("--data-parallel-address") + 1] == "127.0.0.1"
    assert prefill[prefill.index("--data-parallel-rpc-port") + 1] == "29550"
    assert "--enable-expert-parallel" in prefill
    assert prefill[-1] == "--all2all-backend=deepep_high_throughput"  # a role's argument: it moves no KV
    assert entry["vllm"]["decode"]["command"][-1] == "--all2all-backend=deepep_low_latency"
    assert main(["plan", "-f", str(WIDE_EP)]) == 0
    text = capsys.readouterr().out
    assert "prefill DP 4 x TP 2, EP / block 64 HND -> decode DP 16 x TP 1, EP" in text
    assert "side channels on 5600-5615" in text
    assert "each worker adds --headless --data-parallel-start-rank <worker index x 8>" in text


def test_a_pod_asks_dp_x_tp_gpus_and_opens_a_side_channel_per_dp_rank() -> None:
    prefill = engine(wide_ep(), Role.PREFILL)
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == "8"
    side = [(p["name"], p["containerPort"]) for p in prefill["ports"] if p["containerPort"] != 8000]
    assert side == [("side-channel", 5600), ("side-dp1", 5601), ("side-dp2", 5602), ("side-dp3", 5603)]
    assert all(len(name) <= 15 for name, _ in side)
    assert prefill["labels"][LABEL_DP] == "4"
    env = {e["name"]: e.get("value") for e in prefill["env"]}
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"  # vLLM adds the DP index itself
    assert (env["KVBRIDGE_PREFILL_DP_SIZE"], env["KVBRIDGE_DECODE_DP_SIZE"]) == ("4", "16")
    assert env["KVBRIDGE_NUM_EXPERTS"] == "256"
    dd = parse_deployment(wide_ep())
    ports = [p["port"] for p in service(dd, UID, Role.PREFILL, OperatorConfig())["spec"]["ports"]]
    assert ports == [8000, 5600, 5601, 5602, 5603]


def test_one_dp_rank_renders_what_it_rendered_before() -> None:
    doc = wide_ep()
    for role in ("prefill", "decode"):
        doc["spec"][role].update(dataParallelSize=1, expertParallel=False, nodes=1)
    container = engine(doc, Role.PREFILL)
    assert not any(arg.startswith(("--data-parallel", "--enable-expert")) for arg in container["args"])
    assert LABEL_DP not in container["labels"]
    assert not any(e["name"].endswith(("_DP_SIZE", "_EXPERT_PARALLEL")) for e in container["env"])


def test_dense_fingerprints_stay_and_experts_are_part_of_the_model() -> None:
    dense = ModelGeometry(name="meta-llama/Llama-3.1-8B", num_layers=32, num_kv_heads=8, head_dim=128)
    assert fingerprint(dense) == "03588fdb"  # without numExperts, as before it existed (protocol version 5)
    assert fingerprint(dense.model_copy(update={"num_experts": 64})) != fingerprint(dense)


def test_expert_parallelism_without_experts_is_refused_with_a_checked_fix() -> None:
    doc = wide_ep()
    del doc["spec"]["model"]["numExperts"]
    found = problems(doc)
    assert {(p.code, p.field) for p in found} == {
        ("EXPERT_PARALLEL_NEEDS_MOE", "spec.prefill.expertParallel"),
        ("EXPERT_PARALLEL_NEEDS_MOE", "spec.decode.expertParallel"),
    }
    assert "set spec.prefill.expertParallel: false" in found[0].message
    assert isinstance(verdict_for(parse_deployment(fixed(doc))), TransferPlan)


def test_fewer_experts_than_ranks_is_refused() -> None:
    doc = wide_ep()
    doc["spec"]["model"]["numExperts"] = 4
    found = problems(doc)
    by_field = {p.field: p for p in found}
    assert by_field["spec.prefill.dataParallelSize"].code == "EXPERTS_FEWER_THAN_RANKS"
    assert "set spec.prefill.dataParallelSize: 2" in by_field["spec.prefill.dataParallelSize"].message
    assert "set spec.decode.dataParallelSize: 4" in by_field["spec.decode.dataParallelSize"].message
    assert isinstance(verdict_for(parse_deployment(fixed(doc))), TransferPlan)


def test_dp_ranks_over_nodes_are_a_leader_worker_set_group_each_worker_from_its_first_rank() -> None:
    dd = parse_deployment(wide_ep())
    plan = verdict_for(dd)
    assert isinstance(plan, TransferPlan)
    lws = leader_worker_set(dd, UID, Role.DECODE, plan, OperatorConfig())
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    [leader] = [c for c in group["leaderTemplate"]["spec"]["containers"] if c["name"] == "engine"]
    [worker] = [c for c in group["workerTemplate"]["spec"]["containers"] if c["name"] == "engine"]
    for pod in (leader, worker):
        assert pod["resources"]["limits"]["nvidia.com/gpu"] == "8"  # 8 DP ranks x TP 1 per node
        assert pod["args"][pod["args"].index("--data-parallel-size") + 1] == "16"
        assert pod["args"][pod["args"].index("--data-parallel-size-local") + 1] == "8"
        assert pod["args"][pod["args"].index("--data-parallel-address") + 1] == "$(LWS_LEADER_ADDRESS)"
        assert "--nnodes" not in pod["args"]  # no TP group across the nodes: each holds whole DP ranks
    assert "--headless" not in leader["args"]
    assert [p["containerPort"] for p in leader["ports"] if p["name"].startswith("side")] == list(range(5600, 5608))
    assert worker["args"][-1] == "--headless"
    assert worker["command"][:3] == [
        "/bin/sh",
        "-c",
        'exec "$0" "$@" --data-parallel-start-rank "$((LWS_WORKER_INDEX * 8))"',
    ]
    assert worker["ports"] == []
    labels = group["leaderTemplate"]["metadata"]["labels"]
    assert (labels[LABEL_DP], labels[LABEL_DP_LOCAL]) == ("16", "8")


def test_dp_ranks_that_do_not_share_out_over_the_nodes_are_refused() -> None:
    doc = wide_ep()
    doc["spec"]["decode"]["nodes"] = 3
    assert ("DATA_PARALLEL_NODES_DO_NOT_DIVIDE", "spec.decode.nodes") in codes(doc)
    assert isinstance(verdict_for(parse_deployment(fixed(doc))), TransferPlan)


def test_dp_x_tp_beyond_a_node_is_refused_at_the_dp_size() -> None:
    doc = wide_ep()
    doc["spec"]["decode"]["dataParallelSize"] = 32
    [problem] = problems(doc)
    assert (problem.code, problem.field) == ("ROLE_DOES_NOT_FIT", "spec.decode.dataParallelSize")
    assert "needs 16 GPUs in one pod" in problem.message
    assert "set spec.decode.dataParallelSize: 16" in problem.message
    assert isinstance(verdict_for(parse_deployment(fixed(doc))), TransferPlan)


def test_dp_on_cpu_and_ep_on_the_synthetic_engine_are_refused() -> None:
    agent: dict[str, Any] = {
        "apiVersion": "kvbridge.io/v1alpha1",
        "kind": "DisaggregatedDeployment",
        "metadata": {"name": "agent"},
        "spec": {
            "engine": {"kind": "Synthetic"},
            "model": {"name": "m", "numLayers": 2, "numKVHeads": 2, "headDim": 64, "numExperts": 8},
            "prefill": {"dataParallelSize": 2},
            "decode": {"expertParallel": True},
        },
    }
    assert codes(agent) == [("EXPERT_PARALLEL_ON_SYNTHETIC", "spec.decode.expertParallel")]  # its DP ranks it runs
    assert isinstance(verdict_for(parse_deployment(fixed(agent))), TransferPlan)
    cpu = copy.deepcopy(agent)
    cpu["spec"]["engine"] = {"kind": "VLLM", "device": "CPU"}
    cpu["spec"]["prefill"]["blockSize"] = cpu["spec"]["decode"]["blockSize"] = 32
    assert codes(cpu) == [("DATA_PARALLEL_ON_CPU", "spec.prefill.dataParallelSize")]


def test_side_channel_ports_past_65535_are_refused() -> None:
    doc = wide_ep()
    doc["spec"]["transfer"]["sideChannelPort"] = 65530
    found = problems(doc)
    assert [(p.code, p.field) for p in found] == [("SIDE_CHANNEL_PORTS_OUT_OF_RANGE", "spec.transfer.sideChannelPort")]
    assert "set spec.transfer.sideChannelPort: 65520" in found[0].message  # the widest role's 16 ranks


def test_the_status_publishes_every_dp_rank_of_a_prefill_pod() -> None:
    def pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
        return {
            "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }

    [wide] = endpoints([pod("p-0", {LABEL_TP: "2", LABEL_DP: "2"})], 5600)
    assert wide.model_dump(by_alias=True, mode="json")["dataParallelRanks"] == [
        {"rank": 0, "port": 5600, "engineId": "p-0_dp0", "pod": "", "ip": ""},
        {"rank": 1, "port": 5601, "engineId": "p-0_dp1", "pod": "", "ip": ""},
    ]
    spread = {LABEL_TP: "1", LABEL_DP: "4", LABEL_DP_LOCAL: "2"}
    worker = pod("p-0-1", {LABEL_TP: "1"})
    worker["status"]["podIP"] = "10.0.0.2"
    [group] = endpoints([pod("p-0", spread)], 5600, workers=[worker])
    assert [(r.rank, r.port, r.engine_id, r.pod, r.ip) for r in group.data_parallel_ranks or []] == [
        (0, 5600, "p-0_dp0", "", ""),
        (1, 5601, "p-0_dp1", "", ""),
        (2, 5602, "p-0-1_dp2", "p-0-1", "10.0.0.2"),
        (3, 5603, "p-0-1_dp3", "p-0-1", "10.0.0.2"),
    ]
    [alone] = endpoints([pod("p-0", spread)], 5600)  # the worker not ready: its ranks are left out
    assert [r.rank for r in alone.data_parallel_ranks or []] == [0, 1]
    [nixl] = endpoints([pod("p-0", {LABEL_TP: "2", LABEL_DP: "2"})], 5600, named=False)
    assert [r.engine_id for r in nixl.data_parallel_ranks or []] == ["", ""]
    [narrow] = endpoints([pod("p-0", {LABEL_TP: "2"})], 5600)
    assert "dataParallelRanks" not in narrow.model_dump(by_alias=True, mode="json")
