"""Every example manifest parses, validates against the CRD and gives its expected `kvbridge plan` verdict; the
examples that serve a model are vLLM's, the synthetic engine's live apart and say so on their first line, and the
manifests the docs `kubectl apply` serve a model (issue 59: a new user's first `kubectl apply` ran an engine that
serves nothing)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kvbridge_operator.cli.main import main

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"
#: every DisaggregatedDeployment example (examples/autoscaling/ holds HPA and KEDA objects) and its verdict
EXPECTED = {
    "synthetic/llama3-8b-hetero-tp.yaml": (0, []),
    "synthetic/deepseek-mla.yaml": (0, []),
    "synthetic/data-parallel-mla.yaml": (0, []),
    "synthetic/hetero-block-size.yaml": (0, []),
    "synthetic/incompatible-replicated-heads.yaml": (1, ["PREFILL_HEADS_REPLICATED"]),
    **{f"vllm/{p.name}": (0, []) for p in sorted((EXAMPLES / "vllm").glob("*.yaml"))},
}
SYNTHETIC_FIRST_LINE = "# The synthetic engine (engine.kind: Synthetic), which serves no model"
#: the pages whose `kubectl apply -f examples/...` a new user runs
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def deployments() -> list[Path]:
    return sorted(p for p in EXAMPLES.rglob("*.yaml") if p.parent.name != "autoscaling")


def test_every_example_has_an_expected_verdict() -> None:
    assert sorted(str(p.relative_to(EXAMPLES)) for p in deployments()) == sorted(EXPECTED)
    assert not list(EXAMPLES.glob("*.yaml")), "examples/ itself holds folders only: vllm/, synthetic/, autoscaling/"


@pytest.mark.parametrize(("name", "expected"), EXPECTED.items())
def test_plan_verdict(name: str, expected: tuple[int, list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "-f", str(EXAMPLES / name), "--all-ranks", "--json"])
    entries = json.loads(capsys.readouterr().out)
    assert code == expected[0]
    assert sorted({p["code"] for e in entries for p in e["problems"]}) == expected[1]


@pytest.mark.parametrize("path", deployments(), ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_the_synthetic_engine_lives_apart_and_says_so_first(path: Path) -> None:
    kind = yaml.safe_load(path.read_text())["spec"].get("engine", {}).get("kind", "VLLM")
    assert kind in ("VLLM", "Synthetic")  # never the deprecated name
    synthetic = path.parent.name == "synthetic"
    assert (kind == "Synthetic") is synthetic, path
    assert path.read_text().startswith(SYNTHETIC_FIRST_LINE) is synthetic, path


def test_the_manifests_the_docs_apply_serve_a_model() -> None:
    applied = {
        match
        for page in PAGES
        for match in re.findall(r"kubectl apply -f (examples/\S+\.yaml)", page.read_text())
        if "autoscaling/" not in match
    }
    assert applied
    for name in applied:
        spec = yaml.safe_load((ROOT / name).read_text())["spec"]
        assert spec.get("engine", {}).get("kind", "VLLM") == "VLLM", name


def test_one_example_has_autoscaling_and_tracing_on_and_plans_them(capsys: pytest.CaptureFixture[str]) -> None:
    path = EXAMPLES / "vllm" / "llama3-8b-production.yaml"
    assert main(["plan", "-f", str(path)]) == 0
    text = capsys.readouterr().out
    assert "\n  autoscaling: planner to TTFT p95 500 ms and ITL p90 30 ms" in text
    assert "\n  tracing: OTLP grpc to http://otel-collector.observability:4317, 10% of new traces" in text
    assert "\n  router: " in text


def test_models_from_the_hub_are_pinned_to_a_commit() -> None:
    """A branch (``@main``) moves: pods started a week apart would load different weights under one pairing key."""
    for path in deployments():
        source = yaml.safe_load(path.read_text())["spec"]["model"].get("source", "")
        if source.startswith("hf://"):
            assert re.search(r"@[0-9a-f]{40}$", source), (path.name, source)
