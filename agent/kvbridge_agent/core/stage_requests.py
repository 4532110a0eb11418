"""The side channel's ``stage`` message (docs/protocol.md §4d), and what prefill derives from one.

Decode asks one prefill rank to pack a request's segments for one of its reads: the request (prefill's id and its
lease token, as heartbeats and digest requests name it), the rank, the read's *plan* — what prefill needs to
compute the read's source segments exactly as decode did (decode's physical layout and the shared heads, or the
byte range of a cache kind's region block) and their digest — and which of the request's units: ``count`` of them
from ``first``, in token order over the units prefill offered.

- request: ``[header]``, header ``{"version", "fingerprint", "type": "stage", "requestIds": [id], "tokens":
  [token], "stage": StageRequest}``
- reply: ``[header]``, header ``{"version", "fingerprint", "staged": StageReply}``, or the envelope's typed error

Every number is bounded by its schema; anything a stage request names that prefill does not hold is a typed
refusal (:data:`STAGE_NOT_OFFERED`, :data:`STAGE_OUT_OF_RANGE`, :data:`STAGE_PLAN_MISMATCH`), never a pack.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Annotated

import numpy as np
from pydantic import Field, ValidationError

from .blocks import DescriptorIds, IntArray, descriptor_ids
from .errors import KVBridgeError, SpecError
from .geometry import RegionLayout, region_layout
from .handshake import (
    ENVELOPE_VERSION,
    MALFORMED_MESSAGE,
    MAX_REGION_BLOCK_BYTES,
    MAX_TENSORS,
    HandshakeError,
    MessageType,
    Named,
    _dump,
    _header,
    _reply_header,
)
from .layout import PhysicalLayout
from .model import MAX_TENSOR_PARALLEL, CamelModel
from .physical_reads import ChunkSide, PhysicalRead, chunk_descriptor_ids, physical_read
from .plan import TransferPlan
from .staging import Segments, WireOrder, region_segments, run_segments

# Stable codes of stage refusals (docs/troubleshooting.md).
STAGE_NOT_OFFERED = "STAGE_NOT_OFFERED"
STAGE_OUT_OF_RANGE = "STAGE_OUT_OF_RANGE"
STAGE_PLAN_MISMATCH = "STAGE_PLAN_MISMATCH"
STAGE_PLAN_INVALID = "STAGE_PLAN_INVALID"
STAGING_OFF = "STAGING_OFF"
#: decode did not ask prefill to stage (an exchange with it failed lately, or its address was not admitted): said
#: once when the pause begins, not per request
STAGE_SKIPPED = "STAGE_SKIPPED"

#: units (blocks, wire blocks or chunks) one stage request may name: a request's tokens at one per unit
MAX_STAGE_UNITS = 1 << 24
#: heads of one rank (bounded as a layout's H)
MAX_HEADS = 4096

_Head = Annotated[int, Field(ge=0, le=MAX_HEADS)]


class StagePlan(CamelModel):
    """How prefill computes one read's source segments and wire order as decode did: from decode's physical layout
    and the heads both ranks hold (``heads``: prefill's and decode's ``[first, end)``), or, for a cache kind's
    regions, the bytes ``[offset, offset + length)`` of each wire block of each region and the pair's plan for
    ``decode_rank``; ``digest`` and ``order_digest`` are decode's digests of the segments and the order."""

    decode_layout: PhysicalLayout | None = None
    heads: tuple[tuple[_Head, _Head], tuple[_Head, _Head]] | None = None
    offset: int = Field(default=0, ge=0, lt=MAX_REGION_BLOCK_BYTES)
    length: int = Field(default=1, ge=1, le=MAX_REGION_BLOCK_BYTES)
    #: the decode rank reading (a cache kind's regions: where its blocks take the bytes, from the pair's plan)
    decode_rank: int = Field(default=0, ge=0, lt=MAX_TENSOR_PARALLEL)
    #: a cache kind's regions: decode's distinct tensors, where they are not the cache kind's (vLLM's CPU attention
    #: keeps a layer's keys and values in one tensor): its regions, and so the wire order, follow them
    decode_tensors: int | None = Field(default=None, ge=1, le=MAX_TENSORS)
    digest: str = Field(pattern=r"^[0-9a-f]{32}$")
    #: decode's :attr:`~.staging.WireOrder.digest`: the order prefill packs in
    order_digest: str = Field(pattern=r"^[0-9a-f]{32}$")


class StageRequest(CamelModel):
    """Pack ``count`` units from ``first`` of a request for one read of prefill rank ``rank``."""

    rank: int = Field(ge=0, lt=MAX_TENSOR_PARALLEL)
    plan: StagePlan
    first: int = Field(ge=0, lt=MAX_STAGE_UNITS)
    count: int = Field(ge=1, le=MAX_STAGE_UNITS)


class StageState(StrEnum):
    READY = "ready"  # packed at ``offset`` of the rank's staging buffer
    BUSY = "busy"  # no room in the staging buffer now: read directly


class StageReply(CamelModel):
    state: StageState
    offset: int = Field(default=0, ge=0, lt=1 << 48)
    bytes: int = Field(default=0, ge=0, lt=1 << 48)
    #: packed when the request was offered (prefill had met this plan), not on this request
    prestaged: bool = False
    pack_microseconds: float = Field(default=0.0, ge=0, le=1e9)


def encode_stage_request(fingerprint: str, named: Named, request: StageRequest) -> list[bytes]:
    header: dict[str, object] = {
        "version": ENVELOPE_VERSION,
        "fingerprint": fingerprint,
        "type": MessageType.STAGE.value,
        "requestIds": [named[0]],
        "tokens": [named[1]],
        "stage": request.model_dump(mode="json", by_alias=True, exclude_none=True),
    }
    return [_dump(header)]


def decode_stage_request(frames: Sequence[bytes]) -> StageRequest:
    """The ``stage`` part of a request whose envelope ``handshake.decode_request`` already checked."""
    body = _header(frames[0]).get("stage")
    try:
        return StageRequest.model_validate(body)
    except ValidationError as exc:
        raise HandshakeError(f"stage request: {exc.errors()[0]['msg']}", code=MALFORMED_MESSAGE) from exc
    except SpecError as exc:  # a decode layout whose strides contradict its order
        raise HandshakeError(f"stage request: {exc.message}", code=MALFORMED_MESSAGE) from exc


def encode_stage_reply(fingerprint: str, reply: StageReply) -> list[bytes]:
    header = {"version": ENVELOPE_VERSION, "fingerprint": fingerprint, "staged": reply.model_dump(mode="json")}
    return [_dump(header)]


def decode_stage_reply(frames: Sequence[bytes], fingerprint: str) -> StageReply:
    header = _reply_header(frames, fingerprint)
    try:
        return StageReply.model_validate(header.get("staged"))
    except ValidationError as exc:
        raise HandshakeError(f"stage reply: {exc.errors()[0]['msg']}", code=MALFORMED_MESSAGE) from exc


# -- what prefill derives ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SourcePlan:
    """One read's source segments on prefill, and how a request's units become its descriptor ids."""

    segments: Segments
    order: WireOrder
    #: physical layouts: the read's paired runs and prefill's chunking (else a cache kind's regions, unit = wire block)
    physical: PhysicalRead | None = None
    side: ChunkSide | None = None

    def ids(self, units: IntArray, first: int, count: int) -> DescriptorIds:
        """The descriptor ids of units ``first .. first + count - 1`` (token order) of the request's listed units,
        region-major (decode's order)."""
        if self.physical is None or self.side is None:
            if first + count > units.size:
                raise KVBridgeError(
                    f"units [{first}, {first + count}) of a request of {units.size}",
                    field="stage.count",
                    code=STAGE_OUT_OF_RANGE,
                )
            return descriptor_ids(units[first : first + count], self.segments.regions, self.segments.units)
        per_unit = self.side.unit_tokens // self.side.tokens
        if first + count > units.size * per_unit:
            raise KVBridgeError(
                f"chunks [{first}, {first + count}) of a request of {units.size * per_unit}",
                field="stage.count",
                code=STAGE_OUT_OF_RANGE,
            )
        blocks, chunks = self.side.positions(units, first, count)
        return chunk_descriptor_ids(blocks, chunks, self.physical.source)


def source_plan(
    plan: StagePlan,
    rank: int,
    regions: RegionLayout,
    num_blocks: int,
    physical: PhysicalLayout | None,
    block_size: int,
    transfer: TransferPlan,
) -> SourcePlan:
    """What prefill rank ``rank`` (its cache's ``regions`` over ``num_blocks`` blocks of ``block_size`` tokens, its
    ``physical`` layout, if any; ``transfer`` the pair's plan) packs for ``plan``, and in which order; refused when the
    plan does not describe a read of this cache, or its segments or order are not those decode computed."""
    try:
        if physical is not None and plan.decode_layout is not None and plan.heads is not None:
            read = physical_read(rank, physical, plan.decode_layout, plan.heads)
            side = ChunkSide(block_size, transfer.split_ratio, read.source.chunks * read.tokens, read.tokens)
            target = WireOrder(ordering(run_segments(read.target.regions, 0)), read.target.chunks)
            source = SourcePlan(run_segments(read.source.regions, physical.num_blocks), target, read, side)
        elif physical is None and plan.decode_layout is None:
            split = transfer.split_ratio
            segments = region_segments(
                regions, num_blocks, units_per_block=split, offset=plan.offset, length=plan.length
            )
            source = SourcePlan(segments, region_order(transfer, plan.decode_rank, rank, plan.decode_tensors))
        else:
            raise SpecError("the plan and this cache describe different kinds of layout", field="stage.plan")
    except SpecError as exc:
        raise KVBridgeError(f"stage plan: {exc.message}", field="stage.plan", code=STAGE_PLAN_INVALID) from exc
    if source.segments.digest != plan.digest or source.order.digest != plan.order_digest:
        raise KVBridgeError(
            "the stage plan's segments or order differ from what decode computed (their digests): the two engines "
            "run different kvbridge versions, layouts or plans",
            field="stage.plan.digest",
            code=STAGE_PLAN_MISMATCH,
        )
    return source


def ordering(segments: Segments) -> Segments:
    """Segments as a wire order sees them: their geometry, not how many units a side registered."""
    return replace(segments, units=0)


def region_order(
    transfer: TransferPlan, decode_rank: int, prefill_rank: int, decode_tensors: int | None = None
) -> WireOrder:
    """A cache kind's regions: the wire order of decode rank ``decode_rank``'s read from ``prefill_rank`` (its blocks
    or sub-blocks, at the read's local offset), from the pair's plan (``decode_tensors``: decode's distinct tensors,
    where they are not the cache kind's)."""
    if decode_rank >= transfer.decode.tensor_parallel_size:
        raise SpecError(f"decode rank {decode_rank} is not one of the plan's", field="stage.plan.decodeRank")
    reads = [r for r in transfer.for_decode_rank(decode_rank).reads if r.prefill_rank == prefill_rank]
    if not reads:
        raise SpecError(f"decode rank {decode_rank} reads nothing from rank {prefill_rank}", field="stage.plan")
    decode = transfer.decode
    layout = (
        transfer.decode_layout
        if decode_tensors is None
        else region_layout(transfer.model, decode.block_size, decode.tensor_parallel_size, num_tensors=decode_tensors)
    )
    target = region_segments(
        layout,
        0,
        units_per_block=transfer.block_size_ratio,
        offset=reads[0].local_offset,
        length=reads[0].length,
    )
    return WireOrder(target, 1)


def offered_units(blocks: Sequence[int], split_ratio: int) -> IntArray:
    """The units prefill offers of a request's blocks (its wire blocks, unclipped: ``b * split + j``)."""
    array = np.asarray(blocks, dtype=np.int64)
    if split_ratio == 1:
        return array
    return (array[:, None] * split_ratio + np.arange(split_ratio, dtype=np.int64)[None, :]).ravel()
