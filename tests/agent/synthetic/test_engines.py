"""Engines as processes: leases, heartbeats, notifications, bad input, a killed and restarted prefill, cleanup."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings, TransferSettings, Verification
from kvbridge_agent.core.contract import EngineEnvironment
from kvbridge_agent.core.digest import KV_DIGEST_MISMATCH, KV_DIGEST_UNAVAILABLE
from kvbridge_agent.core.handshake import HandshakeError, KVTransferParams
from kvbridge_agent.synthetic.processes import EngineProcess, start_engine
from kvbridge_agent.transfer.keys import CurveKeys, generate_keys
from kvbridge_agent.transfer.side_channel import SideChannelClient
from kvbridge_agent.transfer.transport import Transport
from kvbridge_sim.support import running, wait_until
from tests.kv_faults import overwrite_prefill_kv

MODEL = ModelGeometry(name="tiny", num_layers=2, num_kv_heads=8, head_dim=32)
TRANSFER = TransferSettings(lease_seconds=3, handshake_timeout_seconds=2)


def env(
    role: Role, engine_id: str, keys_dir: Path, *, tp_p: int = 2, model: ModelGeometry = MODEL
) -> EngineEnvironment:
    return EngineEnvironment(
        role=role,
        engine_id=engine_id,
        model=model,
        prefill=RoleSettings(tensor_parallel_size=tp_p),
        decode=RoleSettings(tensor_parallel_size=1),
        transfer=TRANSFER,
        keys_dir=str(keys_dir),
        num_blocks=64,
        http_port=0,
        side_channel_listen_port=0,
        transfer_timeout_seconds=5,
    )


class Cluster:
    def __init__(self, root: Path) -> None:
        self.keys_dir = root / "keys"
        self.keys: CurveKeys = generate_keys(self.keys_dir)
        self.engines: list[EngineProcess] = []
        self.pids: set[int] = set()
        #: the inodes of the sockets the engines listen on (HTTP, side channel), taken once each is ready
        self.sockets: set[int] = set()

    def start(self, environment: EngineEnvironment) -> EngineProcess:
        engine = start_engine(environment)
        self.engines.append(engine)
        self.pids.update(engine.pids)
        ports = [p for p in (engine.ready["httpPort"], engine.ready.get("sideChannelPort")) if p]
        listening = _listening_sockets()
        found = {inode for port in ports for inode in listening.get(port, set())}
        assert found, f"none of the engine's ports {ports} is listened on"
        self.sockets |= found
        return engine

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    built = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        built.prefill = built.start(env(Role.PREFILL, "p1", built.keys_dir))  # type: ignore[attr-defined]
        built.spare = built.start(env(Role.PREFILL, "p2", built.keys_dir, tp_p=1))  # type: ignore[attr-defined]
        built.decode = built.start(env(Role.DECODE, "d1", built.keys_dir))  # type: ignore[attr-defined]
        _handshake(built.prefill, built.decode)  # type: ignore[attr-defined]
        yield built
    finally:
        built.stop()
    time.sleep(0.5)
    leftovers = [pid for pid in built.pids if running(pid)]
    assert leftovers == [], f"processes left behind: {leftovers}"
    # every socket the engines listened on is closed; the port itself may already be another test's (pytest-xdist
    # workers' servers and connections take freed ports), so the sockets are told apart by inode, not by port
    still = {inode for inodes in _listening_sockets().values() for inode in inodes} & built.sockets
    assert not still, f"the engines' listening sockets {sorted(still)} are still open"


def _handshake(p: EngineProcess, d: EngineProcess) -> None:
    """Decode meets prefill before the tests: a first read includes the handshake (NIXL agents, metadata), which on
    two busy cores (`make test`'s parallel stage) can outlast this module's 3 s lease, so a test's first read would
    fail as LEASE_EXPIRED for a reason that is not its own. Tried a few times, each a fresh request."""
    outcomes = []
    for attempt in range(5):
        status, body = decode(d, f"d-handshake-{attempt}", prefill(p, f"handshake-{attempt}", 16))
        if status == 200:
            return
        outcomes.append(body)
    raise AssertionError(f"decode never read from prefill: {outcomes}")


def _listening_sockets() -> dict[int, set[int]]:
    """The inodes of every listening TCP socket on this machine by local port (/proc/net/tcp and tcp6, state 0A)."""
    found: dict[int, set[int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":
                found.setdefault(int(fields[1].rsplit(":", 1)[1], 16), set()).add(int(fields[9]))
    return found


def prefill(engine: EngineProcess, request_id: str, tokens: int) -> dict[str, Any]:
    status, body = engine.post("/v1/prefill", {"requestId": request_id, "numTokens": tokens})
    assert status == 200, body
    params: dict[str, Any] = body["kvTransferParams"]
    return params


def decode(engine: EngineProcess, request_id: str, params: dict[str, Any], hit: int = 0) -> tuple[int, dict[str, Any]]:
    return engine.post("/v1/decode", {"requestId": request_id, "kvTransferParams": params, "prefixHitBlocks": hit})


def metric(engine: EngineProcess, name: str, **labels: str) -> float:
    return engine.metric(name, **labels)


def test_blocks_are_held_until_read_then_freed(cluster: Cluster) -> None:
    p, d = cluster.prefill, cluster.decode  # type: ignore[attr-defined]
    before = metric(p, "kvbridge_held_bytes")
    params = prefill(p, "held-1", 40)
    assert "held-1" in p.get("/v1/held")["held"]
    during = metric(p, "kvbridge_held_bytes")  # the scaling signal: what this prefill pod holds for readers
    assert during > before
    assert metric(p, "kvbridge_held_requests") >= 1
    status, body = decode(d, "d-held-1", params)
    assert status == 200, body
    assert body["verified"] is True
    wait_until(lambda: "held-1" not in p.get("/v1/held")["held"], 5, "held-1 freed")
    assert metric(p, "kvbridge_held_bytes") < during


def test_lease_expiry_frees_blocks_that_nobody_reads(cluster: Cluster) -> None:
    p = cluster.prefill  # type: ignore[attr-defined]
    before = metric(p, "kvbridge_expired_leases_total")
    free = p.get("/v1/held")["freeBlocks"]
    prefill(p, "never-read", 33)
    assert p.get("/v1/held")["freeBlocks"] == free - 3
    wait_until(lambda: "never-read" not in p.get("/v1/held")["held"], 8, "never-read freed")
    assert p.get("/v1/held")["freeBlocks"] == free
    assert metric(p, "kvbridge_expired_leases_total") == before + 1


def test_a_read_after_the_lease_fails_on_decode_and_never_succeeds(cluster: Cluster) -> None:
    """Issue 13 #3: decode read freed blocks 36 s late and still reported verified. The params now carry the
    expiry, and decode refuses a read outside it (typed, with the local blocks to invalidate)."""
    p, d = cluster.prefill, cluster.decode  # type: ignore[attr-defined]
    started = time.time()
    params = prefill(p, "late-1", 40)
    assert started + TRANSFER.lease_seconds <= params["expiresAt"] <= time.time() + TRANSFER.lease_seconds
    time.sleep(TRANSFER.lease_seconds - 1.0 + 0.2)  # inside prefill's lease, past it less decode's 1 s margin
    status, body = decode(d, "d-late-1", params)
    assert status == 410, body
    assert body["error"]["code"] == "LEASE_EXPIRED"
    assert body["error"]["invalidBlocks"]
    assert body.get("verified") is not True
    assert decode(d, "d-fresh-1", prefill(p, "fresh-1", 40))[0] == 200  # a fresh prefill reads fine


def test_heartbeats_renew_the_lease(cluster: Cluster) -> None:
    p = cluster.prefill  # type: ignore[attr-defined]
    params = prefill(p, "kept-alive", 16)
    client = SideChannelClient("127.0.0.1", params["remotePort"], params["fingerprint"], cluster.keys, 2)
    for _ in range(5):  # 5 s > the 3 s lease
        client.heartbeat([("kept-alive", params["leaseToken"])])
        time.sleep(1)
        assert "kept-alive" in p.get("/v1/held")["held"]
    wait_until(lambda: "kept-alive" not in p.get("/v1/held")["held"], 8, "kept-alive freed")


def test_a_lease_is_renewed_only_for_whoever_was_handed_its_parameters(cluster: Cluster) -> None:
    """A keyed peer that was not handed a request's parameters (no lease token, or another request's) cannot hold
    its blocks past the lease, nor fetch its digests."""
    p = cluster.prefill  # type: ignore[attr-defined]
    params = prefill(p, "not-yours", 16)
    other = prefill(p, "someone-else", 16)
    client = SideChannelClient("127.0.0.1", params["remotePort"], params["fingerprint"], cluster.keys, 2)
    for _ in range(5):  # 5 s > the 3 s lease
        client.heartbeat([("not-yours", ""), ("not-yours", other["leaseToken"])])
        time.sleep(1)
    assert "not-yours" not in p.get("/v1/held")["held"]
    assert client.digests("someone-else", params["leaseToken"])[0].value == "unknown"


def test_unknown_and_malformed_notifications_are_ignored_and_counted(cluster: Cluster) -> None:
    p = cluster.spare  # type: ignore[attr-defined]
    params = prefill(p, "probe", 1)
    ranks = SideChannelClient("127.0.0.1", params["remotePort"], params["fingerprint"], cluster.keys, 2).fetch([0])
    stranger = Transport("stranger-" + str(os.getpid()))
    try:
        name = stranger.add_peer(ranks[0][1])
        stranger.notify(name, b"no-such-request:1")
        stranger.notify(name, b"garbage without a colon")

        def counted(reason: str) -> bool:
            stranger.notifications()  # the sender must keep polling until its sends complete
            return metric(p, "kvbridge_failed_notifications_total", reason=reason) >= 1

        wait_until(lambda: counted("unknown"), 10, "an unknown notification counted")
        wait_until(lambda: counted("malformed"), 10, "a malformed notification counted")
    finally:
        stranger.close()
    assert "probe" in p.get("/v1/held")["held"]  # real requests are untouched


def test_bad_requests_get_typed_errors_and_the_engines_keep_serving(cluster: Cluster) -> None:
    p, d = cluster.prefill, cluster.decode  # type: ignore[attr-defined]
    params = prefill(p, "bad-1", 64)
    truncated = {**params, "remoteBlockIds": params["remoteBlockIds"][:1]}
    status, body = decode(d, "d-bad-1", truncated)
    assert status == 502
    assert body["error"]["code"] == "LOCAL_LONGER_THAN_REMOTE"
    assert body["error"]["invalidBlocks"]
    assert decode(d, "d-bad-2", {**params, "numTokens": 0})[1]["error"]["code"] == "INVALID_REQUEST"
    # a claimed prefill TP decides how many ranks decode asks for: bounded by the schema, then by the verdict
    for tp, field in ((1_000_000_000, "kvTransferParams.remoteTpSize"), (3, "kvTransferParams.remoteTpSize")):
        status, body = decode(d, f"d-bad-tp-{tp}", {**params, "remoteTpSize": tp})
        assert (status, body["error"]["code"], body["error"]["field"]) == (400, "INVALID_REQUEST", field), body
    assert decode(d, "d-bad-3", params, hit=99)[1]["error"]["field"] == "prefixHitBlocks"
    assert p.post("/v1/prefill", {"requestId": "x", "numTokens": 0})[1]["error"]["code"] == "INVALID_REQUEST"
    assert p.post("/v1/prefill", {"requestId": "bad-1", "numTokens": 3})[1]["error"]["code"] == "DUPLICATE_REQUEST"
    # longer than the engine's model (what its cache holds): refused before anything is allocated, not 503
    huge = p.post("/v1/prefill", {"requestId": "huge", "numTokens": 10**6})[1]["error"]
    assert (huge["code"], huge["field"]) == ("INVALID_REQUEST", "numTokens")
    request = urllib.request.Request(d.url + "/v1/decode", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 400
    status, body = decode(d, "d-bad-ok", params)  # the original, intact request still verifies
    assert status == 200, body


HOSTILE_IDS = ["a:b", "x" * 300, "with space", "nul\x00", "\u00e9t\u00e9"]


def test_hostile_request_ids_fail_their_own_request_and_hold_nothing(cluster: Cluster) -> None:
    """An id kvbridge cannot carry is refused before anything is allocated (it used to hold its blocks for the
    whole lease, so later requests failed NO_FREE_BLOCKS); a client's X-Request-Id is replaced by one of ours."""
    p, d = cluster.prefill, cluster.decode  # type: ignore[attr-defined]
    held = set(p.get("/v1/held")["held"])
    for request_id in HOSTILE_IDS:
        status, body = p.post("/v1/prefill", {"requestId": request_id, "numTokens": 64})
        assert (status, body["error"]["code"], body["error"]["field"]) == (400, "INVALID_REQUEST_ID", "requestId")
    for request_id in HOSTILE_IDS[:3]:  # an HTTP header cannot hold NUL or non-Latin-1 text
        body = {"prompt": [1] * 64, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        request = urllib.request.Request(p.url + "/v1/completions", data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.loads(response.read())
        ours = answer["kv_transfer_params"]["remoteRequestId"]
        assert ours != request_id
        assert decode(d, f"d-{ours}", answer["kv_transfer_params"])[0] == 200  # read: nothing left held
    wait_until(lambda: set(p.get("/v1/held")["held"]) == held, 10, f"exactly {sorted(held)} held")


def test_a_peer_without_the_key_gets_no_metadata(cluster: Cluster) -> None:
    params = prefill(cluster.prefill, "nokey", 1)  # type: ignore[attr-defined]
    with pytest.raises(HandshakeError) as caught:
        SideChannelClient("127.0.0.1", params["remotePort"], params["fingerprint"], None, 0.5).fetch([0])
    assert caught.value.code == "HANDSHAKE_TIMEOUT"


def test_a_decode_engine_of_another_model_is_refused_with_the_reason(cluster: Cluster) -> None:
    other = cluster.start(env(Role.DECODE, "d-other", cluster.keys_dir, model=MODEL.model_copy(update={"name": "x"})))
    try:
        status, body = decode(other, "d-other-1", prefill(cluster.prefill, "other-1", 20))  # type: ignore[attr-defined]
        assert status == 502
        assert body["error"]["code"] == "FINGERPRINT_MISMATCH"
    finally:
        other.stop()


def test_killed_prefill_fails_its_requests_in_time_and_a_restart_is_rehandshaken(cluster: Cluster) -> None:
    p1, d = cluster.prefill, cluster.decode  # type: ignore[attr-defined]
    spare: EngineProcess = cluster.spare  # type: ignore[attr-defined]
    assert decode(d, "d-warm", prefill(spare, "warm", 48))[0] == 200  # decode knows p2 now
    orphan = prefill(spare, "orphan", 48)
    spare.kill()
    results: dict[str, Any] = {}

    def other() -> None:
        results["other"] = decode(d, "d-other-ok", prefill(p1, "other-ok", 48))

    thread = threading.Thread(target=other)
    thread.start()
    started = time.monotonic()
    status, body = decode(d, "d-orphan", orphan)
    elapsed = time.monotonic() - started
    thread.join(timeout=60)
    assert status in (502, 504), body
    # verified requests ask prefill's side channel for its digests first: a dead prefill does not answer
    assert body["error"]["code"] in {"TRANSFER_FAILED", "TRANSFER_TIMEOUT", "HANDSHAKE_TIMEOUT"}
    assert body["error"]["invalidBlocks"]
    assert elapsed < 5 + 10  # the transfer deadline, plus slack for a busy machine
    assert results["other"][0] == 200, results["other"]  # other requests are unaffected

    restarted = cluster.start(env(Role.PREFILL, "p2", cluster.keys_dir, tp_p=1))  # same engine id, new incarnation
    cluster.spare = restarted  # type: ignore[attr-defined]
    assert restarted.ready["incarnation"] != orphan["remoteIncarnation"]
    evictions = metric(d, "kvbridge_stale_peer_evictions_total")
    status, body = decode(d, "d-after-restart", prefill(restarted, "after-restart", 48))
    assert status == 200, body
    assert metric(d, "kvbridge_stale_peer_evictions_total") >= max(1.0, evictions)
    status, body = decode(d, "d-stale", orphan)  # blocks of the dead incarnation are gone: fail fast
    assert (status, body["error"]["code"]) == (409, "STALE_PEER")


def test_killed_prefill_during_a_large_transfer_never_hangs(cluster: Cluster) -> None:
    d = cluster.decode  # type: ignore[attr-defined]
    victim = cluster.start(env(Role.PREFILL, "p3", cluster.keys_dir, tp_p=1))
    assert decode(d, "d-p3-warm", prefill(victim, "p3-warm", 16))[0] == 200
    params = prefill(victim, "p3-big", 60 * 16)
    threading.Timer(0.002, victim.kill).start()
    started = time.monotonic()
    status, body = decode(d, "d-p3-big", params)
    assert time.monotonic() - started < 5 + 10
    if status != 200:  # the kill may land before, during or after the READs
        assert body["error"]["code"] in {"TRANSFER_FAILED", "TRANSFER_TIMEOUT", "HANDSHAKE_TIMEOUT", "STALE_PEER"}


def test_metrics_endpoint_exposes_the_transfer_figures(cluster: Cluster) -> None:
    with urllib.request.urlopen(cluster.decode.url + "/metrics", timeout=10) as response:  # type: ignore[attr-defined]
        text = response.read().decode()
    for name in (
        "kvbridge_transfer_seconds",
        "kvbridge_transfer_bytes_total",
        "kvbridge_descriptors_per_request",
        "kvbridge_handshake_seconds",
        "kvbridge_failed_transfers_total",
        "kvbridge_stale_peer_evictions",
    ):
        assert re.search(rf"^{name}", text, re.MULTILINE), name
    ranks = cluster.decode.get("/v1/ranks")["ranks"]  # type: ignore[attr-defined]
    assert all(rank["ok"] and rank["inFlight"] == 0 for rank in ranks)


def test_the_allocator_hands_out_contiguous_or_scattered_ids() -> None:
    from kvbridge_agent.core.contract import BlockAllocation
    from kvbridge_agent.synthetic.ranks import BlockAllocator, EngineError

    allocator = BlockAllocator(256)
    assert allocator.allocate(4) == [0, 1, 2, 3]
    scattered = allocator.allocate(100, BlockAllocation.SCATTERED)
    assert len(set(scattered)) == 100
    assert not set(scattered) & {0, 1, 2, 3}
    adjacent = sum(b == a + 1 for a, b in itertools.pairwise(scattered))
    assert adjacent < 10  # runs NIXL could merge are rare
    assert allocator.free_count == 152
    allocator.free([0, 1, 2, 3, *scattered])
    allocator.free([0])  # a double free does not inflate the count
    assert allocator.free_count == 256
    with pytest.raises(EngineError) as caught:
        allocator.allocate(257)
    assert caught.value.code == "NO_FREE_BLOCKS"


def test_block_allocation_per_request_scattered_verifies_and_unknown_is_typed(cluster: Cluster) -> None:
    params = prefill(cluster.prefill, "alloc-1", 40)  # type: ignore[attr-defined]
    status, body = cluster.decode.post(  # type: ignore[attr-defined]
        "/v1/decode", {"requestId": "alloc-1", "kvTransferParams": params, "blockAllocation": "Diagonal"}
    )
    assert status == 400
    assert body["error"]["code"] == "INVALID_REQUEST"
    assert body["error"]["field"] == "blockAllocation"
    status, body = cluster.decode.post(  # type: ignore[attr-defined]
        "/v1/decode", {"requestId": "alloc-1", "kvTransferParams": params, "blockAllocation": "Scattered"}
    )
    assert status == 200, body
    assert body["verified"], body  # scattered decode blocks receive every byte


def test_a_dead_rank_makes_the_engine_unhealthy_and_exit_for_a_restart(cluster: Cluster) -> None:
    """Issue 13 #2: SIGKILL of a rank used to leave /healthz ok and every later request failing RANK_FAILED."""
    engine = cluster.start(env(Role.DECODE, "d-dies", cluster.keys_dir))
    assert engine.get("/healthz")["ok"] is True
    [rank] = engine.ready["rankPids"]
    os.kill(rank, 9)
    assert engine.process.wait(timeout=15) == 3  # EXIT_UNHEALTHY: the kubelet restarts the pod
    assert "rank 0 process exited with code -9 (signal 9)" in engine.log_tail()  # how it ended, for a diagnosis
    assert not running(rank)  # reaped, not a zombie


def test_a_side_channel_listener_that_stops_says_why() -> None:
    """If the listener loop itself ever ends with an error, ``alive`` turns false with the reason; the engine puts
    it in /healthz's problems and exits (as for a dead rank, above)."""
    from kvbridge_agent.transfer.side_channel import SideChannelServer

    def broken() -> None:
        raise RuntimeError("boom")

    server = SideChannelServer("127.0.0.1", 0, "fp", {})
    server._serve = broken  # type: ignore[method-assign]
    server.start()
    try:
        wait_until(lambda: not server.alive, 5, "the listener to stop")
        assert server.failure == "side-channel listener stopped: RuntimeError: boom"
    finally:
        server.close()


def test_sigterm_stops_an_engine_in_bounded_time_even_with_a_stuck_rank(cluster: Cluster) -> None:
    """Issue 13 #6: SIGTERM with pending requests took 8-23 s (each rank got 10 + 5 + 5 s in turn). Now the ranks
    share one budget: 3 s to stop, then SIGTERM, then SIGKILL."""
    engine = cluster.start(env(Role.PREFILL, "p-stuck", cluster.keys_dir))
    for index in range(3):
        prefill(engine, f"pending-{index}", 100)
    stuck, other = engine.ready["rankPids"]
    os.kill(stuck, signal.SIGSTOP)  # a rank that cannot answer the shutdown message
    started = time.monotonic()
    engine.process.send_signal(signal.SIGTERM)
    assert engine.process.wait(timeout=30) == 0
    assert time.monotonic() - started < 10  # 3 s grace + 2 s SIGTERM + SIGKILL; it was 10 + 5 s for this rank
    assert not running(stuck)
    assert not running(other)


def test_kv_overwritten_after_publish_fails_the_request_loudly_and_engines_keep_serving(cluster: Cluster) -> None:
    """Verification (issue 27): prefill's KV overwritten from outside its process after it published the request,
    before decode read it: decode's digest differs from prefill's, the request fails with KV_DIGEST_MISMATCH and
    the blocks it names, counted by peer; the next request is served. With verification off (the negative control)
    the same fault gets past the transfer, and only the synthetic engine's own byte check sees the wrong bytes."""
    p, d = cluster.prefill, cluster.decode  # type: ignore[attr-defined]
    params = prefill(p, "overwritten-1", 40)
    assert params["verify"] is True  # Sampled: every request of the engine's first minutes
    assert overwrite_prefill_kv(KVTransferParams.model_validate(params), cluster.keys) == 2
    status, body = decode(d, "d-overwritten-1", params)
    assert status == 502, body
    assert body["error"]["code"] == KV_DIGEST_MISMATCH
    assert body["error"]["invalidBlocks"]
    assert metric(d, "kvbridge_digest_mismatches_total", peer="p1") >= 1
    status, body = decode(d, "d-after-1", prefill(p, "after-overwrite-1", 40))
    assert status == 200, body
    assert body["verified"] is True
    unverified = TRANSFER.model_copy(update={"verification": Verification.OFF})
    off = cluster.start(env(Role.PREFILL, "p-off", cluster.keys_dir).model_copy(update={"transfer": unverified}))
    params = prefill(off, "overwritten-2", 40)
    assert params["verify"] is False
    overwrite_prefill_kv(KVTransferParams.model_validate(params), cluster.keys)
    status, body = decode(d, "d-overwritten-2", params)
    assert status == 502, body
    assert body["error"]["code"] == "VERIFY_MISMATCH"  # the wrong bytes were read and would have been used


def test_decode_under_all_verifies_what_prefill_did_not_flag_and_refuses_what_it_did_not_digest(
    cluster: Cluster,
) -> None:
    """Decode applies its own policy too (docs/protocol.md §8): with verification All it verifies a request whose
    parameters say ``verify: false`` (here: a proxy dropped the flag of a request prefill did digest, and its KV was
    overwritten: KV_DIGEST_MISMATCH, not wrong bytes), and it refuses one prefill did not digest at all
    (KV_DIGEST_UNAVAILABLE) rather than use it unverified. A decode at Sampled follows the flag (the control)."""
    p, d = cluster.prefill, cluster.decode  # type: ignore[attr-defined]
    every = TRANSFER.model_copy(update={"verification": Verification.ALL})
    strict = cluster.start(env(Role.DECODE, "d-all", cluster.keys_dir).model_copy(update={"transfer": every}))
    params = prefill(p, "flag-lost", 40)
    assert params["verify"] is True  # prefill digested it (Sampled's warm-up)
    overwrite_prefill_kv(KVTransferParams.model_validate(params), cluster.keys)
    status, body = decode(strict, "d-flag-lost", {**params, "verify": False})
    assert status == 502, body
    assert body["error"]["code"] == KV_DIGEST_MISMATCH
    status, body = decode(strict, "d-intact", {**prefill(p, "intact", 40), "verify": False})
    assert status == 200, body  # verified all the same: no false alarm
    unverified = TRANSFER.model_copy(update={"verification": Verification.OFF})
    off = cluster.start(env(Role.PREFILL, "p-off-2", cluster.keys_dir).model_copy(update={"transfer": unverified}))
    params = prefill(off, "never-digested", 40)
    assert params["verify"] is False
    status, body = decode(strict, "d-never-digested", params)
    assert status == 410, body
    assert body["error"]["code"] == KV_DIGEST_UNAVAILABLE
    assert "did not digest" in body["error"]["message"]
    status, body = decode(d, "d-never-digested-sampled", prefill(off, "never-digested-2", 40))
    assert status == 200, body  # decode at Sampled follows prefill's decision
