"""What the user writes is what runs, for nulls and odd values too (issue 34, item 4): every odd value is refused
with its field, by ``kvbridge plan`` and by the operator alike (the same validation), or merged so that what
kvbridge manages stays; never a traceback, never a 'compatible' verdict over a pod that lost what was checked."""

from __future__ import annotations

import json
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
