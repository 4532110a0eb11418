"""The staged-read cost model's constants, measured on this rank's device when it starts (a few milliseconds).

Over the first :data:`SCRATCH_BYTES` of the rank's staging buffer (registered already, nothing staged yet):

- NIXL, reading from this agent itself (NIXL's loopback: its own name as the remote agent): one descriptor of
  :data:`SCRATCH_BYTES`, then :data:`SMALL_COUNT` descriptors of :data:`SMALL_BYTES` in shuffled order (nothing to
  merge). The one descriptor gives the transfer rate; the difference, per extra descriptor, the cost of one.
- ``transfer.staging``'s pack and scatter over :data:`COPY_BYTES` (or the pool) in shuffled rows of
  :data:`ROW_BYTES`: the device's pack and scatter rates.

Each is the best of :data:`REPEATS` tries. Where NIXL refuses the loopback (a backend without it), the constants
fall back to :data:`FALLBACK` for the transfer terms, and the copies are still measured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from kvbridge_agent.core.staging import CostModel
from kvbridge_agent.transfer.staging import RowMap, StagingPool, pack, scatter
from kvbridge_agent.transfer.transport import Transport, TransportError

log = logging.getLogger(__name__)

SCRATCH_BYTES = 1 << 20
#: bytes the copies are timed over: beyond the caches (a 32 MiB L3 here), as a request's are
COPY_BYTES = 48 << 20
SMALL_BYTES = 2 << 10
SMALL_COUNT = SCRATCH_BYTES // SMALL_BYTES // 2
ROW_BYTES = 8 << 10
REPEATS = 2
#: per-descriptor cost and rate of host memory through UCX, measured by ``bench --layouts`` (docs/benchmarks.md)
FALLBACK = CostModel(descriptor_us=2.0, transfer_gbps=6.0, gather_gbps=8.0, scatter_gbps=6.0)


def _best(run: Callable[[], None]) -> float:
    run()  # warm: the first READ connects, the first copy faults pages in
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return max(best, 1e-9)


def _nixl_terms(transport: Transport, pool: StagingPool) -> tuple[float, float]:
    """``(microseconds per descriptor, GB/s on one descriptor)`` of READs within this agent."""
    memory, device = ("VRAM", pool.tensor.device.index or 0) if pool.tensor.is_cuda else ("DRAM", 0)
    base = pool.base
    half = SCRATCH_BYTES // 2

    def rows(start: int, size: int, count: int) -> np.ndarray:
        return np.array([[start, size, device, size, count]], dtype=np.int64)

    lists = [
        transport.prep("", rows(base, half, 1), memory),
        transport.prep(transport.name, rows(base + half, half, 1), memory),
        transport.prep("", rows(base, SMALL_BYTES, SMALL_COUNT), memory),
        transport.prep(transport.name, rows(base + half, SMALL_BYTES, SMALL_COUNT), memory),
    ]
    try:
        one = np.zeros(1, dtype=np.int32)
        shuffled = np.random.default_rng(0).permutation(SMALL_COUNT).astype(np.int32)

        def read(local: object, local_ids: np.ndarray, remote: object, remote_ids: np.ndarray) -> None:
            handle = transport.read(local, local_ids, remote, remote_ids, b"")
            try:
                while (state := transport.state(handle)) == "PROC":
                    pass
            finally:
                transport.release(handle)
            if state != "DONE":
                raise TransportError(f"a loopback READ ended {state}")

        single = _best(lambda: read(lists[0], one, lists[1], one))
        many = _best(lambda: read(lists[2], shuffled, lists[3], shuffled))
    finally:
        for handle in lists:
            transport.release_dlist(handle)
    per_descriptor = max(0.01, (many - single) / SMALL_COUNT * 1e6)  # the same bytes either way
    return per_descriptor, half / single / 1e9


def _copy_terms(pool: StagingPool) -> tuple[float, float]:
    """``(gather GB/s, scatter GB/s)`` of ``transfer.staging``'s pack and scatter over rows of :data:`ROW_BYTES`,
    shuffled, from the first half of the scratch bytes to the second and back."""
    half = min(COPY_BYTES, pool.bytes) // 2
    count = half // ROW_BYTES
    order = np.random.default_rng(1).permutation(count).astype(np.int64)
    rows = RowMap(order.reshape(count, 1), ROW_BYTES, ((0, 0, count),), ROW_BYTES)
    tensors, staging = [pool.tensor[:half]], pool.tensor[half : 2 * half]

    def sync() -> None:
        if pool.tensor.is_cuda:
            torch.cuda.synchronize(pool.tensor.device)

    def gather() -> None:
        pack(tensors, rows, staging)
        sync()

    return half / _best(gather) / 1e9, half / _best(lambda: scatter(tensors, rows, staging, (0, count))) / 1e9


def measure(transport: Transport, pool: StagingPool) -> CostModel:
    """The cost model of this rank's device (its staging pool must hold :data:`SCRATCH_BYTES`)."""
    if pool.bytes < SCRATCH_BYTES:
        return FALLBACK
    gather, scatter = _copy_terms(pool)
    try:
        per_descriptor, rate = _nixl_terms(transport, pool)
    except TransportError as exc:
        log.info("NIXL loopback unavailable for the cost model (%s): using the host-memory constants", exc)
        per_descriptor, rate = FALLBACK.descriptor_us, FALLBACK.transfer_gbps
    return CostModel(descriptor_us=per_descriptor, transfer_gbps=rate, gather_gbps=gather, scatter_gbps=scatter)
