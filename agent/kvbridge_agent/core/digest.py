"""A keyed digest of KV content that does not depend on where the content is stored (protocol
``kvbridge-digest/2``).

The content is taken logically, as the model defines it — never as bytes in a block:

- ``l``: layer; ``c``: 0 for keys, 1 for values (MLA: 0 only, the latent);
- ``h``: global KV head (MLA: 0);
- ``t``: token position in the request (0 is the prompt's first token);
- ``j``: unit of the row, the row being the ``head_dim * element_bytes`` bytes of head ``h`` at position ``t``,
  read as little-endian signed 16-bit integers ``x[l, c, h, t, j]`` (``row_bytes`` is even for every dtype and
  head size in use).

Arithmetic is in the prime field ``Z_p``, ``p = 2**31 - 1``, in ``LANES = 2`` independent lanes ``k``. A key of
32 random bytes, drawn by prefill for each verified request (:func:`new_key`), gives each lane coefficients
``A_k[j]``, ``B_k[l, c]`` and ``P_k[t]`` in ``Z_p`` (:func:`coefficients`: SHAKE-128 of the key, one stream per
axis, 64-bit values reduced mod ``p``). A row's value and the digest of head ``h`` over the positions of wire
block ``i`` (``i * bs .. i * bs + bs - 1``, only those below the request's token count ``n``) are, per lane::

    r_k[l, c, h, t] = sum over j of x[l, c, h, t, j] * A_k[j]                              (mod p)
    D_k[h, i]       = sum over l, c and t in block i, t < n, of r_k[l, c, h, t] * B_k[l, c] * P_k[t]   (mod p)

and the 64-bit value on the wire is ``D_0[h, i] + 2**32 * D_1[h, i]``.

**The bound.** Take any two contents of head ``h`` and block ``i`` that differ anywhere (any bits, any number of
units, any pattern: sign bits flipped in pairs, a whole row or block changed, rows, heads, K/V or blocks
swapped, a layer zeroed). Their digest difference in lane ``k`` is the polynomial
``F(A, B, P) = sum over (l, c, t, j) of d[l, c, t, j] * A_k[j] * B_k[l, c] * P_k[t]`` with
``d = x' - x``: each ``d`` is an integer with ``|d| < 2**16 < p``, so a unit that differs gives a coefficient
that is nonzero mod ``p``, and distinct ``(l, c, t, j)`` are distinct monomials — ``F`` is a nonzero polynomial of
degree 3. By Schwartz-Zippel (in the form for independent variables each taking any one value with probability
at most ``e``; here ``e <= 1/p + 2**-64``, the 64-bit values reduced mod ``p``), ``F`` vanishes with probability
at most ``3 e``; the two lanes' coefficients are independent, so both vanish with probability at most
``(3 e)**2 < 2**-58.8``. The probability is over the key only, so it holds for every corruption that cannot
depend on the key — memory faults, wrong blocks, broken conversions, stale reuse — whatever their pattern. (The
coefficients are SHAKE-128 outputs: "uniform" is the usual assumption that an extendable-output hash of a secret
key cannot be told from random.) A content of any other layout is compared only through these logical
coordinates, so what is not a change of content is not a difference. ``kvbridge-digest/1`` was a linear form
modulo ``2**32`` over 32-bit words with public odd coefficients: two words each changed by ``2**31`` (sign bits
flipped in a pair, in a row or in a whole block) cancelled whatever the coefficients.

Properties the protocol relies on:

- **layout-independent**: only logical coordinates appear, so prefill and decode get the same values whatever
  their TP sizes, block sizes, layouts, block ids and conversions;
- **combinable**: a sum in ``Z_p`` per lane (:func:`combine`); each rank digests the heads it holds, a decode
  rank compares the heads it owns, and a decode block of ``r`` wire blocks is ``r`` digests (positions are the
  request's, not the block's); layers digested apart add up;
- **exact**: every implementation computes the same integers, whatever its order of summation (a GPU reduction,
  BLAS, numba, numpy): row sums are exact in float64 over segments of at most :data:`SEGMENT_UNITS` units with
  centred coefficients (``|x| <= 2**15``, ``|c| < 2**30``: ``128 * 2**45 = 2**52 < 2**53``), then reduced mod ``p``;
- **cheap**: one multiply-add per 16-bit unit and lane in one pass over the blocks; the rows (1/128 of the units
  for a 128-dim bf16 head) combined in 64-bit integers.

This module is the definition and its reference (numpy, exact int64); the agent computes the same values on the
cache's device (``kvbridge_agent.transfer.digest``), tested equal. It also holds the verification policy: which
requests prefill digests (a secret random draw, never the client's request id) and when decode must verify.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .model import TransferSettings, Verification

#: the protocol name (docs/protocol.md §8)
DIGEST_PROTOCOL = "kvbridge-digest/2"
#: the field: ``2**31 - 1`` (a Mersenne prime; > ``2**16``, so a changed 16-bit unit is a nonzero difference)
PRIME = 2**31 - 1
#: independent lanes, packed into one 64-bit value on the wire
LANES = 2
#: a row is read as 16-bit units
UNIT_BYTES = 2
#: bytes of one digest value on the wire (a little-endian uint64: lane 0 low, lane 1 high)
DIGEST_BYTES = 8
#: bytes of a request's digest key
KEY_BYTES = 32
#: the most units an implementation sums in float64 before reducing mod ``p``: ``|x * c| < 2**45``, so any partial
#: sum of a segment, in any order, is an integer below ``2**52`` (exact, with a factor 2 to spare)
SEGMENT_UNITS = 128
#: the probability that a change of content goes undetected, at most (module docstring: ``(3 (1/p + 2**-64))**2``)
MISS_PROBABILITY = (3 * (1 / PRIME + 2.0**-64)) ** 2

_DOMAIN = DIGEST_PROTOCOL.encode()
_AXES = ("row", "layer_kv", "position")
_LOW = np.uint64(0xFFFFFFFF)

Words = npt.NDArray[np.uint64]
Lanes = npt.NDArray[np.int64]


def new_key() -> bytes:
    """A fresh key for one request's digests (the operating system's randomness)."""
    return secrets.token_bytes(KEY_BYTES)


def check_key(key: bytes) -> bytes:
    if len(key) != KEY_BYTES:
        raise ValueError(f"a digest key is {KEY_BYTES} bytes, not {len(key)}")
    return key


def key_stream(key: bytes, axis: str, count: int) -> npt.NDArray[np.uint64]:
    """The 64-bit values behind :func:`coefficients` (``count * LANES`` of them, lane fastest), not yet reduced."""
    if axis not in _AXES:
        raise ValueError(f"unknown digest axis {axis!r}")
    stream = hashlib.shake_128(_DOMAIN + b"\0" + axis.encode() + b"\0" + check_key(key))
    return np.frombuffer(bytearray(stream.digest(8 * LANES * count)), dtype="<u8")  # writable: compiled passes take it


def coefficients(key: bytes, axis: str, count: int) -> Lanes:
    """Coefficients ``0 .. count - 1`` of one axis (``row``, ``layer_kv``, ``position``), ``[count, LANES]`` in
    ``[0, p)``: SHAKE-128 of the protocol name, the axis and the key, read as little-endian 64-bit values reduced
    mod ``p`` (value ``i`` of lane ``k`` is the ``i * LANES + k``-th). A longer count extends a shorter one."""
    return stream_lanes(key_stream(key, axis, count))


def stream_lanes(stream: npt.NDArray[np.uint64]) -> Lanes:
    """A key stream's values reduced mod ``p``, ``[count, LANES]`` (:func:`coefficients`)."""
    return (stream % np.uint64(PRIME)).astype(np.int64).reshape(-1, LANES)


def row_units(row_bytes: int) -> int:
    """Units per row; a row that is not whole 16-bit units has no digest (no model in use has one)."""
    if row_bytes <= 0 or row_bytes % UNIT_BYTES:
        raise ValueError(f"a KV row of {row_bytes} bytes is not a whole number of {UNIT_BYTES}-byte units")
    return row_bytes // UNIT_BYTES


def segments(width: int) -> tuple[int, int]:
    """``(count, units)``: a row of ``width`` units as ``count`` equal segments of at most :data:`SEGMENT_UNITS`
    units, the fewest that divide it (what the float64 implementations sum exactly before reducing)."""
    count = next(k for k in range(1, width + 1) if width % k == 0 and width // k <= SEGMENT_UNITS)
    return count, width // count


def row_coefficients(key: bytes, width: int, groups: int) -> npt.NDArray[np.float64]:
    """``A_k[j] * B_k[g] mod p`` for every layer and K/V group ``g = l * kv_count + c`` (``0 .. groups - 1``),
    centred in ``(-p/2, p/2)``, as float64 ``[groups, LANES, width]``: the one multiply per unit of the
    implementations (a row sum over a segment is then exact in float64, and its value mod ``p`` is ``r * B``)."""
    return coefficient_products(coefficients(key, "row", width), coefficients(key, "layer_kv", groups))


def coefficient_products(a: Lanes, b: Lanes) -> npt.NDArray[np.float64]:
    """:func:`row_coefficients` of ``A`` (``[width, lanes]``) and ``B`` (``[groups, lanes]``), any values in
    ``[0, p)``."""
    c = (b[:, :, None] * a.T[None, :, :]) % PRIME  # < 2**62: exact in int64
    c[c > PRIME // 2] -= PRIME
    return np.ascontiguousarray(c, dtype=np.float64)


def pack(lanes: Lanes) -> Words:
    """``[..., LANES]`` residues -> the 64-bit wire values ``lane 0 + 2**32 * lane 1``."""
    words = lanes.astype(np.uint64)
    return words[..., 0] | (words[..., 1] << np.uint64(32))


def unpack(words: Words) -> Lanes:
    """The inverse of :func:`pack`."""
    words = np.asarray(words, dtype=np.uint64)
    return np.stack([(words & _LOW).astype(np.int64), (words >> np.uint64(32)).astype(np.int64)], axis=-1)


def finish(totals: Lanes, key: bytes, num_tokens: int, block_size: int) -> Words:
    """``D[head, block]`` from ``totals[position, head, lane]`` (the sum over layers and K/V of ``r * B``, any
    integers congruent to it): weighted by ``P_k[t]``, positions from ``num_tokens`` on not counted, summed per
    block of ``block_size`` positions (``positions`` must be whole blocks)."""
    return weighted_blocks(totals, coefficients(key, "position", min(num_tokens, totals.shape[0])), block_size)


def weighted_blocks(totals: Lanes, p: Lanes, block_size: int) -> Words:
    """:func:`finish` with the position coefficients ``p`` (``[tokens, LANES]``, values in ``[0, p)``) of the
    request's ``tokens`` first positions: the rest do not count (their bytes are stale)."""
    positions, heads, _ = totals.shape
    if positions % block_size:
        raise ValueError(f"{positions} positions are not whole blocks of {block_size}")
    weights = np.zeros((positions, LANES), dtype=np.int64)
    weights[: len(p)] = p[:positions]
    weighted = (np.remainder(totals, PRIME) * weights[:, None, :]) % PRIME  # < 2**62
    blocks = weighted.reshape(positions // block_size, block_size, heads, LANES).sum(axis=1) % PRIME
    return np.ascontiguousarray(pack(blocks).T)


def block_digests(
    units: npt.NDArray[np.int16], num_tokens: int, block_size: int, key: bytes, kv_count: int = 2, first_layer: int = 0
) -> Words:
    """The reference: ``units`` is ``[layers, kv, positions, heads, width]`` of int16 (positions from 0, a whole
    number of blocks of ``block_size``); returns ``D[head, block]`` (``heads x positions // block_size``).
    Layers are numbered from ``first_layer``; ``kv_count`` is the model's (2, or 1 for MLA)."""
    layers, kv, _, _, width = units.shape
    a = coefficients(key, "row", width)  # [width, lanes]
    b = coefficients(key, "layer_kv", (first_layer + layers) * kv_count)[first_layer * kv_count :]
    b = b.reshape(layers, kv_count, LANES)[:, :kv]
    rows = (units.astype(np.int64) @ a) % PRIME  # |x * A| < 2**46: exact; [layers, kv, positions, heads, lanes]
    weighted = (rows * b[:, :, None, None, :]) % PRIME
    return finish(weighted.sum(axis=(0, 1)), key, num_tokens, block_size)


def combine(parts: list[Words]) -> Words:
    """Digests of disjoint parts of the same heads and blocks (layers split across calls, or blocks summed into
    a larger one): their sum, lane by lane, mod ``p``."""
    return pack(sum((unpack(part) for part in parts), np.zeros_like(unpack(parts[0]))) % PRIME)


#: a request's digest as exchanged: global head -> ``D[head, wire block]`` row (uint64)
HeadDigests = dict[int, Words]


@dataclass(frozen=True)
class RequestDigests:
    """What prefill publishes for a verified request: the key its coefficients came from and, per global head,
    ``D[head, wire block]``. The key travels with the digests: in the transfer parameters, or on the side channel."""

    key: bytes
    heads: HeadDigests


KV_DIGEST_MISMATCH = "KV_DIGEST_MISMATCH"
#: decode must verify a request but prefill no longer has (or never had) its digests
KV_DIGEST_UNAVAILABLE = "KV_DIGEST_UNAVAILABLE"


def mismatched(expected: HeadDigests, heads: list[int], got: Words) -> list[int]:
    """Wire blocks where this rank's digests (``got``: one row per entry of ``heads``) differ from prefill's;
    a head prefill did not publish, or rows of another length, is a mismatch of every block."""
    bad: set[int] = set()
    for row, head in enumerate(heads):
        want = expected.get(head)
        if want is None or want.shape != got[row].shape:
            return list(range(got.shape[1]))
        bad.update(int(i) for i in np.nonzero(want != got[row])[0])
    return sorted(bad)


#: a uniform draw in [0, 1) from the operating system's randomness (no seed anyone can know or choose)
_SYSTEM_RANDOM = secrets.SystemRandom()
Draw = Callable[[], float]


def should_verify(transfer: TransferSettings, serving_seconds: float, draw: float) -> bool:
    """Prefill's decision for one request (it travels in the transfer parameters, so decode follows it):
    ``serving_seconds`` is how long the prefill engine has been offering requests, ``draw`` a secret uniform draw
    in [0, 1) made for this request alone. Nothing the client sends (its request id) enters the decision."""
    if transfer.verification is Verification.ALL:
        return True
    if transfer.verification is Verification.OFF:
        return False
    return serving_seconds < transfer.verification_first_seconds or draw < transfer.verification_fraction


class VerificationPolicy:
    """A prefill engine's decision per request, the ``Sampled`` warm-up timed from its first offered request.
    Decided once per request where it is offered (every TP rank gets the decision with the offer)."""

    def __init__(self, transfer: TransferSettings, draw: Draw = _SYSTEM_RANDOM.random) -> None:
        self.transfer = transfer
        self._draw = draw
        self._first_offer: float | None = None

    def decide(self) -> bool:
        now = time.monotonic()
        if self._first_offer is None:
            self._first_offer = now
        return should_verify(self.transfer, now - self._first_offer, self._draw())


def decode_verifies(transfer: TransferSettings, prefill_verifies: bool) -> bool:
    """Whether decode verifies a request: when prefill digested it (the parameters' ``verify``), and always when
    decode's own ``spec.transfer.verification`` is ``All`` — then a request prefill did not digest fails with
    :data:`KV_DIGEST_UNAVAILABLE` rather than be used unverified (docs/protocol.md §8)."""
    return prefill_verifies or transfer.verification is Verification.ALL


def to_bytes(digests: HeadDigests) -> tuple[list[int], bytes]:
    """``(heads, the rows as little-endian uint64, head after head)`` for the wire."""
    heads = sorted(digests)
    rows = [np.asarray(digests[h], dtype="<u8") for h in heads]
    return heads, b"".join(row.tobytes() for row in rows)


def from_bytes(heads: list[int], data: bytes) -> HeadDigests:
    """The inverse of :func:`to_bytes`; raises ValueError when the bytes are not whole rows."""
    if not heads:
        if data:
            raise ValueError("digest bytes without heads")
        return {}
    if len(data) % (DIGEST_BYTES * len(heads)):
        raise ValueError(f"{len(data)} digest bytes are not {len(heads)} rows of 64-bit values")
    rows = np.frombuffer(data, dtype="<u8").astype(np.uint64).reshape(len(heads), -1)
    return {int(h): rows[i] for i, h in enumerate(heads)}
