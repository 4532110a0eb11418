"""Issue 57: engine kinds behind one interface. Each kind's module answers for it (children/engines); outside those
modules and their table the kind is named only by the API (its enum, former names and the kinds that load a KV
connector, which the model's check and the CRD's rule read) and by ``kvbridge plan``'s table of what was run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvbridge_operator.api.spec import CONNECTOR_KINDS, DEPRECATED_KINDS, Connector, EngineKind, parse_deployment
from kvbridge_operator.children.engines import ENGINES, engine_of

ROOT = Path(__file__).parents[2]
PRODUCT = [
    ROOT / "operator" / "kvbridge_operator",
    ROOT / "operator" / "kvbridge_router",
    ROOT / "sim" / "kvbridge_sim",
]
ENGINES_DIR = ROOT / "operator" / "kvbridge_operator" / "children" / "engines"
#: where a kind may be named outside its module: the API's enum and its tables, and the table of runs
NAMING_KINDS = {"operator/kvbridge_operator/api/spec.py", "operator/kvbridge_operator/cli/provenance.py"}
KIND_WORDS = {*(kind.value for kind in EngineKind), *DEPRECATED_KINDS}
#: a kind compared in a CEL rule (the CRD's), whose text is a string here
CEL_COMPARED = re.compile(rf"kind\s*[!=]=\s*'({'|'.join(KIND_WORDS)})'")


def document(kind: str, connector: str = "KVBridge") -> dict[str, object]:
    return {
        "apiVersion": "kvbridge.io/v1alpha1",
        "kind": "DisaggregatedDeployment",
        "metadata": {"name": "k"},
        "spec": {
            "engine": {"kind": kind, "device": "CPU", "connector": connector},
            "model": {"name": "m", "numLayers": 2, "numKVHeads": 4, "headDim": 64},
        },
    }


def test_every_kind_has_a_module_and_the_api_knows_which_load_a_connector() -> None:
    assert set(ENGINES) == set(EngineKind)
    specs = {kind: parse_deployment(document(kind.value)).spec for kind in EngineKind}
    loads = {kind for kind, spec in specs.items() if engine_of(spec).connector(spec) is not None}
    assert loads == CONNECTOR_KINDS


@pytest.mark.parametrize("kind", list(EngineKind))
def test_a_kind_that_loads_a_connector_loads_the_one_the_spec_names(kind: EngineKind) -> None:
    for connector in Connector:
        spec = parse_deployment(document(kind.value, connector.value)).spec
        assert engine_of(spec).connector(spec) == (connector if kind in CONNECTOR_KINDS else None)


def _sites(path: Path) -> list[str]:
    """``line: what`` for each naming of an engine kind in ``path``: a member of ``EngineKind``, or a kind's CRD
    value compared (in Python, or in a CEL rule's text)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "EngineKind":
            found.append(f"{node.lineno}: EngineKind.{node.attr}")
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                if isinstance(operand, ast.Constant) and operand.value in KIND_WORDS:
                    found.append(f"{node.lineno}: compared with {operand.value!r}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and CEL_COMPARED.search(node.value):
            found.append(f"{node.lineno}: compared in {node.value!r}")
    return found


def test_nothing_outside_the_kinds_modules_compares_the_kind() -> None:
    found = {}
    for package in PRODUCT:
        for path in sorted(package.rglob("*.py")):
            name = str(path.relative_to(ROOT))
            if ENGINES_DIR in path.parents or name in NAMING_KINDS:
                continue
            if sites := _sites(path):
                found[name] = sites
    assert found == {}, "ask engine_of(spec) (children/engines) rather than naming the kind"
