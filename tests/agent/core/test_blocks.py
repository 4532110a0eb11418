"""Per-request block ids (docs/protocol.md §4): prefix hits, block-size ratios, clipping, errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge_agent.core import BlockMappingError, blocks_for_tokens, descriptor_ids, map_request_blocks, wire_block_ids
from kvbridge_agent.core.blocks import INVALID_BLOCK_IDS, require_distinct


def test_blocks_for_tokens_is_a_ceiling() -> None:
    assert [blocks_for_tokens(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_equal_block_sizes_read_everything_or_the_suffix_after_a_prefix_hit() -> None:
    full = map_request_blocks([7, 8, 9], [1, 2, 3], 1)
    assert (full.local.tolist(), full.remote.tolist()) == ([7, 8, 9], [1, 2, 3])
    hit = map_request_blocks([9], [1, 2, 3], 1)
    assert (hit.local.tolist(), hit.remote.tolist()) == ([9], [3])


def test_full_hit_reads_nothing() -> None:
    mapped = map_request_blocks([], [1, 2, 3], 1)
    assert mapped.full_hit
    assert mapped.remote.size == 0


def test_block_size_ratio_maps_sub_blocks_and_clips_the_partial_last_block() -> None:
    # bs_P 8, bs_D 16, 40 tokens: 5 prefill blocks, 3 decode blocks (the last half full)
    mapped = map_request_blocks([4, 6, 9], [10, 11, 12, 13, 14], 2)
    assert mapped.local.tolist() == [8, 9, 12, 13, 18]
    assert mapped.remote.tolist() == [10, 11, 12, 13, 14]


def test_block_size_ratio_with_a_prefix_hit_skips_whole_local_blocks() -> None:
    # as above, but decode already holds the first local block (prefill blocks 10 and 11)
    mapped = map_request_blocks([6, 9], [10, 11, 12, 13, 14], 2)
    assert mapped.local.tolist() == [12, 13, 18]
    assert mapped.remote.tolist() == [12, 13, 14]


def test_local_longer_than_remote_is_a_typed_error() -> None:
    with pytest.raises(BlockMappingError) as caught:
        map_request_blocks([1, 2, 3], [5, 6], 1)
    assert caught.value.code == "LOCAL_LONGER_THAN_REMOTE"
    assert caught.value.field == "request.local_block_ids"
    with pytest.raises(BlockMappingError):
        map_request_blocks([1, 2], [5, 6, 7], 4)


@pytest.mark.parametrize("bad", [[-1, 2], [[1, 2]], [1.5, 2.0], ["a"]])
def test_malformed_block_ids_are_rejected(bad: object) -> None:
    with pytest.raises(BlockMappingError) as caught:
        map_request_blocks(bad, [1, 2], 1)  # type: ignore[arg-type]
    assert caught.value.code == "INVALID_BLOCK_IDS"


def test_wire_block_ids_after_a_prefill_split() -> None:
    # bs_P 32 split into 16-token wire blocks; 40 tokens need ceil(40/16) = 3 wire blocks
    assert wire_block_ids([5, 2], 40, 2, 16).tolist() == [10, 11, 4]
    assert wire_block_ids([5, 2], 40, 1, 32).tolist() == [5, 2]
    with pytest.raises(BlockMappingError) as caught:
        wire_block_ids([5], 40, 2, 16)
    assert caught.value.code == "TOKENS_EXCEED_BLOCKS"


def test_descriptor_ids_are_region_major_and_bounds_checked() -> None:
    assert descriptor_ids(np.array([0, 3]), 3, 4).tolist() == [0, 3, 4, 7, 8, 11]
    with pytest.raises(BlockMappingError) as caught:
        descriptor_ids(np.array([4]), 3, 4)
    assert caught.value.code == "BLOCK_ID_OUT_OF_RANGE"


def test_descriptor_ids_into_a_reused_buffer() -> None:
    out = np.full(10, -1, dtype=np.int32)
    ids = descriptor_ids(np.array([0, 3]), 3, 4, out=out)
    assert ids.tolist() == [0, 3, 4, 7, 8, 11]
    assert np.shares_memory(ids, out)
    with pytest.raises(BlockMappingError):
        descriptor_ids(np.array([0, 1, 2, 3]), 3, 4, out=out)


@given(ids=st.lists(st.integers(0, 50), max_size=30))
def test_a_block_listed_twice_is_refused(ids: list[int]) -> None:
    """Two READs into one decode block would race (transfer/reads.py checks both sides' units)."""
    units = np.asarray(ids, dtype=np.int64)
    if len(set(ids)) == len(ids):
        require_distinct(units, field="request.local_block_ids")
        return
    with pytest.raises(BlockMappingError) as caught:
        require_distinct(units, field="request.local_block_ids")
    assert (caught.value.code, caught.value.field) == (INVALID_BLOCK_IDS, "request.local_block_ids")
