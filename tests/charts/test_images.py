"""The Dockerfiles cannot be built here (no Docker engine); their contents are checked instead."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
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


def build_context(dockerfile: str, into: Path) -> list[str]:
    """The files the build stage of ``dockerfile`` copies from the repository, laid out under ``into`` as under its
    WORKDIR; returns the copied sources."""
    sources = []
    for word, rest in instructions(ROOT / dockerfile):
        if word != "COPY" or rest.startswith("--from"):
            continue
        *copied, dest = rest.split()
        for source in copied:
            sources.append(source)
            origin, target = ROOT / source, into / dest
            if origin.is_dir():
                shutil.copytree(origin, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target = target / origin.name if dest.endswith("/") else target
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(origin, target)
    return sources


#: run in a fresh interpreter with only an image's source roots in front: imports every module of the given
#: packages (minus the excluded ones and ``__main__``, which would run a command) and prints where each kvbridge
#: module came from
IMPORT_ALL = """
import importlib, json, pkgutil, sys
roots, packages, excluded = json.loads(sys.argv[1])
sys.path[:0] = roots
# the checkout's editable install would find what the image lacks: only the image's files may answer
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", type(f).__module__)]
for name in packages:
    package = importlib.import_module(name)
    for info in pkgutil.walk_packages(package.__path__, name + "."):
        skipped = [x for x in excluded if info.name == x or info.name.startswith(x + ".")]
        if not skipped and not info.name.endswith(".__main__"):
            importlib.import_module(info.name)
print(json.dumps({n: getattr(m, "__file__", None) for n, m in sys.modules.items() if n.startswith("kvbridge")}))
"""


@pytest.mark.parametrize(
    ("dockerfile", "packages", "excluded", "absent"),
    [
        # the operator and the router: every module, from the operator's files and the agent's core alone
        ("operator/Dockerfile", ["kvbridge_operator", "kvbridge_router"], [], ["kvbridge_agent.transfer"]),
        # the agent: every module but the vLLM connector, which runs inside vLLM's images (docs/vllm.md)
        ("agent/Dockerfile", ["kvbridge_agent"], ["kvbridge_agent.vllm_connector"], ["kvbridge_operator"]),
    ],
)
def test_each_image_carries_its_own_packages_and_they_import(
    dockerfile: str, packages: list[str], excluded: list[str], absent: list[str], tmp_path: Path
) -> None:
    sources = build_context(dockerfile, tmp_path)
    assert not any(s.rstrip("/") in (".", "sim", "tests") for s in sources), sources
    for name in absent:
        assert not (tmp_path / "agent" / name.replace(".", "/")).exists()
        assert not (tmp_path / "operator" / name.replace(".", "/")).exists()
    roots = [str(tmp_path / root) for root in ("agent", "operator") if (tmp_path / root).is_dir()]
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, json.dumps([roots, packages, excluded])],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.splitlines()[-1])
    outside = {name: file for name, file in loaded.items() if file and not file.startswith(str(tmp_path))}
    assert not outside, f"{dockerfile}: imported from outside the image's files: {outside}"
    assert not [name for name in loaded if any(name == a or name.startswith(a + ".") for a in absent)]
    assert len(loaded) > 20, sorted(loaded)


@pytest.mark.parametrize(
    ("dockerfile", "kept"),
    [("operator/Dockerfile", {"kvbridge", "kvbridge-router"}), ("agent/Dockerfile", {"kvbridge-agent"})],
)
def test_an_image_drops_the_scripts_whose_code_it_does_not_copy(dockerfile: str, kept: set[str]) -> None:
    """One distribution declares every console script; each image copies one product (the operator's holds its
    router), so another's script would only fail with ModuleNotFoundError."""
    runs = " ".join(rest for word, rest in instructions(ROOT / dockerfile) if word == "RUN")
    assert kept <= set(SCRIPTS)
    for script in SCRIPTS:
        removed = re.search(rf"\brm /opt/kvbridge/bin/{re.escape(script)}(\s|$)", runs) is not None
        assert removed == (script not in kept), (dockerfile, script)
