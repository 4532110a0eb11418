"""Physical layouts (core.layout): runs cover every byte of a block once, run pairs map logical bytes to themselves."""

from __future__ import annotations

import itertools

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import SpecError
from kvbridge_agent.core.layout import (
    B,
    BlockRuns,
    PhysicalLayout,
    PhysicalOrder,
    block_runs,
    dense_strides,
    paired_runs,
    run_regions,
)

ORDERS = list(PhysicalOrder)


def logical_map(layout: PhysicalLayout) -> npt.NDArray[np.int64]:
    """Address (from the origin) -> flat logical index of ``(l, b, h, n, c)``; -1 for padding."""
    shape = layout.shape
    index = np.indices(shape, dtype=np.int64)
    addresses = layout.offsets(tuple(index)).ravel()
    table = np.full(layout.extent, -1, dtype=np.int64)
    assert len(np.unique(addresses)) == addresses.size, "two logical bytes share an address"
    table[addresses] = np.arange(addresses.size, dtype=np.int64)
    return table


def run_bytes(runs: BlockRuns, block: int) -> npt.NDArray[np.int64]:
    starts = np.asarray(runs.offsets, dtype=np.int64) + block * runs.block_stride
    return (starts[:, None] + np.arange(runs.length, dtype=np.int64)[None, :]).ravel()


@st.composite
def layouts(draw: st.DrawFn, order: PhysicalOrder | None = None, padded: bool = True) -> PhysicalLayout:
    order = order or draw(st.sampled_from(ORDERS))
    shape = (
        draw(st.integers(1, 3)),
        draw(st.integers(1, 3)),
        draw(st.integers(1, 3)),
        draw(st.integers(1, 4)),
        draw(st.integers(1, 6)),
    )
    strides = list(dense_strides(order, shape))
    if padded and draw(st.booleans()):  # pad one axis' stride (an overlaid group, a padded page)
        axis = draw(st.sampled_from(order.axes[:-1]))
        pad = draw(st.integers(1, 5))
        strides = [0] * 5
        current = 1
        for a in reversed(order.axes):
            strides[a] = current + (pad if a == axis else 0)
            current = strides[a] * shape[a]
    return PhysicalLayout(
        order=order, shape=shape, strides=(strides[0], strides[1], strides[2], strides[3], strides[4])
    )


@settings(max_examples=200, deadline=None)
@given(layouts(), st.data())
def test_runs_cover_every_byte_of_a_block_once(layout: PhysicalLayout, data: st.DataObject) -> None:
    table = logical_map(layout)
    heads = layout.num_heads
    first = data.draw(st.integers(0, heads - 1))
    end = data.draw(st.integers(first + 1, heads))
    block = data.draw(st.integers(0, layout.num_blocks - 1))
    runs = block_runs(layout, (first, end))
    covered = table[run_bytes(runs, block)]
    assert (covered >= 0).all(), "a run covers padding"
    assert len(np.unique(covered)) == covered.size, "a byte is covered twice"
    _l, b, h, _n, _c = np.unravel_index(covered, layout.shape)
    assert (b == block).all()
    assert (h >= first).all()
    assert (h < end).all()
    expected = layout.num_layers * (end - first) * layout.block_size * layout.content_bytes
    assert covered.size == expected


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_runs_pair_logical_bytes_for_every_layout_pair(data: st.DataObject) -> None:
    shape_draw = layouts()
    source = data.draw(shape_draw)
    for target_order in ORDERS:
        target = PhysicalLayout(
            order=target_order,
            shape=source.shape,
            strides=dense_strides(target_order, source.shape),
        )
        check_pairing(source, target, data)
        check_pairing(target, source, data)


def check_pairing(source: PhysicalLayout, target: PhysicalLayout, data: st.DataObject) -> None:
    count = data.draw(st.integers(1, min(source.num_heads, target.num_heads)))
    s_first = data.draw(st.integers(0, source.num_heads - count))
    t_first = data.draw(st.integers(0, target.num_heads - count))
    s_runs, t_runs = paired_runs(source, target, (s_first, s_first + count), (t_first, t_first + count))
    assert s_runs.count == t_runs.count
    assert s_runs.length == t_runs.length
    s_block = data.draw(st.integers(0, source.num_blocks - 1))
    t_block = data.draw(st.integers(0, target.num_blocks - 1))
    s_logical = np.unravel_index(logical_map(source)[run_bytes(s_runs, s_block)], source.shape)
    t_logical = np.unravel_index(logical_map(target)[run_bytes(t_runs, t_block)], target.shape)
    for axis, (s, t) in enumerate(zip(s_logical, t_logical, strict=True)):
        if axis == B:
            assert (s == s_block).all()
            assert (t == t_block).all()
        elif axis == 2:
            assert (s - s_first == t - t_first).all()
        else:
            assert (s == t).all()
    assert s_runs.bytes_per_block == source.num_layers * count * source.block_size * source.content_bytes


def test_all_36_pairs_descriptor_counts() -> None:
    """Descriptors per block for every (source, target) pair of a 4-layer, 2-head, 16-token cache."""
    shape = (4, 8, 2, 16, 256)
    counts = {}
    for s_order, t_order in itertools.product(ORDERS, ORDERS):
        source = PhysicalLayout(order=s_order, shape=shape, strides=dense_strides(s_order, shape))
        target = PhysicalLayout(order=t_order, shape=shape, strides=dense_strides(t_order, shape))
        s_runs, _t_runs = paired_runs(source, target)
        counts[s_order.value, t_order.value] = s_runs.count
    for order in ("BLHNC", "BLNHC", "BHLNC"):
        assert counts[order, order] == 1  # cross-layer: one descriptor per block for all layers
    assert counts["LBHNC", "LBHNC"] == counts["LBNHC", "LBNHC"] == 4  # one per layer
    assert counts["LHBNC", "LHBNC"] == 8  # one per layer and head
    assert counts["LBHNC", "BLHNC"] == 4  # [H, N, C] contiguous on both sides
    assert counts["BLHNC", "LBNHC"] == 4 * 2 * 16  # orders differ inside the layer: one token of one head
    assert counts["LHBNC", "BHLNC"] == 8  # [N, C] of one layer and head
    assert counts["BLNHC", "LBNHC"] == 4  # [N, H, C]


def test_run_regions_number_runs_as_regions() -> None:
    layout = PhysicalLayout.dense(PhysicalOrder.LBHNC, 2, 5, 2, 4, 8)
    regions = run_regions(block_runs(layout), origin=100)
    assert regions.num_regions == 2
    assert regions.unit_bytes == 64
    assert regions.block_stride == 64
    assert regions.region_offset == (100, 100 + 5 * 64)


def test_strides_against_the_order_are_refused() -> None:
    shape = (2, 4, 2, 16, 8)
    with pytest.raises(SpecError) as caught:
        PhysicalLayout(order=PhysicalOrder.BLHNC, shape=shape, strides=dense_strides(PhysicalOrder.LBHNC, shape))
    assert caught.value.code == "LAYOUT_INCONSISTENT"
    assert caught.value.field == "kvCacheLayout"
    with pytest.raises(SpecError, match="contiguous"):
        PhysicalLayout(order=PhysicalOrder.LBHNC, shape=shape, strides=(1024, 256, 128, 16, 2))


def test_mismatched_shapes_and_head_ranges_are_refused() -> None:
    a = PhysicalLayout.dense(PhysicalOrder.LBHNC, 2, 4, 2, 16, 8)
    b = PhysicalLayout.dense(PhysicalOrder.LBHNC, 2, 4, 2, 32, 8)
    with pytest.raises(SpecError) as caught:
        paired_runs(a, b)
    assert caught.value.code == "LAYOUT_MISMATCH"
    with pytest.raises(SpecError) as caught:
        block_runs(a, (1, 3))
    assert caught.value.code == "HEAD_RANGE_INVALID"


def test_cross_layer_orders() -> None:
    assert [o.value for o in ORDERS if o.cross_layer] == ["BLHNC", "BLNHC", "BHLNC"]


def test_rank_metadata_carries_a_physical_layout_only_when_there_is_one() -> None:
    from kvbridge_agent.core.handshake import (
        MALFORMED_MESSAGE,
        HandshakeError,
        RankMetadata,
        decode_reply,
        encode_reply,
    )

    fields = {
        "engineId": "p",
        "incarnation": "i",
        "agentName": "a",
        "tpRank": 0,
        "tpSize": 1,
        "blockSize": 16,
        "kvLayout": "HND",
        "cacheKind": "Split",
        "numBlocks": 8,
        "tensorBases": [4096],
        "regionBlockBytes": 512,
        "wireBlockSize": 16,
        "wireLayout": "HND",
        "memoryType": "DRAM",
        "deviceId": 0,
    }
    meta = RankMetadata.model_validate(fields)
    frames = encode_reply("f", meta, b"agent")
    assert b"physicalLayout" not in frames[1]  # caches without one encode as before
    layout = PhysicalLayout.dense(PhysicalOrder.BHLNC, 2, 8, 2, 16, 16)
    with_layout = meta.model_copy(update={"physical_layout": layout})
    assert decode_reply(encode_reply("f", with_layout, b"agent"), "f")[0].physical_layout == layout
    lying = encode_reply("f", with_layout, b"agent")
    lying[1] = lying[1].replace(b'"order":"BHLNC"', b'"order":"LBHNC"')
    with pytest.raises(HandshakeError) as caught:
        decode_reply(lying, "f")
    assert caught.value.code == MALFORMED_MESSAGE


def test_kernel_blocks_of_a_block_follow_in_token_order() -> None:
    from kvbridge_agent.core.layout import kernel_blocks

    ids = np.asarray([3, 0], dtype=np.int64)
    assert kernel_blocks(ids, 1) is ids
    assert kernel_blocks(ids, 4).tolist() == [12, 13, 14, 15, 0, 1, 2, 3]
