"""The ``gpu`` suite: kvbridge's transfer path on CUDA devices, and real vLLM (its GPU build) through both connectors.

Every test here is marked ``gpu`` and runs wherever what its module needs is present (``pytest -m gpu`` runs only
them): a CUDA device and NIXL, and vLLM's GPU build unless the module says ``NEEDS_VLLM = False``; elsewhere each is
collected and skipped, the reason naming what is missing.
The check is quick (torch's CUDA query and the installed distribution's version), so the default run pays
nothing for the suite.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .test_cuda_transfer import Opened

HERE = Path(__file__).parent


@functools.cache
def missing(needs_vllm: bool = True) -> str:
    """Why the suite (``needs_vllm``: its real-vLLM tests) cannot run on this machine, or "" when it can."""
    import torch

    if not torch.cuda.is_available():
        build = "a CPU build of torch" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        return f"no CUDA device (torch.cuda.is_available() is False; {build})"
    if importlib.util.find_spec("nixl") is None:
        return "NIXL is not installed (the `nixl` distribution)"
    if not needs_vllm:
        return ""
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "no GPU build of vLLM installed (the `vllm` distribution is missing)"
    if version.partition("+")[2].startswith("cpu"):
        return f"no GPU build of vLLM: vllm {version} is vLLM's CPU build"
    try:  # here, after vLLM: a GPU machine without the operator's dependencies still runs the CUDA modules
        from kvbridge_operator.children.engines.vllm_serve import VLLM_RELEASE
    except Exception as error:  # any failure at import: a skip with its reason, not an error of the whole run
        return f"kvbridge's operator cannot be imported ({type(error).__name__}: {error}): install kvbridge[operator]"
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
        reason = missing(getattr(getattr(item, "module", None), "NEEDS_VLLM", True))
        item.add_marker(pytest.mark.skipif(bool(reason), reason=f"gpu suite: {reason}"))


@pytest.fixture
def opened() -> Iterator[Opened]:
    """Every NIXL agent and decode rank a CUDA test starts, closed however it ends (imported here, when a test asks:
    the suite's collection imports no CUDA code)."""
    from .test_cuda_transfer import Opened

    things = Opened()
    yield things
    for decode in things.decodes:
        decode.close()
    for transport in things.transports:
        transport.close()
