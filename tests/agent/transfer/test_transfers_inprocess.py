"""Byte-exact READs between prefill and decode ranks with real NIXL agents (DRAM), in one process.

Covers the TP pairs, dense and MLA, every cache kind, block-size ratios both
ways, layout permutes, partial last blocks, partial and full prefix hits.
Every decode rank verifies every byte of its heads against the prefill's
derivation.
"""

from __future__ import annotations

import contextlib

from kvbridge_agent.core import Role
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


def test_contiguous_ids_move_byte_exact_as_merged_runs(pair: InProcessPair) -> None:
    """Block ids that run on in both caches (a prefix hit leaving out the first): where the peer's lists hold merged
    entries (core.coalesce) each run of a region goes as the fewest pieces of the prepared lengths, every byte
    lands where it belongs, and the bytes counted are those of the unmerged descriptors."""
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
        merged = peer.merged_lists
        if any(lists is None for lists in merged):
            continue
        # one run per region and read: n units of each region as (n >> levels) + popcount(rest) pieces
        expected = 0
        for lists, length in zip(merged, peer.lengths, strict=True):
            assert lists is not None
            local = lists.local
            units = result.bytes // (length * local.regions * len(merged))
            pieces = (units >> local.levels) + bin(units & ((1 << local.levels) - 1)).count("1")
            expected += local.regions * pieces
        assert result.descriptors == expected
        assert result.descriptors < result.bytes // min(peer.lengths)  # fewer than unmerged
