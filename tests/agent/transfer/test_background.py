"""kvbridge's own threads are named for the OS, keep their Python names and the default scheduling policy."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from kvbridge_agent.transfer.background import MAX_NAME_BYTES, background_executor, background_thread

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS thread names are read from /proc")


def policy_and_names() -> tuple[int, str, str]:
    """On the calling thread: its policy, its OS name and its Python name."""
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as comm:
        return os.sched_getscheduler(0), comm.read().strip(), threading.current_thread().name


@linux
def test_a_pool_thread_is_named_for_the_os_and_keeps_its_python_name() -> None:
    with background_executor(1, "kvbridge-digest-fetch", "kvbridge-fetch") as pool:
        policy, os_name, python_name = pool.submit(policy_and_names).result(timeout=10)
    assert os_name == "kvbridge-fetch"
    assert python_name.startswith("kvbridge-digest-fetch")
    assert policy == os.sched_getscheduler(0)  # the kernel's default, as the thread that made the pool


@linux
def test_a_long_name_is_cut_to_the_kernels_limit_and_the_thread_runs_its_target() -> None:
    seen: list[tuple[int, str, str]] = []
    thread = background_thread(lambda: seen.append(policy_and_names()), "kvbridge-a-very-long-thread-name")
    thread.start()
    thread.join(timeout=10)
    [(_, os_name, python_name)] = seen
    assert os_name == "kvbridge-a-very-long-thread-name"[:MAX_NAME_BYTES]
    assert python_name == "kvbridge-a-very-long-thread-name"
    assert thread.daemon
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as comm:
        assert not comm.read().startswith("kvbridge")  # the caller's own name is untouched
