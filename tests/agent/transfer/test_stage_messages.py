"""The side channel's ``stage`` message (docs/protocol.md §4d) between a keyed decode and a prefill listener: a
request named with its lease token reaches the engine and its reply comes back; a request without it, a malformed
one, or one the engine refuses gets a typed error, and the listener keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbridge_agent.core import KVBridgeError
from kvbridge_agent.core.handshake import MALFORMED_MESSAGE, HandshakeError
from kvbridge_agent.core.stage_requests import (
    STAGE_NOT_OFFERED,
    STAGE_OUT_OF_RANGE,
    STAGING_OFF,
    StagePlan,
    StageReply,
    StageRequest,
    StageState,
    encode_stage_request,
)
from kvbridge_agent.transfer.keys import CurveKeys, generate_keys
from kvbridge_agent.transfer.side_channel import SideChannelServer

from .test_side_channel import META, client, raw_request

PLAN = StagePlan(offset=0, length=4096, digest="a" * 32, order_digest="b" * 32)
REQUEST = StageRequest(rank=0, plan=PLAN, first=0, count=3)


def test_a_stage_request_reaches_the_engine_with_its_token(keys: CurveKeys, tmp_path: Path) -> None:
    asked: list[tuple[str, StageRequest]] = []

    def stage(request_id: str, request: StageRequest) -> StageReply:
        asked.append((request_id, request))
        if request.count > 3:
            raise KVBridgeError("more units than the request has", code=STAGE_OUT_OF_RANGE)
        return StageReply(state=StageState.READY, offset=1 << 20, bytes=3 * 4096, pack_microseconds=42.0)

    srv = SideChannelServer("127.0.0.1", 0, "fp", {0: (META, b"agent-0")}, keys=keys, on_stage=stage).start()
    try:
        reply = client(srv, keys).stage("req-1", srv.token("req-1"), REQUEST)
        assert (reply.state, reply.offset, reply.bytes) == (StageState.READY, 1 << 20, 3 * 4096)
        assert asked == [("req-1", REQUEST)]
        refusals = [
            (("req-1", srv.token("other")), REQUEST, STAGE_NOT_OFFERED),  # a token not the request's
            (("req-1", srv.token("req-1")), REQUEST.model_copy(update={"count": 9}), STAGE_OUT_OF_RANGE),
        ]
        for (request_id, token), request, code in refusals:
            with pytest.raises(HandshakeError) as caught:
                client(srv, keys).stage(request_id, token, request)
            assert caught.value.code == code
        assert len(asked) == 2  # the request without its token never reached the engine
        header = json.loads(encode_stage_request("fp", ("req-1", srv.token("req-1")), REQUEST)[0])
        header["stage"]["count"] = 1 << 40
        assert MALFORMED_MESSAGE.encode() in raw_request(srv, keys, [json.dumps(header).encode()])[0]
        header["stage"] = "x" * 5000  # over the header's bound
        assert MALFORMED_MESSAGE.encode() in raw_request(srv, keys, [json.dumps(header).encode()])[0]
        with pytest.raises(HandshakeError):  # a client without the key gets nothing
            client(srv, generate_keys(tmp_path / "stranger"), timeout=0.5).stage("req-1", srv.token("req-1"), REQUEST)
        assert client(srv, keys).stage("req-1", srv.token("req-1"), REQUEST).state is StageState.READY
        assert srv.stats.staged == 2
    finally:
        srv.close()


def test_a_listener_that_stages_nothing_says_so(keys: CurveKeys) -> None:
    srv = SideChannelServer("127.0.0.1", 0, "fp", {0: (META, b"agent-0")}, keys=keys).start()
    try:
        with pytest.raises(HandshakeError) as caught:
            client(srv, keys).stage("req-1", srv.token("req-1"), REQUEST)
        assert caught.value.code == STAGING_OFF
    finally:
        srv.close()
