"""`kvbridge-router`'s command line: flags generated from the settings (the operator's api owns them), bad input
says what to give and exits 2, no traceback; the operator imports nothing of the router."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvbridge_operator.api.router_settings import DEFAULTS, RouterPolicy, RouterSettings, arguments
from kvbridge_operator.cli.main import main as kvbridge
from kvbridge_router import cli

ROOT = Path(__file__).parents[2]


def router(argv: Sequence[str]) -> int:
    return cli.main(argv)


#: the checkout's source roots, for commands run with a bare environment
ENVIRONMENT = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ([], "give --deployment NAME"),
        (["--deployment", "x", "--status-file", "f"], "give --deployment NAME"),
        (["--status-file", "f", "--prefill-timeout", "0"], "--prefill-timeout must be positive"),
        (["--status-file", "f", "--prefill-attempts", "-1"], "--prefill-attempts must be positive"),
        (["--status-file", "f", "--block-size", "0"], "--block-size"),
        (["--status-file", "f", "--header-timeout", "0"], "--header-timeout must be positive"),
        (["--status-file", "f", "--peers", "http://h:1"], "--peers needs --peer-key-file"),
        (["--status-file", "f", "--peers", "http://h:1", "--peer-key-file", "/nonexistent"], "cannot read"),
        (["--status-file", "f", "--peers", "h:1", "--peer-key-file", __file__], "is not http://host:port"),
        (["--status-file", "f", "--peers", "http://h:1", "--peer-interval", "0"], "--peer-interval must be positive"),
    ],
)
def test_bad_flags_exit_2(args: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert router(args) == 2
    err = capsys.readouterr().err
    assert said in err
    assert err.startswith("kvbridge-router: error: ")


def test_a_peer_key_too_short_exits_2_saying_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "key"
    key.write_text("short\n")
    assert router(["--status-file", "f", "--peers", "http://h:1", "--peer-key-file", str(key)]) == 2
    assert "holds 5 bytes, at least 16 are needed" in capsys.readouterr().err


def test_the_console_script_is_the_routers_own_command_line() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kvbridge-router"] == "kvbridge_router.cli:main"


def test_every_setting_is_a_flag_with_its_default() -> None:
    given = ["--status-file", "dd.yaml"]
    own = cli.chosen(cli.build_parser().parse_args(given))
    assert own == RouterSettings(status_file="dd.yaml")
    assert own.prefill_timeout == DEFAULTS.prefill_timeout
    assert own.policy is RouterPolicy.KV_AWARE


def test_the_rendered_arguments_parse_back_to_the_settings() -> None:
    """What the operator writes into the router Deployment is what the router reads."""
    settings = RouterSettings(
        deployment="dd",
        namespace="team-a",
        policy=RouterPolicy.LEAST_LOADED,
        block_size=32,
        prefill_timeout=30,
        decode_timeout=90.5,
        transfer_token_file="/t",
    )
    args = arguments(settings, always=("port",))
    assert "--port=8000" in args  # asked for at its default
    assert "--host=0.0.0.0" not in args  # at its default, not asked for
    assert cli.chosen(cli.build_parser().parse_args(args)) == settings


def test_no_api_to_watch_exits_2_with_the_code(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvbridge_router", "--deployment", "x", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin", **ENVIRONMENT},
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
                "kvbridge_router",
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


def test_kvbridge_has_no_router_command(capsys: pytest.CaptureFixture[str]) -> None:
    """The router is its own program (kvbridge-router); the operator's command line does not host it."""
    with pytest.raises(SystemExit) as exited:
        kvbridge(["router", "--status-file", "f"])
    assert exited.value.code == 2
    assert "invalid choice: 'router'" in capsys.readouterr().err


def test_the_operator_imports_nothing_of_the_router() -> None:
    """The dependency goes one way (import-linter checks the imports written; this, those made at run time): the
    operator's command line, children and api load no module of kvbridge_router."""
    code = (
        "import sys, kvbridge_operator.cli.main, kvbridge_operator.children.objects.router, kvbridge_operator.api.crd\n"
        "kvbridge_operator.cli.main.build_parser()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kvbridge_router'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env={**os.environ}
    )
    assert result.stdout.strip() == "[]"
