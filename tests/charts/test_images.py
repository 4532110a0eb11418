"""The Dockerfiles cannot be built here (no Docker engine); their contents are checked instead."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]


def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


@pytest.mark.parametrize(
    ("dockerfile", "extra", "entrypoint", "forbidden"),
    [
        ("operator/Dockerfile", "operator", "kvbridge", ("torch", "nixl")),
        ("agent/Dockerfile", "agent", "kvbridge-agent", ()),
    ],
)
def test_dockerfile(dockerfile: str, extra: str, entrypoint: str, forbidden: tuple[str, ...]) -> None:
    steps = instructions(ROOT / dockerfile)
    froms = [rest for word, rest in steps if word == "FROM"]
    assert len(froms) >= 2, "multi-stage"
    for base in froms:
        image = base.split()[0]
        assert re.search(r":\d+\.\d+\.\d+", image) or "@sha256:" in image, f"unpinned base {image}"
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    assert f'".[{extra}]"' in runs
    assert extra in PYPROJECT["project"]["optional-dependencies"]
    for name in forbidden:
        assert name not in runs, f"{dockerfile} must not install {name}"
        assert not any(name in dep for dep in PYPROJECT["project"]["optional-dependencies"][extra])
    [user] = [rest for word, rest in steps if word == "USER"]
    assert not user.startswith(("0", "root"))
    [entry] = [json.loads(rest) for word, rest in steps if word == "ENTRYPOINT"]
    assert entry == [entrypoint]
    assert entrypoint in SCRIPTS, "the entrypoint is a console script of the distribution"


def test_images_run_the_commands_the_operator_and_chart_use() -> None:
    agent_cmd = next(json.loads(r) for w, r in instructions(ROOT / "agent/Dockerfile") if w == "CMD")
    operator_cmd = next(json.loads(r) for w, r in instructions(ROOT / "operator/Dockerfile") if w == "CMD")
    assert agent_cmd == ["serve"]  # the operator renders `kvbridge-agent serve`
    assert operator_cmd == ["operator", "run"]  # the chart runs `kvbridge operator run`
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "tests"} <= set(ignored)


def test_no_image_contains_the_simulation() -> None:
    """The emulated cluster (sim/) is for a checkout's demo and tests: no image copies it, so none can import it."""
    for dockerfile in ("operator/Dockerfile", "agent/Dockerfile"):
        copies = [rest for word, rest in instructions(ROOT / dockerfile) if word in ("COPY", "ADD")]
        assert copies, dockerfile
        assert not any(rest.split()[0].rstrip("/") in (".", "sim") for rest in copies), (dockerfile, copies)
