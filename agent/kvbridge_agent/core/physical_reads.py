"""What one decode rank reads from each prefill rank when both caches have physical layouts (docs/protocol.md §1c).

Two engines on vLLM's ``KVCacheLayout`` views need no re-lay of blocks: every conversion is a choice of
descriptors, made once per peer.

- :func:`shared_heads`: a TP mapping. The KV heads a prefill rank and a decode rank both hold, numbered on each
  side (MLA's latent, and heads replicated when TP exceeds them, count as one head every rank holds).
- :func:`chunk_tokens` and :func:`chunked`: a block-size conversion. Both sides' (kernel) blocks are cut into
  chunks of the smaller size; a chunk is a block of that size at a fixed stride inside its block.
- :class:`ChunkRuns` and :func:`physical_read`: the paired runs of one chunk on both sides (:func:`.layout.paired_runs`
  over the shared heads), repeated per chunk: descriptor region ``r * chunks + c`` is run ``r`` of chunk ``c``.
- :class:`ChunkSide` and :func:`map_chunks`: per request, the chunks to read in token order on both sides, from
  the block ids vLLM gives decode and the (wire) block ids prefill offered; numpy, no loop per block.
- :func:`chunk_descriptor_ids`: those chunks as descriptor ids of each side's prepped list.

Pure: numpy only. Refusals are :class:`~.errors.SpecError` or :class:`~.errors.BlockMappingError` with stable codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .arithmetic import ceil_div
from .blocks import (
    BLOCK_ID_OUT_OF_RANGE,
    LOCAL_LONGER_THAN_REMOTE,
    TOKENS_EXCEED_BLOCKS,
    BlockIds,
    DescriptorIds,
    IntArray,
    as_block_ids,
    descriptor_ids,
)
from .errors import BlockMappingError, SpecError
from .geometry import heads_local
from .layout import BlockRuns, N, PhysicalLayout, paired_runs
from .model import ModelGeometry

#: a head range, a block size or a chunk that two physical layouts cannot share (stable code)
CHUNKS_MISMATCH = "CHUNKS_MISMATCH"


def shared_heads(
    model: ModelGeometry, tp_prefill: int, tp_decode: int, prefill_rank: int, decode_rank: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(prefill's head range, decode's head range)``: the global heads both ranks hold, as ``[first, end)`` of
    each rank's own heads. Rank ``r`` of ``tp`` holds global heads from ``r * K // tp`` (``K`` the model's KV heads,
    one for MLA), ``heads_local(model, tp)`` of them."""
    total = 1 if model.is_mla else model.num_kv_heads
    p_first, d_first = prefill_rank * total // tp_prefill, decode_rank * total // tp_decode
    p_end = p_first + heads_local(model, tp_prefill)
    d_end = d_first + heads_local(model, tp_decode)
    first, end = max(p_first, d_first), min(p_end, d_end)
    if first >= end:
        raise SpecError(
            f"prefill rank {prefill_rank} of TP {tp_prefill} holds heads [{p_first}, {p_end}) and decode rank "
            f"{decode_rank} of TP {tp_decode} heads [{d_first}, {d_end}): none in common, nothing to read",
            field="spec.decode.tensorParallelSize",
            code=CHUNKS_MISMATCH,
        )
    return (first - p_first, end - p_first), (first - d_first, end - d_first)


def chunk_tokens(source: PhysicalLayout, target: PhysicalLayout) -> int:
    """Tokens of one chunk: the smaller (kernel) block size, which must divide the larger."""
    small, large = sorted((source.block_size, target.block_size))
    if large % small:
        raise SpecError(
            f"{source.block_size}-token and {target.block_size}-token (kernel) blocks: one must divide the other",
            field="spec.decode.blockSize",
            code=CHUNKS_MISMATCH,
        )
    return small


def chunked(layout: PhysicalLayout, tokens: int) -> PhysicalLayout:
    """The first chunk of ``tokens`` tokens of each block, at the block's own strides (chunk ``c`` is it shifted by
    ``c * tokens`` token strides)."""
    shape = list(layout.shape)
    shape[N] = tokens
    return PhysicalLayout(
        order=layout.order, shape=(shape[0], shape[1], shape[2], shape[3], shape[4]), strides=layout.strides
    )


@dataclass(frozen=True, slots=True)
class ChunkRuns:
    """One side's runs of one chunk, and the chunks of its ``blocks`` (kernel) blocks: descriptor region
    ``r * chunks + c`` starts at ``offsets[r] + c * chunk_stride`` from the cache's origin; block ``b`` adds
    ``b * runs.block_stride``."""

    runs: BlockRuns
    chunks: int
    chunk_stride: int
    blocks: int

    @property
    def regions(self) -> BlockRuns:
        """Every (run, chunk) as a run of the block, region-major in the order descriptor ids count them."""
        offsets = np.add.outer(
            np.asarray(self.runs.offsets, dtype=np.int64),
            np.arange(self.chunks, dtype=np.int64) * self.chunk_stride,
        ).ravel()
        return BlockRuns(tuple(int(x) for x in offsets), self.runs.length, self.runs.block_stride)


@dataclass(frozen=True, slots=True)
class PhysicalRead:
    """The READs of every request from one prefill rank: its runs paired with this decode rank's, chunk by chunk."""

    prefill_rank: int
    source: ChunkRuns
    target: ChunkRuns
    #: tokens of one chunk (:func:`chunk_tokens`)
    tokens: int


def physical_read(
    prefill_rank: int,
    source: PhysicalLayout,
    target: PhysicalLayout,
    heads: tuple[tuple[int, int], tuple[int, int]],
) -> PhysicalRead:
    """The runs of a READ from ``source`` (a prefill rank's layout) into ``target`` (this decode rank's) of the
    shared ``heads`` (:func:`shared_heads`), both cut into chunks of the smaller block."""
    tokens = chunk_tokens(source, target)
    source_runs, target_runs = paired_runs(chunked(source, tokens), chunked(target, tokens), *heads)
    return PhysicalRead(
        prefill_rank,
        ChunkRuns(source_runs, source.block_size // tokens, tokens * source.strides[N], source.num_blocks),
        ChunkRuns(target_runs, target.block_size // tokens, tokens * target.strides[N], target.num_blocks),
        tokens,
    )


@dataclass(frozen=True, slots=True)
class ChunkSide:
    """How one side's listed block ids cover tokens: each listed unit is ``unit_tokens`` tokens of a block of
    ``block_tokens`` (``units_per_block`` units per block: prefill's wire blocks after a split, else blocks), a block
    is ``block_tokens // kernel_tokens`` kernel blocks (vLLM's kernel block size), each ``kernel_tokens // tokens``
    chunks."""

    block_tokens: int
    units_per_block: int
    kernel_tokens: int
    tokens: int

    def __post_init__(self) -> None:
        unit, rest = divmod(self.block_tokens, self.units_per_block)
        if min(self.tokens, unit) < 1 or rest or unit % self.tokens or self.kernel_tokens % self.tokens:
            raise SpecError(
                f"{self.block_tokens}-token blocks in {self.units_per_block} unit(s) of {self.kernel_tokens}-token "
                f"kernel blocks cannot be cut into {self.tokens}-token chunks",
                field="spec.decode.blockSize",
                code=CHUNKS_MISMATCH,
            )
        if self.block_tokens % self.kernel_tokens:
            raise SpecError(
                f"{self.kernel_tokens}-token kernel blocks do not split {self.block_tokens}-token blocks",
                field="spec.blockSize",
                code=CHUNKS_MISMATCH,
            )

    @property
    def unit_tokens(self) -> int:
        return self.block_tokens // self.units_per_block

    @property
    def chunks(self) -> int:
        return self.kernel_tokens // self.tokens

    def positions(self, unit_ids: IntArray, first: int, count: int) -> tuple[IntArray, IntArray]:
        """``(kernel block, chunk)`` of chunks ``first .. first + count - 1`` of the listed units, in token order."""
        per_unit = self.unit_tokens // self.tokens
        index = np.arange(first, first + count, dtype=np.int64)
        units = unit_ids[index // per_unit]
        token = (units % self.units_per_block) * self.unit_tokens + (index % per_unit) * self.tokens
        kernels = units // self.units_per_block * (self.block_tokens // self.kernel_tokens)
        return kernels + token // self.kernel_tokens, (token % self.kernel_tokens) // self.tokens


@dataclass(frozen=True, slots=True)
class MappedChunks:
    """One request's chunks to read: decode's ``(local_blocks[i], local_chunks[i])`` receives prefill's
    ``(remote_blocks[i], remote_chunks[i])`` (kernel blocks, chunk within)."""

    local_blocks: IntArray
    local_chunks: IntArray
    remote_blocks: IntArray
    remote_chunks: IntArray
    #: the first of prefill's chunks read, counted in token order over its listed units (a staged read names the
    #: chunks ``first .. first + len - 1``, docs/protocol.md §4d)
    first: int = 0

    @property
    def full_hit(self) -> bool:
        return self.local_blocks.size == 0


def map_chunks(
    local_block_ids: BlockIds, remote_unit_ids: BlockIds, num_tokens: int, local: ChunkSide, remote: ChunkSide
) -> MappedChunks:
    """Pair a request's decode blocks (those still to fill: a prefix hit leaves out whole first blocks) with the
    prefill units that hold the same tokens, chunk by chunk, through the last chunk both sides hold."""
    local_ids = as_block_ids(local_block_ids, field="request.local_block_ids")
    remote_ids = as_block_ids(remote_unit_ids, field="request.remote_block_ids")
    if local.tokens != remote.tokens:
        raise SpecError(
            f"decode reads {local.tokens}-token chunks, prefill's are {remote.tokens}",
            field="chunks",
            code=CHUNKS_MISMATCH,
        )
    total_local = ceil_div(num_tokens, local.block_tokens)
    if local_ids.size > total_local:
        raise BlockMappingError(
            f"{local_ids.size} local blocks but the prompt's {num_tokens} tokens fill only {total_local} local "
            f"block(s) of {local.block_tokens} tokens",
            field="request.local_block_ids",
            code=LOCAL_LONGER_THAN_REMOTE,
        )
    if remote_ids.size * remote.unit_tokens < num_tokens:
        raise BlockMappingError(
            f"{num_tokens} tokens but prefill offered {remote_ids.size} blocks of {remote.unit_tokens} tokens",
            field="request.remote_block_ids",
            code=TOKENS_EXCEED_BLOCKS,
        )
    empty = np.zeros(0, dtype=np.int64)
    if local_ids.size == 0:
        return MappedChunks(empty, empty, empty, empty)
    first = (total_local - local_ids.size) * (local.block_tokens // local.tokens)
    # whole blocks where both sides hold them: the tail of the last block past the prompt is read when prefill's
    # blocks cover it too (bytes the engines never use, at no extra descriptor for equal block sizes)
    count = min(
        local_ids.size * (local.block_tokens // local.tokens),
        remote_ids.size * remote.unit_tokens // local.tokens - first,
    )
    local_blocks, local_chunks = local.positions(local_ids, 0, count)
    remote_blocks, remote_chunks = remote.positions(remote_ids, first, count)
    return MappedChunks(local_blocks, local_chunks, remote_blocks, remote_chunks, first)


def chunk_descriptor_ids(
    blocks: IntArray, chunks: IntArray, runs: ChunkRuns, *, out: DescriptorIds | None = None
) -> DescriptorIds:
    """Descriptor ids of chunks ``(blocks[i], chunks[i])`` for every run, run-major: ``(r * runs.chunks +
    chunk) * runs.blocks + block`` — the numbering of a list prepped from :attr:`ChunkRuns.regions`, which is
    :func:`~.blocks.descriptor_ids` over the units ``chunk * blocks + block``."""
    if blocks.size and int(blocks.max()) >= runs.blocks:
        raise BlockMappingError(
            f"block {int(blocks.max())} is outside the {runs.blocks} registered (kernel) blocks",
            field="request.block_ids",
            code=BLOCK_ID_OUT_OF_RANGE,
        )
    return descriptor_ids(chunks * runs.blocks + blocks, runs.runs.count, runs.chunks * runs.blocks, out=out)
