"""Per-request block-id work (docs/protocol.md §4): the only math on the hot path.

Everything here is vectorised with numpy; nothing loops per block in Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .arithmetic import ceil_div
from .errors import BlockMappingError

IntArray = npt.NDArray[np.int64]
DescriptorIds = npt.NDArray[np.int32]
"""Descriptor indices into a prepped list: int32, the index type NIXL's ``make_prepped_xfer`` takes (any other
dtype is converted by NIXL on every request, which cost 0.85 ms for 160,000 ids)."""
MAX_DESCRIPTORS = 2**31 - 1
BlockIds = Sequence[int] | npt.NDArray[np.integer]

# Stable error codes of per-request mapping (documented in docs/troubleshooting.md).
INVALID_BLOCK_IDS = "INVALID_BLOCK_IDS"
LOCAL_LONGER_THAN_REMOTE = "LOCAL_LONGER_THAN_REMOTE"
BLOCK_ID_OUT_OF_RANGE = "BLOCK_ID_OUT_OF_RANGE"
TOKENS_EXCEED_BLOCKS = "TOKENS_EXCEED_BLOCKS"
TOO_MANY_DESCRIPTORS = "TOO_MANY_DESCRIPTORS"


def as_block_ids(ids: BlockIds, *, field: str) -> IntArray:
    """Validate and convert a list of block ids to a 1-D int64 array."""
    array = np.asarray(ids)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise BlockMappingError(
            f"block ids must be a flat list of integers, got {array.dtype} of shape {array.shape}",
            field=field,
            code=INVALID_BLOCK_IDS,
        )
    result = array.astype(np.int64, copy=False)
    if int(result.min()) < 0:
        raise BlockMappingError("block ids must not be negative", field=field, code=INVALID_BLOCK_IDS)
    if int(result.max()) > MAX_DESCRIPTORS:  # no cache has as many blocks; larger ids would overflow the id math
        raise BlockMappingError(
            f"block id {int(result.max())} is beyond any registered cache ({MAX_DESCRIPTORS} at most)",
            field=field,
            code=BLOCK_ID_OUT_OF_RANGE,
        )
    return result


def require_distinct(units: IntArray, *, field: str) -> None:
    """Refuse a request whose units to read (block ids, or any one-to-one key of them) list one twice: two READs
    into one decode block would race, and neither engine lists a block of one request twice."""
    ordered = np.sort(units)
    if bool((ordered[1:] == ordered[:-1]).any()):
        raise BlockMappingError("a block is listed more than once", field=field, code=INVALID_BLOCK_IDS)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks a prompt of ``num_tokens`` occupies: a ceiling, never a floor."""
    if num_tokens < 0:
        raise BlockMappingError("num_tokens must not be negative", field="request.num_tokens", code=INVALID_BLOCK_IDS)
    return ceil_div(num_tokens, block_size)


def wire_block_ids(prefill_block_ids: BlockIds, num_tokens: int, split_ratio: int, wire_block_size: int) -> IntArray:
    """Wire block ids prefill offers for a request: ``b * n + j``, clipped to ``ceil(tokens / wire)``.

    With ``split_ratio == 1`` these are the prefill block ids themselves.
    """
    blocks = as_block_ids(prefill_block_ids, field="request.block_ids")
    needed = blocks_for_tokens(num_tokens, wire_block_size)
    if needed > blocks.size * split_ratio:
        raise BlockMappingError(
            f"{num_tokens} tokens need {needed} wire blocks of {wire_block_size} tokens but only "
            f"{blocks.size} prefill blocks ({blocks.size * split_ratio} wire blocks) were given",
            field="request.num_tokens",
            code=TOKENS_EXCEED_BLOCKS,
        )
    if split_ratio == 1:
        return blocks[:needed]
    wire = (blocks[:, None] * split_ratio + np.arange(split_ratio, dtype=np.int64)[None, :]).ravel()
    return wire[:needed]


@dataclass(frozen=True, slots=True)
class MappedBlocks:
    """One request's units to read: ``local[i]`` receives remote wire block ``remote[i]``."""

    local: IntArray
    remote: IntArray

    @property
    def full_hit(self) -> bool:
        return self.local.size == 0


def map_request_blocks(local_block_ids: BlockIds, remote_block_ids: BlockIds, block_size_ratio: int) -> MappedBlocks:
    """Pair a request's decode blocks with the prefill wire blocks that fill them.

    ``remote`` lists every wire block of the prompt (``ceil(tokens / bs_P)``);
    ``local`` lists the decode blocks still to be filled (a prefix hit leaves
    out the first ones; empty is a full hit: notify, READ nothing).  With
    ``bsr = bs_D / bs_P > 1`` each local block ``b`` becomes the sub-blocks
    ``b*bsr + j``; the prompt's last local block may hold fewer than ``bsr``
    wire blocks, so the sub-block list is clipped to what the prompt needs,
    and a prefix hit skips whole local blocks (``bsr`` wire blocks each).
    """
    local = as_block_ids(local_block_ids, field="request.local_block_ids")
    remote = as_block_ids(remote_block_ids, field="request.remote_block_ids")
    if local.size == 0:
        return MappedBlocks(local, np.zeros(0, dtype=np.int64))
    total_local = ceil_div(remote.size, block_size_ratio)
    if local.size > total_local:
        raise BlockMappingError(
            f"{local.size} local blocks but the prompt's {remote.size} remote blocks fill only {total_local} "
            f"local block(s) of {block_size_ratio} wire block(s) each",
            field="request.local_block_ids",
            code=LOCAL_LONGER_THAN_REMOTE,
        )
    if block_size_ratio == 1:
        return MappedBlocks(local, remote[remote.size - local.size :])
    padding = total_local * block_size_ratio - remote.size  # empty sub-blocks at the end of the last block
    needed = local.size * block_size_ratio - padding
    subs = (local[:, None] * block_size_ratio + np.arange(block_size_ratio, dtype=np.int64)[None, :]).ravel()
    return MappedBlocks(subs[:needed], remote[remote.size - needed :])


def descriptor_ids(
    unit_ids: IntArray, num_regions: int, units_per_region: int, *, out: DescriptorIds | None = None
) -> DescriptorIds:
    """Descriptor ids region-major: ``region * units_per_region + unit`` for every region, as int32.

    ``out`` (at least ``num_regions * len(unit_ids)`` long) receives the ids
    without allocating: large per-request arrays otherwise go through
    mmap/munmap and page faults on every request.
    """
    if num_regions * units_per_region > MAX_DESCRIPTORS:
        raise BlockMappingError(
            f"{num_regions} regions x {units_per_region} blocks exceed NIXL's int32 descriptor index; "
            "use fewer, larger blocks or the CrossLayer cache kind",
            field="numBlocks",
            code=TOO_MANY_DESCRIPTORS,
        )
    if unit_ids.size and int(unit_ids.max()) >= units_per_region:
        raise BlockMappingError(
            f"block id {int(unit_ids.max())} is outside the {units_per_region} registered blocks",
            field="request.block_ids",
            code=BLOCK_ID_OUT_OF_RANGE,
        )
    offsets = np.arange(0, num_regions * units_per_region, units_per_region, dtype=np.int32)
    units = unit_ids.astype(np.int32)
    count = num_regions * unit_ids.size
    if out is None:
        return (offsets[:, None] + units[None, :]).ravel()
    if out.size < count:
        raise BlockMappingError(
            f"output buffer holds {out.size} ids, {count} needed", field="out", code=INVALID_BLOCK_IDS
        )
    result = out[:count]
    np.add(offsets[:, None], units[None, :], out=result.reshape(num_regions, unit_ids.size))
    return result
