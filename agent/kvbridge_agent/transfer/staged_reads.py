"""A decode rank's staged reads (docs/protocol.md §4d): ask prefill to pack, READ a few large descriptors.

Per request the rank's cost model (``core.staging.CostModel``, measured at start by ``transfer.cost_model``) weighs
the direct READs (the descriptors NIXL would post) against staging them. Staged, the rank asks each prefill rank it
reads from to pack the request's segments of that read in wire order (``stager``: the side channel's ``stage``
message, or a direct call in a benchmark; a prefill rank with no room answers ``busy`` and the request is read
directly; the exchange is ``transfer.stage_asks``'s, on the thread that starts the read or off it: :meth:`reserve`,
``ask`` and :meth:`post` are its halves), then READs the packed bytes

- straight into its blocks (``into`` :data:`~kvbridge_agent.core.staging.INTO_BLOCKS`): the wire order is decode's
  address order, so NIXL merges every run of segments that lie end to end in decode's cache; or
- into an extent of its own staging pool (:data:`~kvbridge_agent.core.staging.INTO_BUFFER`; none free: read
  directly) in a few READs of whole pieces, scattering the segments each READ completed into its blocks on a worker
  thread while the next READ copies.

Once every byte is in place it notifies the prefill ranks (so that they free the blocks and the staged bytes: these
READs carry no notification) and gives its extent back; a failure, a timeout or an evicted peer gives it back too,
once NIXL has released every READ into it and the worker is done with it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvbridge_agent.core import KVBridgeError
from kvbridge_agent.core.blocks import DescriptorIds, IntArray, descriptor_ids
from kvbridge_agent.core.handshake import RankMetadata
from kvbridge_agent.core.stage_requests import StageReply
from kvbridge_agent.core.staging import (
    INTO_BLOCKS,
    MIN_ROW_BYTES,
    Choice,
    CostModel,
    posted_estimate,
    read_groups,
)
from kvbridge_agent.transfer.background import background_executor
from kvbridge_agent.transfer.cost_model import measure
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.observed_costs import ObservedCosts
from kvbridge_agent.transfer.peer_lists import ReadSegments
from kvbridge_agent.transfer.reads import InFlight, RemotePeer
from kvbridge_agent.transfer.stage_asks import Asked, Stager, ask
from kvbridge_agent.transfer.staging import Extent, RowMap, StagingPool, scatter
from kvbridge_agent.transfer.transport import Transport

log = logging.getLogger(__name__)

#: entries of a prepped list over a prefill rank's staging buffer in segments (else only READs into the buffer)
MAX_SEGMENT_ENTRIES = 1 << 24
#: entry sizes this rank keeps lists of its cache in (the runs of requests' segments)
MAX_ENTRY_SIZES = 16


@dataclass(frozen=True, slots=True)
class StagedRead:
    """One read of a peer, staged: its segments and wire order, prefill's staging buffer as prepped lists (in
    pieces, and in segments where that list is not too long), and the rows decode scatters in."""

    segments: ReadSegments
    pieces: Any
    piece: int
    row_bytes: int
    #: whether READs of the packed bytes can land straight in decode's blocks (segments whole entries of lists)
    into_blocks: bool
    agent: str
    meta: RankMetadata
    #: prefill's staging buffer in entries of a size (the runs of a request's segments decode's bytes make)
    entries: dict[int, Any] = field(default_factory=dict)
    #: per count of units: decode's runs of a request whose blocks are consecutive from block 0, and the offsets
    #: of its first row of segments (a request in consecutive blocks elsewhere is these, shifted)
    virtual: dict[int, tuple[_Runs, IntArray, IntArray]] = field(default_factory=dict)


@dataclass
class _Part:
    """One READ of a staged request: the bytes of read ``read`` below ``end`` are in once it is done."""

    read: int
    end: int
    handle: Any
    done: bool = False


@dataclass(frozen=True, slots=True)
class _Runs:
    """Decode's bytes of one read of a request in wire order, as maximal runs: first byte (from the tensor's
    storage), size and tensor of each."""

    tensors: IntArray
    offsets: IntArray
    sizes: IntArray

    @classmethod
    def of(cls, tensors: IntArray, offsets: IntArray, length: int) -> _Runs:
        breaks = np.flatnonzero((offsets[1:] != offsets[:-1] + length) | (tensors[1:] != tensors[:-1])) + 1
        starts = np.concatenate(([0], breaks)).astype(np.int64)
        sizes = np.diff(np.concatenate((starts, [offsets.size]))) * length
        return cls(tensors[starts], offsets[starts], sizes)

    def shifted(self, shift: int) -> _Runs:
        return _Runs(self.tensors, self.offsets + shift, self.sizes)


@dataclass
class StagedFlight:
    """A staged request in flight."""

    flight: InFlight
    into: str
    rows: list[RowMap] = field(default_factory=list)  # into the buffer: per read, decode's rows in wire order
    starts: list[int] = field(default_factory=list)  # byte offset of each read's first piece in the extent
    leads: list[int] = field(default_factory=list)  # bytes before each read's own in its first piece
    extent: Extent | None = None
    parts: list[_Part] = field(default_factory=list)
    scattered: list[int] = field(default_factory=list)  # segments scattered per read
    futures: list[Future[float]] = field(default_factory=list)
    stage_us: float = 0.0
    pack_us: float = 0.0
    scatter_s: float = 0.0  # scattered on the caller's thread
    prestaged: bool = True


class DecodeStaging:
    """The staged reads of one decode rank: its staging pool, cost model and scatter worker."""

    def __init__(self, cache: KVCache, transport: Transport, total_bytes: int, stager: Stager | None) -> None:
        self.cache, self.transport, self.stager = cache, transport, stager
        self.pool = StagingPool(transport, cache.tensors[0].device, total_bytes)
        self.cost: CostModel = measure(transport, self.pool)
        rows = np.array([[self.pool.base, self.pool.piece, cache.device_id, self.pool.piece, self.pool.pieces]])
        self._local = transport.prep("", rows, cache.memory_type.value)
        self._worker = background_executor(1, "kvbridge-scatter")
        #: ``auto`` (the cost model), or always ``direct`` / ``staged`` (where the peer allows it)
        self.mode = "auto"
        #: where staged reads land: ``auto`` (the cost model), or always ``blocks`` (where possible) / ``buffer``
        self.into = "auto"
        self.busy = 0  # requests read directly because a staging buffer had no room
        #: the cost model's own choice for the last request weighed (whatever ``mode`` then forced)
        self.last_choice: Choice | None = None
        self.observed = ObservedCosts()  # the model's corrections from completed reads
        self._prestaged: dict[str, bool] = {}  # per peer: whether its last stage reply was packed at offer
        self.quarantine: list[tuple[list[Any], str]] = []  # READs NIXL would not release yet, and their extent
        #: the ids :meth:`choose` last weighed, and per read decode's runs of them in wire order
        self._wire: tuple[object, list[_Runs]] = (None, [])
        #: per segment length: this cache in entries of that length (one strided row per tensor, in address order,
        #: so that NIXL merges segments that lie end to end: it joins consecutive entries of one row), and the id
        #: of each tensor's first entry
        self._segments: dict[int, tuple[Any, IntArray] | None] = {}

    # -- per peer -----------------------------------------------------------------------------------------------
    def attach(self, peer: RemotePeer, reads: list[ReadSegments], ranks: dict[int, tuple[RankMetadata, bytes]]) -> None:
        """Stage this peer's reads when every prefill rank read offers a staging buffer in this pool's pieces and
        both sides' segments are whole rows worth copying (else the peer is read directly)."""
        staged: list[StagedRead] = []
        for read in reads:
            meta = ranks[read.prefill_rank][0]
            row_bytes = read.target.granularity(self.cache.origin)
            usable = meta.staging_base is not None and meta.staging_bytes is not None
            if not usable or meta.staging_piece != self.pool.piece or row_bytes < MIN_ROW_BYTES:
                break
            agent, length = peer.agents[read.prefill_rank], read.target.length
            pieces = self.transport.prep(agent, _strided(meta, meta.staging_piece), meta.memory_type.value)
            # READs straight into the blocks: segments whole entries of lists over both sides' bytes
            aligned = length % self.pool.piece == 0 or self.pool.piece % length == 0  # prefill aligns its ranges
            fits = aligned and row_bytes == length and (meta.staging_bytes or 0) // length <= MAX_SEGMENT_ENTRIES
            into_blocks = fits and self._segment_list(length) is not None
            staged.append(StagedRead(read, pieces, self.pool.piece, row_bytes, into_blocks, agent, meta))
        peer.staged = tuple(staged)
        if len(staged) < len(reads):  # a read that cannot be staged: the whole peer is read directly
            self.drop(peer)

    def _segment_list(self, length: int) -> tuple[Any, IntArray] | None:
        if length not in self._segments and len(self._segments) >= MAX_ENTRY_SIZES:
            return None  # entries of the segments' own length, prepared when the peer was met, serve instead
        if length not in self._segments:
            cache, rows, firsts, total = self.cache, [], [], 0
            for tensor in cache.tensors:
                count = tensor.numel() * tensor.element_size() // length
                rows.append([tensor.data_ptr(), length, cache.device_id, length, count])
                firsts.append(total)
                total += count
            found = None
            if total <= MAX_SEGMENT_ENTRIES:
                handle = self.transport.prep("", np.array(rows, dtype=np.int64), cache.memory_type.value)
                found = (handle, np.asarray(firsts, dtype=np.int64))
            self._segments[length] = found
        return self._segments[length]

    def drop(self, peer: RemotePeer) -> None:
        for read in peer.staged:
            self.transport.release_dlist(read.pieces)
            for handle in read.entries.values():
                self.transport.release_dlist(handle)
            read.entries.clear()
        peer.staged = ()

    # -- per request --------------------------------------------------------------------------------------------
    def choose(self, peer: RemotePeer, ids: list[tuple[DescriptorIds, DescriptorIds]]) -> Choice | None:
        """Direct or staged, and where to, for a request's ids (``None``: the peer is not staged)."""
        if not peer.staged or self.mode == "direct" or self.stager is None:
            return None
        direct, placed, nbytes, pieces = 0, 0, 0, 0
        self._wire = (ids, [])
        for read, (local_ids, remote_ids) in zip(peer.staged, ids, strict=True):
            segments = read.segments
            runs = segments.runs
            units = local_ids.size // runs
            merge = segments.source.tiles and segments.target.tiles
            direct += posted_estimate(
                local_ids[:units].astype(np.int64), remote_ids[:units].astype(np.int64), runs, merge
            )
            found = self._runs(read, local_ids)
            self._wire[1].append(found)  # kept for start()
            placed += int(found.sizes.size)
            size = local_ids.size * segments.target.length
            nbytes += size
            pieces += len(read_groups(size, read.piece))
        into_blocks = placed if all(read.into_blocks for read in peer.staged) else None
        packed = self._prestaged.get(peer.engine_id, False)
        measured = self.cost.choose(direct, into_blocks, nbytes, len(peer.staged), pieces, packed)
        choice = self.last_choice = self.observed.choose(measured, self.cost.margin)
        if self.into != "auto" and (self.into != INTO_BLOCKS or into_blocks is not None):
            choice = replace(choice, into=self.into)
        return replace(choice, staged=True) if self.mode == "staged" else choice

    def start(
        self,
        flight: InFlight,
        peer: RemotePeer,
        ids: list[tuple[DescriptorIds, DescriptorIds]],
        first: int,
        choice: Choice,
    ) -> StagedFlight | None:
        """Stage and post one request's READs on this thread (:meth:`reserve`, ``stage_asks.ask``, :meth:`post`);
        ``None`` when it must be read directly (no room here or on a prefill rank, or a prefill rank refused), with
        nothing left held on this side."""
        staged = self.reserve(flight, peer, ids, choice)
        if staged is None:
            return None
        try:
            asked = ask(self.stager, flight.params, peer.staged, ids, first)
        except BaseException:
            self.pool.release(flight.request_id)
            raise
        return self.post(staged, peer, ids, asked)

    def reserve(
        self, flight: InFlight, peer: RemotePeer, ids: list[tuple[DescriptorIds, DescriptorIds]], choice: Choice
    ) -> StagedFlight | None:
        """The request's staged flight, holding an extent of the pool where its bytes land in the buffer; ``None``:
        no room (read it directly)."""
        staged = StagedFlight(flight, choice.into)
        if choice.into != INTO_BLOCKS and not self._take(staged, peer, ids):
            self.busy += 1
            return None
        return staged

    def post(
        self, staged: StagedFlight, peer: RemotePeer, ids: list[tuple[DescriptorIds, DescriptorIds]], asked: Asked
    ) -> StagedFlight | None:
        """On the thread that owns NIXL: post the READs of a request prefill packed; ``None`` when it must be read
        directly, its extent given back."""
        owner = staged.flight.request_id
        self.busy += asked.busy
        self.cost = replace(self.cost, exchange_us=asked.smoothed(self.cost.exchange_us))
        replies = asked.replies
        if asked.why:
            log.log(
                logging.DEBUG if asked.skipped else logging.WARNING,
                "staging %s failed, reading it directly: %s",
                owner,
                asked.why,
            )
        if replies is None or len(replies) != len(peer.staged):
            self.pool.release(owner)
            return None
        staged.stage_us = (asked.ended - staged.flight.started) * 1e6
        staged.pack_us = sum(reply.pack_microseconds for reply in replies)
        staged.prestaged = all(reply.prestaged for reply in replies)
        self._prestaged[peer.engine_id] = staged.prestaged
        if staged.into == INTO_BLOCKS and any(
            r.offset % s.segments.target.length for r, s in zip(replies, peer.staged, strict=True)
        ):
            log.warning("prefill packed %s at offsets decode cannot READ segments from; reading it directly", owner)
            self.pool.release(owner)
            return None
        try:
            self._post(staged, peer, ids, replies)
        except BaseException:
            self.cancel(staged)
            raise
        return staged

    def _take(self, staged: StagedFlight, peer: RemotePeer, ids: list[tuple[DescriptorIds, DescriptorIds]]) -> bool:
        """Decode's rows of the request and an extent of the pool for it (a piece more per read: a range packed
        when offered may start inside a piece of prefill's)."""
        total = 0
        for index, read in enumerate(peer.staged):
            tensors, offsets = self._placed(ids, index, read)
            length = read.segments.target.length
            staged.rows.append(RowMap.placed(tensors, offsets, length, read.row_bytes, self.cache.origin))
            staged.starts.append(total)
            total += (-(-staged.rows[-1].bytes // self.pool.piece) + 1) * self.pool.piece
        staged.scattered = [0] * len(staged.rows)
        staged.extent = self.pool.take(total, staged.flight.request_id)
        return staged.extent is not None

    def _post(
        self,
        staged: StagedFlight,
        peer: RemotePeer,
        ids: list[tuple[DescriptorIds, DescriptorIds]],
        replies: list[StageReply],
    ) -> None:
        posting, handed = time.perf_counter(), 0
        for index, (read, reply) in enumerate(zip(peer.staged, replies, strict=True)):
            if staged.into == INTO_BLOCKS and read.into_blocks:  # the packed bytes straight into the blocks
                handed += self._post_into_blocks(staged, index, read, ids, reply)
                continue
            if staged.extent is None:
                raise KVBridgeError("a staged read into the buffer without an extent", code="STAGING_FAILED")
            local_first = staged.extent.first + staged.starts[index] // read.piece
            remote_first, lead = divmod(reply.offset, read.piece)
            staged.leads.append(lead)  # the read's bytes start this far into its first piece, on both sides
            for start, count in read_groups(lead + reply.bytes, read.piece):
                pieces = np.arange(start, start + count, dtype=np.int32)
                handle = self.transport.make_read(
                    self._local, pieces + local_first, read.pieces, pieces + remote_first, b""
                )
                self._add(staged, _Part(index, min(reply.bytes, (start + count) * read.piece - lead), handle))
                handed += count
        staged.flight.post_microseconds = (time.perf_counter() - posting) * 1e6
        staged.flight.descriptors = handed

    def _placed(
        self, ids: list[tuple[DescriptorIds, DescriptorIds]], index: int, read: StagedRead
    ) -> tuple[IntArray, IntArray]:
        """Decode's segments of read ``index`` in wire order (tensors, offsets)."""
        local_ids, segments = ids[index][0], read.segments
        order = segments.order.permutation(segments.runs, local_ids.size // segments.runs)
        tensors, offsets = segments.target.offsets(local_ids, segments.runs)
        return tensors[order], offsets[order]

    def _runs(self, read: StagedRead, local_ids: DescriptorIds) -> _Runs:
        """Decode's runs of a read's segments in wire order (origin included). A request in consecutive blocks
        (the common case) shifts the runs computed once for its length: no work per segment."""
        segments = read.segments
        runs, target, chunks = segments.runs, segments.target, segments.order.chunks
        units = local_ids.size // runs
        tensors, offsets = target.offsets(local_ids[:units])  # the first row: one run's segments, unit by unit
        virtual = read.virtual.get(units)
        if virtual is None:
            index = np.arange(units, dtype=np.int64)
            row = (index % chunks) * target.units + index // chunks  # consecutive (kernel) blocks from 0
            grid = descriptor_ids(row, runs, target.units * chunks)
            order = segments.order.permutation(runs, units)
            all_tensors, all_offsets = target.offsets(grid, runs)
            found = _Runs.of(all_tensors[order], all_offsets[order], target.length)
            virtual = read.virtual[units] = (found, *target.offsets(grid[:units]))
            while len(read.virtual) > MAX_ENTRY_SIZES:
                read.virtual.pop(next(iter(read.virtual)))
        shift = int(offsets[0] - virtual[2][0]) if units else 0
        if np.array_equal(tensors, virtual[1]) and np.array_equal(offsets, virtual[2] + shift):
            return virtual[0].shifted(shift + self.cache.origin)
        wire_tensors, wire_offsets = target.offsets(local_ids, runs)
        order = segments.order.permutation(runs, units)
        return _Runs.of(wire_tensors[order], wire_offsets[order] + self.cache.origin, target.length)

    def _post_into_blocks(
        self,
        staged: StagedFlight,
        index: int,
        read: StagedRead,
        ids: list[tuple[DescriptorIds, DescriptorIds]],
        reply: StageReply,
    ) -> int:
        """One READ of a read's packed bytes into decode's blocks, in entries as large as the runs its segments make
        in decode's cache allow (NIXL walks fewer ids; it merges each run into one descriptor either way)."""
        found = self._wire[1][index] if self._wire[0] is ids else self._runs(read, ids[index][0])
        length = read.segments.target.length
        sizes = found.sizes
        size = int(np.gcd.reduce(np.concatenate((sizes, found.offsets, [reply.offset, length]))))
        local = self._segment_list(size) or self._segment_list(length)
        size = size if self._segments.get(size) is not None else length
        if local is None:
            raise KVBridgeError(f"no list of this cache in {length}-byte entries", code="STAGING_FAILED")
        counts = sizes // size
        firsts = local[1][found.tensors] + found.offsets // size
        skip = np.repeat(np.cumsum(counts) - counts, counts)
        entries = (np.repeat(firsts, counts) + np.arange(int(counts.sum()), dtype=np.int64) - skip).astype(np.int32)
        remote = read.entries.get(size)
        if remote is None:
            remote = read.entries[size] = self.transport.prep(
                read.agent, _strided(read.meta, size), read.meta.memory_type.value
            )
        start = reply.offset // size
        remote_ids = np.arange(start, start + entries.size, dtype=np.int32)
        handle = self.transport.make_read(local[0], entries, remote, remote_ids, b"")
        self._add(staged, _Part(index, reply.bytes, handle))
        return int(entries.size)

    def _add(self, staged: StagedFlight, part: _Part) -> None:
        staged.parts.append(part)
        staged.flight.handles.append(part.handle)
        self.transport.post(part.handle)
        self.advance(staged)  # on host memory the copy is done: scatter it while the next READ copies

    def advance(self, staged: StagedFlight) -> str:
        """Check the request's READs, scatter the segments they completed; ``ERR``, ``DONE`` (every byte in place)
        or ``PROC``."""
        for part in staged.parts:
            if not part.done:
                state = self.transport.state(part.handle)
                if state == "ERR":
                    return "ERR"
                part.done = state == "DONE"
        if staged.into == INTO_BLOCKS:
            return "DONE" if all(part.done for part in staged.parts) else "PROC"
        received, stalled = [0] * len(staged.rows), [False] * len(staged.rows)
        for part in staged.parts:  # a read's bytes are in up to its first READ not done
            stalled[part.read] = stalled[part.read] or not part.done
            if not stalled[part.read]:
                received[part.read] = part.end
        last = not any(stalled)
        if last:  # nothing left to overlap: the worker's scatters, then the rest here (no GIL hand-offs meanwhile)
            wait(staged.futures, timeout=60)
        for index, rows in enumerate(staged.rows):
            ready = received[index] // rows.segment_bytes
            if ready > staged.scattered[index]:
                span = (staged.scattered[index], ready)
                if last:
                    try:
                        staged.scatter_s += self._scatter(staged, index, span)
                    except Exception:  # fails its request (``ERR``), never the rank's poll loop or its process
                        log.exception("scattering staged read %s failed", staged.flight.request_id)
                        return "ERR"
                else:
                    staged.futures.append(self._worker.submit(self._scatter, staged, index, span))
                staged.scattered[index] = ready
        if any(f.done() and f.exception() is not None for f in staged.futures):
            return "ERR"
        complete = staged.scattered == [rows.segments for rows in staged.rows]
        return "DONE" if complete and all(f.done() for f in staged.futures) else "PROC"

    def _scatter(self, staged: StagedFlight, index: int, segments: tuple[int, int]) -> float:
        started = time.perf_counter()
        if staged.extent is not None:
            region = self.pool.region(staged.extent, staged.starts[index] + staged.leads[index])
            scatter(self.cache.tensors, staged.rows[index], region, segments)
        return time.perf_counter() - started

    def finish(self, staged: StagedFlight) -> float:
        """Every byte is in place: give the extent back (the READs are released by the caller); the scatter's
        microseconds."""
        self.pool.release(staged.flight.request_id)
        return (staged.scatter_s + sum(f.result() for f in staged.futures)) * 1e6

    def cancel(self, staged: StagedFlight) -> None:
        """Stop a staged request: wait for its scatters, release its READs; its extent goes back once NIXL has
        released every READ into it."""
        wait(staged.futures, timeout=30)
        stuck = [part.handle for part in staged.parts if not self.transport.release(part.handle)]
        staged.flight.handles.clear()
        if stuck:
            self.quarantine.append((stuck, staged.flight.request_id))
        else:
            self.pool.release(staged.flight.request_id)

    def poll(self) -> None:
        """Retry releasing READs NIXL kept; free their extents once it let go of all."""
        kept = []
        for handles, owner in self.quarantine:
            left = [h for h in handles if not self.transport.release(h)]
            if left:
                kept.append((left, owner))
            else:
                self.pool.release(owner)
        self.quarantine = kept

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self.transport.release_dlist(self._local)
        for found in (found for found in self._segments.values() if found is not None):
            self.transport.release_dlist(found[0])
        self._segments.clear()


def _strided(meta: RankMetadata, size: int) -> np.ndarray:
    """A prefill rank's staging buffer as one strided row of ``size``-byte entries."""
    count = (meta.staging_bytes or 0) // size
    return np.array([[meta.staging_base or 0, size, meta.device_id, size, count]], dtype=np.int64)
