"""Stopping a local pod's process group: every process gets its grace period, not only the leader, and what is still
running after it is killed (vLLM's API server exits before its engine core and workers unlink their shared memory)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from kvbridge_sim import pods
from kvbridge_sim.support import running, wait_until

#: a pod's leader that exits at once on SIGTERM, with a child that takes ``delay`` seconds to remove its file on
#: SIGTERM or once its parent is gone (ignores both when ``delay`` is negative); the child's pid goes in ``pid``
POD = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    marker, delay = sys.argv[1], float(sys.argv[2])
    child = '''
    import os, signal, sys, time
    marker, delay = sys.argv[1], float(sys.argv[2])
    open(marker, "w").close()
    def cleanup(*_):
        time.sleep(delay)
        os.unlink(marker)
        sys.exit(0)
    signal.signal(signal.SIGTERM, cleanup if delay >= 0 else signal.SIG_IGN)
    parent = os.getppid()
    open(marker + ".ready", "w").close()
    while os.getppid() == parent or delay < 0:
        time.sleep(0.05)
    cleanup()  # its parent is gone, as vLLM's engine core sees its API server go
    '''
    process = subprocess.Popen([sys.executable, "-c", child, marker, str(delay)])
    open(marker + ".pid", "w").write(str(process.pid))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        time.sleep(1)
    """
)


def start(tmp_path: Path, delay: float) -> tuple[subprocess.Popen[bytes], Path]:
    marker = tmp_path / "segment"
    process = subprocess.Popen([sys.executable, "-c", POD, str(marker), str(delay)], start_new_session=True)
    try:
        wait_until(lambda: Path(f"{marker}.ready").exists(), 30, "the pod's child to start")
    except TimeoutError:
        pods.stop(process, grace=0)  # no pod left behind
        raise
    return process, marker


def test_a_child_still_cleaning_up_after_its_leader_exits_is_not_killed(tmp_path: Path) -> None:
    process, marker = start(tmp_path, delay=1.0)
    began = time.monotonic()
    pods.stop(process, grace=10)
    assert not marker.exists(), "the child was killed before it removed its file"
    assert 1.0 <= time.monotonic() - began < 5  # waited for the child, not for the whole grace period
    assert process.returncode is not None


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    process, marker = start(tmp_path, delay=-1)
    child = int(Path(f"{marker}.pid").read_text())
    began = time.monotonic()
    pods.stop(process, grace=1.0)
    assert 1.0 <= time.monotonic() - began < 5
    assert marker.exists()  # it never cleaned up: it was killed
    assert not running(child)


def test_a_kubelets_stop_gives_the_main_processs_children_the_rest_of_the_grace_period(tmp_path: Path) -> None:
    process, marker = start(tmp_path, delay=1.0)  # SIGTERM to the main process only; its child sees it go
    began = time.monotonic()
    pods.terminate(process, grace=10)
    assert not marker.exists(), "the child was killed before it removed its file"
    assert 1.0 <= time.monotonic() - began < 5


def test_a_kubelets_stop_kills_what_outlives_the_grace_period(tmp_path: Path) -> None:
    process, marker = start(tmp_path, delay=-1)
    began = time.monotonic()
    pods.terminate(process, grace=1.0)
    assert 1.0 <= time.monotonic() - began < 5
    assert marker.exists()
