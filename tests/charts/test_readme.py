"""The chart's README: its links resolve (files and headings), and its table of values names real values with the
defaults values.yaml has."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).parents[2]
CHART = ROOT / "charts" / "kvbridge"
README = CHART / "README.md"
#: pages whose relative links are checked (the README and the pages it sends readers to first)
PAGES = [README, ROOT / "docs" / "install.md", ROOT / "docs" / "operator.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's ids of a page's headings."""
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        assert "shared/" not in target, target
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.is_file(), f"{page.name}: {target}"
        assert linked.is_relative_to(ROOT), f"{page.name}: {target} leaves the repository"
        if anchor:
            assert anchor in anchors(linked), f"{page.name}: {target} (no such heading)"


def value_at(values: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        values = values[key]
    return values


def test_the_values_table_names_real_values_with_their_defaults() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `")]
    assert len(rows) >= 10
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", cells[0])
        defaults = re.findall(r"`([^`]+)`", cells[1])
        for name in names:
            value_at(values, name)  # a KeyError names a value that does not exist
        for name, default in zip(names, defaults, strict=False):
            current = value_at(values, name)
            if current not in ("", None):
                assert yaml.safe_load(default) == current or default == str(current), (name, default, current)
