"""The transfer digest's one pass over a CPU cache (``core.digest``, ``kvbridge-digest/2``), compiled with numba.

Per row of 16-bit units the digest needs ``sum over j of x[j] * c_k[j]`` in two lanes, exactly, then reduced mod
``p``. Torch has no fused form of that on a CPU: a widening copy (int16 -> float64 or int64) and a multiply-add are
separate passes over the whole KV, 3-5 times the old 32-bit digest (measured: benchmarks/digest_cost.py). This
kernel reads each unit once, straight from the request's blocks where they lie (the gather is the loop over
block ids, no copy), widens it in a register and does both lanes' multiply-adds there: float64 products are exact
(``|x * c| < 2**45``) and so is every partial sum of a segment of at most ``SEGMENT_UNITS`` units (below
``2**52``), so reassociating the sum (what lets LLVM vectorise it) changes nothing. Each segment's sum is reduced
to ``s - floor(s / p) * p`` (congruent to it mod ``p``, in ``(-p, 2p)``) and added to the row's total.

A second pass, :func:`add_keys_across`, reads blocks whose keys lie across, dimension-major (``[head_dim,
tokens]``, as vLLM's CPU attention keeps them) and whose values lie along: it sums a keys' segment for every row
at once, unit after unit, the inner loop running along the contiguous tokens, so nothing is copied into token
order first.

Two small passes around them take a request's key stream as SHAKE-128 produced it (``core.digest.coefficients``'s
64-bit values, not yet reduced) and do in one loop what numpy needs a dozen small array operations for (most of a
short request's digest before): :func:`row_coefficients_of` (``A_k[j] * B_k[g]``, centred) and
:func:`finish_sums` (the rows' totals weighted by position and summed per wire block). Both reduce mod ``p`` by
folding (``p = 2**31 - 1``: ``x = (x & p) + (x >> 31)``), exact like ``%``.

numba comes with vLLM (and the agent's image); without it the digester falls back to torch's passes (same values,
slower). One compilation per process (about a second), cached on disk where the installation is writable.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from kvbridge_agent.core.digest import PRIME

log = logging.getLogger(__name__)

_P = float(PRIME)
_INVERSE = 1.0 / _P
_MASK = np.uint64(PRIME)
_THIRTY_ONE = np.uint64(31)
#: a multiple of ``p`` above any row total's magnitude (below ``2**53``): added to a negative one before folding
_LIFT = np.int64(PRIME << 23)
#: total[n, outer, rows, lanes] (added to), region[blocks, outer, groups, rows, units], ids[n], coef[groups, lanes,
#: segments, segment units]
SIGNATURE = "void(float64[:, :, :, ::1], int16[:, :, :, :, ::1], int64[::1], float64[:, :, :, ::1])"
#: :func:`add_keys_across`'s: its region is ``[blocks, outer, 2, width * rows]``
KEYS_ACROSS_SIGNATURE = "void(float64[:, :, :, ::1], int16[:, :, :, ::1], int64[::1], float64[:, :, :, ::1])"

#: :func:`row_coefficients_of`: the ``row`` and ``layer_kv`` streams, out ``[groups, lanes, width]``
COEFFICIENTS_SIGNATURE = "void(uint64[::1], uint64[::1], float64[:, :, ::1])"
#: :func:`finish_sums`: totals ``[blocks, x, y, lanes]``, head-major, the ``position`` stream, tokens, wire block
#: size, out ``[heads, wire blocks]``
FINISH_SIGNATURE = "void(float64[:, :, :, ::1], boolean, uint64[::1], int64, int64, uint64[:, ::1])"

RowKernel = Callable[
    [npt.NDArray[np.float64], npt.NDArray[np.int16], npt.NDArray[np.int64], npt.NDArray[np.float64]], None
]
CoefficientsPass = Callable[[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.float64]], None]
FinishPass = Callable[[npt.NDArray[np.float64], bool, npt.NDArray[np.uint64], int, int, npt.NDArray[np.uint64]], None]
_Pass = TypeVar("_Pass", RowKernel, CoefficientsPass, FinishPass)


def add_rows(
    total: npt.NDArray[np.float64],
    region: npt.NDArray[np.int16],
    ids: npt.NDArray[np.int64],
    coef: npt.NDArray[np.float64],
) -> None:
    """``total[b, o, r, k] += sum over groups g of (the row region[ids[b], o, g, r] . coef[g, k] mod p)``, each
    row sum taken per segment and reduced. Two lanes (``LANES``). The caller checks that ``ids`` are blocks of
    ``region`` (the compiled form does not)."""
    outer, groups, rows = region.shape[1], region.shape[2], region.shape[3]
    count, units = coef.shape[2], coef.shape[3]
    for b in range(ids.shape[0]):
        block = region[ids[b]]
        for o in range(outer):
            for g in range(groups):
                for r in range(rows):
                    row = block[o, g, r]
                    t0 = 0.0
                    t1 = 0.0
                    for q in range(count):
                        part = row[q * units : (q + 1) * units]
                        c0 = coef[g, 0, q]
                        c1 = coef[g, 1, q]
                        s0 = 0.0
                        s1 = 0.0
                        for j in range(units):
                            x = np.float64(part[j])
                            s0 += x * c0[j]
                            s1 += x * c1[j]
                        t0 += s0 - np.floor(s0 * _INVERSE) * _P
                        t1 += s1 - np.floor(s1 * _INVERSE) * _P
                    total[b, o, r, 0] += t0
                    total[b, o, r, 1] += t1


def add_keys_across(
    total: npt.NDArray[np.float64],
    region: npt.NDArray[np.int16],
    ids: npt.NDArray[np.int64],
    coef: npt.NDArray[np.float64],
) -> None:
    """:func:`add_rows` for blocks whose keys lie across: ``region[blocks, outer, 2, width * rows]``, where half 0
    (keys) holds unit ``j`` of row ``r`` at ``j * rows + r`` and half 1 (values) at ``r * width + j``;
    ``total[n, outer, rows, lanes]``, ``coef[2, lanes, segments, segment units]`` (the layer's K and V groups).
    Same values, segments and reductions as :func:`add_rows`. The keys' segment is summed for every row at once,
    unit after unit, along the contiguous rows (what vectorises); the caller checks the shapes."""
    outer, rows = region.shape[1], total.shape[2]
    count, units = coef.shape[2], coef.shape[3]
    width = count * units
    s0 = np.empty(rows)
    s1 = np.empty(rows)
    for b in range(ids.shape[0]):
        block = region[ids[b]]
        for o in range(outer):
            keys = block[o, 0]
            for q in range(count):
                s0[:] = 0.0
                s1[:] = 0.0
                for j in range(units):
                    column = keys[(q * units + j) * rows : (q * units + j + 1) * rows]
                    c0 = coef[0, 0, q, j]
                    c1 = coef[0, 1, q, j]
                    for r in range(rows):
                        x = np.float64(column[r])
                        s0[r] += x * c0
                        s1[r] += x * c1
                for r in range(rows):
                    total[b, o, r, 0] += s0[r] - np.floor(s0[r] * _INVERSE) * _P
                    total[b, o, r, 1] += s1[r] - np.floor(s1[r] * _INVERSE) * _P
            values = block[o, 1]
            for r in range(rows):
                row = values[r * width : (r + 1) * width]
                t0 = 0.0
                t1 = 0.0
                for q in range(count):
                    part = row[q * units : (q + 1) * units]
                    c0 = coef[1, 0, q]
                    c1 = coef[1, 1, q]
                    v0 = 0.0
                    v1 = 0.0
                    for j in range(units):
                        x = np.float64(part[j])
                        v0 += x * c0[j]
                        v1 += x * c1[j]
                    t0 += v0 - np.floor(v0 * _INVERSE) * _P
                    t1 += v1 - np.floor(v1 * _INVERSE) * _P
                total[b, o, r, 0] += t0
                total[b, o, r, 1] += t1


def fold(x: np.uint64) -> np.uint64:
    """``x mod p`` for any 64-bit ``x`` (two folds leave it below ``p + 8``); called by the passes below, compiled
    with them (:func:`compiled_finish`)."""
    x = (x & _MASK) + (x >> _THIRTY_ONE)
    x = (x & _MASK) + (x >> _THIRTY_ONE)
    return x - _MASK if x >= _MASK else x


def row_coefficients_of(
    row: npt.NDArray[np.uint64], layer_kv: npt.NDArray[np.uint64], out: npt.NDArray[np.float64]
) -> None:
    """``core.digest.row_coefficients`` from the key's ``row`` and ``layer_kv`` streams (``LANES`` values per index,
    unreduced): ``out[g, k, j] = A_k[j] * B_k[g] mod p``, centred in ``(-p/2, p/2)``."""
    groups, lanes, width = out.shape[0], out.shape[1], out.shape[2]
    half = _MASK >> np.uint64(1)
    for g in range(groups):
        for k in range(lanes):
            b = fold(layer_kv[g * lanes + k])
            for j in range(width):
                c = fold(b * fold(row[j * lanes + k]))  # both below 2**31: the product fits
                out[g, k, j] = np.float64(c) - _P if c > half else np.float64(c)


def finish_sums(
    total: npt.NDArray[np.float64],
    head_major: bool,
    position: npt.NDArray[np.uint64],
    num_tokens: int,
    wire: int,
    out: npt.NDArray[np.uint64],
) -> None:
    """``core.digest.finish`` of the passes' totals where they lie: ``total[blocks, x, y, lanes]`` (``x, y`` heads
    and the block's positions when ``head_major``, else positions and heads; integers below ``2**53``, either
    sign), weighted by the ``position`` stream's ``P_k[t]`` for ``t < num_tokens`` and summed per ``wire``-token
    block into ``out[head, wire block]`` (the 64-bit wire values). The caller checks the shapes (``out``'s heads are
    the totals', ``num_tokens`` fits the blocks; the compiled form does not)."""
    heads, blocks = out.shape[0], out.shape[1]
    size = total.shape[2] if head_major else total.shape[1]
    lane = np.zeros((2, heads, blocks), dtype=np.uint64)
    for t in range(num_tokens):
        b, r, i = t // size, t % size, t // wire
        for k in range(2):
            weight = fold(position[2 * t + k])
            for h in range(heads):
                v = total[b, h, r, k] if head_major else total[b, r, h, k]
                exact = np.int64(v)
                x = np.uint64(exact) if exact >= 0 else np.uint64(exact + _LIFT)  # congruent, non-negative
                lane[k, h, i] += fold(fold(x) * weight)  # a wire block's sum stays below 2**63
    for h in range(heads):
        for i in range(blocks):
            out[h, i] = fold(lane[0, h, i]) | (fold(lane[1, h, i]) << np.uint64(32))


@functools.cache
def compiled() -> RowKernel | None:
    """:func:`add_rows` compiled (vectorised: reassociation and fused multiply-adds only, which exact integer
    arithmetic allows), or ``None`` without numba."""
    return _compile(add_rows, SIGNATURE)


@functools.cache
def compiled_keys_across() -> RowKernel | None:
    """:func:`add_keys_across` compiled as :func:`compiled`, or ``None`` without numba."""
    return _compile(add_keys_across, KEYS_ACROSS_SIGNATURE)


class FinishPasses(NamedTuple):
    """The two small passes around the row kernels, compiled."""

    coefficients: CoefficientsPass
    finish: FinishPass


@functools.cache
def compiled_finish() -> FinishPasses | None:
    """:func:`row_coefficients_of` and :func:`finish_sums` compiled (with :func:`fold` inside them), or ``None``
    without numba."""
    try:
        from numba.extending import register_jitable
    except ImportError:
        return None
    register_jitable(fold)  # the passes' calls to it compile with them; Python still calls it as it is
    coefficients, finished = (
        _compile(row_coefficients_of, COEFFICIENTS_SIGNATURE),
        _compile(finish_sums, FINISH_SIGNATURE),
    )
    return None if coefficients is None or finished is None else FinishPasses(coefficients, finished)


def _compile(function: _Pass, signature: str) -> _Pass | None:
    try:
        import numba  # optional, and a second of start-up: imported only where a CPU cache is digested
    except ImportError:
        log.warning("numba is not installed: the transfer digest runs as torch passes on CPU caches (slower)")
        return None
    options: dict[str, Any] = {"boundscheck": False, "fastmath": {"reassoc", "contract"}, "nogil": True}
    try:
        kernel: _Pass = numba.njit(signature, cache=True, **options)(function)
    except RuntimeError:  # nowhere writable to cache it (a read-only installation and home): compile each time
        kernel = numba.njit(signature, **options)(function)
    return kernel
