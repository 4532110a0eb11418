"""The parallel stage of ``make test``: pytest over several workers, and a test whose worker died run once more alone.

    python tests/parallel_stage.py PYTEST_ARGS...

A worker process that dies mid-test (a native abort: twice in four runs of the stage on 2026-11-27, in the first
in-process NIXL pair a worker made after its side-channel tests, with four workers on two cores; never when those
tests ran alone) gives no verdict on the test it was running: xdist reports it failed, "worker 'gwN' crashed while
running" it. When every failure of the run is such a crash, those tests (pytest's ``--last-failed``) run once more
in one process, and the stage's verdict is theirs. A test that failed on its own (an assertion, an error) is never
run again: the stage fails as pytest said. Each rerun is announced, with the tests it runs.

What a dead worker wrote as it died (glibc's, UCX's or the C++ runtime's reason, then Python's stack from
faulthandler) goes to stderr among the progress of the other workers, far from the end of a long log. The stage
passes its stderr through and, when a worker died, prints those lines again at the end, where a log's tail shows
them. Its workers capture output at the level of ``sys`` (``--capture=sys``), not of file descriptors: under fd
capture a native library's last words go to pytest's temporary file and die with the worker. The stage's tests
write nothing to the descriptors themselves (a whole run's stderr was empty this way); what a test's child process
writes to an inherited descriptor goes to the stage's stderr (or, for stdout, nowhere: xdist points a worker's at
/dev/null) rather than into that test's report.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import tempfile
import threading
import xml.etree.ElementTree as ElementTree
from pathlib import Path

#: what xdist says of a test whose worker died
CRASHED = "crashed while running"
#: how faulthandler begins what a dying process writes
FATAL = b"Fatal Python error"
#: how faulthandler names the stack of the thread that died
CURRENT = b"Current thread"
#: lines of stderr kept (the newest); shown before each fatal error; searched after it for the dying thread's
#: stack; and of that stack
KEPT, BEFORE, SEARCHED, FRAMES = 5000, 8, 1000, 16
#: how long stderr is still read once pytest has exited (what it wrote last is in the pipe already)
DRAIN_SECONDS = 5.0
#: pytest, as both runs of the stage start it: output captured at the level of ``sys`` (see above)
PYTEST = [sys.executable, "-m", "pytest", "--capture=sys"]


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


def deaths(lines: list[bytes]) -> list[bytes]:
    """What each fatal error in a process's stderr says: a few lines before it (a native reason: glibc's, UCX's,
    the C++ runtime's), the error, and the top of the stack of the thread that died (faulthandler names it the
    current thread, after the others)."""
    shown: list[bytes] = []
    for at, line in enumerate(lines):
        if not line.startswith(FATAL):
            continue
        shown += [b"...\n", *lines[max(0, at - BEFORE) : at + 1]]
        dying = next((i for i in range(at, min(len(lines), at + SEARCHED)) if lines[i].startswith(CURRENT)), None)
        if dying is not None:
            shown += [b"(other threads' stacks are in the log above)\n", *lines[dying : dying + FRAMES]]
    return shown


def run_passing_stderr(command: list[str]) -> tuple[int, list[bytes]]:
    """Run a command, its stderr passed through as it comes; returns its exit code and its newest stderr lines.

    A process a test left running may hold the pipe open after pytest exits: once pytest has, its stderr is read
    for at most :data:`DRAIN_SECONDS` more, never until that process ends.
    """
    kept: collections.deque[bytes] = collections.deque(maxlen=KEPT)
    keeping = threading.Lock()
    process = subprocess.Popen(command, stderr=subprocess.PIPE)

    def pass_through() -> None:
        for line in process.stderr or ():
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
            with keeping:
                kept.append(line)

    reader = threading.Thread(target=pass_through, name="stderr", daemon=True)
    reader.start()
    code = process.wait()
    reader.join(timeout=DRAIN_SECONDS)
    with keeping:
        return code, list(kept)


def main(args: list[str]) -> int:
    with tempfile.TemporaryDirectory() as folder:
        junit = Path(folder, "report.xml")
        code, stderr = run_passing_stderr([*PYTEST, *args, f"--junitxml={junit}"])
        if code == 0:
            return 0
        try:
            crashed, other = crashes(junit)
        except (OSError, ElementTree.ParseError):
            return code
    if other or not crashed:
        tell_deaths(crashed, stderr)
        return code
    print(f"\n{len(crashed)} test(s) whose worker process died, run once more alone: {', '.join(crashed)}", flush=True)
    code, again = run_passing_stderr([*PYTEST, *args, "-n", "0", "--last-failed"])
    tell_deaths(crashed, stderr + again)
    return code


def tell_deaths(crashed: list[str], stderr: list[bytes]) -> None:
    """At the end of the log: what the dead workers wrote as they died, if any died."""
    if not crashed:
        return
    print(f"\nwhat worker processes wrote to stderr as they died, losing {', '.join(crashed)}:", flush=True)
    shown = deaths(stderr) or [b"(nothing: a worker killed without a word, e.g. by the kernel's OOM killer)\n"]
    sys.stdout.buffer.write(b"".join(shown))
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
