"""The connector's worker half: one TP rank's vLLM KV cache on kvbridge's rank machinery.

vLLM's KV tensors are attached as they are (no copy): off vLLM's CPU build as the strided views of one allocation
that vLLM's resolved ``KVCacheLayout`` describes (``transfer.allocations``, docs/protocol.md §1b), on it per layer
as its CPU attention keeps them. A prefill rank is a ``transfer.prefill_rank.PrefillRank``, a decode rank a
``transfer.decode_rank.DecodeRank``: the classes the synthetic worker runs. Decode handshakes with a prefill
engine the first time it meets it (and again after it restarted: a new incarnation evicts the stale peer),
builds the plan once per engine, and READs each request's blocks; a READ it cannot start, a failed or late one,
or one past the prefill's lease marks the request's blocks invalid, which vLLM handles by its
``kv_load_failure_policy`` (recompute, or fail the request): never by using stale KV.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any

from kvbridge_agent.core import KVLayout, ModelGeometry, Role, SpecError, Verification
from kvbridge_agent.core import tracing as words
from kvbridge_agent.core.digest import RequestDigests, decode_verifies, to_bytes
from kvbridge_agent.core.handshake import HandshakeError, KVTransferParams
from kvbridge_agent.core.plan import build_plan
from kvbridge_agent.core.tp import handshake_ranks
from kvbridge_agent.transfer.background import background_executor
from kvbridge_agent.transfer.decode_rank import DecodeRank
from kvbridge_agent.transfer.digest import Digester
from kvbridge_agent.transfer.host_buffer import HostBuffer
from kvbridge_agent.transfer.keys import CurveKeys, load_keys
from kvbridge_agent.transfer.kv_cache import KVCache, distinct_tensors
from kvbridge_agent.transfer.peers import (
    LEASE_EXPIRED,
    PrefillRanks,
    PrefillService,
    fetch_digests,
    fetch_prefill_ranks,
    lease_left,
    require_address,
    require_incarnation,
)
from kvbridge_agent.transfer.prefill_rank import PrefillRank
from kvbridge_agent.transfer.reads import TRANSFER_FAILED, ReadResult
from kvbridge_agent.transfer.relayout import Converter, convert_for_side
from kvbridge_agent.transfer.transport import Transport

from .cache_geometry import (
    check_block_interior,
    cpu_kernel,
    group_slots,
    physical_order,
    refuse_conversions,
    transfer_geometry,
)
from .cpu_blocks import CPUAttentionBlocks
from .failures import HANDSHAKE_BUSY, MAX_HANDSHAKES, request_failure
from .messages import RankHandshake, ReadOrder, StepMetadata
from .settings import ConnectorSettings
from .stage_relay import StageServer
from .staging import ConnectorStager, abandon_expired, decode_rank, prefill_rank
from .stats import KVBridgeStats
from .tracing import Spans, Value
from .verifying import DecodeChecks, PrefillDigests

log = logging.getLogger(f"vllm.kvbridge.{__name__.rsplit('.', 1)[-1]}")  # shown by vLLM's log handler


class ConnectorWorker:
    def __init__(self, settings: ConnectorSettings, tp_rank: int, incarnation: str) -> None:
        self.settings = settings
        self.tp_rank = tp_rank
        self.incarnation = incarnation
        environment = settings.environment
        self.keys: CurveKeys | None = load_keys(environment.keys_dir) if environment.keys_dir else None
        self.prefill: PrefillRank | None = None
        self.decode: DecodeRank | None = None
        self._stage_server: StageServer | None = None  # prefill with a staging buffer: its stage requests (staging.py)
        self.stager = ConnectorStager(self.keys, settings.transfer.handshake_timeout_seconds)  # decode
        self._handshake: RankHandshake | None = None
        self.geometry: ModelGeometry = settings.model
        #: the model as the cache holds it: one cache group's layers deep on the CPU build with several groups
        self.native: ModelGeometry = settings.model
        self.kernel = "n/a"
        self.stats = KVBridgeStats()
        # prefill
        self._leases: dict[str, float] = {}
        self._held_blocks: dict[str, int] = {}  # offered request -> its blocks here (until its blocks are freed)
        self._reported_held: tuple[int, int] | None = None
        self._done_sending: set[str] = set()
        self._finished_seen: set[str] = set()
        #: whether an offer re-lays prefill's own blocks (a split for the wire on vLLM's CPU build), so that it
        #: waits for the request's digest, which reads them as computed; otherwise the digest runs beside the steps
        self._offer_waits_for_digest = False
        # decode
        self._results: list[ReadResult] = []
        self._executor = background_executor(MAX_HANDSHAKES, "kvbridge-handshake", "kvbridge-hshake")
        #: handshakes in flight, by (prefill engine, incarnation): the fetch, when it started and the side channel
        self._fetching: dict[tuple[str, str], tuple[Future[PrefillRanks], float, tuple[str, int]]] = {}
        #: the deployment's prefill pods (KVBRIDGE_PREFILL_SERVICE): the only side channels this rank connects to
        self._service = PrefillService(environment.prefill_service, settings.transfer.handshake_timeout_seconds)
        #: where each prefill engine's current incarnation was met (host, port): its side channel does not move
        self._addresses: dict[str, tuple[str, int]] = {}
        self._parked: dict[tuple[str, str], list[tuple[str, ReadOrder]]] = {}
        self._load_errors: set[int] = set()
        #: reads in flight -> the lease end they must finish before, and the local blocks they fill
        self._expiry: dict[str, tuple[float, list[int]]] = {}
        # verification, off vLLM's thread (verifying.py): prefill's digests, decode's checks
        verifies = settings.transfer.verification is not Verification.OFF
        self._digesting = PrefillDigests(incarnation if verifies and settings.role is Role.PREFILL else None)
        self._checks = DecodeChecks(self._fetch_digests)
        # traces (tracing.py): each traced request's context, when its offer or read began, and its attributes
        self.spans = Spans()
        self._traced: dict[str, tuple[dict[str, str], int, dict[str, Value]]] = {}
        self._fetch_started_ns: dict[tuple[str, str], int] = {}
        self._expired: set[str] = set()

    # -- registration --------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any], layout: str | None = None) -> None:
        """Attach vLLM's KV tensors and register them with NIXL. ``layout`` is the ``KVCacheLayout`` vLLM resolved
        for the cache (its name): the views are then read by their strides (one registration per allocation);
        without it (vLLM's CPU build) the tensors are taken per layer slot (:meth:`_cpu_cache`)."""
        settings, environment = self.settings, self.settings.environment
        convert: Converter = convert_for_side
        engine: KVCache | None = None  # the engine's own cache, when NIXL moves a host mirror of it
        if layout is not None:
            cache = KVCache.attach_views(
                settings.model,
                settings.block_size,
                settings.tp_size,
                self.tp_rank,
                kv_caches,
                physical_order(layout),
                settings.group_layers,
            )
            if settings.host_buffer:
                buffer = HostBuffer(cache)
                engine, cache, convert = cache, buffer.mirror, buffer
        else:
            cache, convert = self._cpu_cache(kv_caches)
        transport = Transport(
            f"{environment.engine_id}-{self.incarnation}-{self.tp_rank}", environment.transfer.backends
        )
        transport.register(cache.tensors)
        rank: PrefillRank | DecodeRank
        if settings.role is Role.PREFILL:
            plan = build_plan(self.geometry, environment.prefill, environment.decode, settings.transfer)
            refuse_conversions(self.geometry, self.native, plan, self.kernel)
            rank, self._stage_server = prefill_rank(
                cache, transport, plan, environment.engine_id, self.incarnation, convert
            )
            self.prefill = rank
            # a host buffer converts into its mirror, a physical layout is never re-laid: the engine's blocks stay
            self._offer_waits_for_digest = bool(plan.wire.steps(Role.PREFILL)) and engine is None and not layout
            metadata = self.prefill.metadata().model_copy(update={"block_interior": self.block_interior})
            self._handshake = RankHandshake(metadata.model_dump_json(exclude_none=True), transport.metadata())
        else:
            self.decode = rank = decode_rank(
                cache, transport, environment.decode, settings.transfer, convert, self.stager
            )
        if isinstance(convert, CPUAttentionBlocks):  # the digest reads keys back to token-major, real heads
            owned = list(range(self.tp_rank * convert.heads, (self.tp_rank + 1) * convert.heads))
            rank.digester = Digester(cache, convert.logical, owned, keys_across=convert.keys_across)
        elif engine is not None:  # the digest reads the engine's cache, on either side of the host copies
            rank.digester = Digester(engine)
        elif settings.transfer.verification is not Verification.OFF:  # now: no verified request waits for numba
            rank.digester = Digester(cache)
        described = f"a {layout} layout" if layout is not None else f"{len(cache.tensors)} KV tensor(s)"
        described += f" of {settings.groups.count} KV cache groups" if settings.groups is not None else ""
        described += " through a host buffer" if engine is not None else ""
        role = settings.role.value
        log.info("kvbridge: %s rank %d registered %s of %d blocks", role, self.tp_rank, described, cache.num_blocks)

    def _cpu_cache(self, kv_caches: dict[str, Any]) -> tuple[KVCache, Converter]:
        """vLLM's CPU build: one tensor per layer slot — per layer with one KV cache group, and with several (its
        hybrid allocator) the slots the groups overlay, group ``g``'s blocks in the first ``len(group)`` of them
        (``group_slots``), so the cache is one group's layers deep; each block's interior is the CPU attention
        kernel's (``CPUAttentionBlocks``)."""
        settings = self.settings
        convert: Converter = convert_for_side
        if settings.group_layers is not None:
            tensors = group_slots(kv_caches, settings.group_layers, settings.model.num_layers)
            self.native = settings.model.model_copy(update={"num_layers": len(tensors)})
        else:
            tensors = distinct_tensors(list(kv_caches.values()))  # vLLM gives them in layer order
        self.geometry = transfer_geometry(self.native, tensors, settings.tp_size)
        if self.geometry != self.native:  # vLLM's CPU attention: its own block interior
            self.kernel = cpu_kernel(
                settings.model_dtype if settings.model_dtype is not None else tensors[0].dtype,
                settings.block_size,
                settings.model.head_dim,
                settings.kv_cache_dtype,
            )
            heads = settings.model.num_kv_heads // settings.tp_size
            convert = CPUAttentionBlocks(heads, settings.model.head_dim, tensors[0].element_size(), self.kernel)
        blocks = int(tensors[0].shape[0])
        cache = KVCache.attach(
            self.geometry, settings.block_size, KVLayout.HND, settings.tp_size, self.tp_rank, blocks, tensors
        )
        return cache, convert

    @property
    def block_interior(self) -> str:
        """What the handshake says of this cache's block interior: vLLM's CPU attention kernel, which decides it
        (``vec`` and ``amx`` builds of one layout are not interchangeable); empty for other caches."""
        return f"vllm-cpu-attention/{self.kernel}" if self.geometry != self.native else ""

    def get_handshake_metadata(self) -> RankHandshake | None:
        return self._handshake

    # -- each step -----------------------------------------------------------------------
    def wait_for_save(self, meta: StepMetadata) -> None:
        """Prefill, after the step's forward: start digesting the requests whose prompt this step completed, in
        their native format (before any conversion), on the digest thread; each is reported with the output of
        the step in which it is done (:meth:`_report_digests`)."""
        if self.prefill is None:
            return
        for request_id, order in meta.to_digest.items():
            self._digesting.start(self.prefill, request_id, order)

    def _report_digests(self) -> None:
        """Prefill: the digests done since the last step, with this step's output (the scheduler publishes them)."""
        for done in self._digesting.take():
            attributes: dict[str, Value] = {words.TOKENS: done.order.num_tokens}
            if done.order.trace:
                tp = {words.TP_RANK: self.tp_rank}
                error = "" if done.digests is not None else "DIGEST_FAILED"
                self.spans.record(
                    words.PREFILL_DIGEST, done.order.trace, done.began_ns, done.ended_ns, {**tp, **attributes}, error
                )
            if done.digests is not None:
                self.stats.record_digests(done.request_id, *to_bytes(done.digests))

    def start_load_kv(self, meta: StepMetadata) -> None:
        if self.prefill is not None:
            for request_id, order in meta.to_offer.items():
                began = time.time_ns()
                # blocks converted in place only after their digest; else the offer does not wait for it
                waited = self._digesting.wait(request_id) if self._offer_waits_for_digest else 0.0
                if order.digest_tokens:  # not digested after its prompt's step: digested here, on vLLM's thread
                    started = time.perf_counter()
                    digests = self.prefill.offer(
                        request_id, order.block_ids, order.digest_tokens, order.digest_key, order.block_layers
                    )
                    waited += time.perf_counter() - started
                else:
                    digests = self.prefill.offer(request_id, order.block_ids)
                if waited > 0:
                    self.stats.record_digest_wait(waited)
                if order.trace:
                    held: dict[str, Value] = {
                        words.BLOCKS: len(order.block_ids),
                        words.LEASE_SECONDS: round(order.expires_at - time.time()),
                    }
                    self._traced[request_id] = (order.trace, began, held)
                    if order.digest_tokens:
                        self._span(words.PREFILL_DIGEST, order.trace, began, {words.TOKENS: order.digest_tokens})
                if digests:
                    self.stats.record_digests(request_id, *to_bytes(digests))
            self._leases.update({r: t for r, t in meta.leases.items() if r in self._leases or r in meta.to_offer})
            for request_id, order in meta.to_offer.items():
                self._leases[request_id] = max(order.expires_at, meta.leases.get(request_id, 0.0))
                self._held_blocks[request_id] = len(order.block_ids)
        if self.decode is not None:
            for request_id, read in meta.to_read.items():
                self._start_or_fail(self.decode, request_id, read)
            if meta.to_read and self.decode.in_flight:
                self._start_checks(self.decode)

    def _start_checks(self, decode: DecodeRank) -> None:
        """Decode: the reads that ended start their checks (the rest wait in ``_results`` for get_finished). Also
        right after posting a step's READs: on host memory UCX may copy inside the post, and the check starts there
        (beside the forward where vLLM starts loads before it; this vLLM starts asynchronous ones after it)."""
        started = [self._checks.start(decode, result) for result in [*self._results, *decode.poll()]]
        self._results = [result for result in started if result is not None]

    def _start_or_fail(self, decode: DecodeRank, request_id: str, order: ReadOrder) -> None:
        """Start one request's READs; anything unforeseen it raises fails that request alone, typed and logged."""
        try:
            result = self._start_read(decode, request_id, order)
        except Exception as exc:  # a request's input never ends vLLM's step (vLLM treats a raise here as fatal)
            code, message = request_failure(exc, TRANSFER_FAILED, request_id)
            result = ReadResult(request_id, False, code, message, list(order.local_block_ids))
        if result is not None:
            self._results.append(result)

    def _start_read(self, decode: DecodeRank, request_id: str, order: ReadOrder) -> ReadResult | None:
        """Post the request's READs; or park it until its prefill engine's handshake is done (that runs on a
        thread: a handshake never holds up vLLM's forward step); or fail it at once."""
        params = order.params
        if order.trace:  # from when it is posted (again after a handshake it waited for)
            engine = {words.REMOTE_ENGINE: params.remote_engine_id} if params is not None else {}
            self._traced[request_id] = (
                order.trace,
                time.time_ns(),
                {words.BLOCKS: len(order.local_block_ids), **engine},
            )
        if order.refused or params is None:
            code, _, message = (order.refused or "INVALID_TRANSFER_PARAMS: no parameters").partition(": ")
            return ReadResult(request_id, False, code, message, list(order.local_block_ids))
        expires_at = order.expires_at if order.expires_at is not None else params.expires_at
        if lease_left(expires_at) <= 0:
            return ReadResult(
                request_id, False, LEASE_EXPIRED, "prefill's lease on the blocks has ended", list(order.local_block_ids)
            )
        peer = decode.peers.get(params.remote_engine_id)
        if peer is not None and peer.incarnation == params.remote_incarnation:
            try:  # parameters crossed with another DP rank's side channel: refused before anything is read
                require_address(params, self._addresses.get(params.remote_engine_id))
            except HandshakeError as exc:
                return ReadResult(request_id, False, exc.code, exc.message, list(order.local_block_ids))
        if peer is None or peer.incarnation != params.remote_incarnation:
            key = (params.remote_engine_id, params.remote_incarnation)
            if key not in self._fetching:
                if len(self._fetching) >= MAX_HANDSHAKES:  # never queued behind side channels that do not answer
                    busy = f"{MAX_HANDSHAKES} handshakes with other prefill engines are in flight; prefill it again"
                    return ReadResult(request_id, False, HANDSHAKE_BUSY, busy, list(order.local_block_ids))
                address = (params.remote_host, params.remote_port)
                self._fetching[key] = (self._executor.submit(self._fetch, params), time.perf_counter(), address)
                self._fetch_started_ns[key] = time.time_ns()
            self._parked.setdefault(key, []).append((request_id, order))
        if expires_at is not None:
            self._expiry[request_id] = (expires_at, list(order.local_block_ids))
        if peer is None or peer.incarnation != params.remote_incarnation:
            return None
        # prefill's draw (the parameters' verify), or decode's own policy when it is All; prefill's digests are
        # fetched while the READs run
        if decode_verifies(self.settings.transfer, params.verify):
            self._checks.expect(request_id, order, params, expires_at)
        return decode.start(
            request_id,
            params,
            order.local_block_ids,
            self.settings.environment.transfer_timeout_seconds,
            group_sizes=order.local_group_sizes,
        )

    def _fetch_digests(self, params: KVTransferParams, until: float | None) -> RequestDigests:
        """On a digest thread: prefill's digests of the request, until its lease ends."""
        until = until if until is not None else time.time() + self.settings.transfer.lease_seconds
        timeout = self.settings.transfer.handshake_timeout_seconds
        return fetch_digests(params, self.settings.fingerprint, self.keys, timeout, until, self._service)

    def _fetch(self, params: KVTransferParams) -> PrefillRanks:
        """On the handshake thread: the prefill ranks' metadata this rank reads from (network only: the prefill
        Service's DNS too, before any connection; a host outside it fails the requests, REMOTE_HOST_NOT_ALLOWED)."""
        needed = handshake_ranks(params.remote_tp_size, self.settings.tp_size, self.tp_rank)
        timeout = self.settings.transfer.handshake_timeout_seconds
        incarnation, ranks = fetch_prefill_ranks(
            params, needed, self.settings.fingerprint, self.keys, timeout, self._service
        )
        require_incarnation(params, incarnation)
        self.stager.admit(params, self._service.address(params.remote_host))  # looked up by the fetch just now
        return ranks

    def _finish_handshakes(self, decode: DecodeRank) -> None:
        """Adopt every finished handshake (NIXL calls stay on vLLM's thread), then post or fail what waited."""
        for key, (future, started, address) in list(self._fetching.items()):
            if not future.done():
                continue
            del self._fetching[key]
            engine_id, incarnation = key
            waiting = self._parked.pop(key, [])
            began = self._fetch_started_ns.pop(key, time.time_ns())
            try:
                ranks = future.result()
                check_block_interior(self.block_interior, engine_id, ranks)
                stale = decode.peers.get(engine_id)
                # add_peer evicts a stale incarnation first (the prefill engine restarted)
                peer = decode.add_peer(engine_id, incarnation, ranks)
                if stale is not None and stale.incarnation != incarnation:
                    self.stats.record_eviction()
                try:
                    refuse_conversions(self.geometry, self.native, peer.plan, self.kernel)
                except SpecError as exc:
                    decode.evict_peer(engine_id)
                    raise HandshakeError(exc.message, code=exc.code) from exc
                self._addresses[engine_id] = address
            except Exception as exc:  # whatever the peer or the parameters brought fails these requests, not vLLM
                code, message = request_failure(exc, "HANDSHAKE_FAILED", engine_id)
                self._results += [ReadResult(r, False, code, message, list(o.local_block_ids)) for r, o in waiting]
                for _, order in waiting:
                    self._span(words.DECODE_HANDSHAKE, order.trace, began, {words.REMOTE_ENGINE: engine_id}, code)
                continue
            self.stats.record_handshake(time.perf_counter() - started)
            for _, order in waiting:
                self._span(words.DECODE_HANDSHAKE, order.trace, began, {words.REMOTE_ENGINE: engine_id})
            for request_id, order in waiting:
                self._start_or_fail(decode, request_id, order)

    def _report_held(self) -> None:
        """Requests whose KV this prefill rank holds for readers, and their bytes (the model's KV per token over
        the rank's blocks, counted once for the engine): recorded when they change, for the gauges autoscalers
        and the pod's preStop drain read."""
        waiting = [r for r in self._leases if r not in self._done_sending]
        tokens = sum(self._held_blocks.get(r, 0) for r in waiting) * self.settings.environment.prefill.block_size
        held = (len(waiting), tokens * self.settings.model.kv_bytes_per_token)
        if held != self._reported_held:
            self._reported_held = held
            self.stats.record_held(self.tp_rank, *held)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose blocks prefill may free, requests whose KV decode has received)."""
        rank = self.prefill or self.decode
        if rank is not None and rank.digester is not None:  # the digests of the last step (decode's: checks)
            self.stats.record_digest_seconds(rank.digester.take_seconds())
        if self.prefill is not None:
            # only the requests this rank holds: vLLM reports every finished request, most never offered
            self._finished_seen |= finished_req_ids & (self._leases.keys() | self._done_sending)
            self._done_sending |= set(self.prefill.poll().completed)
            now = time.time()
            for request_id, until in list(self._leases.items()):
                if request_id in self._done_sending:
                    continue
                if now > until and self.prefill.forget(request_id):
                    log.warning("kvbridge: lease of %s ended unread; its blocks are freed", request_id)
                    self.stats.record_expired_lease()
                    self._done_sending.add(request_id)
                    self._expired.add(request_id)
            # vLLM wants ids it reported finished; a block is freed only once its digest (if one runs) has read it
            ready = {r for r in self._done_sending & self._finished_seen if not self._digesting.running(r)}
            self._done_sending -= ready
            self._finished_seen -= ready
            for request_id in ready:
                self._leases.pop(request_id, None)
                self._held_blocks.pop(request_id, None)
                self._offer_span(request_id)
            self._report_held()
            self._report_digests()
            return ready or None, None
        if self.decode is not None:
            self._finish_handshakes(self.decode)
            self._results += abandon_expired(self.decode, self._expiry)  # before their answer is posted
            self._start_checks(self.decode)
            results, self._results = [*self._results, *self._checks.finished()], []
            if self._checks.joined_seconds > 0:
                self.stats.record_digest_wait(self._checks.joined_seconds)
            for engine_id in self._checks.take_mismatches():
                self.stats.record_digest_mismatch(engine_id)
            done = set()
            now = time.time()
            for result in results:
                done.add(result.request_id)
                lease = self._expiry.pop(result.request_id, None)
                if result.ok and lease is not None and lease_left(lease[0], now) <= 0:
                    # prefill may have freed and reused the blocks while they were read: never use them
                    message = "the read ended after prefill's lease"
                    result = ReadResult(result.request_id, False, LEASE_EXPIRED, message, lease[1])
                self._read_spans(result)
                if result.ok:
                    self.stats.record_read(result.seconds, result.bytes, result.descriptors, result.mode)
                else:
                    self.stats.record_failure(result.code)
                    self._load_errors |= set(result.invalid_blocks)
                    log.warning("kvbridge: read of %s failed: %s: %s", result.request_id, result.code, result.message)
            return None, done or None
        return None, None

    # -- traces ------------------------------------------------------------------------------
    def _span(
        self, name: str, trace: dict[str, str], began: int, attributes: dict[str, Value], error: str = ""
    ) -> None:
        """A span of this rank's, from ``began`` until now (nothing without a trace context)."""
        if trace:
            self.spans.record(name, trace, began, time.time_ns(), {words.TP_RANK: self.tp_rank, **attributes}, error)

    def _offer_span(self, request_id: str) -> None:
        """Prefill: a traced request's offer, from the step that offered it until decode read it or its lease
        ended (``LEASE_EXPIRED``)."""
        traced = self._traced.pop(request_id, None)
        expired = request_id in self._expired
        self._expired.discard(request_id)
        if traced is not None:
            trace, began, attributes = traced
            self._span(words.PREFILL_OFFER, trace, began, attributes, LEASE_EXPIRED if expired else "")

    def _read_spans(self, result: ReadResult) -> None:
        """Decode: a traced request's READs and, when verified, the digest check after them."""
        traced = self._traced.pop(result.request_id, None)
        checked = self._checks.started_ns.pop(result.request_id, None)
        if traced is not None:
            self.spans.record_read(self.tp_rank, *traced, checked, result)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._stage_server is not None:
            self._stage_server.close()
        self.spans.shutdown()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._digesting.shutdown()
        self._checks.shutdown()
        for rank in (self.prefill, self.decode):
            if rank is not None:
                if isinstance(rank, DecodeRank):
                    rank.close()
                rank.transport.close()
