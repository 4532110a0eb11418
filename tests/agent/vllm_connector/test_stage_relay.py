"""Staged reads in the connector: the stage relay (vllm_connector/stage_relay.py) from the scheduler's side channel
to the worker rank that packs, its frames parsed with bounds (hypothesis), and decode's bounded stager
(vllm_connector/staging.py), end to end over a real side channel and NIXL in one process."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from kvbridge_agent.core import KVBridgeError, KVLayout
from kvbridge_agent.core.geometry import region_layout
from kvbridge_agent.core.handshake import HANDSHAKE_TIMEOUT, MALFORMED_MESSAGE, KVTransferParams
from kvbridge_agent.core.stage_requests import (
    STAGE_NOT_OFFERED,
    STAGE_PLAN_INVALID,
    STAGE_SKIPPED,
    StagePlan,
    StageReply,
    StageRequest,
    StageState,
)
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.side_channel import SideChannelServer
from kvbridge_agent.vllm_connector import stage_relay, staging
from kvbridge_agent.vllm_connector.stage_relay import (
    PROTOCOL,
    STAGE_RANK_UNAVAILABLE,
    StageRelay,
    StageServer,
    encode_request,
    parse_reply,
    parse_request,
)
from kvbridge_agent.vllm_connector.staging import ConnectorStager
from tests.agent.transfer.harness import model as region_model
from tests.agent.transfer.staged_harness import Side, StagedPair

TIMEOUT = 1.0
PLAN = StagePlan(digest="0" * 32, order_digest="1" * 32)


def request(rank: int = 0, first: int = 0, count: int = 1) -> StageRequest:
    return StageRequest(rank=rank, plan=PLAN, first=first, count=count)


def echo(request_id: str, asked: StageRequest) -> StageReply:
    """A rank that packs each request at an offset naming it: replies cannot be crossed unnoticed."""
    return StageReply(state=StageState.READY, offset=asked.first, bytes=len(request_id))


@pytest.fixture
def incarnation() -> str:
    return uuid.uuid4().hex[:16]


@pytest.fixture
def server(incarnation: str) -> Iterator[StageServer]:
    served = StageServer(incarnation, 0).start(echo)
    yield served
    served.close()


def raw_exchange(address: str, frames: list[bytes]) -> list[bytes] | None:
    """Frames sent as a REQ would; the answer, or ``None`` when none came within the timeout."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(address)
        socket.send_multipart(frames)
        return socket.recv_multipart() if socket.poll(int(TIMEOUT * 1000)) else None
    finally:
        socket.close(linger=0)


def test_a_stage_request_round_trips_and_a_refusal_keeps_its_code(incarnation: str, server: StageServer) -> None:
    relay = StageRelay(incarnation, [0], TIMEOUT)
    try:
        assert relay("request-a", request(first=7)) == echo("request-a", request(first=7))

        def refuse(request_id: str, asked: StageRequest) -> StageReply:
            raise KVBridgeError("not held", code=STAGE_NOT_OFFERED)

        server._stage = refuse
        with pytest.raises(KVBridgeError) as refused:
            relay("request-b", request())
        assert refused.value.code == STAGE_NOT_OFFERED
    finally:
        relay.close()


def test_hostile_frames_are_answered_typed_and_the_server_keeps_serving(incarnation: str, server: StageServer) -> None:
    good = encode_request("request", request())
    hostile = [
        good[:2],  # truncated
        [b"kvbridge-digest-relay/1", *good[1:]],  # another protocol's tag
        [PROTOCOL, b"", good[2]],  # an empty request id
        [PROTOCOL, b"\xff\xfe", good[2]],  # not UTF-8
        [PROTOCOL, b"r" * (stage_relay.MAX_REQUEST_ID_BYTES + 1), good[2]],  # a request id over its bound
        [PROTOCOL, b"request", b"x" * (stage_relay.MAX_REQUEST_BYTES + 1)],  # a body over its bound
        [PROTOCOL, b"request", b"{not json"],
        [PROTOCOL, b"request", b'{"rank": 5000, "plan": {}, "first": 0, "count": 1}'],  # out of the schema's bounds
        encode_request("request", request(rank=1)),  # another rank's request
    ]
    for frames in hostile:
        reply = raw_exchange(server.address, frames)
        assert reply is not None, frames
        with pytest.raises(KVBridgeError) as refused:
            parse_reply(reply)
        assert refused.value.code in (MALFORMED_MESSAGE, STAGE_PLAN_INVALID), frames
    # a body over the socket's bound is dropped by ZMQ (no answer), and the next request is served
    assert raw_exchange(server.address, [PROTOCOL, b"r", b"x" * (stage_relay.MAX_REQUEST_BYTES + 4096)]) is None
    # frames without a REQ envelope (a DEALER): dropped
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(server.address)
    dealer.send_multipart(good)
    assert not dealer.poll(200)
    dealer.close(linger=0)
    relay = StageRelay(server.address.rsplit("stage-", 1)[1].rsplit("-", 1)[0], [0], TIMEOUT)
    try:
        assert relay("request", request(first=3)).offset == 3
    finally:
        relay.close()


def test_a_bug_in_the_rank_is_an_internal_error_not_a_dead_server(incarnation: str, server: StageServer) -> None:
    def broken(request_id: str, asked: StageRequest) -> StageReply:
        raise ZeroDivisionError("a bug")

    server._stage = broken
    relay = StageRelay(incarnation, [0], TIMEOUT)
    try:
        with pytest.raises(KVBridgeError) as failed:
            relay("request", request())
        assert failed.value.code == "INTERNAL_ERROR"
        server._stage = echo
        assert relay("request", request(first=2)).offset == 2
    finally:
        relay.close()


def test_an_unknown_rank_is_refused_at_once(incarnation: str) -> None:
    relay = StageRelay(incarnation, [0, 1], TIMEOUT)
    started = time.monotonic()
    try:
        with pytest.raises(KVBridgeError) as refused:
            relay("request", request(rank=2))
    finally:
        relay.close()
    assert refused.value.code == STAGE_PLAN_INVALID
    assert time.monotonic() - started < TIMEOUT / 2  # no wait for a socket's answer


@pytest.mark.parametrize("how", ["absent", "slow"])
def test_a_rank_that_is_gone_or_slow_is_unavailable_within_the_timeout(incarnation: str, how: str) -> None:
    served = None
    if how == "slow":

        def slow(request_id: str, asked: StageRequest) -> StageReply:
            time.sleep(3 * 0.3)
            return echo(request_id, asked)

        served = StageServer(incarnation, 0).start(slow)
    relay = StageRelay(incarnation, [0], 0.3)
    try:
        started = time.monotonic()
        with pytest.raises(KVBridgeError) as unavailable:
            relay("request", request())
        assert unavailable.value.code == STAGE_RANK_UNAVAILABLE
        assert 0.25 < time.monotonic() - started < 0.3 + 1.0
    finally:
        relay.close()
        if served is not None:
            served.close()


def test_concurrent_requests_each_get_their_own_answer(incarnation: str, server: StageServer) -> None:
    relay = StageRelay(incarnation, [0], 5.0)
    answers: dict[int, Any] = {}

    def ask(index: int) -> None:
        try:
            answers[index] = relay(f"request-{index}" + "x" * index, request(first=index)).model_dump()
        except KVBridgeError as exc:  # pragma: no cover - reported by the assertion below
            answers[index] = exc.code

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    relay.close()
    assert answers == {i: echo(f"request-{i}" + "x" * i, request(first=i)).model_dump() for i in range(16)}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=5), st.booleans())
def test_any_frame_parses_or_is_refused_typed(frames: list[bytes], tagged: bool) -> None:
    if tagged and frames:
        frames[0] = PROTOCOL
    codes = []
    for parse in (parse_request, parse_reply):
        try:
            parse(frames)
        except KVBridgeError as exc:  # anything else would fail the test
            codes.append((parse, exc.code))
    assert all(code == MALFORMED_MESSAGE for parse, code in codes if parse is parse_request)


def test_the_relay_is_on_only_with_a_staging_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVBRIDGE_STAGING_MIB", raising=False)
    assert stage_relay.stage_relay("x", [0], 5.0) is None
    monkeypatch.setenv("KVBRIDGE_STAGING_MIB", "0")
    assert stage_relay.stage_relay("x", [0], 5.0) is None
    monkeypatch.setenv("KVBRIDGE_STAGING_MIB", "16")
    relay = stage_relay.stage_relay("x", [0], 5.0)
    assert relay is not None
    assert relay.timeout == stage_relay.RELAY_SECONDS < staging.STAGE_WAIT_SECONDS
    relay.close()


# -- decode's stager -----------------------------------------------------------------------------------------
def params_at(port: int, token: str = "t", request_id: str = "request") -> KVTransferParams:
    return KVTransferParams(
        remote_engine_id="prefill-a",
        remote_incarnation="inc-a",
        remote_host="127.0.0.1",
        remote_port=port,
        remote_request_id=request_id,
        remote_block_ids=[0],
        num_tokens=1,
        remote_tp_size=1,
        fingerprint="fp",
        lease_token=token,
    )


def test_a_side_channel_that_does_not_answer_pauses_staging_with_that_engine() -> None:
    silent: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)  # accepts, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    stager = ConnectorStager(None, 0.3)
    params = params_at(port)
    try:
        with pytest.raises(KVBridgeError) as unadmitted:
            stager(params, request())
        assert unadmitted.value.code == STAGE_SKIPPED
        stager.admit(params, "127.0.0.1")
        started = time.monotonic()
        with pytest.raises(KVBridgeError) as late:
            stager(params, request())
        assert late.value.code == HANDSHAKE_TIMEOUT
        assert time.monotonic() - started < 0.3 + 1.0
        started = time.monotonic()
        with pytest.raises(KVBridgeError) as paused:  # no second wait on vLLM's thread
            stager(params, request())
        assert paused.value.code == STAGE_SKIPPED
        assert time.monotonic() - started < 0.2  # under the 0.3 s an exchange may wait
    finally:
        silent.close(linger=0)


def test_an_engine_without_an_admitted_address_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    stager = ConnectorStager(None, 0.3)
    with caplog.at_level(logging.WARNING, logger=staging.log.name):
        for _ in range(3):
            with pytest.raises(KVBridgeError) as skipped:
                stager(params_at(1), request())
            assert skipped.value.code == STAGE_SKIPPED
    assert sum("no admitted address" in r.getMessage() for r in caplog.records) == 1


def test_the_stager_waits_at_most_the_stage_wait_bound() -> None:
    assert ConnectorStager(None, 60.0).timeout == staging.STAGE_WAIT_SECONDS
    assert ConnectorStager(None, 0.5).timeout == 0.5


class LayerTensorPair(StagedPair):
    """Caches of one tensor per layer holding its keys and values, as vLLM's CPU attention keeps them (a Split
    cache of fewer tensors than its kind's: the plan's decode layout is not decode's)."""

    def _cache(self, side: Side, rank: int) -> KVCache:
        model = self.model
        layout = region_layout(model, side.block, side.tp, num_tensors=model.num_layers)
        tensors = [torch.zeros(self.blocks * layout.block_stride, dtype=torch.uint8) for _ in range(model.num_layers)]
        return KVCache.attach(model, side.block, KVLayout.HND, side.tp, rank, self.blocks, tensors)


@pytest.mark.parametrize("caches", ["regions", "a tensor per layer"])
def test_a_staged_read_through_the_side_channel_and_the_relay_equals_a_direct_one(caches: str) -> None:
    """The connector's path end to end, vLLM aside: decode's stager asks a real side channel (CURVE off), whose
    ``on_stage`` is the relay to the prefill rank's stage server, which packs under the rank's lock while this
    thread polls the rank; the staged read leaves decode's cache as the direct read does. Also with a tensor per
    layer (vLLM's CPU attention), where the stage plan names decode's tensors (else prefill's wire order differs:
    ``STAGE_PLAN_MISMATCH``)."""
    kind = StagedPair if caches == "regions" else LayerTensorPair
    pair = kind(region_model(), Side(None, tp=2), Side(None), blocks=16)
    incarnation = uuid.uuid4().hex[:16]
    servers = [StageServer(incarnation, p).start(rank.stage) for p, rank in enumerate(pair.prefill)]
    relay = StageRelay(incarnation, range(len(pair.prefill)), stage_relay.RELAY_SECONDS)
    listener = SideChannelServer("127.0.0.1", 0, "fp", {}, on_stage=relay).start()
    stager = ConnectorStager(None, 5.0)
    try:
        for rank in pair.decode:
            assert rank.staging is not None
            rank.staging.stager = stager
        results = {}
        for mode in ("direct", "staged"):
            params = pair.offer(40, [3, 1, 7], seed=5)
            token = listener.token(params.remote_request_id)
            params = params.model_copy(update={"remote_port": listener.port, "lease_token": token, "fingerprint": "fp"})
            stager.admit(params, "127.0.0.1")
            results[mode] = pair.read(params, [2, 5, 9], mode)
        (direct, direct_bytes), (staged, staged_bytes) = results["direct"][0], results["staged"][0]
        assert (direct.ok, staged.ok) == (True, True), (direct, staged)
        assert (direct.mode, staged.mode) == ("direct", "staged")
        assert all(torch.equal(a, b) for a, b in zip(direct_bytes, staged_bytes, strict=True))
        assert listener.stats.staged == len(pair.prefill)
        assert all(rank.staging is not None and not rank.staging.held for rank in pair.prefill)  # read: given back
    finally:
        listener.close()
        relay.close()
        for served in servers:
            served.close()
        pair.close()
