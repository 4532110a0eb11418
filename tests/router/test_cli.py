"""`kvbridge router`'s command line: bad input says what to give and exits 2, no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge_operator.cli.main import main


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ([], "give --deployment NAME"),
        (["--deployment", "x", "--status-file", "f"], "give --deployment NAME"),
        (["--status-file", "f", "--prefill-timeout", "0"], "--prefill-timeout must be positive"),
        (["--status-file", "f", "--prefill-attempts", "-1"], "--prefill-attempts must be positive"),
        (["--status-file", "f", "--block-size", "0"], "--block-size"),
        (["--status-file", "f", "--header-timeout", "0"], "--header-timeout must be positive"),
    ],
)
def test_bad_flags_exit_2(args: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", *args]) == 2
    assert said in capsys.readouterr().err


def test_no_api_to_watch_exits_2_with_the_code(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvbridge_operator", "router", "--deployment", "x", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin"},
    )
    assert result.returncode == 2
    assert "NO_API_SERVER" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_taken_port_exits_2(tmp_path: Path) -> None:
    (tmp_path / "dd.json").write_text("{}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvbridge_operator",
                "router",
                "--status-file",
                str(tmp_path / "dd.json"),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
