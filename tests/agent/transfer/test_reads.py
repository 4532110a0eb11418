"""A decode rank's mapping of one request's block ids onto a peer's descriptors (transfer/reads.py): a request
never lists more block ids than the peer registered, whatever ids it names."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge_agent.core import BlockMappingError, ModelGeometry, RoleSettings, build_plan
from kvbridge_agent.core.blocks import BLOCK_ID_OUT_OF_RANGE, DescriptorIds
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.transfer.reads import RemotePeer, request_descriptor_ids

MODEL = ModelGeometry(name="m", num_layers=2, num_kv_heads=2, head_dim=8)
PLAN = build_plan(MODEL, RoleSettings(block_size=16), RoleSettings(block_size=16), None)
#: the peer's registered cache: 24 blocks
PEER = RemotePeer("p-0", "i", PLAN, PLAN.for_decode_rank(0), {}, remote_units=24, regions=2, lists=[(None, None)])


def buffers(n: int) -> tuple[DescriptorIds, DescriptorIds]:
    return np.empty(n, dtype=np.int32), np.empty(n, dtype=np.int32)


def params(block_ids: list[int]) -> KVTransferParams:
    return KVTransferParams(
        remote_engine_id="p-0",
        remote_incarnation="i",
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_request_id="r",
        remote_block_ids=block_ids,
        num_tokens=16 * len(block_ids),
        remote_tp_size=1,
        fingerprint="f",
    )


@given(ids=st.lists(st.integers(0, 23), min_size=25, max_size=400))
def test_more_block_ids_than_the_peer_registered_are_refused(ids: list[int]) -> None:
    """Each id within the peer's 24 blocks, but 25 or more of them: not one request's (before, the tail was read and
    the rest carried along, up to the schema's 2^20)."""
    with pytest.raises(BlockMappingError) as caught:
        request_descriptor_ids(PEER, params(ids), [5], None, 64, buffers)
    assert (caught.value.code, caught.value.field) == (BLOCK_ID_OUT_OF_RANGE, "request.remote_block_ids")


@given(ids=st.lists(st.integers(0, 23), min_size=1, max_size=24, unique=True), local=st.integers(1, 24))
def test_a_request_within_the_peer_s_cache_maps_its_tail(ids: list[int], local: int) -> None:
    local_blocks = list(range(40, 40 + min(local, len(ids))))
    ((local_ids, remote_ids),) = request_descriptor_ids(PEER, params(ids), local_blocks, None, 64, buffers)
    tail = np.asarray(ids[len(ids) - len(local_blocks) :])
    assert np.array_equal(remote_ids, np.concatenate([tail, tail + 24]))
    assert np.array_equal(local_ids, np.concatenate([np.asarray(local_blocks), np.asarray(local_blocks) + 64]))
