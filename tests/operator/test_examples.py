"""Every example manifest parses, validates against the CRD and gives its expected `kvbridge plan` verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbridge_operator.cli.main import main

ROOT = Path(__file__).parents[2]
EXPECTED = {
    "llama3-8b-hetero-tp.yaml": (0, []),
    "deepseek-mla.yaml": (0, []),
    "data-parallel-mla.yaml": (0, []),
    "hetero-block-size.yaml": (0, []),
    "incompatible-replicated-heads.yaml": (1, ["PREFILL_HEADS_REPLICATED"]),
}


def test_every_example_has_an_expected_verdict() -> None:
    assert sorted(p.name for p in (ROOT / "examples").glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize(("name", "expected"), EXPECTED.items())
def test_plan_verdict(name: str, expected: tuple[int, list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "-f", str(ROOT / "examples" / name), "--all-ranks", "--json"])
    entries = json.loads(capsys.readouterr().out)
    assert code == expected[0]
    assert sorted({p["code"] for e in entries for p in e["problems"]}) == expected[1]
