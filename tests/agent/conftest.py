from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge_agent.transfer.keys import CurveKeys, generate_keys


@pytest.fixture
def keys(tmp_path: Path) -> CurveKeys:
    return generate_keys(tmp_path / "keys")


@pytest.fixture
def free_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
