"""The operator's settings and the chart's values are documented completely (as problem codes are)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from kvbridge_operator.config import ENV_PREFIX, RENAMED, flag_of, settings, variable_of

ROOT = Path(__file__).parents[2]
OPERATOR_MD = (ROOT / "docs" / "operator.md").read_text()
INSTALL_MD = (ROOT / "docs" / "install.md").read_text()
CHART = ROOT / "charts" / "kvbridge"
#: values whose whole mapping is passed through (pod fields); their keys are the user's
OPAQUE = {
    "resources",
    "nodeSelector",
    "tolerations",
    "affinity",
    "podAnnotations",
    "serviceAccount.annotations",
    "metrics.serviceMonitor.labels",
    "imagePullSecrets",
}


def table_row(text: str, needle: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith("|") and needle in line]
    assert rows, f"{needle} is not in a table row"
    return rows[0]


def test_every_operator_setting_is_in_the_settings_table_with_its_flag() -> None:
    for item in settings():
        row = table_row(OPERATOR_MD, f"`{variable_of(item)}`")
        assert f"`{flag_of(item)}`" in row, item.name


def test_the_settings_table_has_no_stale_rows() -> None:
    """Every variable named is a setting, or the former name of one (still read, said to be deprecated)."""
    documented = set(re.findall(r"`(KVBRIDGE_OPERATOR_[A-Z_]+)`", OPERATOR_MD))
    former = {ENV_PREFIX + old.upper() for old in RENAMED}
    assert documented <= {variable_of(item) for item in settings()} | former
    for name in former:
        assert f"`{name}`" in OPERATOR_MD, name  # where they went is said


def leaf_paths(values: dict[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and path not in OPAQUE:
            paths += leaf_paths(value, f"{path}.")
        else:
            paths.append(path)
    return paths


def test_every_chart_value_is_in_the_install_table() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in leaf_paths(values):
        table_row(INSTALL_MD, f"`{path}`")


def test_every_variable_the_chart_sets_is_a_setting() -> None:
    text = (CHART / "templates" / "deployment.yaml").read_text()
    known = {variable_of(item) for item in settings()}
    set_by_chart = set(re.findall(r"name: (KVBRIDGE_OPERATOR_[A-Z_]+)", text))
    assert set_by_chart
    assert set_by_chart <= known
