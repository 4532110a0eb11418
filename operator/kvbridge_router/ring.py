"""Consistent hashing with bounded loads: where a prompt prefix goes when no router replica has to be asked; pure.

Every pod is put on a ring of 64-bit positions at :data:`POINTS_PER_POD` points, read from the SHAKE-128 output of
its name, so every router replica that reads the same pool builds the same ring, in any process (Python's own
``hash`` of text differs per process). A prompt's *anchor* — the chained key of its first
:data:`ANCHOR_CHUNKS` chunks (``prefixes.prefix_keys``, stable across processes too) — is a position on the ring;
its pods, in order, are the distinct pods met walking clockwise from it. A prompt goes to the first of them whose
load stays within the cap, ``ceil(LOAD_FACTOR * (in flight + 1) / pods)`` and at least a few requests (:func:`cap`;
Mirrokni, Thorup, Zadimoghaddam: "Consistent Hashing with Bounded Loads", 2018): a hot prefix overflows onto its
next pods on the ring, the same ones for every replica, instead of queueing behind itself. A pod that leaves moves
only its own prefixes, to their next pods.

Replicas agree without talking as far as their loads agree: each knows only the requests it sent, so the cap is
crossed at slightly different moments by different replicas (requests spread at random give each replica about
the same share of every pod's load).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Container, Iterable, Mapping, Sequence

import numpy as np

#: points per pod: the share of the ring a pod holds varies by about 1/sqrt(POINTS_PER_POD) (12 %)
POINTS_PER_POD = 64
#: a pod takes a prompt while its load, with the prompt, is at most this many times the average
LOAD_FACTOR = 1.25
#: the anchor: a prompt's first this many chunks (of one KV block each) place it; shorter prompts, all of theirs
ANCHOR_CHUNKS = 4
MASK = (1 << 64) - 1


def points(name: str, count: int = POINTS_PER_POD) -> bytes:
    """A pod's ``count`` positions on the ring, as 64-bit little-endian integers, equal in every process: one hash a
    pod, not one a point (a ring of 256 pods is built in 4 ms, not the 25 ms of a BLAKE2b per point, and a router
    builds one whenever its pool changes, between two requests)."""
    return hashlib.shake_128(name.encode()).digest(8 * count)


def anchor(keys: Sequence[int], chunks: int = ANCHOR_CHUNKS) -> int | None:
    """The ring position of a prompt with these prefix keys, or None when it has none."""
    if not keys:
        return None
    # the chained keys are Python hashes of ints (equal in every process); mixed again so that neighbouring
    # anchors scatter over the ring (SplitMix64's finalizer)
    value = keys[min(len(keys), chunks) - 1] & MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK
    return value ^ (value >> 31)


def cap(total_load: int, pods: int, factor: float = LOAD_FACTOR, slack: int = 0) -> int:
    """The most requests in flight a pod may have, this request included: ``ceil(factor * (total + 1) / pods)``,
    or ``slack`` more than none (with few requests in flight per pod the average rounds to one, and a prefix would
    leave its pod whenever that pod had one request: ``slack`` keeps it there while its pod is barely busy)."""
    return max(1 + slack, math.ceil(factor * (total_load + 1) / max(1, pods)))


class Ring:
    """The ring of a set of pods (built once per set; a lookup is a bisection and a short walk)."""

    def __init__(self, pods: Iterable[str], points_per_pod: int = POINTS_PER_POD) -> None:
        self.pods = tuple(sorted(set(pods)))
        hashed = np.frombuffer(b"".join([points(pod, points_per_pod) for pod in self.pods]), dtype="<u8")
        order = np.argsort(hashed, kind="stable")  # two pods at one position: in name order, in every replica
        self._positions: list[int] = hashed[order].tolist()
        self._owners: list[str] = list(map(self.pods.__getitem__, (order // max(1, points_per_pod)).tolist()))

    def order(self, position: int) -> Iterable[str]:
        """The pods in ring order from ``position`` (each once)."""
        count = len(self._owners)
        seen: set[str] = set()
        start = bisect.bisect_left(self._positions, position)
        for step in range(count):
            pod = self._owners[(start + step) % count]
            if pod not in seen:
                seen.add(pod)
                yield pod
                if len(seen) == len(self.pods):
                    return

    def place(self, position: int, load: Mapping[str, int], left: Container[str], limit: int) -> str | None:
        """The first pod from ``position``, not in ``left``, whose load (absent: 0) with this request stays within
        ``limit`` (:func:`cap`); None when every pod is left out or at the limit."""
        for pod in self.order(position):
            if pod not in left and load.get(pod, 0) < limit:
                return pod
        return None
