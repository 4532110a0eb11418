"""A prefill rank's staging buffer (docs/protocol.md §4d): stage requests packed on request, or when offered.

A stage request names a read's *plan*; the rank computes that read's source segments and wire order from it, its own
cache and the pair's plan (``core.stage_requests.source_plan``), refusing a plan whose segments or order are not
the ones decode computed, and packs the named units of the request into an extent of its staging pool in that order
(the extent starts at a multiple of the segment's length where pieces allow it, so that decode can READ segments of
it straight into its blocks). The plans met are kept (the last :data:`MAX_PLANS`, each :data:`PLAN_SECONDS` after its
last use): when the engine offers a request the rank packs all of it for each, and a stage request for all of it
(no prefix hit on decode) finds it packed. A request's extents go back when its readers are done or its lease ends
(``PrefillRank``); a full pool answers ``busy`` and decode reads directly.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from kvbridge_agent.core import KVBridgeError, TransferPlan
from kvbridge_agent.core.blocks import IntArray
from kvbridge_agent.core.stage_requests import (
    SourcePlan,
    StagePlan,
    StageReply,
    StageRequest,
    StageState,
    source_plan,
)
from kvbridge_agent.core.staging import MIN_ROW_BYTES, STAGING_UNSUPPORTED
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.staging import Extent, RowMap, StagingPool, pack
from kvbridge_agent.transfer.transport import Transport

#: plans kept, and how long one is kept without a stage request naming it
MAX_PLANS = 8
PLAN_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class _Plan:
    source: SourcePlan
    row_bytes: int
    runs: int  # rows of the request's id grid


@dataclass(frozen=True, slots=True)
class _Packed:
    extent: Extent
    first: int
    count: int
    microseconds: float


class PrefillStaging:
    """One prefill rank's staging pool and the plans it has met."""

    def __init__(self, cache: KVCache, transport: Transport, plan: TransferPlan, total_bytes: int) -> None:
        self.cache, self.plan = cache, plan
        self.pool = StagingPool(transport, cache.tensors[0].device, total_bytes)
        self._plans: OrderedDict[str, tuple[_Plan, float]] = OrderedDict()
        self._packed: dict[tuple[str, str], _Packed] = {}  # (request, plan) -> packed at offer

    def _plan(self, plan: StagePlan, rank: int) -> tuple[str, _Plan]:
        key = plan.model_dump_json()
        found = self._plans.pop(key, None)
        if found is None:
            cache = self.cache
            source = source_plan(
                plan, rank, cache.layout, cache.num_blocks, cache.physical, cache.block_size, self.plan
            )
            row_bytes = source.segments.granularity(cache.origin)
            if row_bytes < MIN_ROW_BYTES:
                raise KVBridgeError(
                    f"this cache's segments of the plan are rows of {row_bytes} bytes", code=STAGING_UNSUPPORTED
                )
            runs = source.segments.regions // (1 if source.physical is None else source.physical.source.chunks)
            found = (_Plan(source, row_bytes, runs), 0.0)
        self._plans[key] = (found[0], time.monotonic())
        while len(self._plans) > MAX_PLANS:
            self._plans.popitem(last=False)
        return key, found[0]

    def stage(self, request_id: str, units: IntArray, request: StageRequest) -> StageReply:
        """Pack ``request``'s units of a request whose offered units are ``units`` (or find them packed)."""
        key, plan = self._plan(request.plan, request.rank)
        packed = self._packed.get((request_id, key))
        prestaged = packed is not None and (packed.first, packed.count) == (request.first, request.count)
        if not prestaged:
            packed = self._pack(request_id, plan, units, request.first, request.count)
        if packed is None:
            return StageReply(state=StageState.BUSY)
        return StageReply(
            state=StageState.READY,
            offset=packed.extent.first * self.pool.piece,
            bytes=packed.extent.bytes,
            prestaged=prestaged,
            pack_microseconds=packed.microseconds,
        )

    def _pack(self, request_id: str, plan: _Plan, units: IntArray, first: int, count: int) -> _Packed | None:
        started = time.perf_counter()
        ids = plan.source.ids(units, first, count)
        order = plan.source.order.permutation(plan.runs, ids.size // plan.runs)
        rows = RowMap.of(plan.source.segments, ids, plan.row_bytes, order, self.cache.origin, plan.runs)
        length, piece = plan.source.segments.length, self.pool.piece
        extent = self.pool.take(rows.bytes, request_id, align=length // piece if length % piece == 0 else 1)
        if extent is None:
            return None
        pack(self.cache.tensors, rows, self.pool.region(extent))
        return _Packed(extent, first, count, (time.perf_counter() - started) * 1e6)

    def prestage(self, request_id: str, units: IntArray) -> None:
        """Pack an offered request for every plan met lately, while the pool has room."""
        now = time.monotonic()
        for key, (plan, used) in list(self._plans.items()):
            if now - used > PLAN_SECONDS:
                continue
            side = plan.source.side
            count = units.size * (1 if side is None else side.unit_tokens // side.tokens)
            packed = self._pack(request_id, plan, units, 0, count)
            if packed is None:
                return
            self._packed[(request_id, key)] = packed

    def release(self, request_id: str) -> None:
        """The request's readers are done, or its lease ended: its staged bytes go back."""
        self.pool.release(request_id)
        for entry in [e for e in self._packed if e[0] == request_id]:
            del self._packed[entry]

    @property
    def held(self) -> list[str]:
        """Requests holding staged bytes."""
        return self.pool.owners
