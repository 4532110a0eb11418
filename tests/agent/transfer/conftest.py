"""The in-process pair of every case of the transfer matrix (harness.CASES), one per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .harness import CASES, InProcessPair


@pytest.fixture(params=sorted(CASES), scope="module")
def pair(request: pytest.FixtureRequest) -> Iterator[InProcessPair]:
    built = InProcessPair(*CASES[request.param])
    try:
        yield built
    finally:
        built.close()
