"""What a decode rank reads by, and what it reports: a prefill engine as one decode rank sees it (its plan and
prepped lists), the result of one request's READs, the check asked after them, and the per-request mapping of
block ids to descriptor ids (numpy; the lists are prepared once per peer)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvbridge_agent.core import BlockMappingError, DecodeRankPlan, TransferPlan, descriptor_ids, map_request_blocks
from kvbridge_agent.core.arithmetic import ceil_div
from kvbridge_agent.core.blocks import BLOCK_ID_OUT_OF_RANGE, DescriptorIds, MappedBlocks, require_distinct
from kvbridge_agent.core.cache_groups import CACHE_GROUPS_MISMATCH, pair_groups
from kvbridge_agent.core.digest import KV_DIGEST_MISMATCH, RequestDigests
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.core.physical_reads import ChunkSide, MappedChunks, PhysicalRead, chunk_descriptor_ids, map_chunks

# Stable failure codes of a decode request (documented in docs/troubleshooting.md).
UNKNOWN_PEER = "UNKNOWN_PEER"
TRANSFER_FAILED = "TRANSFER_FAILED"
TRANSFER_TIMEOUT = "TRANSFER_TIMEOUT"
#: per prepped list of a peer, a request's (local, remote) descriptor ids
RequestIds = list[tuple[DescriptorIds, DescriptorIds]]


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
    #: bytes of one descriptor of each list
    lengths: list[int] = field(default_factory=list)
    #: per read, the same read staged (docs/protocol.md §4d; empty: this peer is read directly)
    staged: tuple[Any, ...] = ()


@dataclass
class ReadResult:
    request_id: str
    ok: bool
    code: str = ""
    message: str = ""
    invalid_blocks: list[int] = field(default_factory=list)
    bytes: int = 0
    #: descriptors NIXL posted: it merges the ids of a run adjacent in both caches into one (docs/protocol.md §4c;
    #: from its telemetry, or ``indices`` where it reports none)
    descriptors: int = 0
    #: descriptor ids kvbridge handed NIXL: one per region (or paired run) and unit
    indices: int = 0
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
    #: ``direct`` (READs between the caches) or ``staged`` (through the staging buffers, docs/protocol.md §4d)
    mode: str = "direct"
    #: staged: READ straight ``blocks``, or into decode's ``buffer`` and scattered
    into: str = ""
    #: staged: the stage exchanges, prefill's pack (reported by it; 0 when packed at offer), decode's scatter
    stage_microseconds: float = 0.0
    pack_microseconds: float = 0.0
    scatter_microseconds: float = 0.0
    prestaged: bool = False


@dataclass
class InFlight:
    """A request whose READs are posted: what its result reports once they complete."""

    request_id: str
    params: KVTransferParams
    blocks: list[int]  # local blocks that receive bytes
    handles: list[Any]
    timeout: float
    deadline: float
    started: float
    bytes: int
    descriptors: int  # descriptor ids handed NIXL
    ids_microseconds: float
    make_microseconds: float
    post_microseconds: float
    own_microseconds: float
    verify: Verify | None = None
    #: descriptors NIXL posted (its telemetry, once every READ is done; ``None``: not reported)
    posted: int | None = None
    #: a read the staged-read cost model weighed: the path taken and the model's estimate of it in seconds
    #: (``transfer.observed_costs`` learns from it once the read completes)
    expected: tuple[str, float] | None = None


@dataclass(frozen=True)
class Verify:
    """What decode checks after a request's reads and conversions, before the KV is used: its digests over every
    local block of the request (prefix hits included), under prefill's key for the request, equal prefill's."""

    expected: RequestDigests
    all_blocks: list[int]  # the request's local blocks in token order, the ones read last
    num_tokens: int
    #: per block of ``all_blocks``, the layers holding its KV (a padded cache group's, core.cache_groups)
    block_layers: list[int] | None = None


def request_descriptor_ids(
    peer: RemotePeer,
    params: KVTransferParams,
    local_blocks: list[int],
    group_sizes: list[int] | None,
    num_local_blocks: int,
    buffers: Callable[[int], tuple[DescriptorIds, DescriptorIds]],
) -> list[tuple[DescriptorIds, DescriptorIds]]:
    """Per list of the peer, ``(local ids, remote ids)`` of one request's READs; empty for a full prefix hit.
    ``num_local_blocks``: the blocks of decode's cache; ``buffers(n)``: two id arrays of at least ``n``, which the
    rank reuses from request to request."""
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
        # each block read once on each side (its chunks, one key each): two READs into one block would race
        require_distinct(mapped.local_blocks * local_side.chunks + mapped.local_chunks, field="request.local_block_ids")
        require_distinct(
            mapped.remote_blocks * remote_side.chunks + mapped.remote_chunks, field="request.remote_block_ids"
        )
        return [
            (
                chunk_descriptor_ids(mapped.local_blocks, mapped.local_chunks, read.target),
                chunk_descriptor_ids(mapped.remote_blocks, mapped.remote_chunks, read.source),
            )
            for read in peer.physical
        ]
    plan = peer.plan
    if group_sizes is not None:  # per-layer-slot tensors (vLLM's CPU build): each group's blocks, whole
        mapped_blocks = _map_group_blocks(local_blocks, group_sizes, params, plan.block_size_ratio * plan.split_ratio)
    else:
        mapped_blocks = map_request_blocks(local_blocks, params.remote_block_ids, plan.block_size_ratio)
    if mapped_blocks.full_hit:
        return []
    require_distinct(mapped_blocks.local, field="request.local_block_ids")  # each (sub-)block read once
    require_distinct(mapped_blocks.remote, field="request.remote_block_ids")
    regions = peer.regions
    local_buf, remote_buf = buffers(regions * mapped_blocks.local.size)
    local_ids = descriptor_ids(mapped_blocks.local, regions, num_local_blocks * plan.block_size_ratio, out=local_buf)
    remote_ids = descriptor_ids(mapped_blocks.remote, regions, peer.remote_units, out=remote_buf)
    return [(local_ids, remote_ids)] * len(peer.lists)


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


def _map_group_blocks(
    local_blocks: list[int], group_sizes: list[int], params: KVTransferParams, ratio: int
) -> MappedBlocks:
    """A hybrid model's blocks on per-layer-slot tensors: per cache group, decode's blocks with the last of
    prefill's blocks of that group (both sides one block size: ``ratio`` 1), the groups one after the other."""
    if ratio != 1:
        raise BlockMappingError(
            "several KV cache groups move between equal block sizes only",
            field="spec.decode.blockSize",
            code=CACHE_GROUPS_MISMATCH,
        )
    pairs = pair_groups(local_blocks, group_sizes, params.remote_block_ids, params.remote_group_sizes or [])
    local = [b for mine, _ in pairs for b in mine]
    remote = [b for _, theirs in pairs for b in theirs]
    return MappedBlocks(np.asarray(local, dtype=np.int64), np.asarray(remote, dtype=np.int64))


def stage_first(peer: RemotePeer, params: KVTransferParams, local_count: int, units: int) -> int:
    """The first of prefill's units (token order over those it offered) a request reads ``units`` of, as the
    mapping above pairs them: the last ones of a cache kind's wire blocks, or the chunks after a prefix hit of
    ``len(local blocks) = local_count`` short of the prompt's (docs/protocol.md §4d)."""
    if peer.sides is None:
        return len(params.remote_block_ids) - units
    local = peer.sides[0]
    return (ceil_div(params.num_tokens, local.block_tokens) - local_count) * (local.block_tokens // local.tokens)


def digest_verdict(result: ReadResult, verify: Verify, wrong: list[int], per_local: int, engine_id: str) -> ReadResult:
    """``result`` if no wire block's digest differed (``wrong``: their indices; ``per_local`` wire blocks to a local
    block), else the request failed with ``KV_DIGEST_MISMATCH`` naming the local blocks that differ."""
    bad = sorted({verify.all_blocks[i // per_local] for i in wrong})
    if not bad:
        return result
    message = (
        f"the KV of blocks {bad[:8]}{'...' if len(bad) > 8 else ''} differs from what prefill {engine_id} computed "
        "(digest mismatch): not used"
    )
    return replace(result, ok=False, code=KV_DIGEST_MISMATCH, message=message, invalid_blocks=bad)
