"""The side channel over real sockets: CURVE authentication, fingerprints, bad frames, a listener that keeps serving."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from kvbridge_agent.core.digest import RequestDigests, new_key
from kvbridge_agent.core.handshake import (
    DigestState,
    HandshakeError,
    KVTransferParams,
    MessageType,
    RankMetadata,
    decode_ack,
    decode_reply,
    encode_request,
)
from kvbridge_agent.transfer import side_channel
from kvbridge_agent.transfer.keys import CurveKeys, KeysError, generate_keys, load_keys
from kvbridge_agent.transfer.side_channel import SideChannelClient, SideChannelServer, send_heartbeats
from kvbridge_sim.support import free_port, wait_until

META = RankMetadata(
    engine_id="p-0",
    incarnation="abc",
    agent_name="p-0.abc.0",
    tp_rank=0,
    tp_size=1,
    block_size=16,
    kv_layout="HND",
    cache_kind="Split",
    num_blocks=8,
    tensor_bases=[4096, 8192],
    region_block_bytes=1024,
    wire_block_size=16,
    wire_layout="HND",
    memory_type="DRAM",
    device_id=0,
)


@pytest.fixture
def server(keys: CurveKeys) -> Iterator[SideChannelServer]:
    beats: list[list[str]] = []

    def renew(request_ids: list[str]) -> list[str]:  # an engine holding every request but "gone"
        beats.append(request_ids)
        return [r for r in request_ids if r != "gone"]

    srv = SideChannelServer("127.0.0.1", 0, "fp", {0: (META, b"agent-0")}, keys=keys, on_heartbeat=renew)
    srv.beats = beats  # type: ignore[attr-defined]
    srv.start()
    try:
        yield srv
    finally:
        srv.close()


def client(
    server: SideChannelServer, keys: CurveKeys | None, fingerprint: str = "fp", timeout: float = 2.0
) -> SideChannelClient:
    return SideChannelClient("127.0.0.1", server.port, fingerprint, keys, timeout)


def raw_request(server: SideChannelServer, keys: CurveKeys, frames: list[bytes]) -> list[bytes]:
    """Send raw frames over an authenticated REQ socket; the listener's reply frames."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys.public, keys.public, keys.secret
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        sock.send_multipart(frames)
        assert sock.poll(3000), "the listener did not answer"
        reply: list[bytes] = sock.recv_multipart()
        return reply
    finally:
        sock.close()


def test_authenticated_client_gets_metadata(server: SideChannelServer, keys: CurveKeys) -> None:
    ranks = client(server, keys).fetch([0])
    assert ranks == {0: (META, b"agent-0")}


def test_client_without_the_key_gets_nothing(server: SideChannelServer, tmp_path: Path) -> None:
    for stranger in (None, generate_keys(tmp_path / "other")):
        started = time.monotonic()
        with pytest.raises(HandshakeError) as caught:
            client(server, stranger, timeout=0.5).fetch([0])
        assert caught.value.code == "HANDSHAKE_TIMEOUT"
        assert time.monotonic() - started < 3
    assert server.stats.served == 0


def test_wrong_fingerprint_and_unknown_rank_are_refused_and_the_listener_keeps_serving(
    server: SideChannelServer, keys: CurveKeys
) -> None:
    with pytest.raises(HandshakeError) as caught:
        client(server, keys, fingerprint="other").fetch([0])
    assert caught.value.code == "FINGERPRINT_MISMATCH"
    with pytest.raises(HandshakeError) as caught:
        client(server, keys).fetch([5])
    assert caught.value.code == "UNKNOWN_RANK"
    assert client(server, keys).fetch([0])[0][0] == META
    assert server.stats.rejected == 2


@pytest.mark.parametrize(
    "frames",
    [
        [b"\x00\xff garbage"],
        [b'{"version": 1'],
        [b"{}", b"two", b"three"],
        [b""],
        [b"x" * 10_000],
        [b"[" * 3000],
        [b'{"a":' * 800 + b"1" + b"}" * 800],
    ],
    ids=["garbage", "truncated", "extra-frames", "empty", "long", "nested-lists", "nested-objects"],
)
def test_garbage_frames_get_an_error_reply(server: SideChannelServer, keys: CurveKeys, frames: list[bytes]) -> None:
    with pytest.raises(HandshakeError) as caught:
        decode_reply(raw_request(server, keys, frames), "fp")
    assert caught.value.code in {"MALFORMED_MESSAGE", "UNKNOWN_MESSAGE_TYPE"}
    assert client(server, keys).fetch([0])[0][0] == META


def test_heartbeats_reach_the_engine(server: SideChannelServer, keys: CurveKeys) -> None:
    named = [("r1", server.token("r1")), ("r2", server.token("r2")), ("r3", "forged")]
    assert client(server, keys).heartbeat(named) == {"r1", "r2"}  # what prefill renewed, and only that
    assert server.beats == [["r1", "r2"]]  # type: ignore[attr-defined]
    assert server.stats.not_offered == 1
    assert client(server, keys).heartbeat([("r4", server.token("r1"))]) == set()  # another request's token
    assert server.beats == [["r1", "r2"]]  # type: ignore[attr-defined]
    assert client(server, keys).heartbeat([("gone", server.token("gone"))]) == set()  # freed: not renewed


def offered(server: SideChannelServer, request_id: str) -> KVTransferParams:
    """The transfer parameters the listener's engine would have handed out for ``request_id`` (its lease token)."""
    return KVTransferParams(
        remote_engine_id="p",
        remote_incarnation="i",
        remote_host="127.0.0.1",
        remote_port=server.port,
        remote_request_id=request_id,
        remote_block_ids=[0],
        num_tokens=1,
        remote_tp_size=1,
        fingerprint="fp",
        lease_token=server.token(request_id),
    )


def test_decode_counts_a_lease_renewed_only_where_prefill_says_so(server: SideChannelServer, keys: CurveKeys) -> None:
    forged = offered(server, "other").model_copy(update={"lease_token": "0" * 32})
    waiting = {"d-held": offered(server, "held"), "d-gone": offered(server, "gone"), "d-forged": forged}
    renewed = send_heartbeats(waiting, "fp", keys)
    assert set(renewed) == {"d-held"}  # a freed request, or one named with a wrong token, is not renewed


def test_an_acknowledgement_that_does_not_name_renewals_is_an_older_listeners(
    server: SideChannelServer, keys: CurveKeys, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert decode_ack([b'{"version": 3, "fingerprint": "fp", "renewed": []}'], "fp") == []
    assert decode_ack([b'{"version": 3, "fingerprint": "fp"}'], "fp") is None
    with pytest.raises(HandshakeError):
        decode_ack([b'{"version": 3, "fingerprint": "fp", "renewed": "all"}'], "fp")
    # a listener from before renewals were named renewed what it held of those named: counted as before
    monkeypatch.setattr(
        side_channel, "encode_ack", lambda fingerprint, renewed=(): [b'{"version":3,"fingerprint":"fp"}']
    )
    assert client(server, keys).heartbeat([("r1", server.token("r1")), ("gone", server.token("gone"))]) == {
        "r1",
        "gone",
    }


def test_many_waiting_requests_are_renewed_in_heartbeats_that_fit_a_header(
    server: SideChannelServer, keys: CurveKeys
) -> None:
    waiting = {f"d{i}": offered(server, f"cmpl-{i:04d}-" + "x" * 48) for i in range(150)}  # ~13 KB of ids and tokens
    renewed = send_heartbeats(waiting, "fp", keys)
    assert set(renewed) == set(waiting)  # none lost to an oversized header
    assert len(server.beats) > 1  # type: ignore[attr-defined]
    assert server.stats.heartbeats == len(server.beats)  # type: ignore[attr-defined]


def test_nobody_listening_times_out(keys: CurveKeys) -> None:
    started = time.monotonic()
    with pytest.raises(HandshakeError) as caught:
        SideChannelClient("127.0.0.1", free_port(), "fp", keys, 0.3).fetch([0])
    assert caught.value.code == "HANDSHAKE_TIMEOUT"
    assert time.monotonic() - started < 2


def test_request_without_envelope_version(server: SideChannelServer, keys: CurveKeys) -> None:
    frames = encode_request(MessageType.METADATA, "fp", rank=0)
    frames[0] = frames[0].replace(b'"version":3', b'"version":1')
    with pytest.raises(HandshakeError) as caught:
        decode_reply(raw_request(server, keys, frames), "fp")
    assert caught.value.code == "PROTOCOL_VERSION_MISMATCH"


def test_key_files_are_checked(tmp_path: Path) -> None:
    generate_keys(tmp_path / "a")
    generate_keys(tmp_path / "b")
    assert oct((tmp_path / "a" / "curve-secret").stat().st_mode & 0o777) == "0o600"
    (tmp_path / "a" / "curve-public").write_bytes((tmp_path / "b" / "curve-public").read_bytes())
    with pytest.raises(KeysError, match="does not belong"):
        load_keys(tmp_path / "a")
    with pytest.raises(KeysError, match="cannot read"):
        load_keys(tmp_path / "missing")
    (tmp_path / "b" / "curve-secret").write_text("short")
    with pytest.raises(KeysError, match="40-character"):
        load_keys(tmp_path / "b")


def test_a_frame_over_the_size_limit_is_dropped_and_the_listener_keeps_serving(
    server: SideChannelServer, keys: CurveKeys
) -> None:
    """Issue 13 #1: ZMQ_MAXMSGSIZE drops the peer before anything is allocated for a 100 MB frame."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys.public, keys.public, keys.secret
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        sock.send_multipart([b"x" * (100 << 20)])
        assert not sock.poll(1000), "a frame over the limit got an answer"
    finally:
        sock.close()
    assert server.alive
    assert client(server, keys).fetch([0])[0][0] == META


def test_nested_headers_are_refused_before_parsing() -> None:
    from kvbridge_agent.core.handshake import decode_request

    for frame in (b"[" * 3000, b"[" * 20 + b"]" * 20, b'{"a":' * 3000):
        with pytest.raises(HandshakeError) as caught:
            decode_request([frame], "fp")
        assert caught.value.code == "MALFORMED_MESSAGE"


def test_digests_travel_only_to_a_keyed_client_and_bad_digest_requests_are_refused(
    keys: CurveKeys, tmp_path: Path
) -> None:
    """The digest message (docs/protocol.md §8): ready digests arrive bit for bit with the request's key, a request
    still being digested is pending, anything else unknown; a request naming several ids or no id is refused; a
    client without the key gets nothing."""
    row = np.array([1, 2**64 - 1, 12345], dtype=np.uint64)
    key = new_key()
    published = RequestDigests(key, {0: row, 3: row[::-1].copy()})
    table = {"ready": (DigestState.READY, published), "soon": (DigestState.PENDING, None)}
    srv = SideChannelServer(
        "127.0.0.1",
        0,
        "fp",
        {0: (META, b"agent-0")},
        keys=keys,
        digests=lambda rid: table.get(rid, (DigestState.UNKNOWN, None)),
    ).start()
    try:
        state, found = client(srv, keys).digests("ready", srv.token("ready"))
        assert state is DigestState.READY
        assert found is not None
        assert found.key == key
        assert sorted(found.heads) == [0, 3]
        assert found.heads[0].tolist() == row.tolist()
        assert client(srv, keys).digests("soon", srv.token("soon")) == (DigestState.PENDING, None)
        assert client(srv, keys).digests("other", srv.token("other")) == (DigestState.UNKNOWN, None)
        # a keyed peer that was not handed the request's parameters gets nothing
        assert client(srv, keys).digests("ready", srv.token("soon")) == (DigestState.UNKNOWN, None)
        for ids in ([("a", srv.token("a")), ("b", srv.token("b"))], []):
            frames = encode_request(MessageType.DIGEST, "fp", requests=ids)
            assert b"MALFORMED_MESSAGE" in raw_request(srv, keys, frames)[0]
        with pytest.raises(HandshakeError):
            client(srv, generate_keys(tmp_path / "stranger"), timeout=0.5).digests("ready", srv.token("ready"))
        assert client(srv, keys).digests("ready", srv.token("ready"))[0] is DigestState.READY  # still serving
    finally:
        srv.close()


def test_close_never_closes_the_socket_under_a_listener_still_answering(keys: CurveKeys) -> None:
    """A callback that does not return holds the listener thread past close's wait: close returns in time and
    leaves the socket to the thread (closing a ZMQ socket under the thread using it corrupts memory); once the
    callback returns, the answer still goes out and the thread closes the socket and frees the port."""
    held, entered = threading.Event(), threading.Event()

    def renew(request_ids: list[str]) -> list[str]:
        entered.set()
        held.wait(10)
        return request_ids

    srv = SideChannelServer("127.0.0.1", 0, "fp", {0: (META, b"agent-0")}, keys=keys, on_heartbeat=renew).start()
    answers: list[set[str]] = []
    asking = threading.Thread(
        target=lambda: answers.append(client(srv, keys, timeout=10).heartbeat([("r", srv.token("r"))]))
    )
    asking.start()
    try:
        assert entered.wait(5), "the heartbeat never reached the callback"
        began = time.monotonic()
        srv.close(timeout=0.3)
        assert time.monotonic() - began < 2  # no wait past its bound
        assert not srv._socket.closed  # left to the thread that uses it
        assert not srv.alive  # closed: no longer serving, even while that thread ends
    finally:
        held.set()
        asking.join(timeout=15)
    assert answers == [{"r"}]  # the answer went out on the socket close left open
    # the thread ends after it has closed the socket and terminated the context (the listening port is free then)
    wait_until(lambda: srv._socket.closed and not srv._thread.is_alive(), 5, "the listener to close its socket, end")
    with zmq.Context() as context, context.socket(zmq.ROUTER) as again:  # the port is free again
        again.bind(f"tcp://127.0.0.1:{srv.port}")
    srv.close()  # a second close does nothing


def test_a_reply_frame_over_the_limit_is_refused_before_it_is_allocated(keys: CurveKeys) -> None:
    """A listener (or something on its port) answering with a 256 MiB frame: the client's ZMQ drops it as it
    arrives (ZMQ_MAXMSGSIZE), so the client neither allocates it nor hangs. Before the limit a 256 MiB frame cost
    the client 512 MiB of peak memory before it was refused. Run in a child process to measure its peak."""
    import subprocess
    import sys

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.curve_server = True
    router.curve_publickey, router.curve_secretkey = keys.public, keys.secret
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def answer_hugely() -> None:
        big = b"x" * (256 << 20)
        try:
            while not stop.is_set():
                if router.poll(100):
                    identity, *_ = router.recv_multipart()
                    router.send_multipart([identity, b"", b"{}", big, b"agent"])
        finally:  # closed by the thread that uses it: a ZMQ socket closed under another thread's send or poll
            router.close()  # failed that call (ENOTSOCK) or aborted the process in the next test (libzmq)

    thread = threading.Thread(target=answer_hugely, daemon=True)
    thread.start()
    script = f"""
import resource, sys
from kvbridge_agent.core.handshake import HandshakeError
from kvbridge_agent.transfer.keys import CurveKeys
from kvbridge_agent.transfer.side_channel import SideChannelClient
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    SideChannelClient("127.0.0.1", {port}, "fp", CurveKeys({keys.public!r}, {keys.secret!r}), 3).fetch([0])
except HandshakeError as exc:
    print(exc.code)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive(), "the huge answerer did not stop"
    code, grown = done.stdout.split()
    assert code == "HANDSHAKE_TIMEOUT"
    assert int(grown) < 64, f"the client's peak memory grew by {grown} MiB"


def test_a_side_channel_on_an_ipv6_address_is_reached(keys: CurveKeys) -> None:
    """A pod's IP may be IPv6 (an IPv6-only cluster): the listener binds it and decode reaches it, which ZeroMQ
    does only with IPV6 set and the address in brackets (before, every such handshake timed out)."""
    srv = SideChannelServer("::1", 0, "fp", {0: (META, b"agent-0")}, keys=keys).start()
    try:
        assert SideChannelClient("::1", srv.port, "fp", keys, 2.0).fetch([0]) == {0: (META, b"agent-0")}
    finally:
        srv.close()


def test_digest_exchanges_reuse_one_connection_per_thread_and_drop_a_stuck_one(keys: CurveKeys, tmp_path: Path) -> None:
    """A decode thread asking one prefill engine for many requests' digests pays the CURVE handshake once: the
    socket is kept after a whole exchange, reused by the next, and closed (never kept) after one that failed."""
    published = RequestDigests(new_key(), {0: np.array([7], dtype=np.uint64)})
    srv = SideChannelServer(
        "127.0.0.1", 0, "fp", {0: (META, b"agent-0")}, keys=keys, digests=lambda rid: (DigestState.READY, published)
    ).start()
    endpoint = ("tcp://127.0.0.1:" + str(srv.port), keys.secret)
    try:
        side_channel._KEPT.sockets.pop(endpoint, None)
        assert client(srv, keys).digests("r", srv.token("r"))[0] is DigestState.READY
        kept = side_channel._KEPT.sockets[endpoint]
        for _ in range(5):
            assert client(srv, keys).digests("r", srv.token("r"))[0] is DigestState.READY
        assert side_channel._KEPT.sockets[endpoint] is kept
        stranger = generate_keys(tmp_path / "stranger")
        with pytest.raises(HandshakeError):  # no answer: that socket is closed, not kept
            client(srv, stranger, timeout=0.3).digests("r", srv.token("r"))
        assert ("tcp://127.0.0.1:" + str(srv.port), stranger.secret) not in side_channel._KEPT.sockets
    finally:
        srv.close()
        socket = side_channel._KEPT.sockets.pop(endpoint, None)
        if socket is not None:
            socket.close(linger=0)
