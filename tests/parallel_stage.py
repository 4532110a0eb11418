"""The parallel stage of ``make test``: pytest over several workers, and a test whose worker died run once more alone.

    python tests/parallel_stage.py PYTEST_ARGS...

A worker process that dies mid-test (a native abort: twice in four runs of the stage on 2026-11-27, in the first
in-process NIXL pair a worker made after its side-channel tests, with four workers on two cores; never when those
tests ran alone) gives no verdict on the test it was running: xdist reports it failed, "worker 'gwN' crashed while
running" it. When every failure of the run is such a crash, those tests (pytest's ``--last-failed``) run once more
in one process, and the stage's verdict is theirs. A test that failed on its own (an assertion, an error) is never
run again: the stage fails as pytest said. Each rerun is announced, with the tests it runs.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

#: what xdist says of a test whose worker died
CRASHED = "crashed while running"


def crashes(report: Path) -> tuple[list[str], int]:
    """The tests of a JUnit report whose worker died, and how many failed or erred otherwise."""
    crashed, other = [], 0
    for case in ElementTree.parse(report).iter("testcase"):
        for verdict in (*case.findall("failure"), *case.findall("error")):
            if CRASHED in (verdict.get("message") or "") + (verdict.text or ""):
                crashed.append(f"{case.get('classname')}::{case.get('name')}")
            else:
                other += 1
    return crashed, other


def main(args: list[str]) -> int:
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder, "report.xml")
        first = subprocess.run([sys.executable, "-m", "pytest", *args, f"--junitxml={report}"], check=False)
        if first.returncode == 0:
            return 0
        try:
            crashed, other = crashes(report)
        except (OSError, ElementTree.ParseError):
            return first.returncode
    if other or not crashed:
        return first.returncode
    print(f"\n{len(crashed)} test(s) whose worker process died, run once more alone: {', '.join(crashed)}", flush=True)
    again = subprocess.run([sys.executable, "-m", "pytest", *args, "-n", "0", "--last-failed"], check=False)
    return again.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
