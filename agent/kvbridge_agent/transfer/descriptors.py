"""NIXL descriptor rows for a rank's regions: compact strided rows when the spacing is uniform, and the merged
entries of runs of units that lie end to end (core.coalesce)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvbridge_agent.core import RegionLayout, unit_addresses
from kvbridge_agent.core.coalesce import MergedList, merge_levels
from kvbridge_agent.core.geometry import strided_rows
from kvbridge_agent.core.layout import BlockRuns, run_regions
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.transport import Transport

Rows = npt.NDArray[np.int64]


def descriptor_rows(
    bases: Sequence[int],
    layout: RegionLayout,
    num_blocks: int,
    *,
    units_per_block: int,
    offset: int,
    length: int,
    device_id: int,
) -> Rows:
    """Nx5 strided rows (one per region) when possible, else Nx3 rows (one per descriptor)."""
    rows = strided_rows(
        bases, layout, num_blocks, units_per_block=units_per_block, offset=offset, length=length, device_id=device_id
    )
    if rows is not None:
        return rows
    addresses = unit_addresses(bases, layout, num_blocks, units_per_block=units_per_block, offset=offset, length=length)
    full = np.empty((addresses.size, 3), dtype=np.int64)
    full[:, 0] = addresses
    full[:, 1] = length
    full[:, 2] = device_id
    return full


def end_to_end(rows: Rows) -> bool:
    """Whether every region's units lie end to end: strided rows whose spacing is their length."""
    return rows.ndim == 2 and rows.shape[1] == 5 and bool((rows[:, 3] == rows[:, 1]).all())


def pair_levels(local: Rows, remote: Rows) -> tuple[MergedList, MergedList] | None:
    """The merged lists of one read's two sides (their levels common), or ``None`` where runs cannot merge: a side's
    units are not end to end, or too few for a run of two."""
    if not (end_to_end(local) and end_to_end(remote)) or len(local) != len(remote):
        return None
    units = (int(local[0, 4]), int(remote[0, 4]))
    levels = merge_levels(len(local), units)
    if levels == 0:
        return None
    return MergedList(len(local), units[0], levels), MergedList(len(remote), units[1], levels)


def merged_rows(rows: Rows, merged: MergedList | None) -> Rows:
    """``rows`` (one strided row per region, units end to end) followed by the rows of each merged level: per
    region and residue ``u0`` of the run length ``k``, entries of ``k`` units from units ``u0, u0 + k, ...``."""
    if merged is None:
        return rows
    parts = [rows]
    for level in range(1, merged.levels + 1):
        k = 1 << level
        counts = merged.counts(level)
        residues = np.flatnonzero(counts > 0)
        block = np.empty((merged.regions, residues.size, 5), dtype=np.int64)
        block[:, :, 0] = rows[:, None, 0] + residues[None, :] * rows[:, None, 3]
        block[:, :, 1] = rows[:, None, 1] * k
        block[:, :, 2] = rows[:, None, 2]
        block[:, :, 3] = rows[:, None, 3] * k
        block[:, :, 4] = counts[residues][None, :]
        parts.append(block.reshape(-1, 5))
    return np.concatenate(parts)


#: one read's two merged lists (local, remote), or ``None``: no merged entries
Merged = tuple[MergedList, MergedList] | None


class LocalRead(NamedTuple):
    """A read's local lists: the plain one (one entry per region and unit), and where both sides can merge the
    numbering of both sides' merged lists and the local merged list (the plain one with merged entries)."""

    plain: Any
    merged: Merged = None
    merged_list: Any = None


class LocalLists:
    """A decode rank's own prepped lists, each prepared once and shared by every peer that reads into it: keyed by
    the descriptors of one read (a region layout's sub-blocks, offset and length, or a physical layout's runs) and
    its merged levels."""

    def __init__(self, transport: Transport, cache: KVCache) -> None:
        self.transport, self.cache = transport, cache
        self._handles: dict[tuple[object, MergedList | None], Any] = {}

    def for_layout(self, units_per_block: int, offset: int, length: int, remote: Rows) -> LocalRead:
        """The lists of ``length`` bytes from ``offset`` of each of ``units_per_block`` sub-blocks of every block of
        the cache's region layout, merged with ``remote`` (a peer's rows for the same read) where both can."""
        cache = self.cache
        where = {"units_per_block": units_per_block, "offset": offset, "length": length, "device_id": cache.device_id}

        def rows() -> Rows:
            return descriptor_rows(cache.bases, cache.layout, cache.num_blocks, **where)

        shape = strided_rows(cache.bases, cache.layout, cache.num_blocks, **where)
        merged = None if shape is None else pair_levels(shape, remote)
        return self._read((units_per_block, offset, length), rows, merged)

    def for_runs(self, runs: BlockRuns, remote: Rows) -> LocalRead:
        """The lists of every (kernel) block's ``runs`` (a physical layout's), merged with ``remote`` where both
        can."""
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
        return self._read(runs, lambda: rows, pair_levels(rows, remote))

    def _read(self, key: object, rows: Callable[[], Rows], merged: Merged) -> LocalRead:
        plain = self._get(key, rows, None)
        if merged is None:
            return LocalRead(plain)
        return LocalRead(plain, merged, self._get(key, rows, merged[0]))

    def _get(self, key: object, rows: Callable[[], Rows], merged: MergedList | None) -> Any:
        handle = self._handles.get((key, merged))
        if handle is None:
            handle = self.transport.prep("", merged_rows(rows(), merged), self.cache.memory_type.value)
            self._handles[key, merged] = handle
        return handle

    def close(self) -> None:
        for handle in self._handles.values():
            self.transport.release_dlist(handle)
        self._handles.clear()
