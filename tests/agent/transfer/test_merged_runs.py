"""Runs of blocks adjacent in both caches go as one descriptor (docs/protocol.md §4c): NIXL merges the consecutive
descriptor ids kvbridge hands it where their bytes lie end to end on both sides, so a request costs one descriptor
per region and maximal run — counted from NIXL's own telemetry — and every byte still lands where it belongs.

Real NIXL agents on host memory, in one process (harness.InProcessPair); block ids drawn by hypothesis: contiguous,
reversed, scattered, or runs of a few in any order, with prefix hits; a block listed twice is refused.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import map_request_blocks
from kvbridge_agent.core.arithmetic import ceil_div
from kvbridge_agent.core.blocks import INVALID_BLOCK_IDS, wire_block_ids

from .harness import CASES, InProcessPair
from .test_transfers_inprocess import end_to_end

#: blocks of each side's cache in these pairs
BLOCKS = 24
#: pairs whose blocks lie end to end (equal TP, MLA, decode merging sub-blocks) and two that do not (a head range
#: of each block; K and V halves listed as sub-blocks)
MERGING = ("dense-1to1", "mla-2to1", "bsr2-decode-merges")
NOT_MERGING = ("dense-2to1", "blocks-first-bsr2")
_ids = itertools.count()


@pytest.fixture(params=[*MERGING, *NOT_MERGING], scope="module")
def pair(request: pytest.FixtureRequest) -> Iterator[InProcessPair]:
    built = InProcessPair(*CASES[request.param], num_blocks=BLOCKS)
    try:
        yield built
    finally:
        built.close()


@st.composite
def block_list(draw: st.DrawFn, count: int) -> tuple[str, list[int]]:
    """``count`` distinct ids below ``BLOCKS - 1`` (the last block never listed: the ids of one region's last unit
    and the next region's first would be consecutive, and NIXL may merge those too where the regions touch)."""
    blocks = BLOCKS - 1
    kind = draw(st.sampled_from(["contiguous", "reversed", "scattered", "runs"]))
    if kind in ("contiguous", "reversed"):
        start = draw(st.integers(0, blocks - count))
        ids = list(range(start, start + count))
        return kind, ids if kind == "contiguous" else ids[::-1]
    if kind == "scattered":
        return kind, draw(st.permutations(range(blocks)))[:count]
    size = draw(st.integers(2, 5))
    groups = draw(st.permutations([list(range(i, min(i + size, blocks))) for i in range(0, blocks, size)]))
    return kind, [b for group in groups for b in group][:count]


def runs(local: np.ndarray, remote: np.ndarray) -> int:
    """Maximal runs of pairs that go on by one on both sides."""
    if local.size == 0:
        return 0
    return 1 + int(((np.diff(local) != 1) | (np.diff(remote) != 1)).sum())


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_request_costs_one_descriptor_per_region_and_run(pair: InProcessPair, data: st.DataObject) -> None:
    bs_p, bs_d = pair.prefill_settings.block_size, pair.decode_settings.block_size
    tokens = data.draw(st.integers(1, (BLOCKS - 1) * min(bs_p, bs_d)))
    local_kind, local = data.draw(block_list(ceil_div(tokens, bs_d)))
    remote_kind, remote = data.draw(block_list(ceil_div(tokens, bs_p)))
    hit = data.draw(st.integers(0, len(local)))
    request_id = f"runs-{next(_ids)}"
    results = pair.read(pair.offer(request_id, tokens, remote), local, hit)
    plan = pair.plan
    wire = wire_block_ids(remote, tokens, plan.split_ratio, plan.wire.block_size)
    mapped = map_request_blocks(local[hit:], wire, plan.block_size_ratio)
    for d, result in results.items():
        assert result.ok, (d, result)
        assert pair.verify(d, request_id, local, tokens) == [], f"decode rank {d} bytes differ"
        peer = pair.decode[d].peers[pair.engine_id]
        assert result.indices == peer.regions * len(peer.lists) * mapped.local.size
        merged = peer.regions * len(peer.lists) * runs(mapped.local, mapped.remote)
        assert result.descriptors == (merged if end_to_end(pair, d) else result.indices), (local_kind, remote_kind)
        if end_to_end(pair, d) and (local_kind, remote_kind) == ("contiguous", "contiguous") and hit < len(local):
            assert result.descriptors == peer.regions * len(peer.lists)  # the fewest: one per region and read


def test_the_pairs_here_merge_where_they_should(pair: InProcessPair) -> None:
    name = next(
        name for name, case in CASES.items() if case == (pair.model, pair.prefill_settings, pair.decode_settings)
    )
    assert end_to_end(pair, 0) == (name in MERGING)


def test_a_block_listed_twice_is_refused(pair: InProcessPair) -> None:
    """Two READs into one decode block would race: a request listing a block twice fails alone, typed."""
    bs_p, bs_d = pair.prefill_settings.block_size, pair.decode_settings.block_size
    tokens = 3 * max(bs_p, bs_d)
    remote = list(range(ceil_div(tokens, bs_p)))
    local = [4] * ceil_div(tokens, bs_d)
    results = pair.read(pair.offer(f"twice-{next(_ids)}", tokens, remote), local, 0)
    assert {(result.ok, result.code) for result in results.values()} == {(False, INVALID_BLOCK_IDS)}
