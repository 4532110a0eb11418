"""What a decode rank reads by, and what it reports: a prefill engine as one decode rank sees it (its plan and
prepped lists), the result of one request's READs, the check asked after them, and the per-request mapping of
block ids to descriptor ids (numpy; the lists are prepared once per peer)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvbridge_agent.core import BlockMappingError, DecodeRankPlan, TransferPlan, descriptor_ids, map_request_blocks
from kvbridge_agent.core.blocks import BLOCK_ID_OUT_OF_RANGE, DescriptorIds, IntArray, require_distinct
from kvbridge_agent.core.cache_groups import CACHE_GROUPS_MISMATCH, pair_groups
from kvbridge_agent.core.coalesce import MergedList, merged_ids, merged_runs
from kvbridge_agent.core.digest import RequestDigests
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.core.physical_reads import ChunkSide, MappedChunks, PhysicalRead, chunk_descriptor_ids, map_chunks

# Stable failure codes of a decode request (documented in docs/troubleshooting.md).
UNKNOWN_PEER = "UNKNOWN_PEER"
TRANSFER_FAILED = "TRANSFER_FAILED"
TRANSFER_TIMEOUT = "TRANSFER_TIMEOUT"


@dataclass(frozen=True, eq=False)
class MergedRead:
    """A read's lists with merged entries (core.coalesce), prepared beside its plain ones: each side's numbering,
    and the prepped ``(remote, local)`` lists. A request with a run of two or more reads through these; one without
    through the plain ones, which NIXL looks entries up in faster (fewer rows)."""

    local: MergedList
    remote: MergedList
    lists: tuple[Any, Any]


@dataclass
class RemotePeer:
    """One prefill engine as seen by one decode rank."""

    engine_id: str
    incarnation: str
    plan: TransferPlan
    rank_plan: DecodeRankPlan
    agents: dict[int, str]
    remote_units: int  # descriptor units per region on the prefill side
    #: descriptors per block and read (regions of the cache kind, or the paired runs of two physical layouts)
    regions: int
    #: physical layouts on both sides: per read of the rank plan, the paired runs of one chunk (and then
    #: ``lists``/``lengths`` follow these reads), and decode's and prefill's chunking
    physical: tuple[PhysicalRead, ...] = ()
    sides: tuple[ChunkSide, ChunkSide] | None = None
    #: per read of the rank plan: (remote prepped list, local prepped list)
    lists: list[tuple[Any, Any]] = field(default_factory=list)
    #: bytes of one unmerged descriptor of each list
    lengths: list[int] = field(default_factory=list)
    #: per list: its merged lists (core.coalesce), or ``None`` where its runs cannot merge
    merged: list[MergedRead | None] = field(default_factory=list)

    @property
    def merged_lists(self) -> list[MergedRead | None]:
        """:attr:`merged` for every list (``None`` for lists prepared without merged entries)."""
        return [*self.merged, *[None] * (len(self.lists) - len(self.merged))]


@dataclass
class ReadResult:
    request_id: str
    ok: bool
    code: str = ""
    message: str = ""
    invalid_blocks: list[int] = field(default_factory=list)
    bytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    #: kvbridge mapping block ids to descriptor ids (part of ``own_microseconds``)
    ids_microseconds: float = 0.0
    #: NIXL creating the READs (make_prepped_xfer)
    make_microseconds: float = 0.0
    #: NIXL posting the READs (on host memory the copy happens inside this call: UCX's CMA transport)
    post_microseconds: float = 0.0
    #: kvbridge's own CPU work from the request to every READ posted, NIXL's calls excluded
    own_microseconds: float = 0.0
    peer_failed: bool = False
    #: the part of ``seconds`` spent converting what was read into decode's blocks (0 when nothing was converted)
    convert_seconds: float = 0.0
    #: what that conversion was: the plan's steps on decode, or ``host_copy`` (a host buffer's copy out)
    conversion: str = ""


@dataclass(frozen=True)
class Verify:
    """What decode checks after a request's reads and conversions, before the KV is used: its digests over every
    local block of the request (prefix hits included), under prefill's key for the request, equal prefill's."""

    expected: RequestDigests
    all_blocks: list[int]  # the request's local blocks in token order, the ones read last
    num_tokens: int
    #: per block of ``all_blocks``, the layers holding its KV (a padded cache group's, core.cache_groups)
    block_layers: list[int] | None = None


class ReadIds(NamedTuple):
    """One READ of a request: descriptor ids of the local and the remote list, the units it moves (its descriptors
    before merging: its bytes are these times the list's length), and the ``(remote, local)`` lists the ids index
    when they are not the read's plain ones (merged, :class:`MergedRead`)."""

    local: DescriptorIds
    remote: DescriptorIds
    units: int
    lists: tuple[Any, Any] | None = None


def _ids(local: IntArray, remote: IntArray, merged: MergedRead | None, plain: Callable[[], ReadIds]) -> ReadIds:
    """``local[i] <- remote[i]`` (units of every region) as merged runs where the read has merged lists and the
    request a run of two or more; else the plain ids."""
    if merged is None:
        return plain()
    paired = merged_runs(local, remote)
    if paired is None:  # no run of two
        return plain()
    local_ids, remote_ids = merged_ids(paired, merged.local, merged.remote)
    return ReadIds(local_ids, remote_ids, merged.local.regions * local.size, merged.lists)


def request_descriptor_ids(
    peer: RemotePeer,
    params: KVTransferParams,
    local_blocks: list[int],
    group_sizes: list[int] | None,
    num_local_blocks: int,
    buffers: Callable[[int], tuple[DescriptorIds, DescriptorIds]],
) -> list[ReadIds]:
    """Per list of the peer, the ids of one request's READ (runs adjacent in both caches merged where the lists
    hold merged entries, core.coalesce); empty for a full prefix hit. ``num_local_blocks``: the blocks of decode's
    cache; ``buffers(n)``: two id arrays of at least ``n``, which the rank reuses from request to request."""
    if len(params.remote_block_ids) > peer.remote_units:  # more than the peer's cache holds: not one request's
        raise BlockMappingError(
            f"{len(params.remote_block_ids)} block ids, but prefill {peer.engine_id} registered {peer.remote_units} "
            "wire blocks",
            field="request.remote_block_ids",
            code=BLOCK_ID_OUT_OF_RANGE,
        )
    if (group_sizes is None) != (params.remote_group_sizes is None):
        raise BlockMappingError(
            f"decode lists {'several' if group_sizes else 'one'} KV cache group(s) and prefill "
            f"{'several' if params.remote_group_sizes else 'one'}: not the same model",
            field="request.remote_group_sizes",
            code=CACHE_GROUPS_MISMATCH,
        )
    if peer.sides is not None:  # physical layouts: the chunks of each read, through its paired runs
        local_side, remote_side = peer.sides
        if group_sizes is not None and params.remote_group_sizes is not None:
            mapped = _map_groups(local_blocks, group_sizes, params, local_side, remote_side)
        else:
            mapped = map_chunks(local_blocks, params.remote_block_ids, params.num_tokens, local_side, remote_side)
        if mapped.full_hit:
            return []
        # each block read once, on each side (its chunks: one key each)
        require_distinct(mapped.local_blocks * local_side.chunks + mapped.local_chunks, field="request.local_block_ids")
        require_distinct(
            mapped.remote_blocks * remote_side.chunks + mapped.remote_chunks, field="request.remote_block_ids"
        )
        return [_chunk_ids(mapped, read, merged) for read, merged in zip(peer.physical, peer.merged_lists, strict=True)]
    if group_sizes is not None:
        raise BlockMappingError(
            "several KV cache groups are moved between physical layouts only (vLLM's KVCacheLayout views)",
            field="request.remote_group_sizes",
            code=CACHE_GROUPS_MISMATCH,
        )
    plan = peer.plan
    mapped_blocks = map_request_blocks(local_blocks, params.remote_block_ids, plan.block_size_ratio)
    if mapped_blocks.full_hit:
        return []
    require_distinct(mapped_blocks.local, field="request.local_block_ids")  # each (sub-)block read once
    require_distinct(mapped_blocks.remote, field="request.remote_block_ids")
    regions = peer.regions

    def plain() -> ReadIds:
        local_buf, remote_buf = buffers(regions * mapped_blocks.local.size)
        local_units = num_local_blocks * plan.block_size_ratio
        local_ids = descriptor_ids(mapped_blocks.local, regions, local_units, out=local_buf)
        remote_ids = descriptor_ids(mapped_blocks.remote, regions, peer.remote_units, out=remote_buf)
        return ReadIds(local_ids, remote_ids, regions * mapped_blocks.local.size)

    ids = {merged: _ids(mapped_blocks.local, mapped_blocks.remote, merged, plain) for merged in peer.merged_lists}
    return [ids[merged] for merged in peer.merged_lists]


def _chunk_ids(mapped: MappedChunks, read: PhysicalRead, merged: MergedRead | None) -> ReadIds:
    """One physical read's ids: merged runs of blocks where both sides' blocks are one chunk each."""

    def plain() -> ReadIds:
        return ReadIds(
            chunk_descriptor_ids(mapped.local_blocks, mapped.local_chunks, read.target),
            chunk_descriptor_ids(mapped.remote_blocks, mapped.remote_chunks, read.source),
            read.target.runs.count * mapped.local_blocks.size,
        )

    whole = read.target.chunks == read.source.chunks == 1
    return _ids(mapped.local_blocks, mapped.remote_blocks, merged if whole else None, plain)


def _map_groups(
    local_blocks: list[int],
    group_sizes: list[int],
    params: KVTransferParams,
    local_side: ChunkSide,
    remote_side: ChunkSide,
) -> MappedChunks:
    """A hybrid model's chunks: per cache group, decode's blocks to fill with the last of prefill's blocks of
    that group, whole blocks (both sides run one block size), the groups one after the other."""
    if local_side.block_tokens != remote_side.block_tokens or remote_side.units_per_block != 1:
        raise BlockMappingError(
            f"prefill's {remote_side.block_tokens}-token and decode's {local_side.block_tokens}-token blocks: "
            "several KV cache groups move between equal block sizes only",
            field="spec.decode.blockSize",
            code=CACHE_GROUPS_MISMATCH,
        )
    remote_sizes = params.remote_group_sizes or []
    parts = [
        map_chunks(mine, theirs, len(mine) * local_side.block_tokens, local_side, remote_side)
        for mine, theirs in pair_groups(local_blocks, group_sizes, params.remote_block_ids, remote_sizes)
        if mine
    ]
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return MappedChunks(empty, empty, empty, empty)
    return MappedChunks(
        np.concatenate([p.local_blocks for p in parts]),
        np.concatenate([p.local_chunks for p in parts]),
        np.concatenate([p.remote_blocks for p in parts]),
        np.concatenate([p.remote_chunks for p in parts]),
    )
