"""Fixtures of the connector's tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Everything a test starts (schedulers with side channels and heartbeat threads, workers with NIXL agents),
    shut down however the test ends, the last started first."""
    opened: list[Any] = []
    yield opened
    for thing in reversed(opened):
        thing.shutdown()
