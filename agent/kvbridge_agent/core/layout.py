"""Physical KV cache layouts as byte strides over the logical ``[L, B, H, N, C]`` (docs/protocol.md §1b).

vLLM (0.32) describes the physical layout of a cache group as a ``KVCacheLayout``: a stride permutation over the
logical axes layer ``L``, block ``B``, head ``H``, token ``N`` and content ``C`` (a token's keys then its values,
packed). This module names the six members as vLLM does (:class:`PhysicalOrder`), describes one rank's cache of one
group as byte strides over its own heads (:class:`PhysicalLayout`, ``C`` counted in bytes), and computes what a plan
needs from it:

- :func:`block_runs`: the maximal contiguous byte runs of one block (optionally of a head range), coalescing
  adjacent axes from the innermost outwards — the descriptors one block takes. A cross-layer order (block outermost:
  ``BLHNC``, ``BLNHC``, ``BHLNC``) is one run per block for every layer.
- :func:`paired_runs`: how a source's runs pair with a target's for READs. Both sides are cut at the finest common
  granularity: the longest run of innermost axes that is in the same order and contiguous on *both* sides. The axes
  outside it are enumerated in logical order (``L``, then ``H``, then ``N``) on both sides, so run ``i`` of the
  source holds the same logical bytes, in the same order, as run ``i`` of the target. Equal orders coalesce fully
  (one run per block for cross-layer orders, one per layer for ``LBHNC``/``LBNHC``); different orders pair at the
  finest common granularity (``BLHNC`` -> ``LBNHC``: one token of one head, ``C`` bytes). No byte is permuted after
  the read: every layout pair is served exactly, at the price of more, smaller descriptors where the orders differ
  (a conversion step that permutes blocks in place would trade them for a copy; not done here).
- :func:`run_regions`: runs as the :class:`~.geometry.RegionLayout` that descriptor ids are numbered in (one region
  per run, ``desc_id = run * num_blocks + block``).

Pure: numpy only. Every refusal is a :class:`~.errors.SpecError` with a stable code and the field at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from math import prod

import numpy as np
import numpy.typing as npt
from pydantic import Field, model_validator

from .errors import SpecError
from .geometry import RegionLayout
from .model import MAX_BLOCK_SIZE, CacheKind, CamelModel, KVLayout

IntArray = npt.NDArray[np.int64]

#: the logical axes, in the order strides and shapes are given
AXES = "LBHNC"
L, B, H, N, C = range(5)

#: the most runs one block may be cut into (layers x heads x tokens): a bound on the plan's work for a peer's layout
MAX_RUNS_PER_BLOCK = 1 << 22

# Stable error codes of layout descriptions.
LAYOUT_INCONSISTENT = "LAYOUT_INCONSISTENT"
LAYOUT_MISMATCH = "LAYOUT_MISMATCH"
HEAD_RANGE_INVALID = "HEAD_RANGE_INVALID"


class PhysicalOrder(StrEnum):
    """vLLM's ``KVCacheLayout`` members: the logical axes from the outermost in memory to the innermost."""

    LBHNC = "LBHNC"
    LBNHC = "LBNHC"
    LHBNC = "LHBNC"
    BLHNC = "BLHNC"
    BLNHC = "BLNHC"
    BHLNC = "BHLNC"

    @property
    def axes(self) -> tuple[int, ...]:
        """Logical axis indices, outermost first (vLLM's ``stride_order``)."""
        return tuple(AXES.index(letter) for letter in self.value)

    @property
    def cross_layer(self) -> bool:
        """Block outermost: a block holds every layer's bytes, so it can be one run for all layers."""
        return self.axes[0] == B


def rendered_order(kv_layout: KVLayout, cache_kind: CacheKind) -> PhysicalOrder:
    """The layout a vLLM pod of a role runs (kvbridge renders it as ``VLLM_KV_CACHE_LAYOUT``): one block-major
    tensor for all layers for the cross-layer cache kind, else per layer, heads or tokens outermost in a block."""
    if cache_kind is CacheKind.CROSS_LAYER:
        return PhysicalOrder.BHLNC
    return PhysicalOrder.LBHNC if kv_layout is KVLayout.HND else PhysicalOrder.LBNHC


def dense_strides(order: PhysicalOrder, shape: tuple[int, int, int, int, int]) -> tuple[int, int, int, int, int]:
    """Byte strides of a dense (unpadded) cache of ``shape`` laid out in ``order``."""
    strides = [0] * 5
    current = 1
    for axis in reversed(order.axes):
        strides[axis] = current
        current *= shape[axis]
    return (strides[0], strides[1], strides[2], strides[3], strides[4])


#: the largest L, B (kernel blocks: 2^24 blocks of up to 4096 tokens), H, N and C (bytes) a physical layout may have
_MAX_SHAPE = (1024, (1 << 24) * MAX_BLOCK_SIZE, 4096, MAX_BLOCK_SIZE, 1 << 20)


class PhysicalLayout(CamelModel):
    """One rank's cache of one group: the byte address of logical ``(l, b, h, n, c)`` is
    ``origin + l*sL + b*sB + h*sH + n*sN + c`` (``C`` is bytes, stride 1; ``H`` counts this rank's heads).

    Strides may exceed the dense ones (padding, overlaid groups) but must respect ``order``: walking from the
    innermost axis outwards, each axis of more than one element starts at or after the end of the axes inside it.
    """

    order: PhysicalOrder
    shape: tuple[int, int, int, int, int] = Field(description="Sizes of L, B, H, N and C (bytes).")
    strides: tuple[int, int, int, int, int] = Field(description="Byte strides of L, B, H, N and C.")

    @model_validator(mode="after")
    def _consistent(self) -> PhysicalLayout:
        # bounds first (a peer's layout arrives on the side channel): layers, (kernel) blocks, heads, tokens and
        # bytes of content each within what a real cache has, strides within a 2^48-byte address space
        for name, size, most in zip("LBHNC", self.shape, _MAX_SHAPE, strict=True):
            if size > most:
                raise SpecError(f"{name} of {size} exceeds {most}", field="kvCacheLayout", code=LAYOUT_INCONSISTENT)
        if any(not 0 <= stride < 1 << 48 for stride in self.strides):
            raise SpecError(
                f"strides {self.strides} leave the address space", field="kvCacheLayout", code=LAYOUT_INCONSISTENT
            )
        problem = layout_problem(self.order, self.shape, self.strides)
        if problem:
            raise SpecError(problem, field="kvCacheLayout", code=LAYOUT_INCONSISTENT)
        return self

    @classmethod
    def dense(
        cls, order: PhysicalOrder, layers: int, blocks: int, heads: int, tokens: int, content_bytes: int
    ) -> PhysicalLayout:
        shape = (layers, blocks, heads, tokens, content_bytes)
        return cls(order=order, shape=shape, strides=dense_strides(order, shape))

    @property
    def num_layers(self) -> int:
        return self.shape[L]

    @property
    def num_blocks(self) -> int:
        return self.shape[B]

    @property
    def num_heads(self) -> int:
        return self.shape[H]

    @property
    def block_size(self) -> int:
        return self.shape[N]

    @property
    def content_bytes(self) -> int:
        return self.shape[C]

    @property
    def extent(self) -> int:
        """Bytes from the first byte of the cache to one past its last."""
        return sum((size - 1) * stride for size, stride in zip(self.shape, self.strides, strict=True)) + 1

    def offsets(self, index: tuple[IntArray | int, ...]) -> IntArray:
        """Byte offsets of logical indices ``(l, b, h, n, c)`` (arrays broadcast)."""
        total = np.zeros((), dtype=np.int64)
        for axis, value in enumerate(index):
            total = total + np.asarray(value, dtype=np.int64) * self.strides[axis]
        return np.asarray(total, dtype=np.int64)


def layout_problem(
    order: PhysicalOrder, shape: tuple[int, int, int, int, int], strides: tuple[int, int, int, int, int]
) -> str:
    """Why strides cannot be ``order`` over ``shape`` (empty when they can)."""
    if any(size < 1 for size in shape):
        return f"every axis needs at least one element, got shape {shape} over {AXES}"
    if shape[L] * shape[H] * shape[N] > MAX_RUNS_PER_BLOCK:
        return f"{shape[L]} layers x {shape[H]} heads x {shape[N]} tokens exceed {MAX_RUNS_PER_BLOCK} per block"
    if strides[C] != 1:
        return f"the content axis must be contiguous (byte stride 1), got {strides[C]}"
    end = shape[C]
    for axis in reversed(order.axes[:-1]):
        if shape[axis] == 1:
            continue
        if strides[axis] < end:
            return (
                f"axis {AXES[axis]} has byte stride {strides[axis]}, but the axes inside it in {order.value} span "
                f"{end} bytes: these strides are not the {order.value} layout"
            )
        end = strides[axis] * shape[axis]
    return ""


@dataclass(frozen=True, slots=True)
class BlockRuns:
    """The contiguous byte runs of one block: run ``i`` of block ``b`` starts at
    ``origin + b * block_stride + offsets[i]`` and is ``length`` bytes long."""

    offsets: tuple[int, ...]
    length: int
    block_stride: int

    @property
    def count(self) -> int:
        """Descriptors per block."""
        return len(self.offsets)

    @property
    def bytes_per_block(self) -> int:
        return self.count * self.length


def _head_range(layout: PhysicalLayout, heads: tuple[int, int] | None, side: str) -> tuple[int, int]:
    first, end = (0, layout.num_heads) if heads is None else heads
    if not 0 <= first < end <= layout.num_heads:
        raise SpecError(
            f"head range [{first}, {end}) is not inside the {layout.num_heads} heads of the {side}'s cache",
            field=f"{side}.heads",
            code=HEAD_RANGE_INVALID,
        )
    return first, end


def _inner_axes(order: PhysicalOrder, sizes: dict[int, int]) -> list[int]:
    """The axes inside a block, outermost first, leaving out those of one element (they hold no stride)."""
    return [axis for axis in order.axes if axis != B and sizes[axis] > 1]


def paired_runs(
    source: PhysicalLayout,
    target: PhysicalLayout,
    source_heads: tuple[int, int] | None = None,
    target_heads: tuple[int, int] | None = None,
) -> tuple[BlockRuns, BlockRuns]:
    """The runs of one block on each side such that run ``i`` of the source holds, byte for byte, the logical
    content of run ``i`` of the target (see the module's docstring for the choice)."""
    s_first, s_end = _head_range(source, source_heads, "source")
    t_first, t_end = _head_range(target, target_heads, "target")
    for axis, name in ((L, "layers"), (N, "tokens per (kernel) block"), (C, "content bytes per token and head")):
        if source.shape[axis] != target.shape[axis]:
            raise SpecError(
                f"{name}: the source has {source.shape[axis]}, the target {target.shape[axis]}",
                field=f"kvCacheLayout.shape.{AXES[axis]}",
                code=LAYOUT_MISMATCH,
            )
    if s_end - s_first != t_end - t_first:
        raise SpecError(
            f"the source offers {s_end - s_first} heads, the target takes {t_end - t_first}",
            field="kvCacheLayout.shape.H",
            code=LAYOUT_MISMATCH,
        )
    sizes = {L: source.shape[L], H: s_end - s_first, N: source.shape[N], C: source.shape[C]}
    outer_s, outer_t = _inner_axes(source.order, sizes), _inner_axes(target.order, sizes)
    run = 1
    common: set[int] = set()
    while outer_s and outer_t and outer_s[-1] == outer_t[-1]:
        axis = outer_s[-1]
        if source.strides[axis] != run or target.strides[axis] != run:
            break
        run *= sizes[axis]
        common.add(axis)
        outer_s.pop()
        outer_t.pop()
    outer = [axis for axis in (L, H, N) if axis not in common and sizes[axis] > 1]
    grid = (
        np.indices([sizes[axis] for axis in outer], dtype=np.int64).reshape(len(outer), -1)
        if outer
        else np.zeros((0, 1), dtype=np.int64)
    )

    def starts(layout: PhysicalLayout, first_head: int) -> tuple[int, ...]:
        base = first_head * layout.strides[H]
        offsets = sum((grid[k] * layout.strides[axis] for k, axis in enumerate(outer)), np.zeros(1, np.int64))
        return tuple(int(x) for x in np.broadcast_to(base + offsets, (grid.shape[1],)))

    return (
        BlockRuns(starts(source, s_first), run, source.strides[B]),
        BlockRuns(starts(target, t_first), run, target.strides[B]),
    )


def block_runs(layout: PhysicalLayout, heads: tuple[int, int] | None = None) -> BlockRuns:
    """The maximal contiguous byte runs of one block (of a head range), in logical order of their first byte."""
    return paired_runs(layout, layout, heads, heads)[0]


def kernel_blocks(block_ids: IntArray, ratio: int) -> IntArray:
    """The kernel blocks of ``block_ids`` when an engine's kernels split each block into ``ratio`` (vLLM's kernel
    block size below the block size): block ``b`` is kernel blocks ``b*ratio .. b*ratio + ratio - 1``, in token
    order."""
    if ratio == 1:
        return block_ids
    return (block_ids[:, None] * ratio + np.arange(ratio, dtype=np.int64)[None, :]).ravel()


def run_regions(runs: BlockRuns, origin: int = 0) -> RegionLayout:
    """Runs as regions of one registered base: region ``i`` is run ``i``, ``origin`` bytes past the base."""
    return RegionLayout(
        num_tensors=1,
        block_stride=runs.block_stride,
        unit_bytes=runs.length,
        region_tensor=(0,) * runs.count,
        region_offset=tuple(origin + offset for offset in runs.offsets),
    )


def descriptors_per_request(runs: BlockRuns, blocks: int) -> int:
    """Descriptors one request of ``blocks`` blocks posts on one side (before NIXL merges adjacent ones)."""
    return runs.count * blocks


def block_bytes(layout: PhysicalLayout) -> int:
    """Logical bytes of one block of every layer and head (padding excluded)."""
    return prod(layout.shape[axis] for axis in (L, H, N, C))
