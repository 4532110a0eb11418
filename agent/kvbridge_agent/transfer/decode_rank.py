"""The decode side of one TP rank: peers (one plan each), READs, completion, conversions.

Per remote engine, everything that depends only on the two shapes is done
once in :meth:`DecodeRank.add_peer`: the plan, remote agents, remote and
local prepped descriptor lists.  Per request only block ids are mapped to
descriptor ids (numpy) and the READs are posted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvbridge_agent.core import (
    BlockMappingError,
    IncompatibleError,
    KVBridgeError,
    ModelGeometry,
    Role,
    RoleSettings,
    SpecError,
    TransferPlan,
    TransferSettings,
    build_plan,
    region_layout,
)
from kvbridge_agent.core.blocks import DescriptorIds
from kvbridge_agent.core.digest import KV_DIGEST_MISMATCH, mismatched
from kvbridge_agent.core.handshake import (
    PEER_INCOMPATIBLE,
    WIRE_FORMAT_MISMATCH,
    HandshakeError,
    KVTransferParams,
    RankMetadata,
    notification,
)
from kvbridge_agent.core.layout import BlockRuns, run_regions
from kvbridge_agent.core.physical_reads import (
    ChunkSide,
    PhysicalRead,
    physical_read,
    shared_heads,
)
from kvbridge_agent.transfer.descriptors import descriptor_rows
from kvbridge_agent.transfer.digest import Digester
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.peers import STALE_PEER
from kvbridge_agent.transfer.reads import (
    TRANSFER_FAILED,
    TRANSFER_TIMEOUT,
    UNKNOWN_PEER,
    ReadResult,
    RemotePeer,
    Verify,
    request_descriptor_ids,
)
from kvbridge_agent.transfer.relayout import Converter, convert_for_side
from kvbridge_agent.transfer.transport import Transport, TransportError

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
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


class DecodeRank:
    def __init__(
        self,
        cache: KVCache,
        transport: Transport,
        settings: RoleSettings,
        transfer: TransferSettings,
        convert: Converter = convert_for_side,
    ) -> None:
        self.convert = convert
        self.cache = cache
        self.transport = transport
        self.settings = settings
        self.transfer = transfer
        self.peers: dict[str, RemotePeer] = {}
        self._local_lists: dict[tuple[int, int, int] | BlockRuns, Any] = {}
        self._in_flight: dict[str, _InFlight] = {}
        self._zombies: list[Any] = []  # transfer handles NIXL could not cancel yet
        #: the transfer digest of this cache (core.digest): made from the cache's geometry when first needed,
        #: unless the engine sets one that reads its own block interior
        self.digester: Digester | None = None
        #: digest time of the last verified request (seconds), for the cost measurements
        self._id_buffers: tuple[DescriptorIds, DescriptorIds] = (
            np.empty(0, dtype=np.int32),
            np.empty(0, dtype=np.int32),
        )

    @property
    def model(self) -> ModelGeometry:
        return self.cache.model

    # -- peers --------------------------------------------------------------
    def add_peer(self, engine_id: str, incarnation: str, ranks: dict[int, tuple[RankMetadata, bytes]]) -> RemotePeer:
        """Build the plan and the descriptor lists for a prefill engine (evicting a stale incarnation)."""
        old = self.peers.get(engine_id)
        if old is not None:
            self.evict_peer(engine_id)
        first = next(iter(ranks.values()))[0]
        prefill = RoleSettings(
            tensor_parallel_size=first.tp_size, block_size=first.block_size, kv_layout=first.kv_layout
        )
        try:
            plan = build_plan(self.model, prefill, self.settings, self.transfer)
        except IncompatibleError as exc:
            raise HandshakeError(
                f"prefill engine {engine_id} is incompatible: {exc.message}", code=PEER_INCOMPATIBLE
            ) from exc
        rank_plan = plan.for_decode_rank(self.cache.tp_rank)
        missing = [p for p in rank_plan.handshake_ranks if p not in ranks]
        if missing:
            raise HandshakeError(f"metadata of prefill ranks {missing} is missing", code=PEER_INCOMPATIBLE)
        for p in rank_plan.handshake_ranks:
            meta = ranks[p][0]
            if (meta.wire_block_size, meta.wire_layout) != (plan.wire.block_size, plan.wire.layout):
                raise HandshakeError(
                    f"prefill rank {p} offers {meta.wire_block_size}-token {meta.wire_layout.value} wire blocks, "
                    f"the plan needs {plan.wire.block_size}-token {plan.wire.layout.value}: the two engines were "
                    "configured with different peer settings",
                    code=WIRE_FORMAT_MISMATCH,
                )
            if (meta.tp_size, meta.block_size, meta.kv_layout) != (first.tp_size, first.block_size, first.kv_layout):
                raise HandshakeError(
                    f"prefill rank {p} reports different settings than rank {first.tp_rank}", code=PEER_INCOMPATIBLE
                )
        regions = self.cache.layout.num_regions
        peer = RemotePeer(engine_id, incarnation, plan, rank_plan, {}, first.num_blocks * plan.split_ratio, regions)
        try:
            for p in rank_plan.handshake_ranks:
                peer.agents[p] = self.transport.add_peer(ranks[p][1], expected=ranks[p][0].agent_name)
            if self.cache.physical is not None or first.physical_layout is not None:
                self._add_physical_lists(peer, ranks)
                self.peers[engine_id] = peer
                return peer
            for read in rank_plan.reads:
                meta = ranks[read.prefill_rank][0]
                remote_layout = region_layout(
                    self.model, meta.block_size, meta.tp_size, num_tensors=len(meta.tensor_bases)
                )
                if remote_layout.unit_bytes != meta.region_block_bytes:
                    raise HandshakeError(
                        f"prefill rank {read.prefill_rank} reports {meta.region_block_bytes}-byte region blocks, "
                        f"the model needs {remote_layout.unit_bytes}",
                        code=PEER_INCOMPATIBLE,
                    )
                if remote_layout.num_regions != self.cache.layout.num_regions:
                    raise HandshakeError(
                        f"prefill has {remote_layout.num_regions} regions, decode {self.cache.layout.num_regions}",
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
                remote = self.transport.prep(peer.agents[read.prefill_rank], rows, meta.memory_type.value)
                peer.lists.append((remote, self._local_list(plan, read.local_offset, read.length)))
                peer.lengths.append(read.length)
        except BaseException:
            self._drop(peer)
            raise
        self.peers[engine_id] = peer
        return peer

    def _add_physical_lists(self, peer: RemotePeer, ranks: dict[int, tuple[RankMetadata, bytes]]) -> None:
        """Both caches have physical layouts (docs/protocol.md §1b, §1c): per prefill rank this decode rank reads,
        the runs of the heads both hold, cut into chunks of the smaller block, paired with its own — every TP
        mapping and block-size conversion is a choice of descriptors, nothing is re-laid."""
        plan, rank_plan, local = peer.plan, peer.rank_plan, self.cache.physical
        reads: list[PhysicalRead] = []
        for read in rank_plan.reads:
            meta = ranks[read.prefill_rank][0]
            remote = meta.physical_layout
            if local is None or remote is None:
                raise HandshakeError(
                    f"prefill engine {peer.engine_id} {'has' if remote else 'has no'} physical KV layout and this "
                    f"decode {'has' if local else 'has no'}: run both roles on the same engine build and KV layout "
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
                    self.model,
                    plan.prefill.tensor_parallel_size,
                    plan.decode.tensor_parallel_size,
                    read.prefill_rank,
                    self.cache.tp_rank,
                )
                physical = physical_read(read.prefill_rank, remote, local, heads)
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
            handle = self.transport.prep(peer.agents[read.prefill_rank], rows, meta.memory_type.value)
            peer.lists.append((handle, self._local_runs_list(physical.target.regions)))
            peer.lengths.append(length)
            if reads and (physical.tokens, physical.source.chunks) != (reads[0].tokens, reads[0].source.chunks):
                raise HandshakeError(  # one chunking maps every request's blocks for all reads
                    f"prefill rank {read.prefill_rank} runs other kernel blocks than rank {reads[0].prefill_rank}",
                    code=PEER_INCOMPATIBLE,
                )
            reads.append(physical)
        first, meta = reads[0], ranks[reads[0].prefill_rank][0]
        peer.physical = tuple(reads)
        peer.regions = first.target.runs.count
        peer.sides = (
            ChunkSide(self.cache.block_size, 1, first.target.chunks * first.tokens, first.tokens),
            ChunkSide(meta.block_size, plan.split_ratio, first.source.chunks * first.tokens, first.tokens),
        )

    def _local_runs_list(self, runs: BlockRuns) -> Any:
        handle = self._local_lists.get(runs)
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
            handle = self.transport.prep("", rows, cache.memory_type.value)
            self._local_lists[runs] = handle
        return handle

    def _local_list(self, plan: TransferPlan, offset: int, length: int) -> Any:
        key = (plan.block_size_ratio, offset, length)
        handle = self._local_lists.get(key)
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
            handle = self.transport.prep("", rows, cache.memory_type.value)
            self._local_lists[key] = handle
        return handle

    def _drop(self, peer: RemotePeer) -> None:
        for remote, _local in peer.lists:
            self.transport.release_dlist(remote)
        for name in peer.agents.values():
            self.transport.remove_peer(name)

    def evict_peer(self, engine_id: str) -> bool:
        """Forget a prefill engine: fail its requests in flight, release its lists and remote agents."""
        peer = self.peers.pop(engine_id, None)
        if peer is None:
            return False
        for request_id, flight in list(self._in_flight.items()):
            if flight.params.remote_engine_id == engine_id:
                self._cancel(flight)
                del self._in_flight[request_id]
        self._drop(peer)
        return True

    # -- requests -----------------------------------------------------------
    def start(
        self,
        request_id: str,
        params: KVTransferParams,
        local_blocks: list[int],
        timeout: float,
        verify: Verify | None = None,
        group_sizes: list[int] | None = None,
    ) -> ReadResult | None:
        """Post the READs of one request; returns a result at once on failure or a full prefix hit. With
        ``verify``, the request succeeds only if the digests of what it then holds equal prefill's. With
        ``group_sizes`` (a hybrid model), ``local_blocks`` lists each cache group's blocks one after the other."""
        started = time.perf_counter()
        peer = self.peers.get(params.remote_engine_id)
        if peer is None:
            return ReadResult(
                request_id, False, UNKNOWN_PEER, f"no handshake with {params.remote_engine_id}", list(local_blocks)
            )
        if peer.incarnation != params.remote_incarnation:
            return ReadResult(
                request_id,
                False,
                STALE_PEER,
                f"{params.remote_engine_id} restarted (incarnation {params.remote_incarnation})",
                list(local_blocks),
                peer_failed=True,
            )
        note = notification(params.remote_request_id, self.settings.tensor_parallel_size)
        rank_plan = peer.rank_plan
        try:
            ids = request_descriptor_ids(peer, params, local_blocks, group_sizes, self.cache.num_blocks, self._buffers)
        except (BlockMappingError, SpecError) as exc:
            return ReadResult(request_id, False, exc.code, exc.message, list(local_blocks))
        ids_us = (time.perf_counter() - started) * 1e6
        handles: list[Any] = []
        total_bytes = 0
        make_us = nixl_post_us = 0.0
        try:
            if not ids:  # a full prefix hit: nothing to read
                for p in {r.prefill_rank for r in rank_plan.reads}:
                    self.transport.notify(peer.agents[p], note)
            else:
                made = time.perf_counter()
                for (remote, local), (local_ids, remote_ids) in zip(peer.lists, ids, strict=True):
                    handles.append(self.transport.make_read(local, local_ids, remote, remote_ids, note))
                posting = time.perf_counter()
                make_us = (posting - made) * 1e6
                for handle in handles:
                    self.transport.post(handle)
                nixl_post_us = (time.perf_counter() - posting) * 1e6
                total_bytes = sum(length * pair[0].size for length, pair in zip(peer.lengths, ids, strict=True))
            for p in rank_plan.notify_only_ranks:
                self.transport.notify(peer.agents[p], note)
        except (TransportError, KVBridgeError) as exc:
            for handle in handles:
                self.transport.release(handle)
            return ReadResult(request_id, False, TRANSFER_FAILED, exc.message, list(local_blocks), peer_failed=True)
        own_us = (time.perf_counter() - started) * 1e6 - make_us - nixl_post_us
        flight = _InFlight(
            request_id,
            params,
            list(local_blocks),
            handles,
            timeout,
            time.monotonic() + timeout,
            started,
            total_bytes,
            sum(pair[0].size for pair in ids),
            ids_us,
            make_us,
            nixl_post_us,
            own_us,
            verify,
        )
        if not handles:
            return self._finish(flight, peer)
        self._in_flight[request_id] = flight
        return None

    def _buffers(self, count: int) -> tuple[DescriptorIds, DescriptorIds]:
        if self._id_buffers[0].size < count:
            self._id_buffers = (np.empty(count, dtype=np.int32), np.empty(count, dtype=np.int32))
        return self._id_buffers

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def poll(self) -> list[ReadResult]:
        """Drive progress; results of requests that completed, failed or timed out."""
        results: list[ReadResult] = []
        # progress the worker even with no READ in flight: notifications sent without a READ
        # (full prefix hits, notify-only ranks, first contact) complete only while we poll
        for sender, messages in self.transport.notifications().items():
            log.warning("ignoring %d unexpected notification(s) from %s", len(messages), sender)
        self._zombies = [h for h in self._zombies if not self.transport.release(h)]
        now = time.monotonic()
        for request_id, flight in list(self._in_flight.items()):
            states = [self.transport.state(h) for h in flight.handles]
            peer = self.peers.get(flight.params.remote_engine_id)
            if "ERR" in states or peer is None:
                results.append(
                    self._fail(flight, TRANSFER_FAILED, "NIXL reported a failed READ (the prefill engine may be gone)")
                )
            elif all(state == "DONE" for state in states):
                del self._in_flight[request_id]
                posted = [self.transport.posted(handle) for handle in flight.handles]
                if None not in posted:  # runs adjacent in both caches merged by NIXL (docs/protocol.md §4c)
                    flight.posted = sum(p for p in posted if p is not None)
                for handle in flight.handles:
                    self.transport.release(handle)
                results.append(self._finish(flight, peer))
            elif now > flight.deadline:
                results.append(self._fail(flight, TRANSFER_TIMEOUT, f"READs not complete after {flight.timeout:g} s"))
        return results

    def _finish(self, flight: _InFlight, peer: RemotePeer) -> ReadResult:
        read = time.perf_counter()
        converted = self.convert(self.cache, peer.plan, Role.DECODE, flight.blocks)
        done = time.perf_counter()
        conversion = ""
        if converted:  # the plan's steps on decode, or a host buffer's copy when the plan names none
            conversion = ",".join(step.kind.value for step in peer.plan.wire.steps(Role.DECODE)) or "host_copy"
        result = ReadResult(
            flight.request_id,
            True,
            bytes=flight.bytes,
            descriptors=flight.descriptors if flight.posted is None else flight.posted,
            indices=flight.descriptors,
            seconds=done - flight.started,
            convert_seconds=done - read if converted else 0.0,
            conversion=conversion,
            ids_microseconds=flight.ids_microseconds,
            make_microseconds=flight.make_microseconds,
            post_microseconds=flight.post_microseconds,
            own_microseconds=flight.own_microseconds,
        )
        return result if flight.verify is None else self.verified(result, flight.verify, peer)

    def verified(self, result: ReadResult, verify: Verify, peer: RemotePeer) -> ReadResult:
        """``result`` (a read that completed) if the digests of what this rank now holds equal prefill's; else the
        request fails with ``KV_DIGEST_MISMATCH``, naming the local blocks that differ."""
        digester = self.digester = self.digester or Digester(self.cache)
        wire = peer.plan.wire.block_size
        got = digester.request(verify.expected.key, verify.all_blocks, verify.num_tokens, wire, verify.block_layers)
        per_local = self.cache.block_size // wire
        wrong = mismatched(verify.expected.heads, digester.heads, got)
        bad = sorted({verify.all_blocks[i // per_local] for i in wrong})
        if not bad:
            return result
        message = (
            f"the KV of blocks {bad[:8]}{'...' if len(bad) > 8 else ''} differs from what prefill "
            f"{peer.engine_id} computed (digest mismatch): not used"
        )
        return replace(result, ok=False, code=KV_DIGEST_MISMATCH, message=message, invalid_blocks=bad)

    def _fail(self, flight: _InFlight, code: str, message: str) -> ReadResult:
        """Stop tracking a request, cancel its READs; its local blocks are invalid, its peer suspect."""
        del self._in_flight[flight.request_id]
        self._cancel(flight)
        return ReadResult(flight.request_id, False, code, message, flight.blocks, peer_failed=True)

    def _cancel(self, flight: _InFlight) -> None:
        for handle in flight.handles:
            if not self.transport.release(handle):
                self._zombies.append(handle)

    def close(self) -> None:
        for engine_id in list(self.peers):
            self.evict_peer(engine_id)
        for handle in self._local_lists.values():
            self.transport.release_dlist(handle)
        self._local_lists.clear()
        for handle in self._zombies:
            self.transport.release(handle)
        self._zombies.clear()
