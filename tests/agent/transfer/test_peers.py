"""Decode meeting a prefill engine (shared by the synthetic engine and vLLM's connector): incarnations, leases."""

from __future__ import annotations

import math

import pytest

from kvbridge_agent.core import CacheKind, KVLayout
from kvbridge_agent.core.handshake import HandshakeError, KVTransferParams, MemoryType, RankMetadata
from kvbridge_agent.transfer.peers import (
    LEASE_CLOCK_MARGIN_SECONDS,
    STALE_PEER,
    fetch_prefill_ranks,
    lease_left,
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
