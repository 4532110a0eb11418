"""Decode meeting a prefill engine (shared by the synthetic engine and vLLM's connector): incarnations, leases,
and where it may connect (the addresses of its deployment's prefill Service, :class:`PrefillService`)."""

from __future__ import annotations

import math
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvbridge_agent.core import CacheKind, KVLayout
from kvbridge_agent.core.admission import REMOTE_HOST_NOT_ALLOWED
from kvbridge_agent.core.handshake import HandshakeError, KVTransferParams, MemoryType, RankMetadata
from kvbridge_agent.transfer.peers import (
    LEASE_CLOCK_MARGIN_SECONDS,
    STALE_PEER,
    PrefillService,
    fetch_digests,
    fetch_prefill_ranks,
    lease_left,
    renew_leases,
    require_incarnation,
)
from kvbridge_agent.transfer.side_channel import SideChannelServer

FINGERPRINT = "f00d"


def rank(tp_rank: int, incarnation: str) -> tuple[RankMetadata, bytes]:
    meta = RankMetadata(
        engine_id="prefill-0",
        incarnation=incarnation,
        agent_name=f"a{tp_rank}",
        tp_rank=tp_rank,
        tp_size=2,
        block_size=16,
        kv_layout=KVLayout.HND,
        cache_kind=CacheKind.SPLIT,
        num_blocks=8,
        tensor_bases=[4096],
        region_block_bytes=64,
        wire_block_size=16,
        wire_layout=KVLayout.HND,
        memory_type=MemoryType.DRAM,
        device_id=0,
    )
    return meta, b"agent"


def params(port: int, incarnation: str = "i1", expires_at: float | None = None) -> KVTransferParams:
    return KVTransferParams(
        remote_engine_id="prefill-0",
        remote_incarnation=incarnation,
        remote_host="127.0.0.1",
        remote_port=port,
        remote_request_id="r1",
        remote_block_ids=[0],
        num_tokens=4,
        remote_tp_size=2,
        fingerprint=FINGERPRINT,
        expires_at=expires_at,
    )


@pytest.mark.parametrize(("served", "fails"), [({0: "i1", 1: "i1"}, False), ({0: "i1", 1: "i2"}, True)])
def test_every_rank_must_run_one_incarnation(served: dict[int, str], fails: bool) -> None:
    server = SideChannelServer("127.0.0.1", 0, FINGERPRINT, {r: rank(r, i) for r, i in served.items()}, None).start()
    try:
        if fails:  # a prefill restarting between two ranks' answers
            with pytest.raises(HandshakeError) as caught:
                fetch_prefill_ranks(params(server.port), [0, 1], FINGERPRINT, None, 5.0)
            assert caught.value.code == "PEER_INCOMPATIBLE"
        else:
            incarnation, ranks = fetch_prefill_ranks(params(server.port), [0, 1], FINGERPRINT, None, 5.0)
            assert incarnation == "i1"
            assert sorted(ranks) == [0, 1]
    finally:
        server.close()


def test_a_request_of_an_older_incarnation_is_stale() -> None:
    require_incarnation(params(1, "i1"), "i1")
    with pytest.raises(HandshakeError) as caught:
        require_incarnation(params(1, "i1"), "i2")
    assert caught.value.code == STALE_PEER
    assert "prefill it again" in caught.value.message


def test_the_lease_ends_a_clock_margin_early() -> None:
    assert lease_left(None) == math.inf
    assert lease_left(100.0, now=90.0) == pytest.approx(10.0 - LEASE_CLOCK_MARGIN_SECONDS)
    assert lease_left(100.0, now=100.0 - LEASE_CLOCK_MARGIN_SECONDS) == 0.0


# -- where decode connects: the prefill Service's addresses ------------------------------------------------------

SERVICE = "dd-prefill.ns.svc"


class FakeDNS:
    """A resolver of fixed answers that records what it was asked (a name it lacks: no such name)."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def __call__(self, name: str) -> list[str]:
        self.asked.append(name)
        if name not in self.answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.answers[name])


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def refused(service: PrefillService, host: str) -> str:
    with pytest.raises(HandshakeError) as caught:
        service.address(host)
    assert (caught.value.code, caught.value.field) == (REMOTE_HOST_NOT_ALLOWED, "kvTransferParams.remoteHost")
    return caught.value.message


def test_without_a_service_every_host_is_reachable_and_nothing_is_looked_up() -> None:
    dns = FakeDNS({})
    service = PrefillService(None, 1.0, lookup=dns)
    for host in ("169.254.169.254", "metadata.google.internal", "::1"):
        assert service.address(host) == host
    assert dns.asked == []


def test_only_the_service_s_addresses_are_reachable_and_other_names_are_never_looked_up() -> None:
    dns = FakeDNS({SERVICE: ["10.0.0.5", "fd00::5"]})
    service = PrefillService(SERVICE + ".", 1.0, lookup=dns, clock=Clock())
    assert service.address("10.0.0.5") == "10.0.0.5"
    assert service.address("fd00:0:0::5") == "fd00::5"  # connected to in its plain form
    for host in ("10.0.0.6", "169.254.169.254", "::ffff:10.0.0.5", "127.0.0.1"):
        assert "not among its 2 address(es)" in refused(service, host)
    # a name outside the Service (the Service itself names every prefill pod, not one): refused without a lookup
    for host in ("metadata.google.internal", SERVICE, "p-0.dd-prefill.ns.svc.evil", "dd-prefill.ns.svc.x"):
        assert "neither an address nor a name under it" in refused(service, host)
    assert set(dns.asked) == {SERVICE}


def test_a_name_under_the_service_is_reached_at_its_address_only_if_all_its_addresses_are_the_service_s() -> None:
    dns = FakeDNS(
        {
            SERVICE: ["10.0.0.5", "10.0.0.6"],
            "p-0.dd-prefill.ns.svc": ["10.0.0.6"],
            "p-1.dd-prefill.ns.svc": ["10.0.0.5", "10.9.9.9"],  # half of it elsewhere
        }
    )
    service = PrefillService(SERVICE, 1.0, lookup=dns, clock=Clock())
    assert service.address("P-0.dd-prefill.ns.svc") == "10.0.0.6"  # the address checked, not the name again
    assert "not among" in refused(service, "p-1.dd-prefill.ns.svc")
    assert "resolves to no address" in refused(service, "p-9.dd-prefill.ns.svc")
    params = KVTransferParams.model_validate({**PARAMS, "remoteHost": "p-0.dd-prefill.ns.svc"})
    assert service.admitted(params).remote_host == "10.0.0.6"
    assert service.admitted(params.model_copy(update={"remote_host": "10.0.0.5"})).remote_host == "10.0.0.5"


PARAMS = params(1).model_dump(by_alias=True)


def test_answers_are_cached_and_a_new_pod_is_looked_up_again_at_most_once_a_second() -> None:
    dns = FakeDNS({SERVICE: ["10.0.0.5"]})
    clock = Clock()
    service = PrefillService(SERVICE, 1.0, lookup=dns, clock=clock)
    assert service.address("10.0.0.5") == "10.0.0.5"
    assert service.address("10.0.0.5") == "10.0.0.5"
    assert dns.asked == [SERVICE]  # cached
    dns.answers[SERVICE] = ["10.0.0.5", "10.0.0.6"]  # a new prefill pod
    clock.now += 0.5
    refused(service, "10.0.0.6")  # the answer is half a second old: not looked up again yet
    assert dns.asked == [SERVICE]
    clock.now += 1.0
    assert service.address("10.0.0.6") == "10.0.0.6"  # a miss looks the Service up once more
    assert dns.asked == [SERVICE] * 2
    for _ in range(50):  # a flood of other hosts within the second: no more lookups
        refused(service, "10.6.6.6")
    assert dns.asked == [SERVICE] * 2
    clock.now += 5.0  # past the cache's 5 s: looked up again, even for a known host
    dns.answers[SERVICE] = ["10.0.0.6"]  # 10.0.0.5 is gone
    assert "not among its 1 address(es)" in refused(service, "10.0.0.5")
    assert dns.asked == [SERVICE] * 3


def test_a_failed_lookup_keeps_the_last_answer_and_says_why() -> None:
    dns = FakeDNS({SERVICE: ["10.0.0.5"]})
    clock = Clock()
    service = PrefillService(SERVICE, 1.0, lookup=dns, clock=clock)
    assert service.address("10.0.0.5") == "10.0.0.5"
    del dns.answers[SERVICE]  # cluster DNS down, or the Service gone
    clock.now += 10
    assert service.address("10.0.0.5") == "10.0.0.5"
    assert "the lookup failed: " in refused(service, "10.0.0.6")
    never = PrefillService(SERVICE, 1.0, lookup=FakeDNS({}), clock=clock)
    assert "the lookup failed: " in refused(never, "10.0.0.5")


def test_a_lookup_that_hangs_costs_one_timeout_and_its_answer_is_kept_when_it_comes() -> None:
    release = threading.Event()

    def slow(name: str) -> list[str]:
        release.wait(10)
        return ["10.0.0.5"]

    service = PrefillService(SERVICE, 0.2, lookup=slow)
    started = time.monotonic()
    assert "no answer within 0.2 s" in refused(service, "10.0.0.5")
    refused(service, "10.0.0.5")  # the same lookup is still in flight: not waited for again
    assert time.monotonic() - started < 0.6
    release.set()
    deadline = time.monotonic() + 5
    while service._pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.address("10.0.0.5") == "10.0.0.5"


@pytest.fixture
def stranger() -> Iterator[socket.socket]:
    """A TCP listener at an address outside the Service (what a forged remoteHost points at), to count connects."""
    listener = socket.socket()
    listener.bind(("127.0.0.2", 0))
    listener.listen(8)
    yield listener
    listener.close()


def connected(listener: socket.socket, wait: float = 0.3) -> bool:
    return bool(select.select([listener], [], [], wait)[0])


def test_handshakes_digests_and_heartbeats_connect_only_to_the_service_s_addresses(stranger: socket.socket) -> None:
    """Real lookups (``localhost``: 127.0.0.1, from the hosts file) and real sockets: a host outside the Service is
    refused before any connection by every path that connects (a handshake, a digest request, a heartbeat), one
    inside is reached."""
    beats: list[list[str]] = []

    def beat(ids: list[str]) -> list[str]:
        beats.append(ids)
        return ids

    server = SideChannelServer("127.0.0.1", 0, FINGERPRINT, {0: rank(0, "i1")}, None, on_heartbeat=beat).start()
    service = PrefillService("localhost", 2.0)
    try:
        outside = params(stranger.getsockname()[1]).model_copy(update={"remote_host": "127.0.0.2"})
        with pytest.raises(HandshakeError) as caught:
            fetch_prefill_ranks(outside, [0], FINGERPRINT, None, 1.0, service)
        assert caught.value.code == REMOTE_HOST_NOT_ALLOWED
        with pytest.raises(HandshakeError) as caught:
            fetch_digests(outside, FINGERPRINT, None, 1.0, time.time() + 5, service)
        assert caught.value.code == REMOTE_HOST_NOT_ALLOWED
        inside = params(server.port).model_copy(update={"lease_token": server.token("r1")})
        assert renew_leases({"d-out": outside, "d-in": inside}, service, FINGERPRINT, None).keys() == {"d-in"}
        assert beats == [["r1"]]
        assert not connected(stranger)  # nothing ever reached the stranger
        assert fetch_prefill_ranks(params(server.port), [0], FINGERPRINT, None, 2.0, service)[0] == "i1"
        # without the Service, the same parameters are connected to (what decode did before)
        with pytest.raises(HandshakeError):
            fetch_prefill_ranks(outside, [0], FINGERPRINT, None, 0.3)
        assert connected(stranger)
    finally:
        server.close()
