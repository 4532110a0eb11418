"""Issue 59, item 10: a misspelt field is refused naming the field, the one it most likely meant and the fields
allowed where it stands (pydantic said only "Extra inputs are not permitted"); a misspelt required field written at
the top level (`sepc:`) is named beside the missing one (it was "spec: Field required"); the former engine kind name
is read as the new one, with a warning."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import SpecError
from kvbridge_operator.api.field_errors import allowed_fields, closest, model_at
from kvbridge_operator.api.spec import DisaggregatedDeployment, EngineKind, RoleSpec, parse_deployment

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vllm" / "llama3-8b-hetero-tp.yaml"


def document() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return loaded


def refusal(doc: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as caught:
        parse_deployment(doc)
    return caught.value


def test_an_unknown_field_is_named_with_the_one_meant_and_those_allowed() -> None:
    doc = document()
    doc["spec"]["prefill"]["tensorParalelSize"] = 2
    error = refusal(doc)
    assert error.field == "spec.prefill.tensorParalelSize"
    assert "Extra inputs are not permitted" not in error.message
    assert "unknown field 'tensorParalelSize' (did you mean 'tensorParallelSize'?)" in error.message
    assert "spec.prefill takes tensorParallelSize, blockSize, kvLayout" in error.message


def test_a_misspelt_spec_is_named_beside_the_missing_one() -> None:
    doc = document()
    doc["sepc"] = doc.pop("spec")
    error = refusal(doc)
    assert error.message == "spec: required field 'spec' is missing; the document has 'sepc': did you mean 'spec'?"


def test_a_misspelt_required_field_deeper_is_named_too() -> None:
    doc = document()
    doc["spec"]["model"]["nmae"] = doc["spec"]["model"].pop("name")
    message = refusal(doc).message
    assert "spec.model.name: required field 'name' is missing; spec.model has 'nmae': did you mean 'name'?" in message
    assert "spec.model.nmae: unknown field 'nmae' (did you mean 'name'?)" in message


def test_a_misspelt_enum_value_is_named_with_the_value_meant() -> None:
    doc = document()
    doc["spec"]["engine"]["kind"] = "Synthtic"
    assert "'Synthtic' is not one of 'Synthetic' or 'VLLM' (did you mean 'Synthetic'?)" in refusal(doc).message


def test_an_unknown_field_nothing_resembles_lists_what_is_allowed() -> None:
    doc = document()
    doc["spec"]["engine"]["zzz"] = 1
    message = refusal(doc).message
    assert "unknown field 'zzz'; spec.engine takes kind, device, connector, image" in message
    assert "did you mean" not in message


def test_models_are_found_through_optionals_and_lists() -> None:
    assert model_at(DisaggregatedDeployment, ("spec", "prefill")) is RoleSpec
    assert model_at(DisaggregatedDeployment, ("spec", "tracing")) is not None  # Optional[TracingSpec]
    assert model_at(DisaggregatedDeployment, ("spec", "prefill", "extraArgs")) is None  # a list of strings
    assert model_at(DisaggregatedDeployment, ("spec", "nowhere")) is None


def _paths() -> list[tuple[str, ...]]:
    """Every place of the example that holds a model with at least one field of 6 or more letters."""
    found = []
    for path in [("spec",), ("spec", "engine"), ("spec", "model"), ("spec", "prefill"), ("spec", "decode")]:
        model = model_at(DisaggregatedDeployment, path)
        if model is not None and any(len(name) >= 6 for name in allowed_fields(model)):
            found.append(path)
    return found


@st.composite
def misspelling(draw: st.DrawFn) -> tuple[tuple[str, ...], str, str]:
    """A field of a model in the example, misspelt by one deletion, insertion, substitution or swap."""
    path = draw(st.sampled_from(_paths()))
    model = model_at(DisaggregatedDeployment, path)
    assert model is not None
    meant = draw(st.sampled_from([name for name in allowed_fields(model) if len(name) >= 6]))
    at = draw(st.integers(1, len(meant) - 2))
    letter = draw(st.sampled_from("abcdefghijklmnopqrstuvwxyz"))
    edit = draw(st.sampled_from(["delete", "insert", "substitute", "swap"]))
    typo = {
        "delete": meant[:at] + meant[at + 1 :],
        "insert": meant[:at] + letter + meant[at:],
        "substitute": meant[:at] + letter + meant[at + 1 :],
        "swap": meant[: at - 1] + meant[at] + meant[at - 1] + meant[at + 1 :],
    }[edit]
    return path, meant, typo


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(misspelling())
def test_any_one_letter_typo_is_refused_naming_it_and_a_field_that_exists(
    case: tuple[tuple[str, ...], str, str],
) -> None:
    """Whatever the edit, the refusal names the unknown field and offers a field that exists where it stands: the
    one meant, or one at least as close (``tensorParallelSize`` misspelt may read as ``dataParallelSize``)."""
    path, meant, typo = case
    model = model_at(DisaggregatedDeployment, path)
    assert model is not None
    allowed = allowed_fields(model)
    if typo in allowed:  # the edit made another real field
        return
    doc = document()
    node: Any = doc
    for step in path:
        node = node.setdefault(step, {})
    node[typo] = copy.deepcopy(node.get(meant, 1))
    node.pop(meant, None)
    message = refusal(doc).message
    assert f"unknown field {typo!r}" in message
    offered = closest(typo, allowed)
    assert offered is not None
    assert offered in allowed
    assert f"(did you mean {offered!r}?)" in message
    assert f"{'.'.join(path)} takes {', '.join(allowed)}" in message


def test_agent_is_read_as_synthetic_and_plan_warns_of_it(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "synthetic" / "llama3-8b-hetero-tp.yaml").read_text())
    doc["spec"]["engine"]["kind"] = "Agent"
    assert parse_deployment(doc).spec.engine.kind is EngineKind.SYNTHETIC
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(doc))
    done = subprocess.run(
        [sys.executable, "-m", "kvbridge_operator", "plan", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "spec.engine.kind: Agent is the former name of Synthetic, read as Synthetic (deprecated)" in done.stderr
    head = done.stdout.splitlines()[:2]
    assert head[0].endswith("synthetic engine on GPU, serves no model)")
    assert head[1].startswith("  the synthetic engine serves no model")
