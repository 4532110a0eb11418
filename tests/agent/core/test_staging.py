"""Staged reads' pure parts (docs/protocol.md §4d): both sides' segments are the prepped lists' own bytes, the wire
order is decode's address order, and the cost model picks direct, into the blocks or into the buffer."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import CacheKind, ModelGeometry, region_layout, unit_addresses
from kvbridge_agent.core.layout import BlockRuns, PhysicalLayout, PhysicalOrder
from kvbridge_agent.core.physical_reads import physical_read
from kvbridge_agent.core.staging import (
    INTO_BLOCKS,
    INTO_BUFFER,
    CostModel,
    WireOrder,
    placed_runs,
    posted_estimate,
    region_segments,
    run_segments,
)

KINDS = [CacheKind.SPLIT, CacheKind.BLOCKS_FIRST, CacheKind.CROSS_LAYER]


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    tp=st.sampled_from([1, 2, 4]),
    per_block=st.sampled_from([1, 2]),
    blocks=st.integers(1, 6),
    data=st.data(),
)
def test_a_cache_kinds_segments_are_its_descriptor_addresses(
    kind: CacheKind, tp: int, per_block: int, blocks: int, data: st.DataObject
) -> None:
    model = ModelGeometry(name="m", num_layers=2, num_kv_heads=4, head_dim=16, cache_kind=kind)
    layout = region_layout(model, 16, tp)
    unit = layout.unit_bytes // per_block
    length = data.draw(st.integers(1, unit))
    offset = data.draw(st.integers(0, unit - length))
    bases = [1 << 40 + t for t in range(layout.num_tensors)]
    addresses = unit_addresses(bases, layout, blocks, units_per_block=per_block, offset=offset, length=length)
    segments = region_segments(layout, blocks, units_per_block=per_block, offset=offset, length=length)
    ids = np.arange(addresses.size, dtype=np.int32)
    tensors, offsets = segments.offsets(ids)
    assert np.array_equal(np.asarray(bases, dtype=np.int64)[tensors] + offsets, addresses)
    assert segments.tiles == (length == unit and (per_block == 1 or layout.block_stride == per_block * unit))


@pytest.mark.parametrize("pair", [("LBHNC", "LBNHC"), ("LBHNC", "BLHNC"), ("LHBNC", "LHBNC"), ("BHLNC", "BLNHC")])
def test_paired_runs_segments_are_the_runs_of_each_chunk(pair: tuple[str, str]) -> None:
    source = PhysicalLayout.dense(PhysicalOrder(pair[0]), 3, 8, 2, 16, 256)
    target = PhysicalLayout.dense(PhysicalOrder(pair[1]), 3, 16, 2, 8, 256)  # 8-token blocks: two chunks each
    read = physical_read(0, source, target, ((0, 2), (0, 2)))
    for runs, layout in ((read.source, source), (read.target, target)):
        segments = run_segments(runs.regions, layout.num_blocks)
        ids = np.arange(segments.regions * layout.num_blocks, dtype=np.int32)
        _, offsets = segments.offsets(ids)
        regions, blocks = np.divmod(ids.astype(np.int64), layout.num_blocks)
        expected = np.asarray(runs.regions.offsets)[regions] + blocks * layout.strides[1]
        assert np.array_equal(offsets, expected)
        assert segments.digest == run_segments(runs.regions, layout.num_blocks).digest


@settings(max_examples=40, deadline=None)
@given(order=st.sampled_from(list(PhysicalOrder)), chunks=st.sampled_from([1, 2]), units=st.integers(1, 16))
def test_the_wire_order_is_decodes_address_order_over_consecutive_blocks(
    order: PhysicalOrder, chunks: int, units: int
) -> None:
    """With the request's units in consecutive blocks, the wire order lists decode's bytes from the first to the
    last: every segment starts where the one before it ended or further on, and a dense layout that the request
    fills completely is one run per layer (per-layer orders) or one run (cross-layer orders)."""
    assume(units <= 8 * chunks)  # the request's units fit the 8 blocks of decode's cache
    tokens = 16 // chunks
    layout = PhysicalLayout.dense(order, 3, 8, 2, 16, 256)
    source = PhysicalLayout.dense(order, 3, 8 * chunks, 2, tokens, 256)
    read = physical_read(0, source, layout, ((0, 2), (0, 2)))
    target = run_segments(read.target.regions, 0)
    wire = WireOrder(target, read.target.chunks)
    runs = read.target.runs.count
    permutation = wire.permutation(runs, units)
    assert sorted(permutation.tolist()) == list(range(runs * units))
    index = np.arange(units)
    regions = np.arange(runs)[:, None] * read.target.chunks + (index % read.target.chunks)[None, :]
    blocks = np.broadcast_to(index // read.target.chunks, regions.shape)
    ids = (regions * 8 + blocks).ravel().astype(np.int32)
    tensors, offsets = run_segments(read.target.regions, 8).offsets(ids[permutation])
    assert (np.diff(offsets) > 0).all()
    if units == 8 * read.target.chunks:  # the whole (dense) cache: one run
        assert placed_runs(offsets, tensors, target.length) == 1
    assert wire.digest == WireOrder(target, read.target.chunks).digest != WireOrder(target, 2 * chunks).digest


def test_posted_estimate_counts_runs_adjacent_on_both_sides() -> None:
    local, remote = np.array([3, 4, 5, 9, 10]), np.array([0, 1, 2, 3, 7])
    assert posted_estimate(local, remote, regions=2, merge=True) == 2 * 3  # [3-5], [9], [10]
    assert posted_estimate(local, remote, regions=2, merge=False) == 2 * 5
    assert posted_estimate(local[:0], remote[:0], regions=2, merge=True) == 0
    assert placed_runs(np.array([0, 64, 128, 512]), np.array([0, 0, 1, 1]), 64) == 3


MODEL = CostModel(descriptor_us=2.0, transfer_gbps=6.0, gather_gbps=10.0, scatter_gbps=10.0, exchange_us=500.0)


def test_the_cost_model_stages_many_small_descriptors_and_reads_few_large_ones_directly() -> None:
    request = 256 << 20
    few = MODEL.choose(direct=32, into_blocks=32, nbytes=request, reads=1, pieces=8, packed=True)
    assert not few.staged  # the exchange costs more than 32 descriptors
    many = MODEL.choose(direct=524_288, into_blocks=32, nbytes=request, reads=1, pieces=8, packed=True)
    assert many.staged
    assert many.into == INTO_BLOCKS
    assert many.staged_seconds < 0.85 * many.direct_seconds
    # decode's own runs are as many as the direct read's: only the buffer saves descriptors
    fragmented = MODEL.choose(direct=131_072, into_blocks=131_072, nbytes=request, reads=2, pieces=16, packed=True)
    assert fragmented.staged
    assert fragmented.into == INTO_BUFFER
    assert fragmented.buffer_seconds < fragmented.blocks_seconds
    no_blocks = MODEL.choose(direct=131_072, into_blocks=None, nbytes=request, reads=2, pieces=16, packed=True)
    assert no_blocks.into == INTO_BUFFER
    assert no_blocks.blocks_seconds == float("inf")
    # the pack counts unless prefill packed the request when it offered it
    unpacked = MODEL.choose(direct=524_288, into_blocks=32, nbytes=request, reads=1, pieces=8, packed=False)
    assert unpacked.staged_seconds > many.staged_seconds
    assert set(MODEL.to_dict()) == {
        "descriptorMicroseconds",
        "transferGBps",
        "gatherGBps",
        "scatterGBps",
        "exchangeMicroseconds",
    }


@settings(max_examples=40, deadline=None)
@given(runs=st.integers(1, 5), chunks=st.sampled_from([1, 2, 4]), data=st.data())
def test_a_requests_grid_of_ids_is_offset_by_broadcasting_as_id_by_id(
    runs: int, chunks: int, data: st.DataObject
) -> None:
    from kvbridge_agent.core.blocks import descriptor_ids

    blocks = 9
    offsets = tuple(data.draw(st.lists(st.integers(0, 1 << 20), min_size=runs * chunks, max_size=runs * chunks)))
    segments = run_segments(BlockRuns(offsets, 64, 1 << 21), blocks)
    units = np.asarray(data.draw(st.lists(st.integers(0, chunks * blocks - 1), min_size=1, max_size=12)))
    ids = descriptor_ids(units, runs, chunks * blocks)
    grid = segments.offsets(ids, runs)
    one_by_one = segments.offsets(ids)
    assert all(np.array_equal(a, b) for a, b in zip(grid, one_by_one, strict=True))
