"""The command examples in README.md and docs/ are run, and their output compared with what the page shows, so the
docs cannot go stale. Each ``$ `` line of a ``console`` block is run with bash from the repository root (with the
virtual environment's commands on the PATH); the lines after it, up to the next ``$ `` line, are its output. A
line ``...`` in the page stands for any number of lines; a line ending in ``...`` for any line it begins.

Commands of the kinds in :data:`NOT_RUN_HERE` need what these tests do not start (a cluster for kubectl, a model
folder for ``kvbridge model``); the test lists them, so a new example of a runnable kind cannot slip through.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: the commands these tests run, by their first words
RUN = ("kvbridge plan", "sed ")
#: kinds of example not run here, and why
NOT_RUN_HERE = {
    "kubectl ": "needs a cluster",
    "kvbridge model ": "needs a model folder on the reader's machine",
    "kvbridge-agent loopback ": "starts engine processes for a minute; tests/agent/bench/test_loopback.py runs it",
}


def examples() -> list[tuple[str, str, list[str]]]:
    """(page:line, command, shown output) for every ``$ `` line of every console block."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        inside = False
        for number, line in enumerate(lines, start=1):
            if line.startswith("```"):
                inside = line.strip() == "```console" and not inside
                continue
            if inside and line.startswith("$ "):
                output = []
                for following in lines[number:]:
                    if following.startswith(("$ ", "```")):
                        break
                    output.append(following)
                while output and not output[-1].strip():
                    output.pop()
                found.append((f"{page.relative_to(ROOT)}:{number}", line[2:].strip(), output))
    return found


def _command(text: str) -> str:
    return re.sub(r"^\.venv/bin/", "", text)


def _matches(shown: list[str], got: list[str]) -> bool:
    """``shown`` with its ``...`` wildcards against ``got``."""
    if not shown:
        return not got
    head, rest = shown[0], shown[1:]
    if head.strip() == "...":
        return any(_matches(rest, got[i:]) for i in range(len(got) + 1))
    if not got:
        return False
    line = got[0].rstrip()
    if head.rstrip().endswith("...") and line.startswith(head.rstrip()[:-3].rstrip()):
        return _matches(rest, got[1:])
    return head.rstrip() == line and _matches(rest, got[1:])


EXAMPLES = examples()


def test_every_example_is_run_or_says_why_not() -> None:
    assert EXAMPLES
    for where, command, _ in EXAMPLES:
        command = _command(command)
        assert command.startswith(RUN) or any(command.startswith(k) for k in NOT_RUN_HERE), (where, command)


@pytest.mark.parametrize(
    ("where", "command", "shown"),
    [e for e in EXAMPLES if _command(e[1]).startswith(RUN)],
    ids=[e[0] for e in EXAMPLES if _command(e[1]).startswith(RUN)],
)
def test_the_example_prints_what_the_page_shows(where: str, command: str, shown: list[str]) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-c", _command(command)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    got = done.stdout.splitlines()
    assert _matches(shown, got), f"{where}: `{command}` prints\n" + "\n".join(got) + f"\n(stderr: {done.stderr})"
