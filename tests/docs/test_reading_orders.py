"""Every package opens with a reading order that names each of its modules once, and nothing else.

A package's ``__init__.py`` docstring is a summary line, then ``Reading order:`` and one bullet per module or
subpackage (``- ``name``: a few words``), in the order a newcomer should read them. The docstrings are read with
``ast``, so no package (nor vLLM, torch or Kopf) is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
TOP_PACKAGES = [
    ROOT / "agent" / "kvbridge_agent",
    ROOT / "operator" / "kvbridge_operator",
    ROOT / "operator" / "kvbridge_router",
    ROOT / "sim" / "kvbridge_sim",
]
HEADING = "Reading order:"
BULLET = re.compile(r"^- ``([A-Za-z_][A-Za-z0-9_]*)``")


def packages() -> list[Path]:
    found = []
    for top in TOP_PACKAGES:
        found += [init.parent for init in top.rglob("__init__.py")]
    return sorted(found)


def members(package: Path) -> set[str]:
    """The package's own modules (file names without ``.py``) and subpackages."""
    modules = {path.stem for path in package.glob("*.py") if path.name != "__init__.py"}
    subpackages = {path.name for path in package.iterdir() if (path / "__init__.py").is_file()}
    return modules | subpackages


def reading_order(package: Path) -> list[str]:
    """The names the reading order lists, in order; fails when the docstring does not open with one."""
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
    assert docstring, f"{package.name}/__init__.py has no docstring"
    paragraphs = docstring.split("\n\n")
    opening = paragraphs[:2]  # the reading order comes first, or right after a one-paragraph summary
    starts = [paragraph for paragraph in opening if paragraph.startswith(HEADING)]
    assert starts, f"{package.name}: the docstring does not open with {HEADING!r}"
    lines = starts[0].splitlines()
    assert lines[0] == HEADING, f"{package.name}: {HEADING!r} stands alone on its line, the bullets follow"
    names = []
    for line in lines[1:]:
        if line.startswith("  "):
            continue  # a bullet's continuation
        match = BULLET.match(line)
        assert match, f"{package.name}: not a bullet of the reading order: {line!r}"
        names.append(match.group(1))
    return names


def test_every_package_is_checked() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in packages()}
    assert {"agent/kvbridge_agent/core", "operator/kvbridge_operator/children", "operator/kvbridge_router"} <= names
    assert len(names) >= 13


@pytest.mark.parametrize("package", packages(), ids=lambda path: path.relative_to(ROOT).as_posix())
def test_reading_order_names_every_module(package: Path) -> None:
    listed = reading_order(package)
    duplicates = sorted({name for name in listed if listed.count(name) > 1})
    assert duplicates == [], f"named twice: {duplicates}"
    present = members(package)
    assert sorted(present - set(listed)) == [], "modules the reading order leaves out"
    assert sorted(set(listed) - present) == [], "names in the reading order that are no module of the package"
