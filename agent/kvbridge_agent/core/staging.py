"""Staged reads (docs/protocol.md §4d): the byte geometry both sides share, and the cost model that picks them.

A direct READ moves a request as the pairs of segments its descriptor ids name: segment ``k`` of prefill's list
lands on segment ``k`` of decode's. Where those are many and small (a head range of every block, chunks of a
larger block, one token of one head, scattered ids), a staged read moves the same pairs through two buffers:
prefill packs its segments, in the order decode's ids list them (the *wire order*: region-major, then unit), into
a registered staging buffer; decode READs that in a few large descriptors into its own and scatters each segment
where the direct READ would have put it. Same pairs, same order: byte for byte the direct read.

- :class:`Segments`: one side's segments of one prepped list, as ``(tensor, byte offset)`` from that side's own
  tensors (descriptor id ``region * units + unit``) — what both sides compute alike from a layout and a read.
- :func:`region_segments`, :func:`run_segments`: from a cache kind's regions, or from two physical layouts' runs.
- :func:`posted_estimate`: the descriptors NIXL would post for a direct read (it merges runs adjacent on both sides).
- :class:`CostModel`: a device's per-descriptor cost, transfer and copy bandwidths (measured at start); direct or
  staged per request from its descriptors and bytes.

Pure: numpy only.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from functools import lru_cache, reduce

import numpy as np

from .blocks import DescriptorIds, IntArray
from .errors import SpecError
from .geometry import RegionLayout
from .layout import BlockRuns

#: a staging geometry both sides cannot share (stable code)
STAGING_UNSUPPORTED = "STAGING_UNSUPPORTED"
#: the smallest row worth staging: smaller rows make the index arrays larger than the bytes they move
MIN_ROW_BYTES = 64


@dataclass(frozen=True, slots=True)
class Segments:
    """One side's segments of one prepped list: descriptor id ``i`` is region ``i // units``, unit ``i % units``;
    its ``length`` bytes start ``region_offset[r] + (u // units_per_block) * block_stride + (u % units_per_block) *
    unit_bytes`` into tensor ``region_tensor[r]`` (from the address the side registers the tensor's descriptors at:
    a physical layout's logical origin)."""

    region_tensor: tuple[int, ...]
    region_offset: tuple[int, ...]
    units: int
    block_stride: int
    units_per_block: int
    unit_bytes: int
    length: int

    @property
    def regions(self) -> int:
        return len(self.region_tensor)

    @property
    def digest(self) -> str:
        """What decode names in a stage request and prefill checks against its own (both compute it alike)."""
        text = json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def tiles(self) -> bool:
        """Consecutive units of a region lie end to end (NIXL merges a run of them into one descriptor)."""
        if self.units_per_block == 1:
            return self.length == self.block_stride
        return self.length == self.unit_bytes and self.block_stride == self.units_per_block * self.unit_bytes

    def granularity(self, origin: int = 0) -> int:
        """The largest row size every segment is whole rows of, ``origin`` bytes into the tensor's storage."""
        values = [self.length, self.block_stride, self.unit_bytes, origin, *self.region_offset]
        return int(reduce(math.gcd, values, 0))

    def offsets(self, ids: DescriptorIds, runs: int = 1) -> tuple[IntArray, IntArray]:
        """Per descriptor id: its tensor and the byte offset of its first byte. With ``runs`` > 1 the ids are a
        request's grid, ``runs`` rows of one unit list each (row ``r`` adds ``r * units * regions // runs``: the
        ids descriptor lists are handed), computed from the first row by broadcasting."""
        wide = ids.astype(np.int64)
        count = wide.size // runs
        step = self.units * (self.regions // runs)
        first = wide[:count]
        if runs > 1 and wide.size == runs * count and np.array_equal(wide[-count:], first + (runs - 1) * step):
            region0, unit = np.divmod(first, self.units)
            region = np.arange(runs, dtype=np.int64)[:, None] * (self.regions // runs) + region0[None, :]
            start = (unit // self.units_per_block) * self.block_stride + (unit % self.units_per_block) * self.unit_bytes
            tensors = np.asarray(self.region_tensor, dtype=np.int64)[region].ravel()
            return tensors, (np.asarray(self.region_offset, dtype=np.int64)[region] + start[None, :]).ravel()
        region, unit = np.divmod(wide, self.units)
        starts = (unit // self.units_per_block) * self.block_stride + (unit % self.units_per_block) * self.unit_bytes
        tensors = np.asarray(self.region_tensor, dtype=np.int64)[region]
        return tensors, np.asarray(self.region_offset, dtype=np.int64)[region] + starts


def region_segments(
    layout: RegionLayout, num_blocks: int, *, units_per_block: int, offset: int, length: int
) -> Segments:
    """The segments of a list prepped from a cache kind's regions (``transfer.descriptors.descriptor_rows``)."""
    unit_bytes, rest = divmod(layout.unit_bytes, units_per_block)
    if rest or offset < 0 or length < 1 or offset + length > unit_bytes:
        raise SpecError(
            f"[{offset}, {offset + length}) is not inside a {layout.unit_bytes}-byte block in {units_per_block} "
            "unit(s)",
            field="stage.plan",
            code=STAGING_UNSUPPORTED,
        )
    return Segments(
        layout.region_tensor,
        tuple(region + offset for region in layout.region_offset),
        num_blocks * units_per_block,
        layout.block_stride,
        units_per_block,
        unit_bytes,
        length,
    )


def run_segments(regions: BlockRuns, num_blocks: int) -> Segments:
    """The segments of a list prepped from paired runs (``ChunkRuns.regions``, one region per run and chunk)."""
    return Segments(
        (0,) * regions.count, regions.offsets, num_blocks, regions.block_stride, 1, regions.block_stride, regions.length
    )


@dataclass(frozen=True, slots=True)
class WireOrder:
    """The order of a request's segments on the wire: decode's bytes in address order (by tensor, then offset),
    its units placed as if in consecutive blocks — so that both sides compute it from the read's geometry alone, and
    a READ from the packed bytes straight into decode's blocks merges wherever decode's bytes lie end to end.

    Unit ``i`` of a request (token order) is chunk ``i % chunks`` of the target's ``i // chunks``-th (virtual) unit:
    a physical layout's paired runs count regions ``run * chunks + chunk`` (``chunks`` per kernel block); a cache
    kind's regions are one per region (``chunks`` 1), units blocks or sub-blocks."""

    target: Segments
    chunks: int

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.target.digest}:{self.chunks}".encode()).hexdigest()[:32]

    def permutation(self, runs: int, units: int) -> IntArray:
        """Positions, in the region-major grid ``run * units + i`` that descriptor ids list, in wire order."""
        return _permutation(self, runs, units)


@lru_cache(maxsize=16)
def _permutation(order: WireOrder, runs: int, units: int) -> IntArray:
    target, index = order.target, np.arange(units, dtype=np.int64)
    region = np.arange(runs, dtype=np.int64)[:, None] * order.chunks + (index % order.chunks)[None, :]
    virtual = index // order.chunks
    start = (virtual // target.units_per_block) * target.block_stride
    start += (virtual % target.units_per_block) * target.unit_bytes
    address = np.asarray(target.region_offset, dtype=np.int64)[region] + start[None, :]
    tensor = np.asarray(target.region_tensor, dtype=np.int64)[region]
    found: IntArray = np.lexsort((address.ravel(), tensor.ravel())).astype(np.int64)
    found.setflags(write=False)
    return found


def placed_runs(offsets: IntArray, tensors: IntArray, length: int) -> int:
    """Descriptors a READ of segments in this order (decode's offsets and tensors) posts from packed bytes: NIXL
    merges each segment that starts where the one before it ends, in the same tensor."""
    if offsets.size == 0:
        return 0
    joined = (offsets[1:] == offsets[:-1] + length) & (tensors[1:] == tensors[:-1])
    return int(offsets.size - joined.sum())


def posted_estimate(local_units: IntArray, remote_units: IntArray, regions: int, merge: bool) -> int:
    """Descriptors NIXL posts for one read's ids (docs/protocol.md §4c): one per region and run of units that go on
    by one on both sides where both sides' units lie end to end (``merge``), else one per id."""
    if local_units.size == 0:
        return 0
    if not merge:
        return regions * int(local_units.size)
    breaks = (np.diff(local_units) != 1) | (np.diff(remote_units) != 1)
    return regions * (1 + int(breaks.sum()))


#: where a staged read lands: straight in decode's blocks (its descriptors decode's runs of the packed bytes), or in
#: decode's staging buffer in a few large descriptors, scattered from there
INTO_BLOCKS = "blocks"
INTO_BUFFER = "buffer"


@dataclass(frozen=True, slots=True)
class Choice:
    """Direct or staged (and where to), with the cost model's estimate of each."""

    staged: bool
    into: str
    direct_seconds: float
    blocks_seconds: float
    buffer_seconds: float

    @property
    def staged_seconds(self) -> float:
        return min(self.blocks_seconds, self.buffer_seconds)


@dataclass(frozen=True, slots=True)
class CostModel:
    """What one device's transfers cost, measured when a rank starts (``transfer.cost_model``): NIXL's cost per
    descriptor and its rate on one large one, the device's indexed copy (pack and scatter), and a stage request's
    round trip on the side channel (updated from the exchanges made)."""

    descriptor_us: float
    transfer_gbps: float
    gather_gbps: float
    scatter_gbps: float
    exchange_us: float = 1000.0
    #: staged wins only below this share of the direct estimate (noise in the constants must not flip a choice)
    margin: float = 0.85

    def _read(self, descriptors: int, nbytes: int) -> float:
        return descriptors * self.descriptor_us * 1e-6 + nbytes / (self.transfer_gbps * 1e9)

    def _ask(self, nbytes: int, reads: int, packed: bool) -> float:
        """Stage exchanges (one per prefill rank read) and the pack, unless prefill packed at offer."""
        return reads * self.exchange_us * 1e-6 + (0.0 if packed else nbytes / (self.gather_gbps * 1e9))

    def choose(
        self, direct: int, into_blocks: int | None, nbytes: int, reads: int, pieces: int, packed: bool
    ) -> Choice:
        """``direct``: descriptors a direct read posts; ``into_blocks``: a READ of the packed bytes into decode's
        blocks (``None``: not possible); ``pieces``: READs into decode's buffer, then the scatter — counted in full:
        on host memory the scatter of one piece overlapped with the READ of the next slowed both as much as it saved
        (both bound by the same memory), so no overlap is credited."""
        ask = self._ask(nbytes, reads, packed)
        blocks = float("inf") if into_blocks is None else ask + self._read(into_blocks, nbytes)
        buffer = ask + self._read(pieces, nbytes) + nbytes / (self.scatter_gbps * 1e9)
        direct_seconds = self._read(direct, nbytes)
        into = INTO_BLOCKS if blocks <= buffer else INTO_BUFFER
        return Choice(min(blocks, buffer) < self.margin * direct_seconds, into, direct_seconds, blocks, buffer)

    def to_dict(self) -> dict[str, float]:
        return {
            "descriptorMicroseconds": round(self.descriptor_us, 3),
            "transferGBps": round(self.transfer_gbps, 3),
            "gatherGBps": round(self.gather_gbps, 3),
            "scatterGBps": round(self.scatter_gbps, 3),
            "exchangeMicroseconds": round(self.exchange_us, 1),
        }


#: READs into the buffer one read of a request is cut into (at least :data:`MIN_READ_BYTES` each), so that
#: scattering one overlaps copying the next
READS_PER_READ = 8
MIN_READ_BYTES = 4 << 20


def read_groups(nbytes: int, piece: int) -> list[tuple[int, int]]:
    """The READs of ``nbytes`` staged bytes: ``(first piece, pieces)`` each, about :data:`READS_PER_READ` of at
    least :data:`MIN_READ_BYTES`."""
    pieces = -(-nbytes // piece)
    size = max(-(-pieces // READS_PER_READ), -(-MIN_READ_BYTES // piece))
    return [(start, min(size, pieces - start)) for start in range(0, pieces, size)]
