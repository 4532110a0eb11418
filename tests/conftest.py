"""The ``vllm`` marker: tests that need vLLM's CPU build (real engines, or vLLM's own code).

``make test`` installs vLLM and runs them; ``make check``'s environment has no vLLM, so there each is collected and
skipped, saying why (before any fixture runs, so a session's engines are never asked for). ``pytest -m vllm`` runs
exactly them; ``pytest -m "not vllm"`` leaves them out.
"""

from __future__ import annotations

import importlib.util

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None
REASON = "needs vLLM's CPU build, which this environment lacks (`make check`'s never has it; `make test` runs these)"


@pytest.hookimpl(trylast=True)  # after tests/vllm/conftest.py has marked its tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.skipif(VLLM_MISSING, reason=REASON))
