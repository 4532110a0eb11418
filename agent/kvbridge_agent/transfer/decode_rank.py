"""The decode side of one TP rank: peers (one plan each), READs, completion, conversions.

Per remote engine, everything that depends only on the two shapes is done
once in :meth:`DecodeRank.add_peer`: the plan, remote agents, remote and
local prepped descriptor lists (``transfer.peer_lists``).  Per request only
block ids are mapped to descriptor ids (numpy) and the READs are posted —
directly between the caches, or, where the rank's cost model says so and the
peer stages, through the staging buffers (``transfer.staged_reads``): asked on
the calling thread, or, with :attr:`DecodeRank.asks`, off it and posted by a
later :meth:`DecodeRank.poll` (``transfer.stage_asks``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
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
    TransferSettings,
    build_plan,
)
from kvbridge_agent.core.blocks import DescriptorIds
from kvbridge_agent.core.digest import mismatched
from kvbridge_agent.core.handshake import (
    PEER_INCOMPATIBLE,
    WIRE_FORMAT_MISMATCH,
    HandshakeError,
    KVTransferParams,
    RankMetadata,
    notification,
)
from kvbridge_agent.transfer.digest import Digester
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.peer_lists import LocalLists, add_physical_lists, add_region_lists
from kvbridge_agent.transfer.peers import STALE_PEER
from kvbridge_agent.transfer.reads import (
    TRANSFER_FAILED,
    TRANSFER_TIMEOUT,
    UNKNOWN_PEER,
    InFlight,
    ReadResult,
    RemotePeer,
    RequestIds,
    Verify,
    digest_verdict,
    request_descriptor_ids,
    stage_first,
)
from kvbridge_agent.transfer.relayout import Converter, convert_for_side
from kvbridge_agent.transfer.stage_asks import Asking, StageAsks, Stager
from kvbridge_agent.transfer.staged_reads import DecodeStaging, StagedFlight
from kvbridge_agent.transfer.transport import Transport, TransportError

log = logging.getLogger(__name__)

#: what a staged request that failed reports
STAGED_READ_FAILED = (
    "NIXL reported a failed READ of a staging buffer, or a scatter failed (the prefill engine may be gone)"
)


class DecodeRank:
    def __init__(
        self,
        cache: KVCache,
        transport: Transport,
        settings: RoleSettings,
        transfer: TransferSettings,
        convert: Converter = convert_for_side,
        staging_bytes: int = 0,
        stager: Stager | None = None,
    ) -> None:
        """``staging_bytes``: a staging buffer of that size on the cache's device for staged reads, and the cost
        model measured on it now (0: every read is direct); ``stager`` asks a prefill rank to stage a request."""
        self.convert = convert
        self.cache = cache
        self.transport = transport
        self.settings = settings
        self.transfer = transfer
        self.peers: dict[str, RemotePeer] = {}
        self._local = LocalLists(cache, transport)
        self._in_flight: dict[str, InFlight] = {}
        self._staged: dict[str, StagedFlight] = {}
        self._zombies: list[Any] = []  # transfer handles NIXL could not cancel yet
        self._retired: list[RemotePeer] = []  # evicted peers released once no READ is left unreleased
        #: the transfer digest of this cache (core.digest): made from the cache's geometry when first needed,
        #: unless the engine sets one that reads its own block interior
        self.digester: Digester | None = None
        #: digest time of the last verified request (seconds), for the cost measurements
        self._id_buffers: tuple[DescriptorIds, DescriptorIds] = (
            np.empty(0, dtype=np.int32),
            np.empty(0, dtype=np.int32),
        )
        self.staging = DecodeStaging(cache, transport, staging_bytes, stager) if staging_bytes else None
        #: stage exchanges off the thread that starts reads (``None``: that thread asks, and waits)
        self.asks: StageAsks | None = None
        self._evicted: list[ReadResult] = []  # requests failed by an eviction, for the next poll

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
            physical = self.cache.physical is not None or first.physical_layout is not None
            segments = (add_physical_lists if physical else add_region_lists)(peer, ranks, self.cache, self._local)
            if self.staging is not None:
                self.staging.attach(peer, segments, ranks)
        except BaseException:
            self._drop(peer)
            raise
        self.peers[engine_id] = peer
        return peer

    def _drop(self, peer: RemotePeer) -> None:
        """Release a peer's lists and remote agents; while NIXL still holds a READ it would not release (a zombie,
        or a staged READ in quarantine), later: a READ must not outlive the lists and agents it names."""
        if self._zombies or (self.staging is not None and self.staging.quarantine):
            self._retired.append(peer)
            return
        self._release_peer(peer)

    def _release_peer(self, peer: RemotePeer) -> None:
        if self.staging is not None:
            self.staging.drop(peer)
        for remote, _local in peer.lists:
            self.transport.release_dlist(remote)
        for name in peer.agents.values():
            self.transport.remove_peer(name)

    def evict_peer(self, engine_id: str) -> bool:
        """Forget a prefill engine: fail its requests in flight (their results come with the next :meth:`poll`:
        an engine waiting on one must hear of it), release its lists and remote agents."""
        peer = self.peers.pop(engine_id, None)
        if peer is None:
            return False
        why = f"prefill {engine_id} was forgotten while its READs ran (it restarted, or its handshake was replaced)"
        for request_id, flight in list(self._in_flight.items()):
            if flight.params.remote_engine_id == engine_id:
                self._cancel(flight)
                del self._in_flight[request_id]
                self._evicted.append(ReadResult(request_id, False, TRANSFER_FAILED, why, list(flight.blocks)))
        for request_id, staged in list(self._staged.items()):
            if staged.flight.params.remote_engine_id == engine_id:
                del self._staged[request_id]
                self._cancel_staged(staged)
                self._evicted.append(ReadResult(request_id, False, TRANSFER_FAILED, why, list(staged.flight.blocks)))
        if self.asks is not None:
            self._evicted += self.asks.evicted(engine_id)
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
        try:
            ids = request_descriptor_ids(peer, params, local_blocks, group_sizes, self.cache.num_blocks, self._buffers)
        except (BlockMappingError, SpecError) as exc:
            return ReadResult(request_id, False, exc.code, exc.message, list(local_blocks))
        nbytes = sum(length * pair[0].size for length, pair in zip(peer.lengths, ids, strict=True)) if ids else 0
        ids_us = (time.perf_counter() - started) * 1e6
        descriptors = sum(pair[0].size for pair in ids)
        flight = InFlight(
            request_id,
            params,
            list(local_blocks),
            [],
            timeout,
            time.monotonic() + timeout,
            started,
            nbytes,
            descriptors,
            ids_us,
            make_microseconds=0.0,
            post_microseconds=0.0,
            own_microseconds=0.0,
            verify=verify,
        )
        note = notification(params.remote_request_id, self.settings.tensor_parallel_size)
        try:
            if ids and group_sizes is None and self._start_staged(flight, peer, ids, len(local_blocks), note):
                return None
        except (TransportError, KVBridgeError) as exc:
            return self._failed_start(flight, exc)
        return self._direct(flight, peer, ids, note)

    def _direct(self, flight: InFlight, peer: RemotePeer, ids: RequestIds, note: bytes) -> ReadResult | None:
        """Post a request's direct READs; its result at once on failure or a full prefix hit."""
        try:
            self._post_direct(flight, peer, ids, note)
        except (TransportError, KVBridgeError) as exc:
            return self._failed_start(flight, exc)
        if not flight.handles:
            return self._finish(flight, peer)
        self._in_flight[flight.request_id] = flight
        return None

    def _failed_start(self, flight: InFlight, exc: TransportError | KVBridgeError) -> ReadResult:
        for handle in flight.handles:
            self.transport.release(handle)
        return ReadResult(flight.request_id, False, TRANSFER_FAILED, exc.message, list(flight.blocks), peer_failed=True)

    def _post_direct(self, flight: InFlight, peer: RemotePeer, ids: RequestIds, note: bytes) -> None:
        """The READs between the caches (a full prefix hit: the notifications alone)."""
        if not ids:  # a full prefix hit: nothing to read
            self._notify(peer, {r.prefill_rank for r in peer.rank_plan.reads}, note)
        else:
            made = time.perf_counter()
            for (remote, local), (local_ids, remote_ids) in zip(peer.lists, ids, strict=True):
                flight.handles.append(self.transport.make_read(local, local_ids, remote, remote_ids, note))
            posting = time.perf_counter()
            flight.make_microseconds = (posting - made) * 1e6
            for handle in flight.handles:
                self.transport.post(handle)
            flight.post_microseconds = (time.perf_counter() - posting) * 1e6
        self._notify(peer, peer.rank_plan.notify_only_ranks, note)
        nixl = flight.make_microseconds + flight.post_microseconds
        flight.own_microseconds = (time.perf_counter() - flight.started) * 1e6 - nixl

    def _start_staged(self, flight: InFlight, peer: RemotePeer, ids: RequestIds, local_count: int, note: bytes) -> bool:
        """Stage the request where the cost model says so and both sides have room (docs/protocol.md §4d): posted
        now, or with :attr:`asks` once its exchange is answered (:meth:`poll`; nothing of it is posted meanwhile)."""
        choice = self.staging.choose(peer, ids) if self.staging is not None else None
        if self.staging is None or choice is None:
            return False
        flight.expected = self.staging.observed.expected()
        if not choice.staged:
            return False
        first = stage_first(peer, flight.params, local_count, ids[0][1].size // peer.staged[0].segments.runs)
        if self.asks is not None:
            flight.own_microseconds = (time.perf_counter() - flight.started) * 1e6
            return self.asks.submit(flight, peer, ids, first, choice, note)
        staged = self.staging.start(flight, peer, ids, first, choice)
        return staged is not None and self._adopt(staged, peer, note, flight.started)

    def _adopt(self, staged: StagedFlight, peer: RemotePeer, note: bytes, began: float) -> bool:
        """A staged request whose READs are posted: in flight, the ranks it reads nothing from notified; this
        thread's time on it since ``began`` counted, NIXL's posts aside."""
        flight = staged.flight
        if self.staging is not None:
            flight.expected = self.staging.observed.expected(staged.into)
        flight.own_microseconds += (time.perf_counter() - began) * 1e6 - flight.post_microseconds
        self._staged[flight.request_id] = staged
        self._notify(peer, peer.rank_plan.notify_only_ranks, note)
        return True

    def _answered(self, staging: DecodeStaging, asking: Asking) -> ReadResult | None:
        """A request whose stage exchange is answered (this thread owns NIXL): its staged READs posted, or, where it
        cannot be staged, its direct ones."""
        began = time.perf_counter()
        try:
            staged = staging.post(asking.staged, asking.peer, asking.ids, asking.outcome())
            if staged is not None:
                self._adopt(staged, asking.peer, asking.note, began)
                return None
        except (TransportError, KVBridgeError) as exc:
            return self._failed_start(asking.flight, exc)
        return self._direct(asking.flight, asking.peer, asking.ids, asking.note)

    def _notify(self, peer: RemotePeer, ranks: Any, note: bytes) -> None:
        for p in ranks:
            self.transport.notify(peer.agents[p], note)

    def _buffers(self, count: int) -> tuple[DescriptorIds, DescriptorIds]:
        if self._id_buffers[0].size < count:
            self._id_buffers = (np.empty(count, dtype=np.int32), np.empty(count, dtype=np.int32))
        return self._id_buffers

    @property
    def in_flight(self) -> int:
        return len(self._in_flight) + len(self._staged) + (len(self.asks.requests) if self.asks is not None else 0)

    def poll(self) -> list[ReadResult]:
        """Drive progress; results of requests that completed, failed or timed out."""
        results, self._evicted = self._evicted, []
        # progress the worker even with no READ in flight: notifications sent without a READ
        # (full prefix hits, notify-only ranks, first contact) complete only while we poll
        for sender, messages in self.transport.notifications().items():
            log.warning("ignoring %d unexpected notification(s) from %s", len(messages), sender)
        self._zombies = [h for h in self._zombies if not self.transport.release(h)]
        if self.staging is not None:
            self.staging.poll()
        retired, self._retired = self._retired, []
        for gone in retired:
            self._drop(gone)
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
                self._release(flight)
                results.append(self._finish(flight, peer))
            elif now > flight.deadline:
                results.append(self._fail(flight, TRANSFER_TIMEOUT, f"READs not complete after {flight.timeout:g} s"))
        if self.staging is not None:
            results.extend(self._poll_staged(now))
        results.extend(self._poll_asks(now))
        return results

    def _poll_asks(self, now: float) -> list[ReadResult]:
        """Requests that failed while asking (past their deadline), and those answered, posted now."""
        if self.asks is None:
            return []
        failed, answered = self.asks.poll(now)
        return failed + [r for a in answered if (r := self._answered(self.asks.staging, a)) is not None]

    def _release(self, flight: InFlight) -> None:
        """Release a request's completed READs, counting what NIXL posted (docs/protocol.md §4c)."""
        posted = [self.transport.posted(handle) for handle in flight.handles]
        if None not in posted:  # runs adjacent in both caches merged by NIXL
            flight.posted = sum(p for p in posted if p is not None)
        for handle in flight.handles:
            self.transport.release(handle)
        flight.handles.clear()

    def _poll_staged(self, now: float) -> list[ReadResult]:
        results: list[ReadResult] = []
        staging = self.staging
        for request_id, staged in list(self._staged.items()):
            if staging is None:
                break
            flight = staged.flight
            peer = self.peers.get(flight.params.remote_engine_id)
            state = staging.advance(staged) if peer is not None else "ERR"
            if state == "PROC" and now <= flight.deadline:
                continue
            del self._staged[request_id]
            if state != "DONE" or peer is None:
                self._cancel_staged(staged)
                why = STAGED_READ_FAILED if state == "ERR" else f"READs not complete after {flight.timeout:g} s"
                code = TRANSFER_FAILED if state == "ERR" else TRANSFER_TIMEOUT
                results.append(ReadResult(request_id, False, code, why, flight.blocks, peer_failed=True))
                continue
            self._release(flight)
            scattered = staging.finish(staged)
            note = notification(flight.params.remote_request_id, self.settings.tensor_parallel_size)
            try:  # prefill frees the blocks and staged bytes: the READs of its staging buffer carried no notification
                self._notify(peer, {read.segments.prefill_rank for read in peer.staged}, note)
            except TransportError as exc:
                results.append(
                    ReadResult(request_id, False, TRANSFER_FAILED, exc.message, flight.blocks, peer_failed=True)
                )
                continue
            result = self._finish(flight, peer)
            results.append(
                replace(
                    result,
                    mode="staged",
                    into=staged.into,
                    stage_microseconds=staged.stage_us,
                    pack_microseconds=staged.pack_us,
                    scatter_microseconds=scattered,
                    prestaged=staged.prestaged,
                )
            )
        return results

    def _cancel_staged(self, staged: StagedFlight) -> None:
        if self.staging is not None:
            self.staging.cancel(staged)

    def _finish(self, flight: InFlight, peer: RemotePeer) -> ReadResult:
        read = time.perf_counter()
        if self.staging is not None and flight.expected is not None:  # a read the cost model weighed corrects it
            self.staging.observed.observe(*flight.expected, read - flight.started)
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
        wrong = mismatched(verify.expected.heads, digester.heads, got)
        return digest_verdict(result, verify, sorted(wrong), self.cache.block_size // wire, peer.engine_id)

    def _fail(self, flight: InFlight, code: str, message: str) -> ReadResult:
        """Stop tracking a request, cancel its READs; its local blocks are invalid, its peer suspect."""
        del self._in_flight[flight.request_id]
        self._cancel(flight)
        return ReadResult(flight.request_id, False, code, message, flight.blocks, peer_failed=True)

    def _cancel(self, flight: InFlight) -> None:
        for handle in flight.handles:
            if not self.transport.release(handle):
                self._zombies.append(handle)

    def close(self) -> None:
        if self.asks is not None:
            self.asks.close()
        for engine_id in list(self.peers):
            self.evict_peer(engine_id)
        self._local.close()
        for handle in self._zombies:
            self.transport.release(handle)
        self._zombies.clear()
        retired, self._retired = self._retired, []
        for gone in retired:  # every READ released above: nothing names their lists and agents any more
            self._release_peer(gone)
        if self.staging is not None:
            self.staging.close()
