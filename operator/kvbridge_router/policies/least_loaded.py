"""``least-loaded``: the prefill pod with the fewest requests in flight, then its least loaded decode partner; ties
in turns, so that an idle pool spreads its requests; pure. Also the loads' reading kv-aware falls back on.

A choice among hundreds of pods reads only the pods with requests in flight (here or at other replicas; the others
are idle): no loop over the pods per request.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbridge_operator.api.router_settings import RouterPolicy
from kvbridge_router.policies.base import BY_LOAD, Candidates, Pick, Picking, ends, nth_left

if TYPE_CHECKING:
    from kvbridge_router.pool import Balancer, Target


@dataclass(frozen=True, slots=True)
class Scan:
    """The candidates of one pick as loads read them."""

    every: tuple[Target, ...]
    known: Candidates
    #: the pods left out (failed this request), and their positions, sorted
    left: set[str]
    out: list[int]
    #: how many candidates are not left out
    count: int
    #: the candidates with requests in flight, by position, and their loads: every other one has none
    busy: dict[int, int]
    #: the least load among the candidates not left out (0 while one is idle)
    fewest: int


def scan(view: Balancer, candidates: Iterable[Target], exclude: Iterable[str]) -> Scan | None:
    """``candidates`` (taken in the order given: the pool's are sorted by pod) as a pick reads them, ``exclude`` left
    out; None when none is left."""
    every = tuple(candidates)
    if not every:
        return None
    known = view.candidates(every)
    left, out = known.left_out(exclude)  # a retry: the candidates that failed this request are left out
    count = len(every) - len(out)
    if not count:
        return None
    busy: dict[int, int] = {}
    for pod in view.busy():
        if pod not in left:
            for index in known.positions(pod):
                busy[index] = view.load_of(pod)
    fewest = 0 if len(busy) < count else min(busy.values())
    return Scan(every, known, left, out, count, busy, fewest)


def next_turn(view: Balancer, every: tuple[Target, ...], out: list[int], count: int) -> int:
    """The next turn of the set of candidates, told apart by its size and ends (a tuple of hundreds of names per
    request costs more than the choice; two sets that look alike share a turn counter, which only shifts whose turn
    it is)."""
    first, last = ends(len(every), out)
    return view.next_turn((count, every[first].pod, every[last].pod))


def by_load(found: Scan, turn: int) -> Target:
    """The least loaded candidate, ties taken in turns."""
    every, busy = found.every, found.busy
    if found.fewest:  # every candidate is busy: the least loaded ones
        least = [every[index] for index in sorted(busy) if busy[index] == found.fewest]
        return least[turn % len(least)]
    # the idle candidates, in order: the turn's one, found past the busy and left-out ones before it
    return every[nth_left(turn % (found.count - len(busy)), sorted({*busy, *found.out}))]


def _pick(view: Balancer, candidates: tuple[Target, ...], exclude: Iterable[str], keys: list[int]) -> Pick | None:
    found = scan(view, candidates, exclude)
    if found is None:
        return None
    return by_load(found, next_turn(view, found.every, found.out, found.count)), -1, BY_LOAD


class LeastLoaded(Picking):
    name = RouterPolicy.LEAST_LOADED

    def pick_one(
        self, view: Balancer, candidates: tuple[Target, ...], exclude: Iterable[str], keys: list[int]
    ) -> Pick | None:
        return _pick(view, candidates, exclude, keys)
