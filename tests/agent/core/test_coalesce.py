"""Coalescing runs of units adjacent in both caches (core/coalesce.py): the numbering of a list's merged entries,
the cut of a request into runs and pieces, and what a peer's lists may cost."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge_agent.core import BlockMappingError
from kvbridge_agent.core.blocks import INVALID_BLOCK_IDS, descriptor_ids, require_distinct
from kvbridge_agent.core.coalesce import MAX_MERGED_ROWS, MergedList, merge_levels, merged_ids, pieces, runs


def reference_entries(merged: MergedList) -> dict[tuple[int, int, int], int]:
    """Every entry of the list in the documented order — level, region, first unit's residue, then first unit —
    as ``(level, region, first unit) -> index``: what the ids must agree with."""
    entries: dict[tuple[int, int, int], int] = {}
    for level in range(merged.levels + 1):
        k = 1 << level
        for region in range(merged.regions):
            for residue in range(k):
                for first in range(residue, merged.units - k + 1, k):
                    entries[level, region, first] = len(entries)
    return entries


@cache
def _entries(regions: int, units: int, levels: int) -> dict[tuple[int, int, int], int]:
    return reference_entries(MergedList(regions, units, levels))


@given(regions=st.integers(1, 4), units=st.integers(1, 40), data=st.data())
def test_ids_number_the_entries_level_region_residue_then_unit(regions: int, units: int, data: st.DataObject) -> None:
    levels = data.draw(st.integers(0, units.bit_length() - 1))
    merged = MergedList(regions, units, levels)
    entries = _entries(regions, units, levels)
    assert merged.entries == len(entries)
    level = data.draw(st.integers(0, levels))
    first = data.draw(st.integers(0, units - (1 << level)))
    ids = merged.ids(np.array([level]), np.array([first]))
    assert ids.tolist() == [entries[level, region, first] for region in range(regions)]
    assert ids.dtype == np.int32
    assert [int(c) for c in merged.counts(level)] == [
        sum(1 for (lv, r, u) in entries if (lv, r) == (level, 0) and u % (1 << level) == residue)
        for residue in range(1 << level)
    ]


def min_pieces(n: int, levels: int) -> int:
    """The fewest runs of ``1, 2, 4, .. 2**levels`` units that make ``n`` (dynamic programming)."""
    best = [0] + [n + 1] * n
    for total in range(1, n + 1):
        best[total] = 1 + min(best[total - (1 << j)] for j in range(levels + 1) if 1 << j <= total)
    return best[n]


@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=6), levels=st.integers(0, 9))
def test_pieces_cover_each_run_in_order_with_the_fewest_pieces(lengths: list[int], levels: int) -> None:
    run, offset, level = pieces(np.asarray(lengths, dtype=np.int64), levels)
    for index, length in enumerate(lengths):
        mine = run == index
        sizes = (1 << level[mine]).tolist()
        assert sum(sizes) == length
        assert offset[mine].tolist() == np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()  # one after another
        assert sizes == sorted(sizes, reverse=True)  # the longest first
        assert len(sizes) == min_pieces(length, levels)
    assert run.tolist() == sorted(run.tolist())


@given(pairs=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), max_size=30))
def test_runs_go_on_by_one_on_both_sides(pairs: list[tuple[int, int]]) -> None:
    local = np.asarray([p[0] for p in pairs], dtype=np.int64)
    remote = np.asarray([p[1] for p in pairs], dtype=np.int64)
    cut = runs(local, remote)
    rebuilt = [
        (int(start_l) + i, int(start_r) + i)
        for start_l, start_r, n in zip(cut.local, cut.remote, cut.length, strict=True)
        for i in range(int(n))
    ]
    assert rebuilt == pairs
    ends = np.cumsum(cut.length)[:-1]  # each run is maximal: the next pair does not go on by one on both sides
    assert all(not (local[e] == local[e - 1] + 1 and remote[e] == remote[e - 1] + 1) for e in ends)


@given(units=st.integers(2, 64), data=st.data())
def test_without_levels_merged_ids_are_the_plain_ones(units: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(0, units))
    local = np.asarray(data.draw(st.permutations(range(units)))[:n], dtype=np.int64)
    remote = np.asarray(data.draw(st.permutations(range(units)))[:n], dtype=np.int64)
    plain = MergedList(3, units, 0)
    got = merged_ids(runs(local, remote), plain, plain)
    assert got[0].tolist() == descriptor_ids(local, 3, units).tolist()
    assert got[1].tolist() == descriptor_ids(remote, 3, units).tolist()


def test_a_contiguous_request_is_one_descriptor_per_region_up_to_the_longest_level() -> None:
    local, remote = MergedList(32, 258, 7), MergedList(32, 300, 7)
    ids = merged_ids(runs(np.arange(2, 130), np.arange(100, 228)), local, remote)
    assert [len(side) for side in ids] == [32, 32]
    ids = merged_ids(runs(np.arange(2, 258), np.arange(0, 256)), local, remote)  # 256 = two of the longest, 128
    assert [len(side) for side in ids] == [64, 64]


def test_levels_are_bounded_by_rows_and_by_the_smaller_side() -> None:
    assert merge_levels(32, (4096, 4096)) == 9  # 32 x 1023 rows
    assert 80 * ((1 << (merge_levels(80, (4096, 4096)) + 1)) - 1) <= MAX_MERGED_ROWS
    assert merge_levels(1, (5, 1 << 20)) == 2  # runs of 4 fit 5 units, 8 do not
    assert merge_levels(1, (1, 64)) == 0
    assert merge_levels(MAX_MERGED_ROWS, (64, 64)) == 0  # a list of that many regions gets no merged entries


def test_a_run_past_the_registered_units_is_refused() -> None:
    with pytest.raises(BlockMappingError):
        MergedList(2, 16, 2).ids(np.array([2]), np.array([13]))


@given(ids=st.lists(st.integers(0, 50), min_size=2, max_size=30).filter(lambda ids: len(set(ids)) < len(ids)))
def test_a_block_listed_twice_is_refused(ids: list[int]) -> None:
    with pytest.raises(BlockMappingError) as caught:
        require_distinct(np.asarray(ids, dtype=np.int64), field="request.local_block_ids")
    assert (caught.value.code, caught.value.field) == (INVALID_BLOCK_IDS, "request.local_block_ids")
    require_distinct(np.asarray(sorted(set(ids)), dtype=np.int64), field="request.local_block_ids")
