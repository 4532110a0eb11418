"""Physical reads (core.physical_reads): a TP mapping, a block-size conversion (kernel blocks of either size) and MLA,
as descriptors alone. Every drawn case is executed byte by byte in numpy — each descriptor pair copies its bytes, as
a NIXL READ would — and decode's caches are then read back through their own layouts: every token both sides hold
from the prefix hit on carries prefill's bytes of that layer, global head, token and content byte."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import BlockMappingError, ModelGeometry, SpecError, wire_block_ids
from kvbridge_agent.core.layout import PhysicalLayout, PhysicalOrder
from kvbridge_agent.core.physical_reads import (
    CHUNKS_MISMATCH,
    ChunkRuns,
    ChunkSide,
    chunk_descriptor_ids,
    map_chunks,
    physical_read,
    shared_heads,
)
from kvbridge_agent.core.tp import read_ranks

Bytes = npt.NDArray[np.uint8]
POWERS = [1, 2, 4, 8]


@dataclass(frozen=True)
class Engine:
    order: PhysicalOrder
    tp: int
    block: int  # tokens per (manager) block
    kernel: int  # tokens per kernel block (divides block)
    blocks: int  # manager blocks per rank

    def layout(self, model: ModelGeometry) -> PhysicalLayout:
        heads = 1 if model.is_mla else max(1, model.num_kv_heads // self.tp)
        kernels = self.blocks * (self.block // self.kernel)
        return PhysicalLayout.dense(
            self.order, model.num_layers, kernels, heads, self.kernel, model.token_bytes_per_head
        )


def truth(layer: int, head: int, token: int, content: int) -> int:
    """The byte a request holds at a logical position (global head, prompt token)."""
    return (layer * 131 + head * 71 + token * 29 + content * 7 + 3) % 251


def addresses(runs: ChunkRuns, ids: npt.NDArray[np.int32], num_blocks: int) -> npt.NDArray[np.int64]:
    """The first byte of each descriptor id of a list prepped from ``runs.regions`` (``region * blocks + block``)."""
    regions = runs.regions
    offsets = np.asarray(regions.offsets, dtype=np.int64)
    ids64 = ids.astype(np.int64)
    return offsets[ids64 // num_blocks] + (ids64 % num_blocks) * regions.block_stride


def position(engine: Engine, ids: list[int], token: int) -> tuple[int, int]:
    """(kernel block, token within it) of a prompt token in a request's listed manager blocks."""
    block = ids[token // engine.block]
    within = token % engine.block
    return block * (engine.block // engine.kernel) + within // engine.kernel, within % engine.kernel


@st.composite
def cases(draw: st.DrawFn) -> tuple[ModelGeometry, Engine, Engine, int, int]:
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4]))
    model = ModelGeometry(
        name="m",
        num_layers=draw(st.integers(1, 3)),
        num_kv_heads=heads,
        head_dim=draw(st.integers(1, 2)),
        attention="MLA" if mla else "Dense",
    )

    def engine() -> Engine:
        block = draw(st.sampled_from([2, 4, 8]))
        kernel = draw(st.sampled_from([k for k in POWERS if k <= block]))
        return Engine(draw(st.sampled_from(list(PhysicalOrder))), draw(st.sampled_from([1, 2, 4])), block, kernel, 12)

    prefill, decode = engine(), engine()
    tokens = draw(st.integers(1, 6 * min(prefill.block, decode.block)))
    total = -(-tokens // decode.block)
    hit = draw(st.integers(0, total - 1))
    return model, prefill, decode, tokens, hit


@settings(max_examples=300, deadline=None)
@given(cases())
def test_reads_put_every_byte_where_decode_reads_it(case: tuple[ModelGeometry, Engine, Engine, int, int]) -> None:
    model, prefill, decode, tokens, hit = case
    rng = np.random.default_rng(abs(hash(case)) % (1 << 32))
    p_ids = [int(x) for x in rng.permutation(prefill.blocks)[: -(-tokens // prefill.block)]]
    d_all = [int(x) for x in rng.permutation(decode.blocks)[: -(-tokens // decode.block)]]
    d_ids = d_all[hit:]
    wire = min(prefill.block, decode.block)
    split = prefill.block // wire
    offered = wire_block_ids(p_ids, tokens, split, wire)
    p_layout, d_layout = prefill.layout(model), decode.layout(model)
    content = model.token_bytes_per_head
    heads_p = p_layout.num_heads

    # every prefill rank: noise, then the request's tokens at their logical places
    p_buffers: list[Bytes] = []
    for rank in range(prefill.tp):
        buffer = rng.integers(0, 256, p_layout.extent, dtype=np.uint8)
        first = 0 if model.is_mla else rank * model.num_kv_heads // prefill.tp
        for token in range(tokens):
            kernel, n = position(prefill, p_ids, token)
            for layer in range(model.num_layers):
                for h in range(heads_p):
                    at = int(p_layout.offsets((layer, kernel, h, n, 0)))
                    buffer[at : at + content] = [truth(layer, first + h, token, c) for c in range(content)]
        p_buffers.append(buffer)

    tp_p, tp_d = prefill.tp, decode.tp
    for d in range(tp_d):
        target = np.zeros(d_layout.extent, dtype=np.uint8)
        chunks_read = None
        for p in read_ranks(model, tp_p, tp_d, d):
            read = physical_read(p, p_layout, d_layout, shared_heads(model, tp_p, tp_d, p, d))
            tokens_per_chunk = min(prefill.kernel, decode.kernel)
            local = ChunkSide(decode.block, 1, decode.kernel, tokens_per_chunk)
            remote = ChunkSide(prefill.block, split, prefill.kernel, tokens_per_chunk)
            mapped = map_chunks(d_ids, offered, tokens, local, remote)
            chunks_read = mapped.local_blocks.size
            local_ids = chunk_descriptor_ids(mapped.local_blocks, mapped.local_chunks, read.target)
            remote_ids = chunk_descriptor_ids(mapped.remote_blocks, mapped.remote_chunks, read.source)
            assert local_ids.size == remote_ids.size == read.source.runs.count * chunks_read
            length = read.source.runs.length
            assert length == read.target.runs.length
            for src, dst in zip(
                addresses(read.source, remote_ids, p_layout.num_blocks),
                addresses(read.target, local_ids, d_layout.num_blocks),
                strict=True,
            ):
                target[dst : dst + length] = p_buffers[p][src : src + length]
        assert chunks_read is not None
        # every prompt token from the hit on was read (and nothing before it)
        start = hit * decode.block
        covered = chunks_read * min(prefill.kernel, decode.kernel)
        assert start + covered >= tokens
        first = 0 if model.is_mla else d * model.num_kv_heads // tp_d
        for token in range(start, tokens):
            kernel, n = position(decode, d_all, token)
            for layer in range(model.num_layers):
                for h in range(d_layout.num_heads):
                    at = int(d_layout.offsets((layer, kernel, h, n, 0)))
                    expected = [truth(layer, first + h, token, c) for c in range(content)]
                    assert target[at : at + content].tolist() == expected, (layer, h, token)


def test_shared_heads_cover_a_decode_rank_exactly_once() -> None:
    model = ModelGeometry(name="m", num_layers=1, num_kv_heads=8, head_dim=1)
    # TP 4 -> 2: decode rank 1 holds heads 4..7, from prefill ranks 2 (4, 5) and 3 (6, 7)
    assert shared_heads(model, 4, 2, 2, 1) == ((0, 2), (0, 2))
    assert shared_heads(model, 4, 2, 3, 1) == ((0, 2), (2, 4))
    # TP 2 -> 8: decode rank 5 holds head 5, the second of prefill rank 1's 4..7
    assert shared_heads(model, 2, 8, 1, 5) == ((1, 2), (0, 1))
    # replicated: TP 16 over 8 heads, rank 3 holds head 1
    assert shared_heads(model, 16, 8, 3, 1) == ((0, 1), (0, 1))
    with pytest.raises(SpecError) as caught:
        shared_heads(model, 4, 2, 0, 1)
    assert caught.value.code == CHUNKS_MISMATCH


def test_chunks_refuse_what_cannot_be_cut_typed() -> None:
    with pytest.raises(SpecError) as caught:
        ChunkSide(block_tokens=16, units_per_block=1, kernel_tokens=16, tokens=6)
    assert caught.value.code == CHUNKS_MISMATCH
    local = ChunkSide(16, 1, 16, 16)
    with pytest.raises(BlockMappingError) as mapping:
        map_chunks([1, 2, 3], [4, 5], 20, local, local)  # 20 tokens fill 2 decode blocks, not 3
    assert mapping.value.code == "LOCAL_LONGER_THAN_REMOTE"
    with pytest.raises(BlockMappingError) as mapping:
        map_chunks([1, 2], [4], 20, local, local)  # prefill offered 16 of 20 tokens
    assert mapping.value.code == "TOKENS_EXCEED_BLOCKS"
    assert map_chunks([], [4, 5], 20, local, local).full_hit


def test_a_block_id_past_any_cache_is_refused_before_the_kernel_math() -> None:
    """A forged remote id near 2**62 times the kernel blocks per block would wrap int64 into negative descriptor
    ids; ids beyond any cache (int32 descriptor indices) are refused first."""
    side = ChunkSide(block_tokens=64, units_per_block=1, kernel_tokens=16, tokens=16)
    for forged in (2**62 - 1, 2**62 + 1, 2**31):
        with pytest.raises(BlockMappingError) as caught:
            map_chunks([5], [forged], 64, side, side)
        assert caught.value.code == "BLOCK_ID_OUT_OF_RANGE"
