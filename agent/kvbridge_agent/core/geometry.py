"""Block byte geometry of one TP rank's KV cache (docs/protocol.md §1).

A rank's cache is a set of *tensors* (distinct base addresses) viewed as
*regions*: the unit that descriptors are numbered in.  Every region of a
rank has the same block stride and the same bytes per block, so descriptor
addresses of a whole rank are one numpy broadcast:

``addr = base[tensor[r]] + region_offset[r] + block * stride + sub * sub_bytes + offset``

- ``Split``: one K and one V tensor per layer; region ``2*layer + kv``.
- ``BlocksFirst``: one tensor per layer holding K then V inside each block;
  two virtual regions per layer (the K half and the V half).
- MLA: one latent tensor per layer.
- ``CrossLayer``: one tensor for the whole model; a block holds every
  layer's K and V with heads outermost (``[heads, layers, 2, tokens, dim]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .arithmetic import exact_div
from .errors import SpecError
from .model import CacheKind, ModelGeometry

IntArray = npt.NDArray[np.int64]


def heads_local(model: ModelGeometry, tensor_parallel_size: int) -> int:
    """KV heads held by one rank: ``max(1, K // tp)`` (replicated when ``tp > K``); 1 for MLA."""
    if model.is_mla:
        return 1
    return max(1, model.num_kv_heads // tensor_parallel_size)


def head_bytes(model: ModelGeometry, block_size: int) -> int:
    """Bytes of one head (or the MLA latent) for ``block_size`` tokens."""
    return block_size * model.head_dim * model.element_bytes


@dataclass(frozen=True, slots=True)
class RegionLayout:
    """How one rank's tensors are addressed as regions of equal-sized blocks."""

    num_tensors: int
    #: bytes from one block to the next inside a tensor
    block_stride: int
    #: bytes of one block of one region (one layer's K, the K half, the latent, the whole model's block)
    unit_bytes: int
    #: per region: which tensor it lives in, and its byte offset inside a block of that tensor
    region_tensor: tuple[int, ...]
    region_offset: tuple[int, ...]

    @property
    def num_regions(self) -> int:
        return len(self.region_tensor)


def region_layout(
    model: ModelGeometry, block_size: int, tensor_parallel_size: int, *, num_tensors: int | None = None
) -> RegionLayout:
    """The region layout of one rank with the given block size and TP size.

    ``num_tensors`` describes an engine that shares tensors between layers
    (hybrid allocators hand the same ``data_ptr()`` several times): after
    deduplication each distinct tensor keeps its regions (one, or two halves
    for ``BlocksFirst``).  ``None`` means one tensor per layer and K/V as the
    cache kind defines.
    """
    if block_size < 1 or tensor_parallel_size < 1:
        raise SpecError("block size and tensor-parallel size must be at least 1", code="INVALID_SPEC")
    layers = model.num_layers
    per_head = head_bytes(model, block_size)
    unit = per_head * heads_local(model, tensor_parallel_size)
    if model.is_mla:
        tensors, stride, halves = layers, per_head, 1
        unit = per_head
    elif model.cache_kind is CacheKind.SPLIT:
        tensors, stride, halves = 2 * layers, unit, 1
    elif model.cache_kind is CacheKind.BLOCKS_FIRST:
        tensors, stride, halves = layers, 2 * unit, 2
    else:
        unit = unit * 2 * layers
        tensors, stride, halves = 1, unit, 1
    if num_tensors is not None:
        if num_tensors < 1 or num_tensors > tensors:
            raise SpecError(
                f"{num_tensors} distinct tensors cannot hold a {model.cache_kind.value} cache of {layers} layers",
                field="tensors",
                code="REGION_COUNT_MISMATCH",
            )
        tensors = num_tensors
    region_tensor = tuple(t for t in range(tensors) for _ in range(halves))
    region_offset = tuple(half * unit for _ in range(tensors) for half in range(halves))
    return RegionLayout(tensors, stride, unit, region_tensor, region_offset)


def strided_rows(
    bases: Sequence[int],
    layout: RegionLayout,
    num_blocks: int,
    *,
    units_per_block: int = 1,
    offset: int = 0,
    length: int | None = None,
    device_id: int = 0,
) -> IntArray | None:
    """The same descriptors as :func:`unit_addresses` in NIXL's compact strided form.

    One row per region: ``(address, length, device, stride, count)``.  ``None``
    when the units of a region are not evenly spaced (``BlocksFirst`` viewed
    as sub-blocks), in which case the caller lists every descriptor.
    """
    sub_bytes, span = _descriptor_span(bases, layout, units_per_block, offset, length)
    if units_per_block > 1 and layout.block_stride != units_per_block * sub_bytes:
        return None
    spacing = sub_bytes if units_per_block > 1 else layout.block_stride
    base = np.asarray(bases, dtype=np.int64)[np.asarray(layout.region_tensor, dtype=np.int64)]
    rows = np.empty((layout.num_regions, 5), dtype=np.int64)
    rows[:, 0] = base + np.asarray(layout.region_offset, dtype=np.int64) + offset
    rows[:, 1] = span
    rows[:, 2] = device_id
    rows[:, 3] = spacing
    rows[:, 4] = num_blocks * units_per_block
    return rows


def _descriptor_span(
    bases: Sequence[int], layout: RegionLayout, units_per_block: int, offset: int, length: int | None
) -> tuple[int, int]:
    """``(sub-unit bytes, descriptor length)``, or a typed error if the descriptors would not fit."""
    if len(bases) != layout.num_tensors:
        raise SpecError(
            f"expected {layout.num_tensors} tensor base addresses for this cache layout, got {len(bases)}",
            field="bases",
            code="REGION_COUNT_MISMATCH",
        )
    sub_bytes = exact_div(layout.unit_bytes, units_per_block, what="region block bytes per sub-unit")
    span = sub_bytes - offset if length is None else length
    if offset < 0 or span <= 0 or offset + span > sub_bytes:
        raise SpecError(
            f"descriptor [{offset}, {offset + span}) does not fit in a {sub_bytes}-byte unit",
            field="offset",
            code="DESCRIPTOR_OUT_OF_BOUNDS",
        )
    return sub_bytes, span


def unit_addresses(
    bases: Sequence[int],
    layout: RegionLayout,
    num_blocks: int,
    *,
    units_per_block: int = 1,
    offset: int = 0,
    length: int | None = None,
) -> IntArray:
    """Start addresses of every descriptor of one rank, region-major then unit order.

    Each block of each region is viewed as ``units_per_block`` equal sub-units
    (prefill wire blocks after a split, or decode sub-blocks before a merge);
    every descriptor starts ``offset`` bytes into its unit and is ``length``
    bytes long.  Adjacent units of a region stay adjacent in the result, so
    NIXL can merge contiguous descriptors.  The descriptor with id
    ``region * num_blocks * units_per_block + unit`` is element ``id``.
    """
    if num_blocks < 1:
        raise SpecError("num_blocks must be at least 1", field="num_blocks", code="INVALID_SPEC")
    sub_bytes, _span = _descriptor_span(bases, layout, units_per_block, offset, length)
    base = np.asarray(bases, dtype=np.int64)[np.asarray(layout.region_tensor, dtype=np.int64)]
    region_start = base + np.asarray(layout.region_offset, dtype=np.int64) + offset
    units = np.arange(num_blocks * units_per_block, dtype=np.int64)
    unit_start = (units // units_per_block) * layout.block_stride + (units % units_per_block) * sub_bytes
    return (region_start[:, None] + unit_start[None, :]).ravel()
