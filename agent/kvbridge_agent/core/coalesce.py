"""Coalescing: units adjacent in both caches go as one descriptor (docs/protocol.md §4c).

A prepped descriptor list numbers one entry per region and unit (a block, a sub-block or a kernel block):
``desc_id = region * units + unit`` (§4). Where a region's units lie end to end in memory on *both* sides (each
unit's bytes end where the next one's begin: per-layer ``LBHNC``, every cross-layer layout, a cross-layer cache
kind), a request whose ids run on in both lists could move the whole run as one descriptor — but an entry of a
prepped list has a fixed length, and the lists are prepared once per peer, never per request.

So a list also holds, once per peer, the merged entries of a few run lengths: **level** ``j`` (``1 .. levels``) has
one entry of ``2**j`` units per region and first unit (every first unit whose run stays inside the region). Per
request, the pairs of units are cut into maximal runs that go on by one unit on both sides (:func:`runs`), each run
is cut into pieces of those lengths, the longest first (:func:`pieces`: a run of ``n`` units is ``n >> levels``
pieces of the longest level and one piece per set bit of the rest), and each piece is one descriptor id on each
side (:meth:`MergedList.ids`). A run of ``2**j`` units up to the longest level is one descriptor per region; the
pieces of a run follow one another in memory, so NIXL merges them further when it builds the transfer.

**The list, level by level** (:class:`MergedList`): level 0 is the unmerged list; level ``j`` (run length
``k = 2**j``) follows, region-major, then by the first unit's residue ``u0 = u mod k``, then ``m = u // k``: one
strided row of NIXL's per region and residue (a strided row's stride cannot be below its length, so the ``k``
residues are ``k`` rows, each ``k`` units apart). With ``E = units - k + 1`` first units per region, ``E = q*k + s``,
residue ``u0`` holds ``q + (u0 < s)`` entries, so unit ``u`` of region ``r`` is entry
``offset[j] + r*E + u0*q + min(u0, s) + m``.

**Bounded.** A list of ``levels`` levels has ``regions * (2**(levels+1) - 1)`` strided rows (NIXL keeps about
120 bytes per row, and looking entries up slows with the rows): :func:`merge_levels` takes the most levels within
:data:`MAX_MERGED_ROWS` rows and the smaller side's units. No level is built where a side's units are not end to
end (a sub-range of heads, a chunk of a larger block, K and V halves).

Pure: numpy only; nothing loops per block or per run in Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt

from .blocks import BLOCK_ID_OUT_OF_RANGE, MAX_DESCRIPTORS, TOO_MANY_DESCRIPTORS, DescriptorIds, IntArray
from .errors import BlockMappingError

#: the strided rows one prepped list may hold with its merged levels
MAX_MERGED_ROWS = 1 << 15
#: the longest merged entry: ``2**MAX_LEVEL`` units
MAX_LEVEL = 16


def merge_levels(regions: int, units: tuple[int, ...], *, max_rows: int = MAX_MERGED_ROWS) -> int:
    """The levels of merged entries of lists of ``regions`` regions with ``units`` units each (one per side): the
    most whose rows fit ``max_rows`` and whose longest run fits the smaller side (0: none)."""
    fewest = min(units)
    levels = 0
    while levels < MAX_LEVEL and 1 << (levels + 1) <= fewest and regions * ((1 << (levels + 2)) - 1) <= max_rows:
        levels += 1
    return levels


@dataclass(frozen=True)
class MergedList:
    """One side's prepped list: ``regions`` regions of ``units`` units, and merged entries of ``2**j`` units for
    ``j = 1 .. levels`` (see the module's docstring for the numbering)."""

    regions: int
    units: int
    levels: int

    def __post_init__(self) -> None:
        if self.regions < 1 or self.units < 1 or not 0 <= self.levels <= MAX_LEVEL or 1 << self.levels > self.units:
            raise BlockMappingError(
                f"{self.regions} regions of {self.units} units cannot hold runs of {1 << self.levels}",
                field="levels",
                code=TOO_MANY_DESCRIPTORS,
            )
        if self.entries > MAX_DESCRIPTORS:
            raise BlockMappingError(
                f"{self.entries} descriptors with merged levels exceed NIXL's int32 descriptor index",
                field="numBlocks",
                code=TOO_MANY_DESCRIPTORS,
            )

    @cached_property
    def _level(self) -> IntArray:
        """Per level (rows): first units of a run in one region (``E``), ``q`` and ``s`` of ``E = q*k + s``, the
        level's first entry, and ``k - 1``."""
        k = np.int64(1) << np.arange(self.levels + 1, dtype=np.int64)
        starts = self.units - k + 1
        offsets = np.concatenate(([0], np.cumsum(self.regions * starts)[:-1])).astype(np.int64)
        return np.stack([starts, starts // k, starts % k, offsets, k - 1], axis=1)

    @property
    def entries(self) -> int:
        """Entries of the whole list."""
        return sum(self.regions * (self.units - (1 << j) + 1) for j in range(self.levels + 1))

    def counts(self, level: int) -> IntArray:
        """Entries of each residue's row at ``level`` (``2**level`` of them; trailing zeros where a region holds
        fewer first units than the run is long)."""
        _starts, q, s, _offsets, _mask = self._level[level]
        counts: IntArray = q + (np.arange(1 << level, dtype=np.int64) < s)
        return counts

    def ids(self, levels: IntArray, units: IntArray) -> DescriptorIds:
        """Entries of runs of ``2**levels[i]`` units from ``units[i]``, for every region, region-major (int32)."""
        first, q, s, offsets, mask = self._level[levels].T
        if units.size and int((units - first).max()) >= 0:
            raise BlockMappingError(
                f"a run ends past the {self.units} registered units",
                field="request.block_ids",
                code=BLOCK_ID_OUT_OF_RANGE,
            )
        residue = units & mask
        base = offsets + residue * q + np.minimum(residue, s) + (units >> levels)
        regions = np.arange(self.regions, dtype=np.int64)
        ids: DescriptorIds = (regions[:, None] * first[None, :] + base[None, :]).astype(np.int32).ravel()
        return ids


@dataclass(frozen=True, slots=True)
class Runs:
    """Maximal runs of paired units: local units ``local[i] ..`` receive remote units ``remote[i] ..``, ``length[i]``
    of each, one after the other on both sides."""

    local: IntArray
    remote: IntArray
    length: IntArray


def runs(local: IntArray, remote: IntArray) -> Runs:
    """Pairs ``local[i] <- remote[i]`` (in the order they are read) as maximal runs going on by one on both sides."""
    return _cut(local, remote, _goes_on(local, remote))


def merged_runs(local: IntArray, remote: IntArray) -> Runs | None:
    """:func:`runs`, or ``None`` where no pair goes on by one from the one before it on both sides (no run of two:
    nothing to merge)."""
    on = _goes_on(local, remote)
    return _cut(local, remote, on) if on.any() else None


def _goes_on(local: IntArray, remote: IntArray) -> npt.NDArray[np.bool_]:
    """Per pair after the first: whether it goes on by one from the one before it on both sides."""
    if local.size != remote.size:
        raise BlockMappingError(
            f"{local.size} local units for {remote.size} remote ones",
            field="request.block_ids",
            code="INVALID_BLOCK_IDS",
        )
    on: npt.NDArray[np.bool_] = (local[1:] - local[:-1] == 1) & (remote[1:] - remote[:-1] == 1)
    return on


def _cut(local: IntArray, remote: IntArray, on: npt.NDArray[np.bool_]) -> Runs:
    if local.size == 0:
        return Runs(local, remote, local)
    if on.all():  # one run: the common case, in the fewest numpy calls
        return Runs(local[:1], remote[:1], np.array([local.size], dtype=np.int64))
    breaks = np.flatnonzero(~on) + 1
    first = np.empty(breaks.size + 1, dtype=np.int64)
    first[0], first[1:] = 0, breaks
    length = np.empty_like(first)
    length[:-1], length[-1] = breaks - first[:-1], local.size - first[-1]
    return Runs(local[first], remote[first], length)


def pieces(lengths: IntArray, levels: int) -> tuple[IntArray, IntArray, IntArray]:
    """``(run, offset, level)`` of each piece of runs of ``lengths`` units, in order: per run ``length >> levels``
    pieces of ``2**levels`` units, then one of ``2**j`` per set bit ``j`` of the rest, the longest first."""
    lengths = lengths.astype(np.int64)
    if lengths.size == 0:
        return lengths, lengths, lengths
    if lengths.size == 1:  # one run (a request whose ids all go on by one): fewer numpy calls
        n = int(lengths[0])
        bits = [j for j in range(levels - 1, -1, -1) if n >> j & 1]
        level = np.array([levels] * (n >> levels) + bits, dtype=np.int64)
        size = np.int64(1) << level
        return np.zeros(level.size, dtype=np.int64), np.cumsum(size) - size, level
    order = np.arange(levels, -1, -1, dtype=np.int64)  # the levels of a run's pieces, the longest first
    counts: IntArray = (lengths[:, None] >> order[None, :]) & 1  # runs x levels: the set bits of each length
    counts[:, 0] = lengths >> levels  # as many of the longest as fit
    per_run = counts.ravel()
    level = np.repeat(np.tile(order, lengths.size), per_run)
    run = np.repeat(np.arange(lengths.size, dtype=np.int64), counts.sum(axis=1))
    size = np.int64(1) << level
    ends = np.cumsum(size)
    offset = ends - size - (np.cumsum(lengths) - lengths)[run]
    return run, offset, level


def merged_ids(paired: Runs, local_list: MergedList, remote_list: MergedList) -> tuple[DescriptorIds, DescriptorIds]:
    """Descriptor ids of the ``paired`` runs (:func:`runs`) for every region, merged: each run as pieces of the
    levels both lists hold (region-major, like :func:`~.blocks.descriptor_ids`; equal to it without levels)."""
    levels = min(local_list.levels, remote_list.levels)
    run, offset, level = pieces(paired.length, levels)
    return local_list.ids(level, paired.local[run] + offset), remote_list.ids(level, paired.remote[run] + offset)
