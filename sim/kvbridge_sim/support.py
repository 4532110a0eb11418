"""What the simulation, the tests and the benchmarks share for running things locally: a free port on this
machine, waiting for a condition with a deadline (asynchronous :func:`until`, blocking :func:`wait_until`), and
whether a process still runs (:func:`running`), and loopback addresses for a local cluster's pods
(:func:`own_subnet`, :func:`pod_addresses`, :func:`fixed_address`).

The standard library only, so that any test may import it without the ``demo`` extra."""

from __future__ import annotations

import asyncio
import inspect
import os
import random
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

#: the pause between two checks of a condition, unless a caller asks for another
INTERVAL = 0.1

#: what a wait is for, in its timeout's message: the text, or a function that says it then (with the state then)
What = str | Callable[[], str]


#: where the kernel picks the ports of sockets bound to port 0 (servers asking for any port, every client
#: connection): Linux's file, and its default
EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_LOW = 32768
#: how many ports below the ephemeral range :func:`free_port` draws from
FREE_PORTS = 12000
_draws = random.Random()  # its own: a test that seeds the global generator must not make workers draw alike


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` that nothing listens on now, for a process the caller starts to listen on (another
    process may still take it first; for local tests and the demo, not for production).

    Drawn at random below the kernel's ephemeral range and checked by binding it: a port the kernel gave a socket
    bound to port 0 and then released would go, in the meantime, to the next server or client connection asking for
    any port (tests running side by side met this: a router started on a port another test's server had been given).
    Where the range leaves no room below it, the kernel's choice."""
    low = _ephemeral_low()
    for _ in range(64):
        port = _draws.randrange(max(1024, low - FREE_PORTS), low) if low > 1024 + 256 else 0
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:  # taken (or reserved): another draw
                continue
            return int(probe.getsockname()[1])
    raise OSError(f"no free port on {host} below {low} after 64 draws")


#: how many /24s of loopback :func:`pod_addresses` tries before it gives up
SUBNETS_TRIED = 16
#: the last byte from which addresses of :func:`own_subnet` are left to tests' engines at fixed addresses
FIXED_ADDRESSES = 128


def own_subnet(pid: int | None = None) -> str:
    """This process's own /24 of loopback, ``127.A.B`` with A.B from its pid (A from 1, so never 127.0.0.N, where
    other tools listen). Linux routes all of 127.0.0.0/8 to the loopback device, so two local clusters on one
    machine (a test beside a benchmark or a demo, two pytest workers) each give their pods addresses of their own,
    where otherwise an engine would fail to bind its port or a probe would reach the other cluster's pod."""
    own = os.getpid() if pid is None else pid
    return f"127.{1 + (own >> 8) % 254}.{own % 256}"


def fixed_address(n: int) -> str:
    """The ``n``-th address of this process's own /24 for an engine a test starts at an address of its choosing
    (``0 <= n <= 126``: ``.128`` to ``.254``)."""
    if not 0 <= n <= 254 - FIXED_ADDRESSES:
        raise ValueError(f"fixed address {n} is outside 0..{254 - FIXED_ADDRESSES} (the upper half of a /24)")
    return f"{own_subnet()}.{FIXED_ADDRESSES + n}"


def pod_addresses(port: int = 8000, pid: int | None = None) -> Iterator[str]:
    """Loopback addresses for one local cluster's pods in :func:`own_subnet`, 127.A.B.2 to .127, each with nothing
    listening on ``port`` when it is given (an address in use is skipped); then the next /24, up to
    :data:`SUBNETS_TRIED` of them: past that (something listening on every one, as a server bound to 0.0.0.0 on
    ``port`` would be) :class:`OSError` names the port. The upper half, :data:`FIXED_ADDRESSES` on, is for engines a
    test starts at an address of its own choosing."""
    own = os.getpid() if pid is None else pid
    skipped = 0
    for subnet in range(own, own + SUBNETS_TRIED):
        for last in range(2, FIXED_ADDRESSES):
            address = f"{own_subnet(subnet)}.{last}"
            with socket.socket() as probe:
                try:
                    probe.bind((address, port))
                except OSError:
                    skipped += 1
                    continue
            yield address
    raise OSError(
        f"no loopback address free for a pod's port {port}: {skipped} addresses in use in "
        f"{SUBNETS_TRIED} /24s from {own_subnet(own)} (is something listening on 0.0.0.0:{port}?)"
    )


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


class _Deadline:
    """One wait: the deadline, the message on timeout, and the last exception of a kind the caller tolerates."""

    def __init__(self, timeout: float, what: What, tolerate: tuple[type[Exception], ...]) -> None:
        self.timeout, self.what, self.tolerate = timeout, what, tolerate
        self.end = time.monotonic() + timeout
        self.last: Exception | None = None

    def expired(self) -> bool:
        return time.monotonic() > self.end

    def error(self) -> TimeoutError:
        last = f" (the last check raised {type(self.last).__name__}: {self.last})" if self.last is not None else ""
        what = self.what if isinstance(self.what, str) else self.what()
        return TimeoutError(f"timed out after {self.timeout:g} s waiting for {what}{last}")


async def until(
    predicate: Callable[[], object],
    timeout: float,
    what: What,
    *,
    interval: float = INTERVAL,
    tolerate: tuple[type[Exception], ...] = (),
) -> None:
    """Return once ``predicate()`` is true (a coroutine's result is awaited), checking every ``interval`` seconds;
    ``TimeoutError`` naming ``what`` after ``timeout`` seconds (a function is called then, so that the message can
    show the state at the end). An exception of a ``tolerate`` kind counts as
    "not yet" (the last one is in the error)."""
    deadline = _Deadline(timeout, what, tolerate)
    while True:
        try:
            result = predicate()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return
        except tolerate as exc:
            deadline.last = exc
        if deadline.expired():
            raise deadline.error()
        await asyncio.sleep(interval)


def wait_until(
    predicate: Callable[[], object],
    timeout: float,
    what: What,
    *,
    interval: float = INTERVAL,
    tolerate: tuple[type[Exception], ...] = (),
) -> None:
    """:func:`until` for callers without an event loop: blocks the thread between checks."""
    deadline = _Deadline(timeout, what, tolerate)
    while True:
        try:
            if predicate():
                return
        except tolerate as exc:
            deadline.last = exc
        if deadline.expired():
            raise deadline.error()
        time.sleep(interval)


def running(pid: int) -> bool:
    """Whether the process runs: it exists and is not a zombie (one that has exited and waits for its parent's
    ``wait()`` runs no more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # the state follows the command name, which may hold spaces
