"""Byte-exact READs between prefill and decode ranks with real NIXL agents (DRAM), in one process.

Covers the TP pairs, dense and MLA, every cache kind, block-size ratios both
ways, layout permutes, partial last blocks, partial and full prefix hits.
Every decode rank verifies every byte of its heads against the prefill's
derivation.
"""

from __future__ import annotations

import contextlib

from kvbridge_agent.core import RegionLayout, Role
from kvbridge_agent.core.blocks import blocks_for_tokens
from kvbridge_sim.support import wait_until

from .harness import InProcessPair


def test_partial_last_block(pair: InProcessPair) -> None:
    bs = max(pair.prefill_settings.block_size, pair.decode_settings.block_size)
    results = pair.roundtrip("partial", 2 * bs + 3, 0)
    assert all(r.bytes > 0 and r.descriptors > 0 for r in results.values())
    # the conversion's own time and what it was (decode's trace shows it as a span of its own)
    steps = ",".join(step.kind.value for step in pair.plan.wire.steps(Role.DECODE))
    for result in results.values():  # none when the step moves no byte (NHD blocks merged)
        assert result.conversion in ("", steps)
        assert (0 < result.convert_seconds < result.seconds) == bool(result.conversion)
    moved = [result.conversion for result in results.values() if result.conversion]
    assert moved or not steps or pair.decode_settings.kv_layout.value == "NHD"


def test_one_token_prompt(pair: InProcessPair) -> None:
    pair.roundtrip("one", 1, 0, offset=1)


def test_partial_prefix_hit(pair: InProcessPair) -> None:
    bs_d = pair.decode_settings.block_size
    tokens = 3 * max(pair.prefill_settings.block_size, bs_d) + 5
    pair.roundtrip("hit", tokens, 2)


def test_full_prefix_hit_reads_nothing_and_still_notifies(pair: InProcessPair) -> None:
    bs_d = pair.decode_settings.block_size
    results = pair.roundtrip("full", 2 * bs_d, 2, offset=1)
    assert all(r.bytes == 0 for r in results.values())

    # every prefill rank saw all its notifications: nothing left pending. A notification sent without a READ goes
    # out only while decode's worker progresses, which its poll drives (as an engine's step loop does)
    def settled() -> bool:
        for rank in pair.decode:
            rank.poll()
        pair.poll_prefill()
        return not any(rank.pending for rank in pair.prefill)

    with contextlib.suppress(TimeoutError):  # the assertion below names what is still pending
        wait_until(settled, 10, "every prefill rank's notifications", interval=0.001)
    assert [rank.pending for rank in pair.prefill] == [[] for _ in pair.prefill]


def spacing(layout: RegionLayout, units_per_block: int) -> int | None:
    """Bytes from one descriptor unit of a region to the next (``None``: not evenly spaced)."""
    sub = layout.unit_bytes // units_per_block
    if units_per_block == 1:
        return layout.block_stride
    return sub if layout.block_stride == units_per_block * sub else None


def end_to_end(pair: InProcessPair, d: int) -> bool:
    """Whether every read of decode rank ``d`` moves whole units that lie end to end on both sides."""
    peer, plan = pair.decode[d].peers[pair.engine_id], pair.plan
    local = spacing(pair.decode[d].cache.layout, plan.block_size_ratio)
    return all(
        length == local == spacing(pair.prefill[read.prefill_rank].cache.layout, plan.split_ratio)
        for read, length in zip(peer.rank_plan.reads, peer.lengths, strict=True)
    )


def test_contiguous_ids_go_as_one_descriptor_per_region_where_blocks_lie_end_to_end(pair: InProcessPair) -> None:
    """Block ids that run on in both caches (a prefix hit leaving out the first): where each region's blocks (or
    sub-blocks) lie end to end on both sides, NIXL posts the request's run as one descriptor per region (its
    telemetry, docs/protocol.md §4c), byte-exact; elsewhere the descriptors kvbridge hands it."""
    bs_p, bs_d = pair.prefill_settings.block_size, pair.decode_settings.block_size
    tokens = 3 * max(bs_p, bs_d) + 3
    prefill_blocks = list(range(3, 3 + blocks_for_tokens(tokens, bs_p)))
    decode_blocks = list(range(20, 20 + blocks_for_tokens(tokens, bs_d)))  # within the harness's 48 blocks
    params = pair.offer("contiguous", tokens, prefill_blocks)
    results = pair.read(params, decode_blocks, 1)
    assert sorted(results) == list(range(len(pair.decode)))
    for d, result in results.items():
        assert result.ok, (d, result)
        assert pair.verify(d, "contiguous", decode_blocks, tokens) == [], f"decode rank {d} bytes differ"
        peer = pair.decode[d].peers[pair.engine_id]
        assert result.indices == result.bytes // sum(peer.lengths) * len(peer.lengths)
        one_run = peer.regions * len(peer.lists)
        assert result.descriptors == (one_run if end_to_end(pair, d) else result.indices)
