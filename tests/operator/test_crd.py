"""The generated CRD: no drift, valid apiextensions/v1, structural, and it rejects what it should."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvbridge_operator.crd import FILE_NAME, SPEC_RULES, crd, render_yaml
from kvbridge_operator.spec import parse_deployment

from .schema_tools import apply_defaults, cel_failures, schema_errors

ROOT = Path(__file__).parents[2]
SCHEMA = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = SCHEMA["properties"]["spec"]


def examples() -> list[dict[str, Any]]:
    return [doc for path in sorted((ROOT / "examples").glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())]


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
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Ready", "Prefill", "Decode", "TP", "Age"]
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
