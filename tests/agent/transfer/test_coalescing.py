"""A decode rank's merged descriptors (core.coalesce through transfer/descriptors.py and decode_rank.py) move exactly
the bytes the unmerged ones move, from and to the same places, in the same order — for every cache kind and
physical layout, TP pair and block-size ratio, and any block ids — and a request whose ids run on in both caches
costs the fewest descriptors the prepared run lengths allow.

The peer is built by the real ``DecodeRank.add_peer`` over a transport that records the rows it is asked to
prepare; the test expands those rows into the entries NIXL would hold and follows each descriptor id to its bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import cache
from typing import cast

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import (
    BlockMappingError,
    CacheKind,
    ModelGeometry,
    RoleSettings,
    TransferSettings,
    build_plan,
)
from kvbridge_agent.core.arithmetic import ceil_div
from kvbridge_agent.core.blocks import INVALID_BLOCK_IDS, DescriptorIds, wire_block_ids
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.core.layout import PhysicalOrder
from kvbridge_agent.core.tp import handshake_ranks
from kvbridge_agent.transfer.decode_rank import DecodeRank
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.prefill_rank import PrefillRank
from kvbridge_agent.transfer.reads import ReadIds, RemotePeer, request_descriptor_ids
from kvbridge_agent.transfer.transport import Transport
from tests.physical_kv import HEAD_SIZE, HEADS, LAYERS, own_views

from .harness import CASES, model, role

Int = npt.NDArray[np.int64]
BLOCKS = 24  # each side's cache: blocks (region layouts) or blocks of vLLM's views (physical layouts)


class Recording:
    """The transport calls ``add_peer`` makes, recording the rows of every prepared list."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rows: dict[int, Int] = {}

    def add_peer(self, metadata: bytes, expected: str = "") -> str:
        return expected

    def remove_peer(self, name: str) -> None:
        pass

    def prep(self, peer: str, rows: Int, memory_type: str) -> int:
        self.rows[len(self.rows) + 1] = np.asarray(rows, dtype=np.int64)
        return len(self.rows)

    def release_dlist(self, handle: int) -> None:
        pass


@cache
def _region_pair(name: str) -> tuple[DecodeRank, RemotePeer]:
    geometry, prefill, decode = REGION_CASES[name]
    plan = build_plan(geometry, prefill, decode, TransferSettings())

    def cache_of(settings: RoleSettings, rank: int) -> KVCache:
        tp, bs = settings.tensor_parallel_size, settings.block_size
        return KVCache.allocate(geometry, bs, settings.kv_layout, tp, rank, BLOCKS)

    return _connect(plan.prefill, plan.decode, geometry, cache_of)


PHYSICAL_MODEL = ModelGeometry(name="layouts", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_SIZE)
MLA_MODEL = ModelGeometry(name="layouts-mla", num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_SIZE, attention="MLA")
#: name -> (prefill order, block, kernel, TP), (decode order, block, kernel, TP), MLA
PHYSICAL_CASES: dict[str, tuple[tuple[str, int, int | None, int], tuple[str, int, int | None, int], bool]] = {
    **{f"{o}-same": ((o, 16, None, 1), (o, 16, None, 1), False) for o in PhysicalOrder},
    "BHLNC-mla": (("BHLNC", 16, None, 1), ("BHLNC", 16, None, 1), True),
    "LBHNC-mla-tp2to1": (("LBHNC", 16, None, 2), ("LBHNC", 16, None, 1), True),
    "LBHNC-tp2to1": (("LBHNC", 16, None, 2), ("LBHNC", 16, None, 1), False),
    "BHLNC-tp2to1": (("BHLNC", 16, None, 2), ("BHLNC", 16, None, 1), False),
    "BHLNC-tp1to2": (("BHLNC", 16, None, 1), ("BHLNC", 16, None, 2), False),
    "LBHNC-block16to32": (("LBHNC", 16, None, 1), ("LBHNC", 32, None, 1), False),
    "LBHNC-block32to16": (("LBHNC", 32, None, 1), ("LBHNC", 16, None, 1), False),
    "LBHNC-kernel32by16": (("LBHNC", 32, 16, 1), ("LBHNC", 32, 16, 1), False),
    "LBNHC-kernel64by16-to-32by16": (("LBNHC", 64, 16, 1), ("LBNHC", 32, 16, 1), False),
    "LBHNC-to-BLHNC": (("LBHNC", 16, None, 1), ("BLHNC", 16, None, 1), False),
    "LHBNC-to-BHLNC": (("LHBNC", 16, None, 1), ("BHLNC", 16, None, 1), False),
}


@cache
def _physical_pair(name: str) -> tuple[DecodeRank, RemotePeer]:
    (p_order, p_block, p_kernel, p_tp), (d_order, d_block, d_kernel, d_tp), mla = PHYSICAL_CASES[name]
    geometry = MLA_MODEL if mla else PHYSICAL_MODEL
    prefill = RoleSettings(block_size=p_block, tensor_parallel_size=p_tp)
    decode = RoleSettings(block_size=d_block, tensor_parallel_size=d_tp)
    sides = {id(prefill): (p_order, p_kernel), id(decode): (d_order, d_kernel)}

    def cache_of(settings: RoleSettings, rank: int) -> KVCache:
        order, kernel = sides[id(settings)]
        tp, block = settings.tensor_parallel_size, settings.block_size
        heads = 1 if mla else max(1, HEADS // tp)
        views = own_views(order, block, kernel, heads, mla, "cpu")
        return KVCache.attach_views(geometry, block, tp, rank, views, PhysicalOrder(order))

    return _connect(prefill, decode, geometry, cache_of)


def _connect(
    prefill: RoleSettings,
    decode: RoleSettings,
    geometry: ModelGeometry,
    cache_of: Callable[[RoleSettings, int], KVCache],
) -> tuple[DecodeRank, RemotePeer]:
    """Decode rank 0 of the pair, its peer added from every prefill rank it handshakes."""
    plan = build_plan(geometry, prefill, decode, TransferSettings())
    tp_p, tp_d = prefill.tensor_parallel_size, decode.tensor_parallel_size
    ranks = {}
    for p in handshake_ranks(tp_p, tp_d, 0):
        transport = cast(Transport, Recording(f"prefill.{p}"))
        ranks[p] = (PrefillRank(cache_of(prefill, p), transport, plan, "prefill", "inc").metadata(), b"")
    rank = DecodeRank(cache_of(decode, 0), cast(Transport, Recording("decode")), decode, TransferSettings())
    return rank, rank.add_peer("prefill", "inc", ranks)


EXTRA = {
    "cross-layer-1to1": (model(CacheKind.CROSS_LAYER), role(1), role(1)),
    "blocks-first-1to1": (model(CacheKind.BLOCKS_FIRST), role(1), role(1)),
}
REGION_CASES = {**CASES, **EXTRA}
#: the cases whose lists merge: both sides' units end to end (whole blocks or sub-blocks of a region, a physical
#: layout's runs of whole blocks)
MERGING = {
    "dense-1to1",
    "equal-tp-nhd-to-hnd",
    "bsr2-decode-merges",
    "bsr2-decode-merges-nhd",
    "cross-layer-1to1",
    *(name for name in CASES if name.startswith("mla-")),
    *(f"{o}-same" for o in PhysicalOrder),
    "BHLNC-mla",
    "LBHNC-mla-tp2to1",
    "LBHNC-kernel32by16",
    "LBNHC-kernel64by16-to-32by16",  # 16-token kernel blocks on both sides: whole kernel blocks, end to end
}
ALL = [("region", name) for name in sorted(REGION_CASES)] + [("physical", name) for name in PHYSICAL_CASES]


def pair_of(kind: str, name: str) -> tuple[DecodeRank, RemotePeer]:
    return _region_pair(name) if kind == "region" else _physical_pair(name)


def entries(rows: Int) -> tuple[Int, Int]:
    """``(address, length)`` of every entry of a prepared list, in index order (strided rows expanded)."""
    if rows.shape[1] == 3:
        return rows[:, 0], rows[:, 1]
    counts = rows[:, 4]
    row = np.repeat(np.arange(len(rows)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return rows[row, 0] + within * rows[row, 3], rows[row, 1]


def unit_bytes(addresses: Int, lengths: Int, unit: int) -> Int:
    """The start of every ``unit``-byte piece of the entries ``(addresses, lengths)``, in order."""
    assert (lengths % unit == 0).all()
    counts = lengths // unit
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(addresses, counts) + within * unit


def moved(rank: DecodeRank, peer: RemotePeer, ids: list[ReadIds]) -> list[tuple[Int, Int]]:
    """Per READ, ``(local, remote)`` start of every unit it moves, in the order NIXL is handed them."""
    out = []
    transport = cast(Recording, rank.transport)
    for lists, read, unit in zip(peer.lists, ids, peer.lengths, strict=True):
        remote, local = read.lists or lists  # merged ids index the read's merged lists
        l_addr, l_len = entries(transport.rows[local])
        r_addr, r_len = entries(transport.rows[remote])  # decode prepares the remote lists too
        assert np.array_equal(l_len[read.local], r_len[read.remote])  # each pair of entries is one length
        assert read.units * unit == int(l_len[read.local].sum())
        local_units = unit_bytes(l_addr[read.local], l_len[read.local], unit)
        out.append((local_units, unit_bytes(r_addr[read.remote], r_len[read.remote], unit)))
    return out


def buffers(n: int) -> tuple[DescriptorIds, DescriptorIds]:
    return np.empty(n, dtype=np.int32), np.empty(n, dtype=np.int32)


def params(peer: RemotePeer, wire: list[int], tokens: int) -> KVTransferParams:
    return KVTransferParams(
        remote_engine_id="prefill",
        remote_incarnation="inc",
        remote_host="127.0.0.1",
        remote_port=1,
        remote_request_id="r",
        remote_block_ids=wire,
        num_tokens=tokens,
        remote_tp_size=peer.plan.prefill.tensor_parallel_size,
        fingerprint=peer.plan.fingerprint,
    )


@st.composite
def block_list(draw: st.DrawFn, count: int, blocks: int) -> tuple[str, list[int]]:
    """``count`` distinct block ids of ``blocks``: contiguous, reversed, scattered, or runs of a few in any order."""
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


def request(peer: RemotePeer, data: st.DataObject) -> tuple[str, list[int], str, list[int], int]:
    """A request's tokens, decode's blocks to fill (a prefix hit leaves out first ones) and prefill's wire ids."""
    plan = peer.plan
    bs_p, bs_d = plan.prefill.block_size, plan.decode.block_size
    tokens = data.draw(st.integers(1, BLOCKS * min(bs_p, bs_d)))
    local_kind, local = data.draw(block_list(ceil_div(tokens, bs_d), BLOCKS))
    remote_kind, remote = data.draw(block_list(ceil_div(tokens, bs_p), BLOCKS))
    hit = data.draw(st.integers(0, len(local)))
    wire = wire_block_ids(remote, tokens, plan.split_ratio, plan.wire.block_size).tolist()
    return local_kind, local[hit:], remote_kind, wire, tokens


@pytest.mark.parametrize(("kind", "name"), ALL, ids=[name for _, name in ALL])
def test_lists_merge_where_both_sides_units_lie_end_to_end(kind: str, name: str) -> None:
    _rank, peer = pair_of(kind, name)
    assert any(m is not None for m in peer.merged_lists) == (name in MERGING)


@pytest.mark.parametrize(("kind", "name"), ALL, ids=[name for _, name in ALL])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_merged_descriptors_move_the_same_bytes_as_unmerged_ones(kind: str, name: str, data: st.DataObject) -> None:
    rank, peer = pair_of(kind, name)
    local_kind, local, remote_kind, wire, tokens = request(peer, data)
    asked = params(peer, wire, tokens)
    merged = request_descriptor_ids(peer, asked, local, None, rank.cache.num_blocks, buffers)
    plain = request_descriptor_ids(replace(peer, merged=[]), asked, local, None, rank.cache.num_blocks, buffers)
    if not local:  # a full prefix hit reads nothing
        assert merged == plain == []
        return
    assert len(merged) == len(plain)
    for got, want in zip(moved(rank, peer, merged), moved(rank, peer, plain), strict=True):
        assert np.array_equal(got[0], want[0])  # decode's bytes, in order
        assert np.array_equal(got[1], want[1])  # prefill's bytes, in order
    for read, lists in zip(merged, peer.merged_lists, strict=True):
        if lists is None or (local_kind, remote_kind) != ("contiguous", "contiguous"):
            continue
        # one run per region: the fewest pieces of the prepared lengths (core.coalesce.pieces)
        units, levels = read.units // lists.local.regions, lists.local.levels
        assert read.local.size == lists.local.regions * (
            (units >> levels) + bin(units & ((1 << levels) - 1)).count("1")
        )


@pytest.mark.parametrize(("kind", "name"), [("region", "dense-1to1"), ("physical", "LBHNC-same")])
def test_a_block_listed_twice_is_refused(kind: str, name: str) -> None:
    rank, peer = pair_of(kind, name)
    for local, wire in (([3, 4, 3], [0, 1, 2]), ([3, 4, 5], [0, 1, 1])):
        with pytest.raises(BlockMappingError) as caught:
            request_descriptor_ids(peer, params(peer, wire, 48), local, None, rank.cache.num_blocks, buffers)
        assert caught.value.code == INVALID_BLOCK_IDS


def test_a_contiguous_request_costs_one_descriptor_per_region() -> None:
    """LBHNC, 3 layers: 16 contiguous blocks on both sides are 3 descriptors (one per layer), not 48."""
    rank, peer = pair_of("physical", "LBHNC-same")
    asked = params(peer, list(range(4, 20)), 16 * 16)
    (read,) = request_descriptor_ids(peer, asked, list(range(2, 18)), None, rank.cache.num_blocks, buffers)
    assert (read.local.size, read.remote.size, read.units) == (LAYERS, LAYERS, LAYERS * 16)
