"""A decode rank's prepped descriptor lists for one prefill engine, built once per peer (docs/protocol.md §1c, §4).

Per read of the rank plan: prefill's list (its blocks' segments of the read) and decode's own (shared between
peers: :class:`LocalLists`), and both sides' :class:`~kvbridge_agent.core.staging.Segments` — what a staged read
(``transfer.staged_reads``) packs and scatters, in the same pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbridge_agent.core import KVBridgeError, TransferPlan, region_layout
from kvbridge_agent.core.handshake import PEER_INCOMPATIBLE, HandshakeError, RankMetadata
from kvbridge_agent.core.layout import BlockRuns, run_regions
from kvbridge_agent.core.physical_reads import ChunkSide, PhysicalRead, physical_read, shared_heads
from kvbridge_agent.core.stage_requests import StagePlan, ordering
from kvbridge_agent.core.staging import Segments, WireOrder, region_segments, run_segments
from kvbridge_agent.transfer.descriptors import descriptor_rows
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.reads import RemotePeer
from kvbridge_agent.transfer.transport import Transport

Ranks = dict[int, tuple[RankMetadata, bytes]]


@dataclass(frozen=True, slots=True)
class ReadSegments:
    """One read of a peer as segments: prefill rank ``prefill_rank``'s (``source``), this rank's (``target``), and
    the stage plan that lets prefill compute ``source`` itself (its digest included)."""

    prefill_rank: int
    source: Segments
    target: Segments
    order: WireOrder
    plan: StagePlan
    #: rows of the grid a request's descriptor ids form (ids ``run * units + unit``): regions, or paired runs
    runs: int


class LocalLists:
    """This rank's own prepped lists, one per distinct geometry, shared by every peer that reads into it."""

    def __init__(self, cache: KVCache, transport: Transport) -> None:
        self.cache, self.transport = cache, transport
        self._lists: dict[tuple[int, int, int] | BlockRuns, Any] = {}

    def blocks(self, plan: TransferPlan, offset: int, length: int) -> Any:
        key = (plan.block_size_ratio, offset, length)
        handle = self._lists.get(key)
        if handle is None:
            cache = self.cache
            rows = descriptor_rows(
                cache.bases,
                cache.layout,
                cache.num_blocks,
                units_per_block=plan.block_size_ratio,
                offset=offset,
                length=length,
                device_id=cache.device_id,
            )
            handle = self._lists[key] = self.transport.prep("", rows, cache.memory_type.value)
        return handle

    def runs(self, runs: BlockRuns) -> Any:
        handle = self._lists.get(runs)
        if handle is None:
            cache = self.cache
            rows = descriptor_rows(
                cache.bases,
                run_regions(runs),
                cache.num_blocks * cache.kernel_ratio,
                units_per_block=1,
                offset=0,
                length=runs.length,
                device_id=cache.device_id,
            )
            handle = self._lists[runs] = self.transport.prep("", rows, cache.memory_type.value)
        return handle

    def close(self) -> None:
        for handle in self._lists.values():
            self.transport.release_dlist(handle)
        self._lists.clear()


def add_region_lists(peer: RemotePeer, ranks: Ranks, cache: KVCache, local: LocalLists) -> list[ReadSegments]:
    """A cache kind's regions on both sides (docs/protocol.md §3): per read, its byte range of every region block."""
    plan, transport, found = peer.plan, local.transport, []
    for read in peer.rank_plan.reads:
        meta = ranks[read.prefill_rank][0]
        remote_layout = region_layout(cache.model, meta.block_size, meta.tp_size, num_tensors=len(meta.tensor_bases))
        if remote_layout.unit_bytes != meta.region_block_bytes:
            raise HandshakeError(
                f"prefill rank {read.prefill_rank} reports {meta.region_block_bytes}-byte region blocks, "
                f"the model needs {remote_layout.unit_bytes}",
                code=PEER_INCOMPATIBLE,
            )
        if remote_layout.num_regions != cache.layout.num_regions:
            raise HandshakeError(
                f"prefill has {remote_layout.num_regions} regions, decode {cache.layout.num_regions}",
                code=PEER_INCOMPATIBLE,
            )
        rows = descriptor_rows(
            meta.tensor_bases,
            remote_layout,
            meta.num_blocks,
            units_per_block=plan.split_ratio,
            offset=read.remote_offset,
            length=read.length,
            device_id=meta.device_id,
        )
        remote = transport.prep(peer.agents[read.prefill_rank], rows, meta.memory_type.value)
        peer.lists.append((remote, local.blocks(plan, read.local_offset, read.length)))
        peer.lengths.append(read.length)
        units = plan.split_ratio
        source = region_segments(
            remote_layout, meta.num_blocks, units_per_block=units, offset=read.remote_offset, length=read.length
        )
        target = region_segments(
            cache.layout,
            cache.num_blocks,
            units_per_block=plan.block_size_ratio,
            offset=read.local_offset,
            length=read.length,
        )
        order = WireOrder(ordering(target), 1)
        tensors = cache.layout.num_tensors  # named where the plan's layout has others (vLLM's CPU attention)
        stage = StagePlan(
            offset=read.remote_offset,
            length=read.length,
            decode_rank=cache.tp_rank,
            decode_tensors=tensors if tensors != plan.decode_layout.num_tensors else None,
            digest=source.digest,
            order_digest=order.digest,
        )
        found.append(ReadSegments(read.prefill_rank, source, target, order, stage, cache.layout.num_regions))
    return found


def add_physical_lists(peer: RemotePeer, ranks: Ranks, cache: KVCache, local: LocalLists) -> list[ReadSegments]:
    """Both caches have physical layouts (docs/protocol.md §1b, §1c): per prefill rank this decode rank reads,
    the runs of the heads both hold, cut into chunks of the smaller block, paired with its own — every TP
    mapping and block-size conversion is a choice of descriptors, nothing is re-laid."""
    plan, rank_plan, own = peer.plan, peer.rank_plan, cache.physical
    reads: list[PhysicalRead] = []
    found: list[ReadSegments] = []
    for read in rank_plan.reads:
        meta = ranks[read.prefill_rank][0]
        remote = meta.physical_layout
        if own is None or remote is None:
            raise HandshakeError(
                f"prefill engine {peer.engine_id} {'has' if remote else 'has no'} physical KV layout and this "
                f"decode {'has' if own else 'has no'}: run both roles on the same engine build and KV layout "
                "kind",
                code=PEER_INCOMPATIBLE,
            )
        if len(meta.tensor_bases) != 1:
            raise HandshakeError("a physical layout has one base address", code=PEER_INCOMPATIBLE)
        if meta.block_size % remote.block_size or remote.num_blocks != meta.num_blocks * (
            meta.block_size // remote.block_size
        ):
            raise HandshakeError(
                f"prefill rank {read.prefill_rank} describes {remote.num_blocks} kernel blocks of "
                f"{remote.block_size} tokens for {meta.num_blocks} blocks of {meta.block_size}",
                code=PEER_INCOMPATIBLE,
            )
        try:
            heads = shared_heads(
                cache.model,
                plan.prefill.tensor_parallel_size,
                plan.decode.tensor_parallel_size,
                read.prefill_rank,
                cache.tp_rank,
            )
            physical = physical_read(read.prefill_rank, remote, own, heads)
        except KVBridgeError as exc:
            raise HandshakeError(
                f"prefill engine {peer.engine_id} rank {read.prefill_rank}: {exc.message}", code=PEER_INCOMPATIBLE
            ) from exc
        length = physical.source.runs.length
        rows = descriptor_rows(
            meta.tensor_bases,
            run_regions(physical.source.regions),
            remote.num_blocks,
            units_per_block=1,
            offset=0,
            length=length,
            device_id=meta.device_id,
        )
        handle = local.transport.prep(peer.agents[read.prefill_rank], rows, meta.memory_type.value)
        peer.lists.append((handle, local.runs(physical.target.regions)))
        peer.lengths.append(length)
        if reads and (physical.tokens, physical.source.chunks) != (reads[0].tokens, reads[0].source.chunks):
            raise HandshakeError(  # one chunking maps every request's blocks for all reads
                f"prefill rank {read.prefill_rank} runs other kernel blocks than rank {reads[0].prefill_rank}",
                code=PEER_INCOMPATIBLE,
            )
        reads.append(physical)
        source = run_segments(physical.source.regions, remote.num_blocks)
        target = run_segments(physical.target.regions, cache.num_blocks * cache.kernel_ratio)
        order = WireOrder(ordering(target), physical.target.chunks)
        stage = StagePlan(
            decode_layout=own,
            heads=heads,
            length=length,
            decode_rank=cache.tp_rank,
            digest=source.digest,
            order_digest=order.digest,
        )
        found.append(ReadSegments(read.prefill_rank, source, target, order, stage, physical.target.runs.count))
    first, meta = reads[0], ranks[reads[0].prefill_rank][0]
    peer.physical = tuple(reads)
    peer.regions = first.target.runs.count
    peer.sides = (
        ChunkSide(cache.block_size, 1, first.target.chunks * first.tokens, first.tokens),
        ChunkSide(meta.block_size, plan.split_ratio, first.source.chunks * first.tokens, first.tokens),
    )
    return found
