"""``round-robin``: each request to the next prefill pod in turn, then the next of its decode partners, whatever
their loads or what they were sent; pure. The simplest policy: a baseline the others are measured against
(docs/benchmarks.md), and the proof that a policy is one module and its registration.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvbridge_operator.api.router_settings import RouterPolicy
from kvbridge_router.policies.base import BY_TURN, Pick, Picking, nth_left
from kvbridge_router.policies.least_loaded import next_turn

if TYPE_CHECKING:
    from kvbridge_router.pool import Balancer, Target


def _pick(view: Balancer, candidates: tuple[Target, ...], exclude: Iterable[str], keys: list[int]) -> Pick | None:
    every = tuple(candidates)
    if not every:
        return None
    _, out = view.candidates(every).left_out(exclude)
    count = len(every) - len(out)
    if not count:
        return None
    turn = next_turn(view, every, out, count)
    return every[nth_left(turn % count, out)], -1, BY_TURN


class RoundRobin(Picking):
    name = RouterPolicy.ROUND_ROBIN

    def pick_one(
        self, view: Balancer, candidates: tuple[Target, ...], exclude: Iterable[str], keys: list[int]
    ) -> Pick | None:
        return _pick(view, candidates, exclude, keys)
