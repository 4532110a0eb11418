"""Router replicas' reports to each other: the frame (round trip, hostile frames), the view of the peers (fresh,
newest, bounded), the balancer's use of it, and two routers exchanging reports over HTTP in front of fake engines."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_router.peering import PeersError, parse_peers
from kvbridge_router.peers import (
    _DOMAIN,
    MAX_PEERS,
    VERSION,
    PeerFrameError,
    PeerView,
    Records,
    Report,
    decode,
    encode,
)
from kvbridge_router.pool import Balancer, Pool, Target
from kvbridge_router.prefixes import prefix_keys
from kvbridge_router.proxy import Router, RouterConfig, listening
from kvbridge_sim.support import free_port, until

from .test_proxy import FakeEngine

KEY = b"k" * 32
A, B = b"a" * 16, b"b" * 16

names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
keys = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=50)


@given(
    st.dictionaries(names, st.integers(0, 2**32 - 1), max_size=20),
    st.lists(st.tuples(names, keys), max_size=20),
    st.integers(0, 2**64 - 1),
)
@settings(max_examples=200, deadline=None)
def test_a_report_comes_back_as_it_was_sent(loads: dict[str, int], sent: list[Any], sequence: int) -> None:
    report = Report(A, sequence, loads, [(pod, list(ks)) for pod, ks in sent])
    back = decode(encode(report, KEY), KEY)
    assert back.replica == A
    assert back.sequence == sequence
    assert {p: c for p, c in back.loads.items() if p in loads} == loads
    assert all(back.loads[p] == 0 for p in back.loads if p not in loads)  # pods named only by records: 0
    assert [(p, list(k)) for p, k in back.sent] == report.sent


def test_a_decoded_reports_records_read_as_used_are_its_records() -> None:
    sent = [("p-0", [1, 2, 3]), ("p-1", []), ("p-0", [-4]), ("p-2", [5, 6])]
    records = decode(encode(Report(A, 1, {}, sent), KEY), KEY).sent
    assert isinstance(records, Records)
    assert list(records) == sent
    assert (len(records), records.key_count()) == (4, 6)
    assert (records[0], records[-1], records[1:3], records[::2]) == (sent[0], sent[-1], sent[1:3], sent[::2])
    assert list(records.between(1, 3)) == sent[1:3]
    # records from the first holding 3 keys at most: the first two (3 and 0 keys); at least one, whatever it holds
    assert (records.stop_after(0, 3), records.stop_after(0, 2), records.stop_after(1, 1)) == (2, 1, 3)
    assert records.stop_after(3, 9) == 4
    with pytest.raises(IndexError):
        records[4]


def signed(body: bytes, key: bytes = KEY) -> bytes:
    return body + hmac.new(key, _DOMAIN + body, hashlib.sha256).digest()


def head(pods: int, version: int = VERSION) -> bytes:
    return struct.pack("<4sB16sQQH", b"KVBP", version, A, 1, 0, pods)


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"", "TRUNCATED"),
        (signed(head(0) + b"\0\0\0\0")[:-1] + b"?", "BAD_SIGNATURE"),  # (its last byte is not "?": checked)
        (signed(head(0), b"x" * 32), "BAD_SIGNATURE"),
        (signed(head(0, version=VERSION - 1) + b"\0\0\0\0"), "VERSION"),  # the version before
        (signed(head(0, version=VERSION + 1) + b"\0\0\0\0"), "VERSION"),
        (signed(head(0)), "TRUNCATED"),  # no record count
        (signed(head(1) + b"\x05\x00ab"), "TRUNCATED"),  # a name longer than the frame
        (signed(head(1) + b"\x02\x00\xff\xfe" + b"\0" * 8), "BAD_NAME"),
        (signed(head(5000)), "TOO_MANY_PODS"),
        (signed(head(0) + b"\0\0\0\0" + b"x"), "TRAILING_BYTES"),
        # one pod, one record naming pod 3
        (signed(head(1) + b"\x01\x00p" + b"\0" * 4 + b"\x01\0\0\0" + b"\x03\0" + b"\x00\0"), "BAD_POD_INDEX"),
        # a record announcing 2 keys, holding 1
        (signed(head(1) + b"\x01\x00p" + b"\0" * 4 + b"\x01\0\0\0" + b"\0\0" + b"\x02\0" + b"\0" * 8), "TRUNCATED"),
        (signed(head(0) + b"\xff\xff\x01\0"), "TOO_MANY_RECORDS"),
        (b"\0" * (5 << 20), "TOO_LARGE"),
    ],
)
def test_a_frame_that_is_no_report_is_refused_with_its_code(frame: bytes, code: str) -> None:
    assert signed(head(0) + b"\0\0\0\0")[-1:] != b"?"
    with pytest.raises(PeerFrameError) as refused:
        decode(frame, KEY)
    assert refused.value.code == code


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_any_damage_to_a_frame_is_a_frame_error_never_another(data: st.DataObject) -> None:
    frame = bytearray(encode(Report(A, 7, {"p-0": 3, "p-1": 1}, [("p-0", [1, 2, 3]), ("p-1", [-4])]), KEY))
    cut = data.draw(st.integers(0, len(frame)))
    flips = data.draw(st.lists(st.integers(0, len(frame) - 1), max_size=3))
    for at in flips:
        frame[at] ^= 0xFF
    damaged = bytes(frame[:cut]) + data.draw(st.binary(max_size=8))
    # a frame error, never another exception (a report that survives is one that was sent: flips undone)
    with contextlib.suppress(PeerFrameError):
        decode(damaged, KEY)


def test_the_view_keeps_each_replicas_newest_fresh_report_and_never_its_own() -> None:
    view = PeerView(me=A, fresh=1.0)
    assert view.admit(Report(A, 1, {"p": 5}), now=0.0, wall=0.0) == "stale"  # its own, through the Service
    assert view.admit(Report(B, 2, {"p": 2, "q": 1}), now=0.0, wall=0.0) == "accepted"
    assert view.admit(Report(B, 1, {"p": 9}), now=0.1, wall=0.1) == "stale"  # older: a replay or a late packet
    assert view.admit(Report(b"c" * 16, 1, {"p": 1}, sent_at_ms=500), now=0.5, wall=0.5) == "accepted"
    assert view.loads(now=0.6) == ({"p": 3, "q": 1}, 2)
    assert view.loads(now=1.2) == ({"p": 1}, 1)  # B stopped reporting: its counts go
    assert view.loads(now=2.0) == ({}, 0)


def test_a_report_replayed_after_its_replica_went_stale_is_still_refused() -> None:
    view = PeerView(me=A, fresh=1.0)
    report = Report(B, 5, {"p": 7})
    assert view.admit(report, now=0.0, wall=0.0) == "accepted"
    assert view.loads(now=1.6) == ({}, 0)  # stale: B's counts go
    # but its sequence number is remembered: the replay changes nothing
    assert view.admit(report, now=1.6, wall=1.6) == "stale"
    assert view.loads(now=1.6) == ({}, 0)
    assert view.admit(Report(B, 6, {"p": 1}, sent_at_ms=1700), now=1.7, wall=1.7) == "accepted"  # a newer one
    # long after, B's sequence forgotten (a restart reusing an id: never, ids are random)
    assert view.admit(Report(B, 1, {"p": 1}, sent_at_ms=30_000), now=30.0, wall=30.0) == "accepted"


def test_the_view_holds_a_bounded_number_of_replicas() -> None:
    view = PeerView(me=A, fresh=10.0)
    taken = [
        view.admit(Report(i.to_bytes(16, "little"), 1, {"p": 1}), now=0.0, wall=0.0) for i in range(1, MAX_PEERS + 5)
    ]
    assert taken.count("accepted") == MAX_PEERS
    assert view.loads(now=0.0) == ({"p": MAX_PEERS}, MAX_PEERS)


def test_peers_are_a_list_of_urls_or_one_name_to_resolve() -> None:
    assert parse_peers("http://10.0.0.1:8000, http://10.0.0.2:8000/") == (
        ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
        None,
    )
    assert parse_peers("dns:dd-router-peers.ns.svc:8000") == ([], ("dd-router-peers.ns.svc", 8000))
    for bad in (
        "dns:name",
        "dns::80",
        "10.0.0.1:8000",
        "http://host",
        "dns:x:99999",
        "http://h:99999",
        "http://:8080",
        "https://h:1",
        "http://h:1/path",
        "http://h:0",
        "http://user:pass@h:1",
        " , ",
        "dns:a.svc:8000,http://10.0.0.1:8000",
        "dns: :80",
        "http://[::1:80",
    ):
        with pytest.raises(PeersError):
            parse_peers(bad)


def pool(pods: int) -> Pool:
    return Pool(
        tuple(Target(f"p-{i}", f"http://10.0.0.{i}:8000", "k") for i in range(pods)),
        (Target("d-0", "http://10.0.1.0:8000", "k"),),
    )


def least_loaded(balancer: Balancer, p: Pool) -> str:
    chosen = balancer.pick(p.prefill)
    assert chosen is not None
    return chosen.pod


def test_a_replica_counts_its_peers_requests_and_its_own_for_each_peer_unheard() -> None:
    balancer = Balancer(replicas=3)
    p = pool(2)
    balancer.started("p-0")
    # no report yet: its own counts three times, so p-1 is chosen
    assert least_loaded(balancer, p) == "p-1"
    balancer.set_peers({"p-1": 4}, heard=2)  # both peers heard: p-1 carries 4 of theirs, p-0 this one's 1
    assert balancer.unheard == 0
    assert least_loaded(balancer, p) == "p-0"
    balancer.set_peers({"p-1": 4}, heard=1)  # one peer unheard: p-0 counts 2, p-1 4
    assert least_loaded(balancer, p) == "p-0"
    balancer.set_peers({}, heard=0)
    assert balancer.unheard == 2
    assert least_loaded(balancer, p) == "p-1"


@contextlib.asynccontextmanager
async def two_replicas(
    interval: float = 0.05, more_peers: tuple[str, ...] = ()
) -> AsyncIterator[tuple[list[str], list[Router], list[FakeEngine]]]:
    engines = [FakeEngine(f"prefill-{i}") for i in range(4)] + [FakeEngine("decode-0")]
    for engine in engines:
        await engine.start()
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    routers: list[Router] = []
    servers: list[contextlib.AsyncExitStack] = []  # closed in the order started, as replicas stop one by one
    status = {
        "prefill": {"endpoints": [e.endpoint for e in engines[:4]]},
        "decode": {"endpoints": [engines[4].endpoint]},
    }
    try:
        for port in ports:
            config = RouterConfig(
                replicas=2, peers=",".join((*urls, *more_peers)), peer_interval=interval, peer_key=KEY
            )
            router = Router(config)
            router.set_pool(Pool.from_status(status))
            servers.append(contextlib.AsyncExitStack())
            await servers[-1].enter_async_context(listening(router, port=port))
            routers.append(router)
        yield urls, routers, engines
    finally:
        for server in servers:
            await server.aclose()
        for engine in engines:
            if engine.server is not None:
                await engine.server.close()


def pod_of(engines: list[FakeEngine], prompt: list[int]) -> str:
    """The prefill engine that was sent ``prompt``."""
    return next(e.name for e in engines if any(body["prompt"] == prompt for body in e.received))


async def test_a_replica_knows_what_the_other_sent_where_and_its_requests_in_flight() -> None:
    prompts = [[1000 * n + i for i in range(64)] for n in range(12)]
    async with two_replicas() as (urls, routers, engines), aiohttp.ClientSession() as session:
        await until(
            lambda: all(r.metrics.peers._value.get() == 1 for r in routers), 5, "the replicas to hear each other"
        )
        for prompt in prompts:  # replica 0 places each prompt on a pod
            async with session.post(urls[0] + "/v1/completions", json={"prompt": prompt}) as r:
                assert r.status == 200
        placed = {tuple(p): pod_of(engines[:4], p) for p in prompts}
        index = routers[1].balancer.prefixes

        def told(prompt: list[int]) -> bool:
            keys = prefix_keys({"prompt": prompt}, 16)
            return index.matched(placed[tuple(prompt)], keys) == len(keys)

        # replica 1 was sent none of them: it knows each whole prompt's pod from the reports
        await until(lambda: all(told(p) for p in prompts), 5, "replica 0's records in replica 1's index")
        for engine in engines:
            engine.received.clear()
        for prompt in prompts:  # and sends each where replica 0 did
            async with session.post(urls[1] + "/v1/completions", json={"prompt": prompt}) as r:
                assert r.status == 200
        assert {tuple(p): pod_of(engines[:4], p) for p in prompts} == placed
        # replica 0's requests in flight are counted by replica 1 (its own: none)
        for engine in engines:
            engine.delay = 1.0
        calls = [
            asyncio.ensure_future(session.post(urls[0] + "/v1/completions", json={"prompt": [i]})) for i in range(4)
        ]
        await until(
            lambda: sum(routers[1].balancer._peer_loads.values()) >= 4, 5, "replica 0's calls in replica 1's view"
        )
        assert routers[1].balancer.outstanding == {}
        for call in calls:
            (await call).release()
    assert routers[1].metrics.peer_reports.labels("received", "accepted")._value.get() > 0
    sent = routers[0].metrics.peer_reports
    assert sent.labels("sent", "delivered")._value.get() > 0  # as the sender sees it too
    assert sent.labels("sent", "unreachable")._value.get() == 0


async def test_a_report_that_is_not_one_is_refused_and_changes_nothing() -> None:
    async with two_replicas(interval=10.0) as (urls, routers, _), aiohttp.ClientSession() as session:
        now = int(time.time() * 1000)
        forged = encode(Report(B, 1, {"prefill-0": 1000}, [("prefill-0", [1, 2, 3])], now), b"not the key" * 3)
        for body in (forged, b"", b"KVBP" + b"\0" * 100):
            async with session.post(urls[0] + "/internal/peer-report", data=body) as r:
                assert r.status == 400
                assert (await r.text()) in ("BAD_SIGNATURE", "TRUNCATED")
        assert routers[0].balancer.prefixes.size() == 0
        assert sum(routers[0].balancer._peer_loads.values()) == 0
        # a report from a pod name the pool does not hold is taken, its records of that pod are not
        old = encode(Report(B, 1, {"prefill-0": 2}, [("prefill-1", [5, 6])], now - 60_000), KEY)
        async with session.post(urls[0] + "/internal/peer-report", data=old) as r:  # a replay, a minute late
            assert (r.status, await r.text()) == (400, "expired")
        assert routers[0].balancer.prefixes.matched("prefill-1", [5, 6]) == 0
        async with session.post(urls[0] + "/internal/peer-report", data=b"x" * (5 << 20)) as r:
            assert r.status == 413
        good = encode(Report(B, 2, {"prefill-0": 2}, [("elsewhere", [1, 2]), ("prefill-1", [5, 6])], now), KEY)
        async with session.post(urls[0] + "/internal/peer-report", data=good) as r:
            assert (r.status, await r.text()) == (200, "accepted")
        assert routers[0].balancer.prefixes.matched("prefill-1", [5, 6]) == 2
        assert routers[0].balancer.prefixes.matched("elsewhere", [1, 2]) == 0


async def test_a_peer_that_never_answers_costs_its_own_reports_only() -> None:
    """A replica that accepts connections and answers nothing (a dead node still in DNS): the two live replicas
    keep hearing each other every interval; the reports to it time out and the next ones to it are skipped."""
    hung: list[asyncio.StreamWriter] = []

    async def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hung.append(writer)  # never answered

    silent = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    try:
        async with two_replicas(more_peers=(f"http://127.0.0.1:{port}",)) as (_, routers, _engines):
            await until(lambda: all(r.metrics.peers._value.get() == 1 for r in routers), 5, "the replicas to hear")
            heard = []
            for _ in range(30):  # 1.5 s: longer than a send's bound, and than a report stays fresh
                await asyncio.sleep(0.05)
                heard.append(min(fresh_peers(r) for r in routers))
            assert min(heard) == 1
            skipped = routers[0].metrics.peer_reports.labels("sent", "skipped")._value.get()
            assert skipped > 0
    finally:
        for writer in hung:
            writer.close()
        silent.close()
        await silent.wait_closed()


def fresh_peers(router: Router) -> int:
    """The replicas a router has a fresh report of (what its balancer counts as heard)."""
    assert router.exchange is not None
    return len(tuple(router.exchange.view.replicas(time.monotonic())))


async def test_a_name_is_resolved_in_the_background_and_its_addresses_used() -> None:
    """dns:NAME:PORT: the first report goes nowhere (the name is being resolved), the next ones to its addresses."""
    from kvbridge_router.metrics import RouterMetrics
    from kvbridge_router.peering import Exchange

    exchange = Exchange(Balancer(replicas=2), RouterMetrics(), KEY, "dns:localhost:8123", 0.05, frozenset)
    assert exchange._addresses() == []
    assert exchange._resolving is not None
    await exchange._resolving
    assert "http://127.0.0.1:8123" in exchange._addresses()
