"""``kv-aware`` (the default): among the pods at most :data:`LOAD_SLACK` requests busier than the least loaded, the
one that was sent the longest leading part of the prompt (its prefix cache most likely holds it), ties to the least
loaded, then in turns; pure. A prompt none of them was sent goes where consistent hashing with bounded loads puts
its first chunks (ring.py), so that router replicas, each knowing only what it sent, send a new prefix to the same
pod; without the ring (``Balancer.ring``), to the least loaded pod. The decode pod is chosen the same way among the
prefill pod's partners (decode affinity: the partner that was sent the prefix reads only the rest).

It scores only the pods holding the prompt's first key, and walks the candidates' ring, built once per set of
candidates. (Plain dicts, not arrays: a request runs through much code, and numpy's calls on cold caches cost tens of
microseconds each, more than the few dict reads.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvbridge_operator.api.router_settings import RouterPolicy
from kvbridge_router.policies.base import BY_LOAD, BY_PREFIX, BY_RING, Choice, Pick, Picking
from kvbridge_router.policies.least_loaded import Scan, by_load, next_turn, scan
from kvbridge_router.ring import anchor, cap

if TYPE_CHECKING:
    from kvbridge_router.pool import Balancer, Target

#: a pod holding the prompt's prefix is preferred while it has at most this many more requests in flight than the
#: least loaded pod (a busy pod's queue costs more than recomputing a prefix elsewhere)
LOAD_SLACK = 2


def _pick(view: Balancer, candidates: tuple[Target, ...], exclude: Iterable[str], keys: list[int]) -> Pick | None:
    found = scan(view, candidates, exclude)
    if found is None:
        return None
    tied: list[Target] = []
    best = 0
    if keys:
        # among the pods at most LOAD_SLACK busier than the least loaded: the longest match, then the least load;
        # only the pods holding the prompt's first key can match at all, taken in the candidates' order
        every, busy, left, position = found.every, found.busy, found.left, found.known.position
        best_load, matched, limit = 0, view.prefixes.matched, found.fewest + LOAD_SLACK
        for index in sorted(position[pod] for pod in view.prefixes.holders(keys[0]) if pod in position):
            target, load = every[index], busy.get(index, 0)
            if load > limit or target.pod in left:
                continue
            score = matched(target.pod, keys)
            if score == 0 or score < best or (score == best and load > best_load):
                continue
            if score > best or load < best_load:
                best, best_load, tied = score, load, [target]
            else:
                tied.append(target)
        if not tied and view.ring:
            placed = _place(view, found, keys)
            if placed is not None:
                return placed, -1, BY_RING
    turn = next_turn(view, found.every, found.out, found.count)
    if tied:
        return tied[turn % len(tied)], best, BY_PREFIX
    return by_load(found, turn), -1, BY_LOAD


def _place(view: Balancer, found: Scan, keys: list[int]) -> Target | None:
    """The pod the hash ring of the candidates gives the prompt, the left-out ones excluded, its load within the cap
    (the requests in flight at the candidates not left out, spread evenly, plus the slack)."""
    position = anchor(keys)
    if position is None:
        return None
    known = found.known
    limit = cap(sum(found.busy.values()), found.count, slack=LOAD_SLACK)
    pod = view.ring_of(known.names).place(position, view.in_flight(), found.left, limit)
    return None if pod is None else known.targets[known.position[pod]]


class KvAware(Picking):
    name = RouterPolicy.KV_AWARE
    scores_prefixes = True

    def choice(self, view: Balancer, keys: list[int], picked: Pick, decode: Target) -> Choice:
        """The pair, and what the prefill pod matched of the prompt and when it was sent it (what
        ``Balancer.observed`` compares with its answer); the choice is recorded as sent to it."""
        prefill, score, reason = picked
        if not keys:
            return Choice(prefill, decode, reason)
        matched = score if score >= 0 else view.prefixes.matched(prefill.pod, keys)
        ticks = view.believed(prefill.pod, keys, matched) if matched else []
        # written at the index's next use, or once the caller sent the prefill request (Balancer.flush)
        tick = view.sending(prefill.pod, decode.pod, keys)
        return Choice(prefill, decode, reason, matched, tuple(ticks), tick)

    def pick_one(
        self, view: Balancer, candidates: tuple[Target, ...], exclude: Iterable[str], keys: list[int]
    ) -> Pick | None:
        return _pick(view, candidates, exclude, keys)
