"""The side channel's ``stage`` message (docs/protocol.md §4d): one schema with a bound on every number, parsed
after the envelope, and prefill's refusals of a plan that is not a read of its cache, typed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvbridge_agent.core import KVBridgeError, ModelGeometry, RoleSettings, TransferSettings, build_plan
from kvbridge_agent.core.handshake import (
    MALFORMED_MESSAGE,
    HandshakeError,
    MessageType,
    decode_request,
    encode_error,
)
from kvbridge_agent.core.layout import PhysicalLayout, PhysicalOrder
from kvbridge_agent.core.physical_reads import physical_read
from kvbridge_agent.core.stage_requests import (
    MAX_STAGE_UNITS,
    STAGE_OUT_OF_RANGE,
    STAGE_PLAN_INVALID,
    STAGE_PLAN_MISMATCH,
    StagePlan,
    StageReply,
    StageRequest,
    StageState,
    decode_stage_reply,
    decode_stage_request,
    encode_stage_reply,
    encode_stage_request,
    offered_units,
    ordering,
    region_order,
    source_plan,
)
from kvbridge_agent.core.staging import WireOrder, region_segments, run_segments

FINGERPRINT = "f" * 16
MODEL = ModelGeometry(name="m", num_layers=3, num_kv_heads=2, head_dim=64)
PREFILL = PhysicalLayout.dense(PhysicalOrder.LBHNC, 3, 24, 1, 16, 256)  # TP 2: one head each
DECODE = PhysicalLayout.dense(PhysicalOrder.LBNHC, 3, 24, 2, 16, 256)
TRANSFER = build_plan(MODEL, RoleSettings(tensor_parallel_size=2), RoleSettings(), TransferSettings())


def physical_plan(heads: tuple[tuple[int, int], tuple[int, int]] = ((0, 1), (1, 2))) -> StagePlan:
    read = physical_read(1, PREFILL, DECODE, heads)
    source = run_segments(read.source.regions, PREFILL.num_blocks)
    order = WireOrder(ordering(run_segments(read.target.regions, 0)), read.target.chunks)
    return StagePlan(decode_layout=DECODE, heads=heads, length=256, digest=source.digest, order_digest=order.digest)


def request(plan: StagePlan | None = None, first: int = 0, count: int = 4) -> StageRequest:
    return StageRequest(rank=1, plan=plan or physical_plan(), first=first, count=count)


def test_a_stage_request_round_trips_through_the_envelope() -> None:
    sent = request()
    frames = encode_stage_request(FINGERPRINT, ("req-1", "t" * 32), sent)
    kind, _, named = decode_request(frames, FINGERPRINT)
    assert (kind, named) == (MessageType.STAGE, [("req-1", "t" * 32)])
    assert decode_stage_request(frames) == sent
    assert len(frames[0]) < 4096  # a decode layout and the digests fit the header's bound
    reply = StageReply(state=StageState.READY, offset=1 << 20, bytes=4096, prestaged=True, pack_microseconds=12.5)
    assert decode_stage_reply(encode_stage_reply(FINGERPRINT, reply), FINGERPRINT) == reply
    busy = decode_stage_reply(encode_stage_reply(FINGERPRINT, StageReply(state=StageState.BUSY)), FINGERPRINT)
    assert busy.state is StageState.BUSY


@pytest.mark.parametrize(
    "change",
    [
        {"count": MAX_STAGE_UNITS + 1},  # more units than any request has
        {"count": 0},
        {"first": -1},
        {"rank": 1 << 20},
        {"plan": {"length": 1 << 40}},
        {"plan": {"digest": "not-hex"}},
        {"plan": {"heads": [[0, 1 << 20], [0, 1]]}},
        {"plan": {"decodeLayout": {"order": "LBHNC", "shape": [3, 24, 2, 16, 256], "strides": [1, 1, 1, 1, 1]}}},
        {"plan": {"unknownField": 1}},
        {"stage": None},
    ],
)
def test_out_of_bounds_stage_requests_are_malformed(change: dict[str, object]) -> None:
    header = json.loads(encode_stage_request(FINGERPRINT, ("req-1", "t"), request())[0])
    body = header["stage"]
    for key, value in change.items():
        if key == "plan" and isinstance(value, dict):
            body["plan"].update(value)
        elif key == "stage":
            header["stage"] = value
        else:
            body[key] = value
    with pytest.raises(HandshakeError) as caught:
        decode_stage_request([json.dumps(header).encode()])
    assert caught.value.code == MALFORMED_MESSAGE


def test_a_refused_stage_request_raises_prefills_code() -> None:
    with pytest.raises(HandshakeError) as caught:
        decode_stage_reply(encode_error(FINGERPRINT, STAGE_OUT_OF_RANGE, "no"), FINGERPRINT)
    assert caught.value.code == STAGE_OUT_OF_RANGE


def source(plan: StagePlan, rank: int = 1) -> object:
    return source_plan(plan, rank, TRANSFER.prefill_layout, 24, PREFILL, 16, TRANSFER)


def test_prefill_computes_decodes_segments_and_refuses_what_differs() -> None:
    found = source(physical_plan())
    units = offered_units([3, 7, 9, 11], 1)
    ids = found.ids(units, 1, 3)  # type: ignore[attr-defined]
    assert ids.size == 3 * 16 * 3  # one token of the head per layer (LBHNC into LBNHC), three blocks
    with pytest.raises(KVBridgeError) as caught:
        found.ids(units, 2, 3)  # type: ignore[attr-defined]
    assert caught.value.code == STAGE_OUT_OF_RANGE
    lying = physical_plan().model_copy(update={"digest": "0" * 32})
    with pytest.raises(KVBridgeError) as caught:
        source(lying)
    assert caught.value.code == STAGE_PLAN_MISMATCH
    reordered = physical_plan().model_copy(update={"order_digest": "0" * 32})
    with pytest.raises(KVBridgeError) as caught:
        source(reordered)
    assert caught.value.code == STAGE_PLAN_MISMATCH
    with pytest.raises(KVBridgeError) as caught:  # heads this rank does not hold
        source(physical_plan().model_copy(update={"heads": ((0, 2), (0, 2))}))
    assert caught.value.code == STAGE_PLAN_INVALID


def test_a_cache_kinds_plan_comes_from_the_pairs_plan() -> None:
    read = TRANSFER.for_decode_rank(0).reads[1]
    segments = region_segments(
        TRANSFER.prefill_layout, 24, units_per_block=1, offset=read.remote_offset, length=read.length
    )
    order = region_order(TRANSFER, 0, 1)
    plan = StagePlan(offset=read.remote_offset, length=read.length, digest=segments.digest, order_digest=order.digest)
    found = source_plan(plan, 1, TRANSFER.prefill_layout, 24, None, 16, TRANSFER)
    assert found.segments == segments
    ids = found.ids(np.array([5, 6, 2]), 0, 3)
    assert ids.size == 3 * TRANSFER.prefill_layout.num_regions
    with pytest.raises(KVBridgeError) as caught:  # a decode rank the plan does not have
        source_plan(plan.model_copy(update={"decode_rank": 5}), 1, TRANSFER.prefill_layout, 24, None, 16, TRANSFER)
    assert caught.value.code == STAGE_PLAN_INVALID
    with pytest.raises(KVBridgeError) as caught:  # a physical plan for a cache kind's regions
        source_plan(physical_plan(), 1, TRANSFER.prefill_layout, 24, None, 16, TRANSFER)
    assert caught.value.code == STAGE_PLAN_INVALID
    assert offered_units([4, 1], 2).tolist() == [8, 9, 2, 3]
