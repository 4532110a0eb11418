"""deploy/kvbridge.yaml, the plain-manifest install (`kubectl apply -f`), is the chart rendered with its defaults:
`make manifests` writes it with deploy/render.py; this test renders the chart the same way and compares."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import kubernetes_validate
import yaml

ROOT = Path(__file__).parents[2]
MANIFESTS = ROOT / "deploy" / "kvbridge.yaml"


def renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvbridge_deploy_render", ROOT / "deploy" / "render.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_checked_in_manifests_are_the_chart_rendered_with_its_defaults() -> None:
    assert MANIFESTS.read_text() == renderer().render(), "the chart changed: run `make manifests` and commit"


def test_the_manifests_hold_the_namespace_the_crds_and_the_operator_in_install_order() -> None:
    documents: list[dict[str, Any]] = [d for d in yaml.safe_load_all(MANIFESTS.read_text()) if d]
    kinds = [d["kind"] for d in documents]
    crd = "CustomResourceDefinition"
    assert kinds == [
        "Namespace",
        crd,
        crd,
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Service",
        "Deployment",
    ]
    crds = {d["metadata"]["name"] for d in documents if d["kind"] == "CustomResourceDefinition"}
    assert crds == {p.name.removesuffix(".yaml") for p in (ROOT / "charts" / "kvbridge" / "crds").glob("*.yaml")}
    for document in documents:
        if document["kind"] not in ("Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"):
            assert document["metadata"]["namespace"] == "kvbridge-system", document["kind"]
        kubernetes_validate.validate(document, "1.30", strict=True)


def test_render_takes_values_as_helm_set_does(tmp_path: Path) -> None:
    out = tmp_path / "kvbridge.yaml"
    assert renderer().main(["--set", "image.repository=registry.local/op,image.tag=dev", "-o", str(out)]) == 0
    [deployment] = [d for d in yaml.safe_load_all(out.read_text()) if d and d["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.local/op:dev"
