"""Several KV cache groups as one list (core.cache_groups): what each group keeps, and how the sides pair."""

from __future__ import annotations

import pytest

from kvbridge_agent.core import BlockMappingError, SpecError
from kvbridge_agent.core.cache_groups import (
    CACHE_GROUPS_MISMATCH,
    NULL_BLOCK_IN_WINDOW,
    CacheGroups,
    pair_groups,
    split,
)

GROUPS = CacheGroups.of([None, 32], 16)  # full attention, a 32-token window


def test_a_window_keeps_its_last_blocks_plus_one() -> None:
    assert GROUPS.kept == (None, 3)
    assert CacheGroups.of([None, 100], 16).kept == (None, 8)  # ceil(100 / 16) + 1


def test_flatten_clips_each_group_to_the_prompt_and_the_window() -> None:
    table = ([3, 7, 1, 12, 5, 9], [0, 0, 20, 21, 22, 23])  # one block past the 70-token prompt
    flat, sizes = GROUPS.flatten(table, 70)
    assert flat == [3, 7, 1, 12, 5, 20, 21, 22]
    assert sizes == [5, 3]
    assert GROUPS.digest_tokens(flat) == 8 * 16
    short, short_sizes = GROUPS.flatten(([3, 7], [20, 21]), 20)  # the window holds the whole prompt
    assert (short, short_sizes) == ([3, 7, 20, 21], [2, 2])


def test_a_null_block_inside_what_a_group_keeps_is_refused() -> None:
    with pytest.raises(BlockMappingError) as caught:
        GROUPS.flatten(([3, 7, 1, 12, 5], [0, 0, 0, 21, 22]), 70)
    assert caught.value.code == NULL_BLOCK_IN_WINDOW
    with pytest.raises(BlockMappingError) as caught:
        GROUPS.flatten(([3, 7, 1, 12, 5],), 70)
    assert caught.value.code == CACHE_GROUPS_MISMATCH


def test_pairing_takes_the_last_blocks_of_each_group() -> None:
    pairs = pair_groups([14, 6, 11, 15, 16, 17], [3, 3], [3, 7, 1, 12, 5, 20, 21, 22], [5, 3])
    assert pairs == [([14, 6, 11], [1, 12, 5]), ([15, 16, 17], [20, 21, 22])]
    assert pair_groups([], [0, 0], [3, 20], [1, 1]) == [([], []), ([], [])]


@pytest.mark.parametrize(
    ("local", "local_sizes", "remote", "remote_sizes"),
    [
        ([1, 2], [1, 1], [3, 4], [2]),  # different group counts
        ([1, 2, 3], [3, 0], [4, 5], [1, 1]),  # a group longer on decode
        ([1, 2], [1, 2], [3, 4], [1, 1]),  # sizes that do not add up
    ],
)
def test_groups_that_do_not_pair_are_refused_typed(
    local: list[int], local_sizes: list[int], remote: list[int], remote_sizes: list[int]
) -> None:
    with pytest.raises(BlockMappingError) as caught:
        pair_groups(local, local_sizes, remote, remote_sizes)
    assert caught.value.code in {CACHE_GROUPS_MISMATCH, "LOCAL_LONGER_THAN_REMOTE"}


def test_bad_windows_are_refused() -> None:
    with pytest.raises(SpecError):
        CacheGroups.of([], 16)
    with pytest.raises(SpecError):
        CacheGroups.of([None, 0], 16)
    with pytest.raises(BlockMappingError):
        split([1, 2, 3], [1, 1], "f")
