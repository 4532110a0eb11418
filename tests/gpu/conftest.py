"""The ``gpu`` suite: real vLLM (its GPU build) on CUDA devices, through both connectors.

Every test here is marked ``gpu`` and runs wherever a CUDA device and vLLM's GPU build are present
(``pytest -m gpu`` runs only them); elsewhere each is collected and skipped, the reason naming what is missing.
The check is quick (torch's CUDA query and the installed distribution's version), so the default run pays
nothing for the suite.
"""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path

import pytest

from kvbridge_operator.children.vllm_engine import VLLM_RELEASE

HERE = Path(__file__).parent


@functools.cache
def missing() -> str:
    """Why the suite cannot run on this machine, or "" when it can."""
    import torch

    if not torch.cuda.is_available():
        build = "a CPU build of torch" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        return f"no CUDA device (torch.cuda.is_available() is False; {build})"
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "no GPU build of vLLM installed (the `vllm` distribution is missing)"
    if version.partition("+")[2].startswith("cpu"):
        return f"no GPU build of vLLM: vllm {version} is vLLM's CPU build"
    if not version.startswith(f"{VLLM_RELEASE}."):
        return f"vllm {version} is installed; kvbridge renders for vLLM {VLLM_RELEASE}"
    return ""


def gpus() -> int:
    import torch

    return int(torch.cuda.device_count())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE not in item.path.parents:
            continue
        item.add_marker(pytest.mark.gpu)
        reason = missing()
        item.add_marker(pytest.mark.skipif(bool(reason), reason=f"gpu suite: {reason}"))
