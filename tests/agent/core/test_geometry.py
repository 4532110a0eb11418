"""Region geometry of each cache kind and descriptor addresses (docs/protocol.md §1)."""

from __future__ import annotations

import pytest

from kvbridge_agent.core import SpecError, heads_local, region_layout, unit_addresses

from .conftest import dense, mla


def test_heads_local_replicates_when_tp_exceeds_heads() -> None:
    assert [heads_local(dense(8), tp) for tp in (1, 2, 8, 16)] == [8, 4, 1, 1]
    assert heads_local(mla(), 4) == 1


def test_split_layout() -> None:
    layout = region_layout(dense(8, layers=2), 16, 2)
    assert (layout.num_tensors, layout.num_regions, layout.unit_bytes, layout.block_stride) == (4, 4, 16384, 16384)


def test_blocks_first_layout_has_two_halves_per_tensor() -> None:
    layout = region_layout(dense(8, layers=2, cacheKind="BlocksFirst"), 16, 1)
    assert layout.region_tensor == (0, 0, 1, 1)
    assert layout.region_offset == (0, 32768, 0, 32768)
    assert (layout.unit_bytes, layout.block_stride) == (32768, 65536)


def test_mla_and_cross_layer_layouts() -> None:
    assert region_layout(mla(576, layers=3), 16, 2).unit_bytes == 16 * 576 * 2
    cross = region_layout(dense(8, layers=32, cacheKind="CrossLayer"), 16, 2)
    assert (cross.num_tensors, cross.num_regions, cross.unit_bytes) == (1, 1, 32 * 2 * 16 * 4 * 128 * 2)


def test_unit_addresses_region_major_with_sub_units_and_offsets() -> None:
    layout = region_layout(dense(1, layers=1, head_dim=4), 2, 1)  # unit 16 bytes
    addresses = unit_addresses([1000, 5000], layout, 3, units_per_block=2, offset=2, length=4)
    assert addresses.tolist() == [1002, 1010, 1018, 1026, 1034, 1042, 5002, 5010, 5018, 5026, 5034, 5042]


def test_unit_addresses_reject_descriptors_past_the_unit() -> None:
    layout = region_layout(dense(1, layers=1, head_dim=4), 2, 1)
    with pytest.raises(SpecError) as caught:
        unit_addresses([0, 100], layout, 1, offset=8, length=16)
    assert caught.value.code == "DESCRIPTOR_OUT_OF_BOUNDS"
    with pytest.raises(SpecError) as caught:
        unit_addresses([0], layout, 1)
    assert caught.value.code == "REGION_COUNT_MISMATCH"
