"""What the user writes is what runs, for nulls and odd values too (issue 34, item 4): every odd value is refused
with its field, by ``kvbridge plan`` and by the operator alike (the same validation), or merged so that what
kvbridge manages stays; never a traceback, never a 'compatible' verdict over a pod that lost what was checked."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge_agent.core import Role, SpecError
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.cli.main import main
from kvbridge_operator.config import OperatorConfig
from kvbridge_operator.controller.actions import Event, Post, WriteStatus
from kvbridge_operator.controller.plan import Children, Observed, plan
from kvbridge_operator.kube import DEPLOYMENTS

ROOT = Path(__file__).resolve().parents[2]
VLLM = ROOT / "examples" / "vllm" / "llama3-8b-hetero-tp.yaml"
NOW = "2025-01-01T00:00:00Z"


def document(path: Path = VLLM) -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load(path.read_text())
    return found


def nested(depth: int) -> dict[str, Any]:
    """``{"a": {"a": ...}}`` ``depth`` maps deep, built without recursion."""
    root: dict[str, Any] = {}
    current = root
    for _ in range(depth - 1):
        current["a"] = {}
        current = current["a"]
    return root


def planned(doc: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, Any, str]:
    """``kvbridge plan -f FILE --json``: the exit status, the JSON entries and stderr (JSON text: no YAML
    emitter recursion on deep documents)."""
    path = tmp_path / "dd.json"
    path.write_text(json.dumps(doc))
    code = main(["plan", "-f", str(path), "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out else None, err


def reconciled(doc: dict[str, Any]) -> tuple[dict[str, Any], list[Event], bool]:
    """The operator's pure reconcile of ``doc`` as the API server would hand it over: the deployment's status it
    writes, its events and whether it applies children."""
    meta = {**doc["metadata"], "namespace": "default", "uid": "00000000-0000-0000-0000-0000000000cc", "generation": 1}
    body = {**doc, "metadata": meta}  # not copied deeply: the body may nest deeper than copy.deepcopy recurses
    children = Children(dict.fromkeys(Role), dict.fromkeys(Role), [])
    result = plan(Observed(body, children, OperatorConfig(), True, NOW))
    [status] = [a.status for a in result.actions if isinstance(a, WriteStatus) and a.resource == DEPLOYMENTS]
    events = [a.event for a in result.actions if isinstance(a, Post)]
    return status, events, result.applied


def condition(status: dict[str, Any], kind: str = "Compatible") -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in status["conditions"] if c["type"] == kind)
    return found


# --- a template nested deeper than any manifest needs ------------------------------------------------------------


def test_a_template_nested_3000_deep_is_refused_with_its_field_before_any_recursion() -> None:
    doc = document()
    doc["spec"]["decode"]["template"] = {"metadata": {"annotations": nested(3000)}}
    with pytest.raises(SpecError) as raised:
        parse_deployment(doc)
    assert raised.value.code == "NESTING_TOO_DEEP"
    assert raised.value.field.startswith("spec.decode.template.metadata.annotations.a.a")
    assert "64" in raised.value.message


def test_the_operator_reports_a_deep_template_in_the_status_without_crashing() -> None:
    doc = document()
    doc["spec"]["prefill"]["template"] = {"spec": {"nodeSelector": nested(3000)}}
    status, events, applied = reconciled(doc)
    assert not applied
    compatible = condition(status)
    assert (compatible["status"], compatible["reason"]) == ("False", "InvalidSpec")
    assert compatible["message"].startswith("spec.prefill.template.spec.nodeSelector.a.a")
    assert [(e.type, e.reason) for e in events] == [("Warning", "InvalidSpec")]


def test_kvbridge_plan_refuses_a_deep_json_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "deep.json"
    doc = document()
    doc["spec"]["decode"]["template"] = {"spec": {"tolerations": [nested(80)]}}
    path.write_text(json.dumps(doc))
    code = main(["plan", "-f", str(path), "--json"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "Traceback" not in err
    [entry] = json.loads(out)
    assert entry["invalid"] is True
    assert entry["problems"][0]["code"] == "BAD_YAML"  # the reader's own bound (64 levels), at its line


def test_a_spec_within_the_bound_parses() -> None:
    doc = document()
    doc["spec"]["decode"]["template"] = {"metadata": {"annotations": {"a": "b"}}, "spec": {"affinity": nested(40)}}
    parse_deployment(doc)


def test_an_unexpected_error_in_the_checks_is_reported_in_the_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reconcile is pure up to the API calls: an exception there is a bug in kvbridge, which no retry mends;
    it is reported in the status and an event (and logged), and nothing that runs changes."""

    def broken(*_: object, **__: object) -> None:
        raise TypeError("'NoneType' object does not support item assignment")

    monkeypatch.setattr("kvbridge_operator.controller.plan.verdict_for", broken)
    status, events, applied = reconciled(document())
    assert not applied
    compatible = condition(status)
    assert (compatible["status"], compatible["reason"]) == ("False", "CheckFailed")
    assert "TypeError: 'NoneType' object does not support item assignment" in compatible["message"]
    assert "report" in compatible["message"]
    assert condition(status, "Ready")["reason"] == "CheckFailed"
    assert [(e.type, e.reason) for e in events] == [("Warning", "CheckFailed")]


def test_the_operator_process_decodes_any_object_the_api_server_stores() -> None:
    """The API server stores JSON up to 10,000 levels deep; Python's JSON decoder (Kopf's watches, the API client)
    recurses once per level. The operator's process allows that depth, so such an object reaches the typed
    refusal instead of ending Kopf's watch of every deployment with RecursionError."""
    import sys

    from kvbridge_operator.controller.handlers import allow_api_depth

    limit = sys.getrecursionlimit()
    try:
        allow_api_depth()
        doc = document()
        doc["spec"]["decode"]["template"] = {"spec": {"nodeSelector": "DEEP"}}
        event = json.dumps({"type": "ADDED", "object": doc}).replace('"DEEP"', '{"a":' * 9990 + "1" + "}" * 9990)
        body = json.loads(event)["object"]
        status, _, applied = reconciled(body)
    finally:
        sys.setrecursionlimit(limit)
    assert not applied
    assert condition(status)["reason"] == "InvalidSpec"
    assert condition(status)["message"].startswith("spec.decode.template.spec.nodeSelector.a.a")


async def test_a_deep_deployment_is_refused_in_its_status_and_the_others_keep_being_served() -> None:
    import aiohttp

    from kvbridge_sim.cluster import cluster

    async with cluster() as c:
        first = document()
        await c.apply(first)  # the operator runs (and has set its process up) once this one is reconciled
        name = first["metadata"]["name"]
        await c.wait(lambda: c.condition(name, "Compatible").get("status") == "True", what="first Compatible")
        deep = document()
        deep["metadata"]["name"] = "deep"
        deep["spec"]["decode"]["template"] = {"spec": {"nodeSelector": "DEEP"}}
        text = json.dumps(deep).replace('"DEEP"', '{"a":' * 3000 + '"b"' + "}" * 3000)
        url = f"{c.url}/apis/kvbridge.io/v1alpha1/namespaces/default/disaggregateddeployments"
        headers = {"Content-Type": "application/json"}
        async with aiohttp.ClientSession() as session, session.post(url, data=text, headers=headers) as response:
            assert response.status in (200, 201), await response.text()
        await c.wait(lambda: c.condition("deep", "Compatible").get("reason") == "InvalidSpec", what="deep refused")
        assert "nests deeper than 64 levels" in c.condition("deep", "Compatible")["message"]
        later = document()
        later["metadata"]["name"] = "later"
        await c.apply(later)
        await c.wait(lambda: c.condition("later", "Compatible").get("status") == "True", what="later Compatible")
        assert c.operator is not None
        assert not c.operator.done()


# --- comma-joined network fields: items of a sane alphabet and length, a bounded count ---------------------------

#: (field under spec.transfer, value, the item's index refused); each list is joined with commas into one setting
#: (UCX_TLS, UCX_NET_DEVICES, the Multus annotation, KVBRIDGE_BACKENDS), where a comma inside an item makes two
BAD_ITEMS: list[tuple[str, list[str], int]] = [
    ("network.ucxTransports", ["rc,tcp"], 0),
    ("network.ucxTransports", ["tcp", "tcp\x00"], 1),
    ("network.ucxTransports", ["x" * 100_000], 0),
    ("network.ucxTransports", ["rc\ntcp"], 0),
    ("network.ucxTransports", [""], 0),
    ("network.ucxDevices", ["mlx5_0:1,mlx5_1:1"], 0),
    ("network.ucxDevices", ["mlx5_0:1", "eth0 "], 1),
    ("network.secondaryNetworks", ["rdma/net-a,other"], 0),
    ("network.secondaryNetworks", ["ns/x\x01"], 0),
    ("network.secondaryNetworks", ["a" * 100_000], 0),
    ("network.secondaryNetworks", ['[{"name": "x"}]'], 0),
    ("backends", ["UCX,GDS"], 0),
    ("backends", ["UCX", "GDS\x00"], 1),
    ("backends", ["U" * 100_000], 0),
]
GOOD_ITEMS: list[tuple[str, list[str]]] = [
    ("network.ucxTransports", ["rc", "^ud", "cuda_copy", "rc_x", "tcp"]),
    ("network.ucxDevices", ["mlx5_0:1", "mlx5_bond_0:1", "eth0", "bond0.100"]),
    ("network.secondaryNetworks", ["rdma-net", "kube-system/sriov-a@net1", "team-a/net.b"]),
    ("backends", ["UCX", "GDS_MT", "LIBFABRIC"]),
]


def with_transfer(path: str, value: Any) -> dict[str, Any]:
    doc = document()
    where = doc["spec"].setdefault("transfer", {})
    *parents, last = path.split(".")
    for part in parents:
        where = where.setdefault(part, {})
    where[last] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "index"), BAD_ITEMS, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD_ITEMS)]
)
def test_an_odd_item_of_a_joined_network_field_is_refused_with_its_field(
    path: str, value: list[str], index: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    field = f"spec.transfer.{path}.{index}"
    doc = with_transfer(path, value)
    with pytest.raises(SpecError) as raised:
        parse_deployment(doc)
    assert (raised.value.code, raised.value.field) == ("INVALID_SPEC", field)
    assert len(raised.value.message) < 1000  # a 100,000-character value is not echoed back
    code, entries, err = planned(doc, tmp_path, capsys)
    assert code == 2
    assert "Traceback" not in err
    assert entries[0]["problems"][0]["field"] == field
    status, _, applied = reconciled(doc)
    assert not applied
    assert condition(status)["reason"] == "InvalidSpec"
    assert condition(status)["message"].startswith(f"{field}: ")


@pytest.mark.parametrize(("path", "value"), GOOD_ITEMS, ids=[p for p, _ in GOOD_ITEMS])
def test_the_names_these_fields_take_are_accepted(path: str, value: list[str]) -> None:
    parse_deployment(with_transfer(path, value))


def test_the_crd_bounds_each_item_as_the_model_does() -> None:
    """The API server refuses the same items (the CRD is generated from the model): a pattern and a length per
    item, and a count per list."""
    from kvbridge_operator.api.crd import crd

    transfer = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    transfer = transfer["transfer"]["properties"]
    network = transfer["network"]["properties"]
    for schema in (network["ucxTransports"], network["ucxDevices"], network["secondaryNetworks"], transfer["backends"]):
        assert schema["maxItems"] <= 64
        assert {"pattern", "maxLength", "minLength"} <= set(schema["items"])
        assert re.fullmatch(schema["items"]["pattern"], "rc,tcp") is None


# --- GPUs through spec.transfer.network.rdmaResources ----------------------------------------------------------


@pytest.mark.parametrize("name", ["nvidia.com/gpu", "amd.com/gpu", "nvidia.com/mig-1g.10gb", "gpu.intel.com/i915"])
def test_rdma_resources_may_not_ask_for_gpus(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GPUs are what the ranks take (tensorParallelSize / nodes, checked against the node's GPUs); asked here they
    went around that check (the rendered requests and limits said 8 where the plan said 1 or 2)."""
    doc = with_transfer("network.rdmaResources", {"rdma/ib": 1, name: 8})
    field = f"spec.transfer.network.rdmaResources.{name}"
    code, entries, err = planned(doc, tmp_path, capsys)
    assert code == 1, err
    assert [(p["code"], p["field"]) for p in entries[0]["problems"]] == [("RDMA_RESOURCE_GPU", field)]
    message = entries[0]["problems"][0]["message"]
    assert "tensorParallelSize" in message
    assert "remove" in message
    status, _, applied = reconciled(doc)
    assert not applied
    assert condition(status)["reason"] == "Incompatible"
    assert f"RDMA_RESOURCE_GPU at {field}" in condition(status)["message"]


def test_rdma_resources_of_a_nic_are_still_rendered() -> None:
    from kvbridge_operator.children.render import pod_template
    from kvbridge_operator.children.verdict import verdict_for

    dd = parse_deployment(with_transfer("network.rdmaResources", {"rdma/ib": 1, "nvidia.com/hostdev": 2}))
    verdict = verdict_for(dd)
    assert not isinstance(verdict, list), verdict
    engine = pod_template(dd, Role.DECODE, verdict, OperatorConfig())["spec"]["containers"][0]
    assert engine["resources"]["limits"] == {"nvidia.com/gpu": "1", "rdma/ib": "1", "nvidia.com/hostdev": "2"}
