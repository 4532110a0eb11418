"""What every router policy is: the protocol, the choice it returns as a value, and the reading of a set of
candidates the policies share; pure.

A policy is a stateless unit: what it reads (requests in flight, what each pod was sent, the turn counters and hash
rings of each set of candidates) lives in the :class:`~kvbridge_router.pool.Balancer` it is given, and what it chose
comes back as a :class:`Choice`: the pair and why. The prefill call (prefill.py) reads nothing else of the choice, and
shows why on the trace and in the metrics.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvbridge_operator.api.router_settings import RouterPolicy
    from kvbridge_router.pool import Balancer, Pool, Target

#: why a pod was chosen (:attr:`Choice.reason`)
BY_PREFIX = "prefix"  # kv-aware: it was sent the longest leading part of the prompt
BY_RING = "ring"  # kv-aware: no pod was sent the prompt; consistent hashing with bounded loads placed it
BY_LOAD = "load"  # the fewest requests in flight, ties taken in turns
BY_TURN = "turn"  # round-robin: the next in turn, whatever its load


@dataclass(frozen=True)
class Choice:
    """A policy's choice for one request: the pair, and why (what the trace and the metrics read)."""

    prefill: Target
    decode: Target
    #: why the prefill pod was chosen (``BY_*``)
    reason: str
    #: kv-aware: how many leading chunks of the prompt the prefill pod had been sent before
    matched: int = 0
    #: and when (:meth:`PrefixIndex.ticks`): what ``Balancer.observed`` compares with the pod's answer
    ticks: tuple[int, ...] = ()
    #: the tick of this choice's record at the prefill pod (0: none), for ``Balancer.prefilled``
    tick: int = 0


#: a policy's choice of one of the candidates: the pod, its score (the leading chunks it was sent, when it was
#: chosen by score, else -1), and why
Pick = tuple["Target", int, str]


class Policy(Protocol):
    """How the router chooses pods (one module per policy, registered in ``policies.POLICIES``)."""

    #: its name, the value of ``--policy`` and of ``spec.router.policy``
    name: RouterPolicy
    #: whether it reads the prompt's prefix keys (the proxy computes them only for a policy that does)
    scores_prefixes: bool

    def choose(
        self, view: Balancer, pool: Pool, keys: list[int], exclude: Iterable[str], exclude_decodes: Iterable[str]
    ) -> Choice | None:
        """A (prefill, decode) pair of ``pool`` for a request whose prompt has ``keys`` (empty when not scored), or
        None when none is left; ``exclude`` names prefill pods, ``exclude_decodes`` decode pods (ones that failed
        this request)."""
        ...

    def pick(
        self, view: Balancer, candidates: tuple[Target, ...], exclude: Iterable[str] = (), keys: list[int] | None = None
    ) -> Target | None:
        """One of ``candidates``, ``exclude`` left out (another decode pod for a retry, a pod for /v1/models), for a
        prompt of ``keys`` when given."""
        ...


@dataclass(frozen=True)
class Candidates:
    """A set of candidates as a request's choice reads it, built once per tuple of targets (the pool's are cached
    per pool): each target's position by pod name (its first, and every position of a name listed more than once)."""

    targets: tuple[Target, ...]
    position: dict[str, int]
    names: tuple[str, ...]
    twins: dict[str, tuple[int, ...]]

    def positions(self, pod: str) -> tuple[int, ...]:
        """Every position of ``pod`` among the candidates (none when it is not one)."""
        twins = self.twins.get(pod)
        if twins is not None:
            return twins
        index = self.position.get(pod)
        return () if index is None else (index,)

    def left_out(self, exclude: Iterable[str]) -> tuple[set[str], list[int]]:
        """The pods of ``exclude`` (those that failed this request), and their positions, sorted."""
        left = set(exclude)
        return left, sorted({index for pod in left for index in self.positions(pod)}) if left else []


def candidates_of(every: tuple[Target, ...]) -> Candidates:
    names = tuple(t.pod for t in every)
    position = {name: index for index, name in reversed(tuple(enumerate(names)))}  # a name listed twice: its first
    twins: dict[str, tuple[int, ...]] = {}
    if len(position) < len(names):
        for name in position:
            indices = tuple(index for index, other in enumerate(names) if other == name)
            if len(indices) > 1:
                twins[name] = indices
    return Candidates(every, position, names, twins)


def ends(size: int, out: list[int]) -> tuple[int, int]:
    """The first and last of ``size`` positions not in ``out`` (sorted; fewer than ``size``)."""
    first, last, left = 0, size - 1, set(out)
    while first in left:
        first += 1
    while last in left:
        last -= 1
    return first, last


def nth_left(index: int, skipped: Iterable[int]) -> int:
    """The position of the ``index``-th candidate not ``skipped`` (positions, sorted)."""
    for position in skipped:
        if position > index:
            break
        index += 1
    return index


def pair(
    pick: Callable[[Balancer, tuple[Target, ...], Iterable[str], list[int]], Pick | None],
    view: Balancer,
    pool: Pool,
    keys: list[int],
    exclude: Iterable[str],
    exclude_decodes: Iterable[str],
) -> tuple[Pick, Target] | None:
    """The prefill pod ``pick`` chooses among those with a decode partner not excluded, then the decode partner it
    chooses (decode affinity, for a policy scoring prefixes: the partner that was sent the prompt's prefix already
    holds those blocks, and reads only the rest)."""
    avoided = set(exclude_decodes)
    candidates = pool.routable()
    if avoided:
        candidates = tuple(p for p in candidates if any(d.pod not in avoided for d in pool.decodes_for(p)))
    prefill = pick(view, candidates, exclude, keys)
    if prefill is None:
        return None
    decode = pick(view, pool.decodes_for(prefill[0]), avoided, keys)
    return None if decode is None else (prefill, decode[0])


class Picking(ABC):
    """A policy that is one pick of a pod among candidates (:meth:`pick_one`): a pair is that pick of a prefill pod
    then of its decode partner (:func:`pair`), and :meth:`pick` is the pick's pod. least-loaded and round-robin are
    this and their pick; kv-aware adds what the prefill pod matched."""

    name: RouterPolicy
    scores_prefixes = False

    @abstractmethod
    def pick_one(
        self, view: Balancer, candidates: tuple[Target, ...], exclude: Iterable[str], keys: list[int]
    ) -> Pick | None:
        """One of ``candidates`` with its score and why, ``exclude`` left out (None: none is left)."""

    def choose(
        self, view: Balancer, pool: Pool, keys: list[int], exclude: Iterable[str], exclude_decodes: Iterable[str]
    ) -> Choice | None:
        chosen = pair(self.pick_one, view, pool, keys, exclude, exclude_decodes)
        return None if chosen is None else self.choice(view, keys, *chosen)

    def choice(self, view: Balancer, keys: list[int], picked: Pick, decode: Target) -> Choice:
        """The choice of a pair picked for a prompt of ``keys``: the pods and why (kv-aware adds what matched)."""
        return Choice(picked[0], decode, picked[2])

    def pick(
        self, view: Balancer, candidates: tuple[Target, ...], exclude: Iterable[str] = (), keys: list[int] | None = None
    ) -> Target | None:
        picked = self.pick_one(view, candidates, exclude, keys or [])
        return None if picked is None else picked[0]
