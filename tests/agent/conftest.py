from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge_agent.transfer.keys import CurveKeys, generate_keys


@pytest.fixture
def keys(tmp_path: Path) -> CurveKeys:
    return generate_keys(tmp_path / "keys")
