"""kvbridge's own threads inside an engine's process, named for the OS: ``top -H``, ``ps -L`` and
``/proc/<pid>/task/*/comm`` then show each one's CPU apart from the engine's threads (Python before 3.14 names its
threads for itself only; the kernel's name is at most 15 bytes).

Their scheduling is the kernel's default on purpose. Measured with one of two cores busy (docs/benchmarks.md, run
X), ``SCHED_BATCH`` — the same share of the CPU, but waking such a thread never preempts the thread that woke it —
made verified requests slower, not faster (throughput 0.95x, TPOT 1.13x against the default); likely because vLLM's
thread then waits for the GIL held by a thread that the kernel does not hurry back onto the core.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

#: the kernel's limit on a thread's name (16 bytes with the terminating zero)
MAX_NAME_BYTES = 15


def name_this_thread(name: str) -> None:
    """Name the calling thread ``name`` for the OS (its first :data:`MAX_NAME_BYTES` bytes); where that is not
    possible (not Linux) nothing happens."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "wb") as comm:
            comm.write(name.encode()[:MAX_NAME_BYTES])
    except OSError:
        pass


def background_executor(workers: int, name: str, os_name: str = "") -> ThreadPoolExecutor:
    """A pool of threads named ``name`` in Python and ``os_name`` (default ``name``) for the OS."""
    return ThreadPoolExecutor(
        workers, thread_name_prefix=name, initializer=name_this_thread, initargs=(os_name or name,)
    )


def background_thread(target: Callable[[], None], name: str, os_name: str = "") -> threading.Thread:
    """A daemon thread (not started) named ``name`` in Python and ``os_name`` (default ``name``) for the OS, that
    runs ``target``."""

    def run() -> None:
        name_this_thread(os_name or name)
        target()

    return threading.Thread(target=run, name=name, daemon=True)
