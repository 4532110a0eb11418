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
from kvbridge_operator.controller.decide import ExistingChildren, Observed, decide
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
    children = ExistingChildren(dict.fromkeys(Role), dict.fromkeys(Role), [])
    result = decide(Observed(body, children, OperatorConfig(), True, NOW))
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

    monkeypatch.setattr("kvbridge_operator.controller.decide.verdict_for", broken)
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
    from kvbridge_operator.children.objects.pod import pod_template
    from kvbridge_operator.children.verdict import verdict_for

    dd = parse_deployment(with_transfer("network.rdmaResources", {"rdma/ib": 1, "nvidia.com/hostdev": 2}))
    verdict = verdict_for(dd)
    assert not isinstance(verdict, list), verdict
    engine = pod_template(dd, Role.DECODE, verdict, OperatorConfig())["spec"]["containers"][0]
    assert engine["resources"]["limits"] == {"nvidia.com/gpu": "1", "rdma/ib": "1", "nvidia.com/hostdev": "2"}


# --- role template overlays: nulls, empty and odd items over what kvbridge manages --------------------------------

ENGINE = "spec.decode.template.spec.containers[0]"


def engine_overlay(**fields: Any) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "engine", **fields}]}}


#: (what, overlay, code, field): each refused by plan and the operator alike, naming the overlay's field
TEMPLATE_REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("env null", engine_overlay(env=None), "TEMPLATE_NULL", f"{ENGINE}.env"),
    ("resources null", engine_overlay(resources=None), "TEMPLATE_NULL", f"{ENGINE}.resources"),
    ("ports null", engine_overlay(ports=None), "TEMPLATE_NULL", f"{ENGINE}.ports"),
    ("volumeMounts null", engine_overlay(volumeMounts=None), "TEMPLATE_NULL", f"{ENGINE}.volumeMounts"),
    ("limits null", engine_overlay(resources={"limits": None}), "TEMPLATE_NULL", f"{ENGINE}.resources.limits"),
    (
        "the GPUs null",
        engine_overlay(resources={"requests": {"nvidia.com/gpu": None}}),
        "TEMPLATE_NULL",
        f"{ENGINE}.resources.requests.nvidia.com/gpu",
    ),
    ("labels null", {"metadata": {"labels": None}}, "TEMPLATE_NULL", "spec.decode.template.metadata.labels"),
    (
        "annotations null",
        {"metadata": {"annotations": None}},
        "TEMPLATE_NULL",
        "spec.decode.template.metadata.annotations",
    ),
    ("metadata null", {"metadata": None}, "TEMPLATE_NULL", "spec.decode.template.metadata"),
    ("spec null", {"spec": None}, "TEMPLATE_NULL", "spec.decode.template.spec"),
    ("containers null", {"spec": {"containers": None}}, "TEMPLATE_NULL", "spec.decode.template.spec.containers"),
    ("volumes null", {"spec": {"volumes": None}}, "TEMPLATE_NULL", "spec.decode.template.spec.volumes"),
    ("a name-less env item", engine_overlay(env=[{"value": "x"}]), "TEMPLATE_INVALID", f"{ENGINE}.env[0]"),
    ("an empty env name", engine_overlay(env=[{"name": "", "value": "x"}]), "TEMPLATE_INVALID", f"{ENGINE}.env[0]"),
    (
        "a null env item",
        engine_overlay(env=[{"name": "A", "value": "1"}, None]),
        "TEMPLATE_INVALID",
        f"{ENGINE}.env[1]",
    ),
    (
        "an env value not a string",
        engine_overlay(env=[{"name": "NCCL_DEBUG", "value": 1}]),
        "TEMPLATE_INVALID",
        f"{ENGINE}.env[0]",
    ),
    (
        "a variable twice",
        engine_overlay(env=[{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
        "TEMPLATE_INVALID",
        f"{ENGINE}.env[1]",
    ),
    ("env not a list", engine_overlay(env="NCCL_DEBUG=INFO"), "TEMPLATE_INVALID", f"{ENGINE}.env"),
    (
        "a port without its number",
        engine_overlay(ports=[{"name": "metrics"}]),
        "TEMPLATE_INVALID",
        f"{ENGINE}.ports[0]",
    ),
    (
        "a port number twice",
        engine_overlay(ports=[{"containerPort": 9090}, {"containerPort": 9090, "name": "m"}]),
        "TEMPLATE_INVALID",
        f"{ENGINE}.ports[1]",
    ),
    (
        "a port on kvbridge's HTTP port",
        engine_overlay(ports=[{"name": "metrics", "containerPort": 8000}]),
        "TEMPLATE_MANAGED_FIELD",
        f"{ENGINE}.ports[0]",
    ),
    (
        "a port on the side channel's",
        engine_overlay(ports=[{"containerPort": 5600, "protocol": "UDP"}]),
        "TEMPLATE_MANAGED_FIELD",
        f"{ENGINE}.ports[0]",
    ),
    ("resources not a map", engine_overlay(resources=["gpu"]), "TEMPLATE_INVALID", f"{ENGINE}.resources"),
    (
        "a mount without its path",
        engine_overlay(volumeMounts=[{"name": "x"}]),
        "TEMPLATE_INVALID",
        f"{ENGINE}.volumeMounts[0]",
    ),
    (
        "a mount over kvbridge's",
        engine_overlay(volumeMounts=[{"name": "mine", "mountPath": "/dev/shm"}]),
        "TEMPLATE_MANAGED_FIELD",
        f"{ENGINE}.volumeMounts[0]",
    ),
    (
        "a volume without a name",
        {"spec": {"volumes": [{"emptyDir": {}}]}},
        "TEMPLATE_INVALID",
        "spec.decode.template.spec.volumes[0]",
    ),
    (
        "kvbridge's volume replaced",
        {"spec": {"volumes": [{"name": "dshm", "hostPath": {"path": "/"}}]}},
        "TEMPLATE_MANAGED_FIELD",
        "spec.decode.template.spec.volumes[0]",
    ),
    ("a null container", {"spec": {"containers": [None]}}, "TEMPLATE_INVALID", "spec.decode.template.spec.containers"),
    (
        "the engine twice",
        {"spec": {"containers": [{"name": "engine"}, {"name": "engine", "image": "x"}]}},
        "TEMPLATE_INVALID",
        "spec.decode.template.spec.containers[1]",
    ),
    ("metadata not a map", {"metadata": ["labels"]}, "TEMPLATE_INVALID", "spec.decode.template.metadata"),
    ("spec not a map", {"spec": "nodeSelector"}, "TEMPLATE_INVALID", "spec.decode.template.spec"),
    (
        "a label not a string",
        {"metadata": {"labels": {"team": None}}},
        "TEMPLATE_INVALID",
        "spec.decode.template.metadata.labels.team",
    ),
    (
        "Multus' annotation",
        {"metadata": {"annotations": {"k8s.v1.cni.cncf.io/networks": "mine"}}},
        "TEMPLATE_MANAGED_FIELD",
        "spec.decode.template.metadata.annotations.k8s.v1.cni.cncf.io/networks",
    ),
]


@pytest.mark.parametrize(("what", "template", "code", "field"), TEMPLATE_REFUSED, ids=[r[0] for r in TEMPLATE_REFUSED])
def test_a_template_that_would_drop_or_garble_what_kvbridge_manages_is_refused(
    what: str, template: dict[str, Any], code: str, field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = document()
    doc["spec"]["decode"]["template"] = template
    exit_code, entries, err = planned(doc, tmp_path, capsys)
    assert "Traceback" not in err, what
    assert exit_code == 1, (what, err)
    found = [(p["code"], p["field"]) for p in entries[0]["problems"]]
    assert (code, field) in found, found
    message = next(p["message"] for p in entries[0]["problems"] if p["field"] == field)
    assert any(word in message for word in ("remove", "write", "leave")), message  # says what to do instead
    status, _, applied = reconciled(doc)
    assert not applied
    assert condition(status)["reason"] == "Incompatible", condition(status)
    assert f"{code} at {field}" in condition(status)["message"]


def test_the_template_may_not_drop_the_ipc_lock_capability_the_network_asks() -> None:
    doc = with_transfer("network.ipcLock", True)
    doc["spec"]["decode"]["template"] = engine_overlay(securityContext={"capabilities": {"add": ["SYS_PTRACE"]}})
    status, _, applied = reconciled(doc)
    assert not applied
    assert f"TEMPLATE_MANAGED_FIELD at {ENGINE}.securityContext.capabilities.add" in condition(status)["message"]


def test_the_template_may_not_change_the_rdma_resources_the_network_asks() -> None:
    doc = with_transfer("network.rdmaResources", {"rdma/ib": 1})
    doc["spec"]["decode"]["template"] = engine_overlay(resources={"limits": {"rdma/ib": 4}})
    status, _, applied = reconciled(doc)
    assert not applied
    assert f"TEMPLATE_MANAGED_FIELD at {ENGINE}.resources.limits.rdma/ib" in condition(status)["message"]


#: overlays that keep everything kvbridge manages: merged, and the pod has it all
TEMPLATE_MERGED: dict[str, dict[str, Any]] = {
    "no env added": engine_overlay(env=[]),
    "no ports added": engine_overlay(ports=[]),
    "no mounts added": engine_overlay(volumeMounts=[]),
    "no resources changed": engine_overlay(resources={}),
    "no limits changed": engine_overlay(resources={"limits": {}}),
    "no containers": {"spec": {"containers": []}},
    "no volumes added": {"spec": {"volumes": []}},
    "no labels added": {"metadata": {"labels": {}}},
    "no annotations added": {"metadata": {"annotations": {}}},
    "an empty template": {},
    "an empty pod spec": {"spec": {}},
    "a node selector of none": {"spec": {"nodeSelector": None}},
    "the liveness probe removed": engine_overlay(livenessProbe=None),
    "a metrics port": engine_overlay(ports=[{"name": "metrics", "containerPort": 9090}]),
    "a variable with an empty value": engine_overlay(env=[{"name": "A", "value": ""}, {"name": "B", "value": None}]),
    "a volume and its mount": {
        "spec": {
            "volumes": [{"name": "scratch", "emptyDir": {}}],
            "containers": [{"name": "engine", "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}],
        }
    },
}


@pytest.mark.parametrize("what", sorted(TEMPLATE_MERGED))
def test_a_template_that_keeps_what_kvbridge_manages_is_merged_with_all_of_it(what: str) -> None:
    from kvbridge_operator.children.objects.pod import pod_template
    from kvbridge_operator.children.verdict import verdict_for

    plain = parse_deployment(document())
    doc = document()
    doc["spec"]["decode"]["template"] = TEMPLATE_MERGED[what]
    dd = parse_deployment(doc)
    verdict = verdict_for(dd)
    assert not isinstance(verdict, list), verdict
    before = pod_template(plain, Role.DECODE, verdict, OperatorConfig())
    after = pod_template(dd, Role.DECODE, verdict, OperatorConfig())
    old, new = (t["spec"]["containers"][0] for t in (before, after))
    for field in ("command", "args", "env", "volumeMounts"):
        assert [x for x in new[field] if x in old[field]] == old[field], field  # every item, once, unchanged
    assert [p for p in new["ports"] if p in old["ports"]] == old["ports"]
    assert new["resources"]["limits"]["nvidia.com/gpu"] == old["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert [v for v in after["spec"]["volumes"] if v in before["spec"]["volumes"]] == before["spec"]["volumes"]
    labels = {k: v for k, v in before["metadata"]["labels"].items() if k != "kvbridge.io/revision"}
    assert labels.items() <= after["metadata"]["labels"].items()


def test_thousands_of_odd_items_are_summed_up_in_the_status_not_refused_for_its_length() -> None:
    """A condition's message may hold 32,768 characters: 2,000 problems are listed as far as 8,192 characters go."""
    doc = document()
    doc["spec"]["decode"]["template"] = engine_overlay(env=[{"value": "x"}] * 2000)
    status, events, applied = reconciled(doc)
    assert not applied
    compatible = condition(status)
    assert compatible["reason"] == "Incompatible"
    assert len(compatible["message"]) <= 8192
    assert compatible["message"].startswith(f"TEMPLATE_INVALID at {ENGINE}.env[0]: ")
    assert compatible["message"].endswith("more problem(s) (kvbridge plan lists them all)")
    # the refusal, and the advisory of this vLLM spec (NixlConnector runs the default verification unverified)
    assert [e.reason for e in events] == ["Incompatible", "Advisory"]
    assert all(len(e.message) <= 8192 for e in events)


def test_a_long_spec_error_is_cut_to_fit_the_status() -> None:
    from kvbridge_operator.controller.observe import invalid
    from kvbridge_operator.controller.status_rules import MAX_MESSAGE

    status, [event] = invalid({}, 3, SpecError("x" * 100_000, field="spec.model.name"), NOW)
    assert [len(c["message"]) <= MAX_MESSAGE for c in status["conditions"]] == [True, True]
    assert len(event.message) <= MAX_MESSAGE


def test_a_port_on_the_rendezvous_of_an_engine_over_nodes_is_refused() -> None:
    """The leader of an engine spanning nodes opens vLLM's rendezvous port (29500) after the overlay is merged: the
    check looks at the leader's and the workers' pods as they are rendered."""
    doc = document(ROOT / "examples" / "vllm" / "deepseek-v3-h200-two-node-prefill.yaml")
    doc["spec"]["prefill"]["template"] = engine_overlay(ports=[{"containerPort": 29500, "name": "metrics"}])
    status, _, applied = reconciled(doc)
    assert not applied
    field = "spec.prefill.template.spec.containers[0].ports[0]"
    assert f"TEMPLATE_MANAGED_FIELD at {field}" in condition(status)["message"]


def test_rdma_resources_may_not_ask_for_the_gpu_resource_the_operator_is_set_to() -> None:
    """An operator whose GPUs are another extended resource (``gpuResource``) refuses that name there too."""
    from kvbridge_operator.children.verdict import verdict_for

    dd = parse_deployment(with_transfer("network.rdmaResources", {"example.com/accelerator": 8}))
    assert not isinstance(verdict_for(dd), list)  # the default GPU resource is nvidia.com/gpu
    verdict = verdict_for(dd, OperatorConfig(gpu_resource="example.com/accelerator"))
    assert isinstance(verdict, list)
    field = "spec.transfer.network.rdmaResources.example.com/accelerator"
    assert [(p.code, p.field) for p in verdict] == [("RDMA_RESOURCE_GPU", field)]
