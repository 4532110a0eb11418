"""A digest of KV content that does not depend on where the content is stored (protocol ``kvbridge-digest/1``).

The content is taken logically, as the model defines it — never as bytes in a block:

- ``l``: layer; ``c``: 0 for keys, 1 for values (MLA: 0 only, the latent);
- ``h``: global KV head (MLA: 0);
- ``t``: token position in the request (0 is the prompt's first token);
- ``j``: word of the row, the row being the ``head_dim * element_bytes`` bytes of head ``h`` at position ``t``,
  read as little-endian 32-bit words (``row_bytes % 4 == 0``; every dtype and head size in use satisfies it).

With odd coefficients ``A[j]`` (32-bit), ``B[l, c]`` and ``P[t]`` (64-bit) (:func:`coefficients`), a row's value is
``r[l, c, h, t] = sum over j of word[l, c, h, t, j] * A[j]`` modulo 2**32, taken as a signed 32-bit integer and
sign-extended to 64 bits (what widening an int32 does on every device), and the digest
of head ``h`` over the positions of wire block ``i`` (``i * bs .. i * bs + bs - 1``, only those below the request's
token count ``n``) is, modulo 2**64::

    D[h, i] = sum over l, c, t in block i of  r[l, c, h, t] * B[l, c] * P[t]

The row sums are 32-bit because that is what CPUs multiply in vector registers (AVX2 has no 64-bit multiply): one
multiply-add per 4 bytes at memory speed; the rows, 1/32 of the words or fewer, are combined in 64 bits.

Properties the protocol relies on:

- **layout-independent**: only logical coordinates appear, so prefill and decode get the same values whatever
  their TP sizes, block sizes, layouts, block ids and conversions;
- **combinable**: a sum; each rank digests the heads it holds, a decode rank compares the heads it owns, and a
  decode block of ``r`` wire blocks is ``r`` digests (positions are the request's, not the block's);
- **position-sensitive**: a word at another layer, K/V half, position or place in the row meets another
  coefficient, and a word at another head lands in another head's digest, so a block in the wrong place, a head
  slice swapped or K and V swapped changes it; any single changed word changes it (odd coefficients are
  invertible modulo 2**64);
- **cheap**: one multiply-add per word plus one per row; integer arithmetic is exact, so the order of summation
  (a GPU reduction, numpy, a Python loop) does not matter.

It guards against faults (a wrong block, a stale or overwritten one, a broken conversion), not against an
adversary who can write KV memory and knows the coefficients: those are public.

This module is the definition and its reference (numpy); the agent computes the same values with torch on the
cache's device (``kvbridge_agent.transfer.digest``), tested equal.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import numpy.typing as npt

from .model import TransferSettings, Verification

#: the protocol name (docs/protocol.md §8)
DIGEST_PROTOCOL = "kvbridge-digest/1"
WORD_BYTES = 4
#: bytes of one digest value on the wire (a little-endian uint64)
DIGEST_BYTES = 8

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
#: one stream of coefficients per axis
_SEEDS = {"word": np.uint64(0x6B76627764696731), "layer_kv": np.uint64(0x6B766264696C6B76),
          "position": np.uint64(0x6B76626469706F73)}  # fmt: skip

Words = npt.NDArray[np.uint64]


def coefficients(axis: str, count: int, start: int = 0) -> Words:
    """Odd coefficients ``start .. start + count - 1`` of one axis (``word``, ``layer_kv``, ``position``):
    splitmix64 of the index in the axis' own stream, lowest bit set; ``word`` coefficients are the low 32 bits."""
    index = np.arange(start, start + count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = _SEEDS[axis] + (index + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z = z ^ (z >> np.uint64(31))
    if axis == "word":
        z &= np.uint64(0xFFFFFFFF)
    return z | np.uint64(1)


def row_words(row_bytes: int) -> int:
    """Words per row; a row that is not whole words has no digest (no model in use has one)."""
    if row_bytes <= 0 or row_bytes % WORD_BYTES:
        raise ValueError(f"a KV row of {row_bytes} bytes is not a whole number of {WORD_BYTES}-byte words")
    return row_bytes // WORD_BYTES


def block_digests(words: npt.NDArray[np.uint32], num_tokens: int, block_size: int, kv_count: int = 2,
                  first_layer: int = 0) -> Words:  # fmt: skip
    """The reference: ``words`` is ``[layers, kv, positions, heads, row_words]`` of uint32 (positions from 0, a
    whole number of blocks of ``block_size``); returns ``D[head, block]`` (``heads x positions // block_size``).
    Layers are numbered from ``first_layer``; ``kv_count`` is the model's (2, or 1 for MLA)."""
    layers, kv, positions, heads, width = words.shape
    if positions % block_size:
        raise ValueError(f"{positions} positions are not whole blocks of {block_size}")
    a = coefficients("word", width)
    b = coefficients("layer_kv", layers * kv_count, first_layer * kv_count).reshape(layers, kv_count)[:, :kv]
    p = coefficients("position", positions)
    p[num_tokens:] = 0  # positions past the request's tokens do not count (their bytes are stale)
    with np.errstate(over="ignore"):
        rows32 = (words.astype(np.uint32) * a.astype(np.uint32)).sum(axis=-1, dtype=np.uint32)
        rows = rows32.view(np.int32).astype(np.int64).view(np.uint64)  # signed 32-bit, sign-extended
        weighted = rows * b[:, :, None, None] * p[None, None, :, None]
        per_position = weighted.sum(axis=(0, 1), dtype=np.uint64)  # [positions, heads]
        blocks = per_position.reshape(positions // block_size, block_size, heads).sum(axis=1, dtype=np.uint64)
    return np.ascontiguousarray(blocks.T)


def combine(parts: list[Words]) -> Words:
    """Digests of disjoint parts of the same heads and blocks (layers split across calls): their sum."""
    total = np.zeros_like(parts[0])
    with np.errstate(over="ignore"):
        for part in parts:
            total += part
    return total


def mismatched_blocks(expected: Words, got: Words) -> list[int]:
    """Blocks (columns) where any head differs; both ``[heads, blocks]``."""
    if expected.shape != got.shape:
        raise ValueError(f"digests of shape {expected.shape} and {got.shape} do not compare")
    return [int(i) for i in np.nonzero((expected != got).any(axis=0))[0]]


#: a request's digest as exchanged: global head -> ``D[head, wire block]`` row (uint64)
HeadDigests = dict[int, Words]

KV_DIGEST_MISMATCH = "KV_DIGEST_MISMATCH"
#: decode was told to verify a request but prefill no longer has (or never had) its digests
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


def sampled(request_id: str, fraction: float) -> bool:
    """Whether a request falls in a sample of ``fraction``: decided by its id alone (the same answer on every TP
    rank and every retry), uniformly over ids."""
    if fraction >= 1.0:
        return True
    point = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little") / 2**64
    return point < fraction


def should_verify(transfer: TransferSettings, request_id: str, serving_seconds: float) -> bool:
    """Prefill's decision for one request (it travels in the transfer parameters, so decode follows it):
    ``serving_seconds`` is how long the prefill engine has been offering requests."""
    if transfer.verification is Verification.ALL:
        return True
    if transfer.verification is Verification.OFF:
        return False
    return serving_seconds < transfer.verification_first_seconds or sampled(request_id, transfer.verification_fraction)


class VerificationPolicy:
    """A prefill engine's decision per request, the ``Sampled`` warm-up timed from its first offered request."""

    def __init__(self, transfer: TransferSettings) -> None:
        self.transfer = transfer
        self._first_offer: float | None = None

    def decide(self, request_id: str) -> bool:
        now = time.monotonic()
        if self._first_offer is None:
            self._first_offer = now
        return should_verify(self.transfer, request_id, now - self._first_offer)


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
