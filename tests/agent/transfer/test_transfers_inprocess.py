"""Byte-exact READs between prefill and decode ranks with real NIXL agents (DRAM), in one process.

Covers the TP pairs, dense and MLA, every cache kind, block-size ratios both
ways, layout permutes, partial last blocks, partial and full prefix hits.
Every decode rank verifies every byte of its heads against the prefill's
derivation.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge_agent.core import Attention, CacheKind, KVLayout, ModelGeometry, RoleSettings

from .harness import InProcessPair


def model(kind: CacheKind = CacheKind.SPLIT, heads: int = 8, mla: bool = False) -> ModelGeometry:
    return ModelGeometry(
        name="tiny", num_layers=2, num_kv_heads=1 if mla else heads, head_dim=32 if mla else 16,
        kv_cache_dtype="bfloat16", attention=Attention.MLA if mla else Attention.DENSE, cache_kind=kind,
    )  # fmt: skip


def role(tp: int, bs: int = 16, layout: str = "HND") -> RoleSettings:
    return RoleSettings(tensor_parallel_size=tp, block_size=bs, kv_layout=KVLayout(layout))


CASES = {
    # (model, prefill, decode)
    "dense-1to1": (model(), role(1), role(1)),
    "dense-2to1": (model(), role(2), role(1)),
    "dense-1to2": (model(), role(1), role(2)),
    "dense-4to2": (model(), role(4), role(2)),
    "dense-2to4": (model(), role(2), role(4)),
    "dense-4to1": (model(), role(4), role(1)),
    "dense-2to8-replicated-decode": (model(heads=4), role(2), role(8)),
    "mla-1to1": (model(mla=True), role(1), role(1)),
    "mla-2to1": (model(mla=True), role(2), role(1)),
    "mla-1to2": (model(mla=True), role(1), role(2)),
    "mla-4to2": (model(mla=True), role(4), role(2)),
    "mla-2to4": (model(mla=True), role(2), role(4)),
    "mla-4to1": (model(mla=True), role(4), role(1)),
    "bsr2-decode-merges": (model(), role(1, 8), role(1, 16)),
    "bsr2-decode-merges-tp1to2": (model(), role(1, 8), role(2, 16)),
    "bsr2-decode-merges-nhd": (model(), role(1, 8, "NHD"), role(1, 16, "NHD")),
    "prefill-splits-32nhd-tp2-to-16hnd-tp1": (model(), role(2, 32, "NHD"), role(1, 16, "HND")),
    "prefill-splits-128nhd-tp4-to-16hnd-tp1": (model(), role(4, 128, "NHD"), role(1, 16, "HND")),
    "decode-permutes-to-nhd": (model(), role(2), role(1, 16, "NHD")),
    "equal-tp-nhd-to-hnd": (model(), role(2, 16, "NHD"), role(2, 16, "HND")),
    "blocks-first-2to1": (model(CacheKind.BLOCKS_FIRST), role(2), role(1)),
    "blocks-first-1to2-nhd": (model(CacheKind.BLOCKS_FIRST), role(1, 16, "NHD"), role(2, 16, "NHD")),
    "blocks-first-bsr2": (model(CacheKind.BLOCKS_FIRST), role(1, 8), role(1, 16)),
    "cross-layer-2to1": (model(CacheKind.CROSS_LAYER), role(2), role(1)),
    "cross-layer-1to4": (model(CacheKind.CROSS_LAYER), role(1), role(4)),
}


@pytest.fixture(params=sorted(CASES), scope="module")
def pair(request: pytest.FixtureRequest) -> Iterator[InProcessPair]:
    built = InProcessPair(*CASES[request.param])
    try:
        yield built
    finally:
        built.close()


def test_partial_last_block(pair: InProcessPair) -> None:
    bs = max(pair.prefill_settings.block_size, pair.decode_settings.block_size)
    results = pair.roundtrip("partial", 2 * bs + 3, 0)
    assert all(r.bytes > 0 and r.descriptors > 0 for r in results.values())


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
    # every prefill rank saw all its notifications: nothing left pending
    for _ in range(50):
        pair.poll_prefill()
        if not any(rank.pending for rank in pair.prefill):
            break
    assert [rank.pending for rank in pair.prefill] == [[] for _ in pair.prefill]
