"""The prefill side of one TP rank: offer requests in the wire format, stage them for readers that ask
(docs/protocol.md §4d), count notifications."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np

from kvbridge_agent.core import KVBridgeError, Role, TransferPlan
from kvbridge_agent.core.blocks import IntArray
from kvbridge_agent.core.digest import HeadDigests
from kvbridge_agent.core.handshake import RankMetadata, parse_notification
from kvbridge_agent.core.stage_requests import (
    STAGE_NOT_OFFERED,
    STAGE_PLAN_INVALID,
    STAGING_OFF,
    StageReply,
    StageRequest,
    offered_units,
)
from kvbridge_agent.transfer.digest import Digester
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.prefill_staging import PrefillStaging
from kvbridge_agent.transfer.relayout import Converter, convert_for_side
from kvbridge_agent.transfer.transport import Transport

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    received: int = 0
    expected: int | None = None
    #: the units offered (wire blocks, unclipped): what a stage request's range counts over
    units: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass
class PrefillEvents:
    """What one poll observed."""

    completed: list[str] = field(default_factory=list)
    unknown: int = 0  # notifications for requests this rank does not hold
    malformed: int = 0  # notifications that are not "<request id>:<decode tp>"


class PrefillRank:
    """Holds offered requests until every expected reader has notified this rank.

    Thread-safe where an engine calls it from two threads (vLLM's connector: its step thread offers, polls and
    forgets, a relay thread stages): what the requests hold and the staging buffer change under one lock. A stage
    request waits for an offer's bookkeeping and pack (not its digest or conversion), an offer for a pack in
    progress."""

    def __init__(
        self,
        cache: KVCache,
        transport: Transport,
        plan: TransferPlan,
        engine_id: str,
        incarnation: str,
        convert: Converter = convert_for_side,
        staging_bytes: int = 0,
    ) -> None:
        """``staging_bytes``: a staging buffer of that size on the cache's device, registered, for staged reads
        (0: none; decode then reads this rank directly)."""
        self.convert = convert
        self.cache = cache
        self.transport = transport
        self.plan = plan
        self.engine_id = engine_id
        self.incarnation = incarnation
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.RLock()
        #: the transfer digest of this cache (core.digest): made from the cache's geometry when first needed,
        #: unless the engine sets one that reads its own block interior
        self.digester: Digester | None = None
        self.staging = PrefillStaging(cache, transport, plan, staging_bytes) if staging_bytes else None

    def metadata(self) -> RankMetadata:
        cache, staging = self.cache, self.staging
        return RankMetadata(
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            agent_name=self.transport.name,
            tp_rank=cache.tp_rank,
            tp_size=cache.tp_size,
            block_size=cache.block_size,
            kv_layout=cache.kv_layout,
            cache_kind=cache.model.cache_kind,
            num_blocks=cache.num_blocks,
            tensor_bases=cache.bases,
            region_block_bytes=cache.layout.unit_bytes,
            wire_block_size=self.plan.wire.block_size,
            wire_layout=self.plan.wire.layout,
            memory_type=cache.memory_type,
            device_id=cache.device_id,
            physical_layout=cache.physical,
            staging_base=staging.pool.base if staging else None,
            staging_bytes=staging.pool.bytes if staging else None,
            staging_piece=staging.pool.piece if staging else None,
        )

    def offer(
        self,
        request_id: str,
        block_ids: list[int],
        digest_tokens: int = 0,
        digest_key: bytes = b"",
        block_layers: list[int] | None = None,
    ) -> HeadDigests:
        """Convert the request's computed blocks to the wire format and wait for its readers. With
        ``digest_tokens`` (the request's token count) and ``digest_key`` (the request's, drawn where it was decided
        to verify it) the content is digested first, as computed (core.digest): returned, per global head this rank
        holds, for decode to verify what it read (``block_layers``: :meth:`digest`)."""
        digests = self.digest(digest_key, block_ids, digest_tokens, block_layers) if digest_tokens else {}
        self.convert(self.cache, self.plan, Role.PREFILL, block_ids)
        units = offered_units(block_ids, self.plan.split_ratio)
        with self._lock:
            self._pending[request_id] = _Pending(units=units)
            if self.staging is not None:  # packed now for the plans met: decode's stage request finds it packed
                self.staging.prestage(request_id, units)
        return digests

    def stage(self, request_id: str, request: StageRequest) -> StageReply:
        """Pack a request this rank holds for one read of a decode rank (docs/protocol.md §4d); a refusal is a
        typed :class:`KVBridgeError`, a full staging buffer a ``busy`` reply."""
        if self.staging is None:
            raise KVBridgeError("this prefill rank has no staging buffer", field="stage", code=STAGING_OFF)
        with self._lock:
            return self._stage(self.staging, request_id, request)

    def _stage(self, staging: PrefillStaging, request_id: str, request: StageRequest) -> StageReply:
        pending = self._pending.get(request_id)
        if pending is None:
            raise KVBridgeError(
                f"request {request_id[:80]!r} is not held here (never offered, read, or its lease ended)",
                field="stage.requestId",
                code=STAGE_NOT_OFFERED,
            )
        if request.rank != self.cache.tp_rank:
            raise KVBridgeError(
                f"a stage request for rank {request.rank} reached rank {self.cache.tp_rank}",
                field="stage.rank",
                code=STAGE_PLAN_INVALID,
            )
        return staging.stage(request_id, pending.units, request)

    def digest(
        self, key: bytes, block_ids: list[int], num_tokens: int, block_layers: list[int] | None = None
    ) -> HeadDigests:
        """The digests under ``key`` of a request's blocks in this rank's native format (before any conversion);
        ``block_layers``: per block, the layers holding its KV (a padded cache group's, core.cache_groups)."""
        digester = self.digester = self.digester or Digester(self.cache)
        rows = digester.request(key, block_ids, num_tokens, self.plan.wire.block_size, block_layers)
        return dict(zip(digester.heads, rows, strict=True))

    def forget(self, request_id: str) -> bool:
        """Stop waiting for a request (its lease expired); late notifications count as unknown. Its staged bytes
        go back."""
        with self._lock:
            if self.staging is not None:
                self.staging.release(request_id)
            return self._pending.pop(request_id, None) is not None

    @property
    def pending(self) -> list[str]:
        with self._lock:
            return list(self._pending)

    def poll(self) -> PrefillEvents:
        """Drive NIXL progress and count notifications."""
        events = PrefillEvents()
        for _peer, messages in self.transport.notifications().items():
            with self._lock:
                self._count(messages, events)
        return events

    def _count(self, messages: list[bytes], events: PrefillEvents) -> None:
        """Notifications of one reader: a request every expected reader notified is done, its staged bytes go
        back."""
        for message in messages:
            parsed = parse_notification(message)
            if parsed is None:
                events.malformed += 1
                log.warning("ignoring malformed notification %r", message[:80])
                continue
            request_id, decode_tp = parsed
            pending = self._pending.get(request_id)
            if pending is None:
                events.unknown += 1
                log.warning("ignoring notification for unknown request %r", request_id)
                continue
            if pending.expected is None:
                pending.expected = max(1, decode_tp // self.cache.tp_size)
            pending.received += 1
            if pending.received >= pending.expected:
                del self._pending[request_id]
                if self.staging is not None:
                    self.staging.release(request_id)
                events.completed.append(request_id)
