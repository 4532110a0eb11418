"""The generated CRD: no drift, valid apiextensions/v1, structural, and it rejects what it should."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvbridge_operator.api.crd import FILE_NAME, ROOT_RULES, SPEC_RULES, crd, render_yaml
from kvbridge_operator.api.spec import parse_deployment

from .schema_tools import apply_defaults, cel_failures, schema_errors

ROOT = Path(__file__).parents[2]
SCHEMA = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = SCHEMA["properties"]["spec"]


def examples() -> list[dict[str, Any]]:
    paths = sorted(p for p in (ROOT / "examples").glob("*/*.yaml") if p.parent.name != "autoscaling")
    return [doc for path in paths for doc in yaml.safe_load_all(path.read_text())]


def test_committed_crd_matches_the_generator() -> None:
    committed = (ROOT / "crds" / FILE_NAME).read_text()
    assert committed == render_yaml(), "crds/ drifted from the models: run `make crds` and commit"


def test_crd_is_a_valid_apiextensions_v1_object() -> None:
    kubernetes_validate.validate(crd(), "1.30", strict=True)


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        found.append((path, node))
        for key, value in node.items():
            found += _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _walk(value, f"{path}[{index}]")
    return found


def test_schema_is_structural() -> None:
    for path, node in _walk(SCHEMA):
        assert not {"$ref", "anyOf", "allOf"} & set(node), path
        assert node.get("additionalProperties") is not False, path
        assert node.get("default", "") is not None, path
        for name, sub in node.get("properties", {}).items() if node.get("type") == "object" else ():
            assert "type" in sub or "x-kubernetes-int-or-string" in sub, f"{path}.{name} has no type"


def test_printer_columns_short_names_and_status_subresource() -> None:
    version = crd()["spec"]["versions"][0]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Ready",
        "Available",
        "Prefill",
        "Decode",
        "TP",
        "Router",
        "Planner",
        "Planned",
        "Age",
    ]
    assert crd()["spec"]["names"]["shortNames"] == ["dd", "disagg"]
    assert version["subresources"] == {"status": {}}
    conditions = SCHEMA["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


@pytest.mark.parametrize("document", examples(), ids=lambda d: d["metadata"]["name"])
def test_examples_pass_schema_and_cel(document: dict[str, Any]) -> None:
    assert schema_errors(SCHEMA, document) == []
    spec = apply_defaults(SPEC_SCHEMA, document["spec"])
    assert cel_failures(SPEC_RULES, spec) == []
    parse_deployment(document)  # and the operator's own model agrees


def base() -> dict[str, Any]:
    return copy.deepcopy(next(d for d in examples() if d["metadata"]["name"] == "llama3-8b"))


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda d: d["spec"]["decode"].update(tensorParallelSize="two"), "spec.decode.tensorParallelSize"),
        (lambda d: d["spec"]["decode"].update(tensorParallelSize=0), "spec.decode.tensorParallelSize"),
        (lambda d: d["spec"]["model"].pop("numLayers"), "spec.model"),
        (lambda d: d["spec"]["model"].update(kvCacheDtype="int4"), "spec.model.kvCacheDtype"),
        (lambda d: d["spec"]["prefill"].update(kvLayout="HDN"), "spec.prefill.kvLayout"),
        (lambda d: d["spec"]["transfer"].update(sideChannelPort=70000), "spec.transfer.sideChannelPort"),
        (lambda d: d["spec"]["transfer"].update(handshakeTimeoutSeconds=0), "spec.transfer.handshakeTimeoutSeconds"),
        (lambda d: d["spec"]["model"].update(name=""), "spec.model.name"),
        (lambda d: d.pop("spec"), ""),
    ],
)
def test_schema_rejects_bad_resources(change: Any, where: str) -> None:
    document = base()
    change(document)
    errors = schema_errors(SCHEMA, document)
    assert errors, "the schema accepted a bad resource"
    assert any(e.startswith(where) for e in errors), errors


@pytest.mark.parametrize(
    ("change", "field_path"),
    [
        (lambda s: s["decode"].update(tensorParallelSize=3), ".decode.tensorParallelSize"),
        (lambda s: s["decode"].update(blockSize=24), ".decode.blockSize"),
        (lambda s: s["model"].update(attention="MLA"), ".model.numKVHeads"),
        (
            lambda s: s["model"].update(cacheKind="CrossLayer") or s["prefill"].update(kvLayout="NHD"),
            ".model.cacheKind",
        ),
        (lambda s: s["model"].update(cacheKind="CrossLayer") or s["decode"].update(blockSize=32), ".decode.blockSize"),
        (lambda s: s["transfer"].update(conversion="Off") or s["decode"].update(blockSize=32), ".decode.blockSize"),
        (lambda s: s["router"].update(signTransfers=True), ".router.signTransfers"),
        (lambda s: s.update(autoscaling={"enabled": True}) or s["decode"].update(minReplicas=0), ".decode.minReplicas"),
    ],
)
def test_cel_rules_reject_cross_field_violations(change: Any, field_path: str) -> None:
    spec = apply_defaults(SPEC_SCHEMA, base()["spec"])
    change(spec)
    failed = cel_failures(SPEC_RULES, spec)
    assert [rule["fieldPath"] for rule in failed] == [field_path]


def test_defaults_make_a_minimal_spec_valid_for_cel() -> None:
    minimal = {"model": {"name": "m", "numLayers": 2, "numKVHeads": 8, "headDim": 64}}
    spec = apply_defaults(SPEC_SCHEMA, minimal)
    assert spec["prefill"]["tensorParallelSize"] == 1
    assert spec["transfer"]["conversion"] == "Auto"
    assert cel_failures(SPEC_RULES, spec) == []


DNS_1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def unknown_fields(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Fields the structural schema does not declare (kubectl's default, --validate=strict, refuses them)."""
    if isinstance(value, list) and "items" in schema:
        return [f for i, item in enumerate(value) for f in unknown_fields(schema["items"], item, f"{path}[{i}]")]
    if not isinstance(value, dict) or schema.get("x-kubernetes-preserve-unknown-fields") or "properties" not in schema:
        return []
    found = [f"{path}.{k}" for k in value if k not in schema["properties"]]
    return found + [
        f
        for k, v in value.items()
        if k in schema["properties"]
        for f in unknown_fields(schema["properties"][k], v, f"{path}.{k}")
    ]


def api_server_accepts(document: dict[str, Any]) -> bool:
    """What the API server decides for a custom resource applied with kubectl: the name rule, strict field
    validation (kubectl's default), the CRD schema, then CEL."""
    import re

    name = document.get("metadata", {}).get("name", "")
    if not isinstance(name, str) or len(name) > 253 or not re.match(DNS_1123_SUBDOMAIN, name):
        return False
    if unknown_fields(SPEC_SCHEMA, document["spec"]) or schema_errors(SCHEMA, document):
        return False
    if cel_failures(ROOT_RULES, {"metadata": {"name": name}}):
        return False
    return not cel_failures(SPEC_RULES, apply_defaults(SPEC_SCHEMA, document["spec"]))


def plan_accepts(document: dict[str, Any]) -> bool:
    from kvbridge_agent.core import SpecError

    try:
        parse_deployment(document)
    except SpecError:
        return False
    return True


PLANNER = {
    "enabled": True,
    "prometheusUrl": "http://prometheus.monitoring:9090",
    "ttft": {"milliseconds": 500},
    "itl": {"milliseconds": 30},
    "profile": {"name": "profile"},
}
CORPUS: list[tuple[str, Any]] = [
    ("valid", lambda d: None),
    ("tp-true", lambda d: d["spec"]["decode"].update(tensorParallelSize=True)),
    ("tp-string", lambda d: d["spec"]["decode"].update(tensorParallelSize="2")),
    ("tp-float", lambda d: d["spec"]["decode"].update(tensorParallelSize=2.0)),
    ("tp-fraction", lambda d: d["spec"]["decode"].update(tensorParallelSize=1.5)),
    ("block-string", lambda d: d["spec"]["prefill"].update(blockSize="16")),
    ("port-float", lambda d: d["spec"]["transfer"].update(sideChannelPort=5600.0)),
    ("timeout-int", lambda d: d["spec"]["transfer"].update(handshakeTimeoutSeconds=5)),
    ("timeout-string", lambda d: d["spec"]["transfer"].update(handshakeTimeoutSeconds="5")),
    ("layers-zero", lambda d: d["spec"]["model"].update(numLayers=0)),
    ("name-upper", lambda d: d["metadata"].update(name="My_Deployment")),
    ("name-emoji", lambda d: d["metadata"].update(name="llama-\U0001f999")),
    ("name-dots", lambda d: d["metadata"].update(name="team.llama3")),
    ("name-too-long", lambda d: d["metadata"].update(name="a" * 254)),
    ("name-dash-end", lambda d: d["metadata"].update(name="llama-")),
    ("unknown-field", lambda d: d["spec"]["model"].update(numHeads=8)),
    ("extra-args-number", lambda d: d["spec"].update(engine={"kind": "VLLM", "extraArgs": [8192]})),
    ("replicas-negative", lambda d: d["spec"]["prefill"].update(replicas=-1)),
    ("kind-enum-lower", lambda d: d["spec"].update(engine={"kind": "vllm"})),
    ("dtype-fp8-alias", lambda d: d["spec"]["model"].update(kvCacheDtype="fp8")),
    ("dtype-fp9", lambda d: d["spec"]["model"].update(kvCacheDtype="fp9")),
    # the children's names: <name>-prefill is a Service (DNS-1035 label) and a StatefulSet (<= 52 characters)
    ("name-44", lambda d: d["metadata"].update(name="a" * 44)),
    ("name-45", lambda d: d["metadata"].update(name="a" * 45)),
    ("name-digit-first", lambda d: d["metadata"].update(name="1llama")),
    # the serving path and placement (cross-field rules as CEL)
    ("pool-without-picker", lambda d: d["spec"].update(inferencePool={"enabled": True})),
    ("pool-with-picker", lambda d: d["spec"].update(inferencePool={"enabled": True, "endpointPicker": "epp"})),
    ("token-without-source", lambda d: d["spec"]["model"].update(tokenSecret={"name": "t"})),
    ("token-with-pvc-source", lambda d: d["spec"]["model"].update(tokenSecret={"name": "t"}, source="pvc://w/m")),
    ("token-with-hf-source", lambda d: d["spec"]["model"].update(tokenSecret={"name": "t"}, source="hf://o/m@v1")),
    ("source-s3", lambda d: d["spec"]["model"].update(source="s3://bucket/model")),
    ("colocation-without-key", lambda d: d["spec"].update(placement={"colocation": "Required"})),
    (
        "colocation-with-key",
        lambda d: d["spec"].update(placement={"colocation": "Preferred", "topologyKey": "topology.kubernetes.io/zone"}),
    ),
    ("gpus-per-node-zero", lambda d: d["spec"].update(placement={"gpusPerNode": 0})),
    ("sign-without-router", lambda d: d["spec"].update(router={"signTransfers": True})),
    ("sign-with-router", lambda d: d["spec"].update(router={"enabled": True, "signTransfers": True})),
    # lists joined with commas into one setting: one name per item (issue 34, item 4)
    ("transports-joined", lambda d: d["spec"].update(transfer={"network": {"ucxTransports": ["rc,tcp"]}})),
    ("transport-nul", lambda d: d["spec"].update(transfer={"network": {"ucxTransports": ["tcp\x00"]}})),
    ("networks-joined", lambda d: d["spec"].update(transfer={"network": {"secondaryNetworks": ["a,b"]}})),
    ("network-huge", lambda d: d["spec"].update(transfer={"network": {"secondaryNetworks": ["a" * 100_000]}})),
    ("network-named", lambda d: d["spec"].update(transfer={"network": {"secondaryNetworks": ["ns/rdma@net1"]}})),
    ("backends-joined", lambda d: d["spec"].update(transfer={"backends": ["UCX,GDS"]})),
    ("backends-two", lambda d: d["spec"].update(transfer={"backends": ["UCX", "GDS_MT"]})),
    # the planner cannot bring a role back from 0 (issue 56, finding 2); the default minimum is 1
    ("planner-default-minimum", lambda d: d["spec"].update(autoscaling=PLANNER)),
    (
        "planner-prefill-minimum-0",
        lambda d: d["spec"].update(autoscaling=PLANNER) or d["spec"]["prefill"].update(minReplicas=0),
    ),
    (
        "planner-decode-minimum-0",
        lambda d: d["spec"].update(autoscaling=PLANNER) or d["spec"]["decode"].update(minReplicas=0),
    ),
    ("planner-off-minimum-0", lambda d: d["spec"]["decode"].update(minReplicas=0, replicas=0)),
    ("replicas-0-default-minimum", lambda d: d["spec"]["decode"].update(replicas=0)),
    (
        "planner-url-userinfo",
        lambda d: d["spec"].update(autoscaling=PLANNER | {"prometheusUrl": "http://u:p@prom:9090"}),
    ),
    ("planner-url-query", lambda d: d["spec"].update(autoscaling=PLANNER | {"prometheusUrl": "http://prom:9090/?a=b"})),
]


@pytest.mark.parametrize(("label", "change"), CORPUS, ids=[label for label, _ in CORPUS])
def test_plan_and_the_api_server_give_the_same_verdict(label: str, change: Any) -> None:
    """Issue 13 #7: plan accepted true, "2" and 2.0 as integers and names the API server refuses."""
    document = base()
    change(document)
    assert plan_accepts(document) == api_server_accepts(document), label


@pytest.mark.parametrize(
    ("label", "accepted"),
    [
        ("valid", True),
        ("dtype-fp8-alias", True),
        ("dtype-fp9", False),
        ("name-44", True),
        ("name-45", False),
        ("name-digit-first", False),
        ("name-dots", False),
        ("name-upper", False),
        ("pool-without-picker", False),
        ("pool-with-picker", True),
        ("token-without-source", False),
        ("token-with-pvc-source", False),
        ("token-with-hf-source", True),
        ("source-s3", False),
        ("colocation-without-key", False),
        ("colocation-with-key", True),
        ("gpus-per-node-zero", False),
        ("sign-without-router", False),
        ("sign-with-router", True),
        ("transports-joined", False),
        ("transport-nul", False),
        ("networks-joined", False),
        ("network-huge", False),
        ("network-named", True),
        ("backends-joined", False),
        ("backends-two", True),
        ("planner-default-minimum", True),
        ("planner-prefill-minimum-0", False),
        ("planner-decode-minimum-0", False),
        ("planner-off-minimum-0", True),
        ("replicas-0-default-minimum", False),
        ("planner-url-userinfo", False),
        ("planner-url-query", False),
    ],
)
def test_the_verdicts_themselves(label: str, accepted: bool) -> None:
    document = base()
    dict(CORPUS)[label](document)
    assert plan_accepts(document) is accepted


def test_fp8_is_read_as_fp8_e4m3_so_both_spellings_pair() -> None:
    from kvbridge_operator.children.pairing import pairing

    one, other = base(), base()
    one["spec"]["model"]["kvCacheDtype"] = "fp8"
    other["spec"]["model"]["kvCacheDtype"] = "fp8_e4m3"
    first, second = parse_deployment(one), parse_deployment(other)
    assert first.spec.model.kv_cache_dtype.value == "fp8_e4m3"
    assert pairing(first.spec) == pairing(second.spec)


def test_children_of_the_longest_name_are_valid_kubernetes_names() -> None:
    """A 44-character name gives a 52-character StatefulSet (its revision-hash label fits 63) and Service."""
    from kvbridge_agent.core import Role
    from kvbridge_operator.api.names import role_name

    for role in Role:
        child = role_name("a" * 44, role)
        assert len(child) <= 52
        assert len(f"{child}-{'x' * 10}") <= 63
