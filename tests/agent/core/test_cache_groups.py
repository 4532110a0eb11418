"""Several KV cache groups as one list (core.cache_groups): what each group keeps, and how the sides pair."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import BlockMappingError, SpecError
from kvbridge_agent.core.cache_groups import (
    CACHE_GROUPS_MISMATCH,
    NULL_BLOCK_IN_WINDOW,
    CacheGroups,
    pair_groups,
    split,
)

GROUPS = CacheGroups.of([None, 32], 16)  # full attention, a 32-token window


def test_a_window_keeps_the_blocks_vllm_keeps() -> None:
    """vLLM's SlidingWindowManager skips ``max(0, n - window + 1 - extra)`` tokens: their whole blocks are null."""
    assert [GROUPS.skipped_blocks(1, n) for n in (1, 31, 32, 47, 48, 64, 70)] == [0, 0, 0, 1, 1, 2, 2]
    assert GROUPS.skipped_blocks(0, 10_000) == 0  # full attention keeps every block
    assert GROUPS.sizes(70) == [5, 3]
    assert GROUPS.sizes(64) == [4, 2]  # was 3: one block more than vLLM keeps
    edge = CacheGroups.of([16], 16)
    assert [edge.sizes(n) for n in (31, 32, 33)] == [[1], [1], [2]]
    assert CacheGroups.of([16], 16, [5]).sizes(32) == [2]  # tokens vLLM retains below the window (MTP)


def test_prompts_at_the_window_edge_are_not_refused() -> None:
    """31 and 32 tokens in a 16-token window: vLLM's tables null the first block; kvbridge keeps the second."""
    edge = CacheGroups.of([None, 16], 16)
    assert edge.flatten(([4, 5], [0, 6]), 31) == ([4, 5, 6], [2, 1])
    assert edge.flatten(([4, 5], [0, 6]), 32) == ([4, 5, 6], [2, 1])
    assert edge.flatten(([4, 5, 7], [0, 6, 8]), 33) == ([4, 5, 7, 6, 8], [3, 2])


@settings(max_examples=300)
@given(
    windows=st.lists(st.one_of(st.none(), st.integers(1, 200)), min_size=1, max_size=4),
    block=st.sampled_from([1, 8, 16, 32]),
    tokens=st.integers(1, 2000),
)
def test_what_a_group_keeps_is_what_vllm_leaves(windows: list[int | None], block: int, tokens: int) -> None:
    """A table nulled as vLLM nulls it clips to its non-null prompt blocks, whatever the window and length."""
    groups = CacheGroups.of(windows, block)
    prompt = -(-tokens // block)
    tables = []
    for index, window in enumerate(windows):
        skipped = 0 if window is None else max(0, tokens - window + 1) // block
        tables.append([0] * skipped + [1000 * (index + 1) + i for i in range(skipped, prompt + 1)])
    flat, sizes = groups.flatten(tables, tokens)
    assert sizes == groups.sizes(tokens)
    assert 0 not in flat
    assert sizes == [len([b for b in table[:prompt] if b]) for table in tables]


def test_padded_groups_digest_their_own_layers() -> None:
    """vLLM's groups of 2, 2 and 1 layers: the third group's blocks hold KV in their first layer slot only."""
    padded = CacheGroups.of([None, 32, 32], 16, layers=[2, 2, 1])
    assert padded.depths == (2, 2, 1)
    assert padded.block_layers([3, 2, 2]) == [2, 2, 2, 2, 2, 1, 1]
    assert CacheGroups.of([None, 32], 16, layers=[2, 2]).block_layers([3, 2]) is None  # none padded
    assert GROUPS.block_layers([5, 3]) is None


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
    with pytest.raises(SpecError):
        CacheGroups.of([None, 16], 16, layers=[2])
    with pytest.raises(SpecError):
        CacheGroups.of([None, 16], 16, retained=[0, -1])
    with pytest.raises(BlockMappingError):
        split([1, 2, 3], [1, 1], "f")
