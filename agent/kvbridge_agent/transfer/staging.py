"""Staging buffers and the indexed copies of staged reads (docs/protocol.md §4d), on the cache's own device.

- :class:`StagingPool`: one registered buffer in equal pieces; a request takes an extent of whole pieces and gives
  it back (bounded and reused: a request that finds no room reads directly).
- :class:`RowMap`: one side's segments of one request as rows of its tensors, in wire order (``core.staging``): the
  index arrays the copies use, built with numpy.
- :func:`pack` (prefill: the cache's segments into a staging extent) and :func:`scatter` (decode: a staging extent
  into the cache's segments, a range of segments at a time): torch indexing on any device — one ``index_select``
  (or ``index_copy_``) per tensor span, straight between the cache's rows and the staging bytes; on host memory the
  scatter of rows of at least :data:`NUMPY_ROW_BYTES` is numpy's fancy assignment over the same memory (whole rows
  at memcpy speed: 22-24 GB/s against 4-11 for torch's ``index_copy_`` on this 2-core host). Nothing loops over
  blocks or segments in Python.
- On host memory every copy runs on one thread (:func:`one_thread`): torch's OpenMP pool on a shared 2-core host
  gathered 8 KiB rows at 3 GB/s with two threads and 7.5 with one (32 KiB rows: 2 and 18), and a 512 KiB gather
  took 17 ms instead of 0.01 while the machine was loaded.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from kvbridge_agent.core import SpecError
from kvbridge_agent.core.blocks import DescriptorIds, IntArray
from kvbridge_agent.core.staging import STAGING_UNSUPPORTED, Segments
from kvbridge_agent.transfer.transport import Transport

#: bytes of one piece of a staging buffer: the unit of its extents and of the descriptors that read it
PIECE_BYTES = 1 << 20
#: tensor spans of one request's segments in wire order at most (one per tensor: 2 per layer for ``Split`` caches)
MAX_SPANS = 1 << 16
#: host memory: rows at least this long are scattered by numpy (shorter ones by torch, which did better there)
NUMPY_ROW_BYTES = 4 << 10
_THREADS = threading.Lock()


@contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """Host memory: torch's intra-op pool at one thread for the copies inside (process-wide: the other threads of
    this process that use torch meanwhile run on one thread too, which changes nothing but their pace)."""
    if device.type != "cpu":
        yield
        return
    with _THREADS:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


@dataclass(frozen=True, slots=True)
class Extent:
    """Pieces ``[first, first + pieces)`` of a pool, ``bytes`` of them used."""

    first: int
    pieces: int
    bytes: int


class StagingPool:
    """A registered staging buffer of ``pieces`` pieces of ``piece`` bytes; extents lent per owner."""

    def __init__(self, transport: Transport, device: torch.device | str, total_bytes: int, piece: int = PIECE_BYTES):
        self.piece = piece
        self.pieces = max(1, total_bytes // piece)
        self.tensor = torch.zeros(self.pieces * piece, dtype=torch.uint8, device=device)  # every page touched
        transport.register([self.tensor])
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.pieces)]  # (first, count), sorted, coalesced
        self._owners: dict[str, list[Extent]] = {}

    @property
    def base(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def bytes(self) -> int:
        return self.pieces * self.piece

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(count for _, count in self._free) * self.piece

    @property
    def owners(self) -> list[str]:
        with self._lock:
            return list(self._owners)

    def take(self, nbytes: int, owner: str, align: int = 1) -> Extent | None:
        """An extent of ``nbytes`` (whole pieces, its first piece a multiple of ``align``) for ``owner``, or
        ``None`` when no free range holds it (back-pressure: the caller reads directly)."""
        pieces = max(1, -(-nbytes // self.piece))
        with self._lock:
            for index, (first, count) in enumerate(self._free):
                start = -(-first // align) * align
                if start + pieces > first + count:
                    continue
                rest = [(first, start - first), (start + pieces, first + count - start - pieces)]
                self._free[index : index + 1] = [(f, c) for f, c in rest if c > 0]
                extent = Extent(start, pieces, nbytes)
                self._owners.setdefault(owner, []).append(extent)
                return extent
        return None

    def release(self, owner: str) -> int:
        """Give back every extent of ``owner``; returns the bytes freed."""
        with self._lock:
            extents = self._owners.pop(owner, [])
            for extent in extents:
                self._free.append((extent.first, extent.pieces))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for first, count in self._free:
                if merged and merged[-1][0] + merged[-1][1] == first:
                    merged[-1] = (merged[-1][0], merged[-1][1] + count)
                else:
                    merged.append((first, count))
            self._free = merged
        return sum(extent.pieces for extent in extents) * self.piece

    def region(self, extent: Extent, offset: int = 0) -> torch.Tensor:
        """An extent's bytes from ``offset`` to the end of its last piece."""
        start = extent.first * self.piece
        return self.tensor[start + offset : start + extent.pieces * self.piece]


def _element(row_bytes: int, tensors: list[torch.Tensor]) -> torch.dtype:
    """The widest element rows can be copied in: 8-byte words where rows and storages allow it."""
    aligned = all(t.data_ptr() % 8 == 0 for t in tensors)
    return torch.int64 if row_bytes % 8 == 0 and aligned else torch.uint8


def _rows(tensor: torch.Tensor, row_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor's bytes as ``[rows, row_bytes]`` in ``dtype`` (any tail shorter than a row left out)."""
    flat = tensor.reshape(-1).view(torch.uint8)
    whole = flat.numel() // row_bytes * row_bytes
    return flat[:whole].view(dtype).view(-1, row_bytes // torch.empty(0, dtype=dtype).element_size())


@dataclass
class RowMap:
    """One side's segments of one request in wire order: segment ``k`` is rows ``index[k, :]`` (each ``row_bytes``)
    of one tensor; ``spans`` are the ranges of segments ``[start, end)`` of one tensor each."""

    index: IntArray  # [segments, rows per segment]
    row_bytes: int
    spans: tuple[tuple[int, int, int], ...]  # (tensor, start, end)
    segment_bytes: int

    @classmethod
    def of(
        cls, segments: Segments, ids: DescriptorIds, row_bytes: int, order: IntArray, origin: int = 0, runs: int = 1
    ) -> RowMap:
        """Rows of the segments ``ids`` name (region-major, as READs list them: ``runs`` rows of units) taken in
        wire ``order`` (``core.staging.WireOrder``), ``origin`` bytes into each tensor's storage (a physical
        layout's logical origin)."""
        tensors, offsets = segments.offsets(ids, runs)
        return cls.placed(tensors[order], offsets[order], segments.length, row_bytes, origin)

    @classmethod
    def placed(cls, tensors: IntArray, offsets: IntArray, length: int, row_bytes: int, origin: int = 0) -> RowMap:
        """Rows of segments of ``length`` bytes at ``offsets`` of ``tensors``, in the order given;
        :data:`~kvbridge_agent.core.staging.STAGING_UNSUPPORTED` past :data:`MAX_SPANS` tensor spans."""
        segments_length = length
        per = segments_length // row_bytes
        index = ((offsets + origin) // row_bytes)[:, None] + np.arange(per, dtype=np.int64)[None, :]
        changes = np.flatnonzero(tensors[1:] != tensors[:-1]) + 1
        if changes.size >= MAX_SPANS:
            raise SpecError(
                f"{changes.size + 1} tensor spans in one request, at most {MAX_SPANS}",
                field="stage.plan",
                code=STAGING_UNSUPPORTED,
            )
        bounds = [0, *changes.tolist(), int(tensors.size)] if tensors.size else []
        spans = tuple((int(tensors[a]), a, b) for a, b in itertools.pairwise(bounds))
        return cls(index, row_bytes, spans, segments_length)

    @property
    def segments(self) -> int:
        return int(self.index.shape[0])

    @property
    def bytes(self) -> int:
        return self.segments * self.segment_bytes


def _staged_rows(staging: torch.Tensor, rows: RowMap, dtype: torch.dtype) -> torch.Tensor:
    """The staging bytes as ``[segments * rows per segment, words]``."""
    words = rows.row_bytes // torch.empty(0, dtype=dtype).element_size()
    return staging[: rows.bytes].view(dtype).view(-1, words)


def pack(tensors: list[torch.Tensor], rows: RowMap, staging: torch.Tensor) -> None:
    """Prefill: copy the request's segments from ``tensors`` (the cache's) into ``staging`` in wire order: one
    gather per tensor span, straight into the staging bytes."""
    dtype = _element(rows.row_bytes, [*tensors, staging])
    device, per = staging.device, rows.index.shape[1]
    out = _staged_rows(staging, rows, dtype)
    with one_thread(device):
        for tensor, start, end in rows.spans:
            index = torch.from_numpy(rows.index[start:end].reshape(-1)).to(device)
            source = _rows(tensors[tensor], rows.row_bytes, dtype)
            torch.index_select(source, 0, index, out=out[start * per : end * per])


def scatter(
    tensors: list[torch.Tensor],
    rows: RowMap,
    staging: torch.Tensor,
    segments: tuple[int, int],
    use_numpy: bool = True,
) -> None:
    """Decode: copy segments ``[start, end)`` of a request from ``staging`` (wire order) into the cache's; long rows
    on host memory by numpy (``use_numpy``), anything else by torch."""
    first, last = segments
    dtype = _element(rows.row_bytes, [*tensors, staging])
    source, per = _staged_rows(staging, rows, dtype), rows.index.shape[1]
    on_host = use_numpy and staging.device.type == "cpu" and rows.row_bytes >= NUMPY_ROW_BYTES
    with one_thread(staging.device):
        for tensor, start, end in rows.spans:
            start, end = max(start, first), min(end, last)
            if start >= end:
                continue
            target = _rows(tensors[tensor], rows.row_bytes, dtype)
            index = rows.index[start:end].reshape(-1)
            if on_host:
                target.numpy()[index] = source[start * per : end * per].numpy()
            else:
                target.index_copy_(0, torch.from_numpy(index).to(target.device), source[start * per : end * per])
    if staging.device.type == "cuda":  # the bytes are in place before the read is reported done
        torch.cuda.current_stream(staging.device).synchronize()


#: a rank's staging buffer in MiB (0: none); unset: :data:`DEFAULT_STAGING_BYTES`, at most the cache's size. Off by
#: default in this version: agents from before staged reads refuse a rank metadata that announces a buffer, so a
#: rollout across versions would fail reads (the next version turns it on, once every decode accepts it)
STAGING_MIB_VARIABLE = "KVBRIDGE_STAGING_MIB"
#: ``auto`` (the cost model picks per request), ``direct`` or ``staged`` (where the peer stages)
STAGING_MODE_VARIABLE = "KVBRIDGE_STAGING_MODE"
DEFAULT_STAGING_BYTES = 0


def staging_bytes(environ: Mapping[str, str], cache_bytes: int) -> int:
    """A rank's staging buffer from the environment (``KVBRIDGE_STAGING_MIB``): whole pieces, 0 for none."""
    text = environ.get(STAGING_MIB_VARIABLE, "").strip()
    wanted = int(text) << 20 if text.isdigit() else min(DEFAULT_STAGING_BYTES, cache_bytes + 2 * PIECE_BYTES)
    return -(-wanted // PIECE_BYTES) * PIECE_BYTES if wanted > 0 else 0


def staging_mode(environ: Mapping[str, str]) -> str:
    mode = environ.get(STAGING_MODE_VARIABLE, "auto").strip().lower()
    return mode if mode in ("auto", "direct", "staged") else "auto"
