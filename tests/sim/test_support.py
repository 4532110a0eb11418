"""The shared local helpers: a free port, and waiting with a deadline."""

from __future__ import annotations

import ipaddress
import itertools
import socket
import time

import pytest

from kvbridge_sim.support import (
    FREE_PORTS,
    _ephemeral_low,
    fixed_address,
    free_port,
    own_subnet,
    pod_addresses,
    until,
    wait_until,
)


def test_a_free_port_can_be_listened_on() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()


def test_a_free_port_is_never_one_the_kernel_gives_a_socket_bound_to_port_0() -> None:
    """A server asking for any port (port 0), or a client connection, is given one of the ephemeral range: a port
    handed out from there could be given away again before the caller binds it."""
    low = _ephemeral_low()
    ports = {free_port() for _ in range(50)}
    assert all(max(1024, low - FREE_PORTS) <= port < low for port in ports)
    assert len(ports) > 40  # drawn at random, not handed out in order
    with socket.socket() as any_port:
        any_port.bind(("127.0.0.1", 0))
        assert any_port.getsockname()[1] >= low


def test_pod_addresses_are_loopback_and_each_process_has_its_own() -> None:
    """Two local clusters on one machine (a test beside a benchmark) must not give their pods the same address."""
    firsts = {pid: list(itertools.islice(pod_addresses(port=free_port(), pid=pid), 3)) for pid in (4242, 4243, 70000)}
    every = [a for addresses in firsts.values() for a in addresses]
    assert len(set(every)) == len(every)
    assert all(ipaddress.ip_address(a) in ipaddress.ip_network("127.0.0.0/8") for a in every)
    assert not any(a.startswith("127.0.0.") for a in every)  # where other tools listen


def test_pod_addresses_skip_one_something_listens_on() -> None:
    port = free_port()
    first = next(pod_addresses(port=port, pid=4242))
    with socket.socket() as taken:
        taken.bind((first, port))
        taken.listen()
        assert next(pod_addresses(port=port, pid=4242)) != first


def test_pod_addresses_give_up_naming_the_port_when_every_one_is_taken() -> None:
    """A server on 0.0.0.0 holds the port on every loopback address: an error, never an endless search."""
    with socket.socket() as everywhere:
        everywhere.bind(("0.0.0.0", 0))
        everywhere.listen()
        port = everywhere.getsockname()[1]
        with pytest.raises(OSError, match=f"0.0.0.0:{port}"):
            next(pod_addresses(port=port, pid=4242))


def test_fixed_addresses_are_the_upper_half_of_the_own_subnet_and_bounded() -> None:
    assert fixed_address(0) == f"{own_subnet()}.128"
    assert fixed_address(126) == f"{own_subnet()}.254"
    for outside in (-1, 127, 1000):
        with pytest.raises(ValueError, match="upper half"):
            fixed_address(outside)


def test_wait_until_returns_once_the_condition_holds() -> None:
    calls = iter(range(100))
    wait_until(lambda: next(calls) >= 3, 5, "the fourth check", interval=0.001)
    assert next(calls) == 4


def test_wait_until_times_out_naming_what_it_waited_for() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"timed out after 0.2 s waiting for the moon"):
        wait_until(lambda: False, 0.2, "the moon", interval=0.01)
    assert 0.2 <= time.monotonic() - started < 2


def test_tolerated_exceptions_count_as_not_yet_and_the_last_is_reported() -> None:
    def missing() -> bool:
        raise KeyError("spec")

    with pytest.raises(TimeoutError, match=r"the spec \(the last check raised KeyError: 'spec'\)"):
        wait_until(missing, 0.05, "the spec", interval=0.01, tolerate=(KeyError,))
    with pytest.raises(KeyError):  # not tolerated: raised at once
        wait_until(missing, 5, "the spec")


async def test_until_awaits_coroutine_conditions_and_says_the_state_at_the_end() -> None:
    seen: list[int] = []

    async def grows() -> bool:
        seen.append(len(seen))
        return len(seen) >= 3

    await until(grows, 5, "three checks", interval=0.001)
    assert seen == [0, 1, 2]
    with pytest.raises(TimeoutError, match=r"waiting for 3 < 4"):
        await until(lambda: len(seen) >= 4, 0.05, lambda: f"{len(seen)} < 4", interval=0.01)
