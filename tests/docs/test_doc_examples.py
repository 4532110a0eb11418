"""The command examples in README.md and docs/ are run, and their output compared with what the page shows, so the
docs cannot go stale. Each ``$ `` line of a ``console`` block is run with bash from the repository root (with the
virtual environment's commands on the PATH); the lines after it, up to the next ``$ `` line, are its output. A
line ``...`` in the page stands for any number of lines; a line ending in ``...`` for any line it begins.

``kubectl`` examples run, in the page's order, with the real kubectl against a fresh emulated cluster per page (the
API, the operator and the StatefulSet controller stand-in; kvbridge_sim.kubectl). Ages and column padding are not
compared (they depend on when the command ran), and a ``kubectl get``/``describe`` whose output does not match yet
is run again for up to 20 s: the operator reconciles asynchronously, as on a real cluster.

Commands of the kinds in :data:`NOT_RUN_HERE` need what these tests do not start (a model folder for
``kvbridge model``); the test lists them, so a new example of a runnable kind cannot slip through.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge_sim.kubectl import KUBECTL, background_cluster
from kvbridge_sim.support import wait_until

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: the commands these tests run, by their first words
RUN = ("kvbridge plan", "sed ")
#: run in order per page against an emulated cluster
KUBECTL_EXAMPLES = "kubectl "
#: an age as kubectl prints it (3m, 12s, 2h5m, 4d)
_AGE = re.compile(r"(?<!\S)\d+[smhdy](\d+[smhd])?(?!\S)")
#: kinds of example not run here, and why
NOT_RUN_HERE = {
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
        runnable = command.startswith((*RUN, KUBECTL_EXAMPLES))
        assert runnable or any(command.startswith(k) for k in NOT_RUN_HERE), (where, command)


@pytest.mark.parametrize(
    ("where", "command", "shown"),
    [e for e in EXAMPLES if _command(e[1]).startswith(RUN)],
    ids=[e[0] for e in EXAMPLES if _command(e[1]).startswith(RUN)],
)
def test_the_example_prints_what_the_page_shows(where: str, command: str, shown: list[str]) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        ["bash", "-c", _command(command)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    got = done.stdout.splitlines()
    assert _matches(shown, got), f"{where}: `{command}` prints\n" + "\n".join(got) + f"\n(stderr: {done.stderr})"


def _loose(lines: list[str]) -> list[str]:
    """Lines with every age as ``<age>`` and runs of blanks as one: what does not depend on when kubectl ran."""
    return [" ".join(_AGE.sub("<age>", line).split()) for line in lines]


KUBECTL_PAGES = sorted({e[0].split(":")[0] for e in EXAMPLES if e[1].startswith(KUBECTL_EXAMPLES)})


@pytest.mark.skipif(KUBECTL is None, reason="no kubectl binary on the PATH (CI machines have one)")
@pytest.mark.parametrize("page", KUBECTL_PAGES)
def test_the_pages_kubectl_examples_print_what_it_shows(page: str) -> None:
    steps = [e for e in EXAMPLES if e[0].startswith(f"{page}:") and e[1].startswith(KUBECTL_EXAMPLES)]
    with background_cluster() as config:
        env = {**os.environ, "KUBECONFIG": str(config)}
        for where, command, shown in steps:
            got: list[str] = []

            def prints_it(command: str = command, shown: list[str] = shown, got: list[str] = got) -> bool:
                done = subprocess.run(
                    ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
                )
                got[:] = (done.stdout + done.stderr).splitlines()
                return _matches(_loose(shown), _loose(got))

            with contextlib.suppress(TimeoutError):  # reads may lag the operator; the assertion shows the output
                wait_until(
                    prints_it,
                    20 if command.startswith(("kubectl get", "kubectl describe")) else 0,
                    f"`{command}`",
                    interval=0.3,
                )
            assert _matches(_loose(shown), _loose(got)), f"{where}: `{command}` prints\n" + "\n".join(got)
