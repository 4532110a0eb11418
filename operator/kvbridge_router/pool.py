"""Which prefill and decode pods a request may use, read from a DisaggregatedDeployment's status; pure.

A prefill pod and a decode pod are a pair when their pairing keys are equal (one spec, one checked plan) or
listed together in ``status.rollout.pairings`` (a mix of old and new pods the operator checked during a rollout).
Nothing else is paired: pods of different keys that are not listed were never checked and may exchange KV
caches wrongly. Among the pairs, the balancer picks the prefill pod with the fewest requests in flight, then
the least loaded decode pod paired with it; ties go round-robin so that an idle pool spreads its requests.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from kvbridge_operator.api.objects import Obj
from kvbridge_router.prefixes import PrefixIndex
from kvbridge_router.ring import Ring, anchor, cap
from kvbridge_router.settings import RouterPolicy

KV_AWARE = RouterPolicy.KV_AWARE.value
LEAST_LOADED = RouterPolicy.LEAST_LOADED.value
#: kv-aware: a pod holding the prompt's prefix is preferred while it has at most this many more requests in flight
#: than the least loaded pod (a busy pod's queue costs more than recomputing a prefix elsewhere)
LOAD_SLACK = 2


@dataclass(frozen=True)
class Target:
    """One engine a request can be sent to."""

    pod: str
    url: str
    pairing: str
    revision: str = ""
    #: the pod's uid and container restarts (``uid:restarts``): another one is another engine, its caches empty
    incarnation: str = ""


@dataclass(frozen=True)
class Pool:
    prefill: tuple[Target, ...] = ()
    decode: tuple[Target, ...] = ()
    #: (prefill key, decode key) pairs checked compatible beyond equal keys
    pairings: frozenset[tuple[str, str]] = frozenset()
    #: why an endpoint of the status was left out (no HTTP port, no pairing key), for /health and the log
    skipped: tuple[str, ...] = ()
    #: the status' resourceVersion this pool was read from
    version: str = ""

    @classmethod
    def from_status(cls, status: Obj, version: str = "") -> Pool:
        skipped: list[str] = []
        roles = {role: _targets(status, role, skipped) for role in ("prefill", "decode")}
        listed = ((status.get("rollout") or {}).get("pairings")) or []
        pairings = frozenset((str(p.get("prefill", "")), str(p.get("decode", ""))) for p in listed)
        return cls(roles["prefill"], roles["decode"], pairings, tuple(skipped), version)

    def reborn(self, previous: Pool) -> set[str]:
        """Pods of this pool that ``previous`` listed as another incarnation (restarted, or replaced under the same
        name): what was sent to them before is gone from their caches."""
        before = {t.pod: t.incarnation for t in (*previous.prefill, *previous.decode) if t.incarnation}
        return {
            t.pod
            for t in (*self.prefill, *self.decode)
            if t.incarnation and before.get(t.pod, t.incarnation) != t.incarnation
        }

    def compatible(self, prefill: Target, decode: Target) -> bool:
        return prefill.pairing == decode.pairing or (prefill.pairing, decode.pairing) in self.pairings

    @cached_property
    def _partners(self) -> dict[str, tuple[Target, ...]]:
        """Each prefill pod's decode partners, computed once per pool (a pool changes only with the status; a
        request reads this)."""
        decode = sorted(self.decode, key=lambda t: t.pod)
        return {p.pod: tuple(d for d in decode if self.compatible(p, d)) for p in self.prefill}

    def decodes_for(self, prefill: Target) -> tuple[Target, ...]:
        return self._partners.get(prefill.pod, ())

    @cached_property
    def _routable(self) -> tuple[Target, ...]:
        return tuple(sorted((p for p in self.prefill if self._partners[p.pod]), key=lambda t: t.pod))

    def routable(self) -> tuple[Target, ...]:
        """Prefill pods with at least one decode pod to pair with, sorted by name (as ``decodes_for``'s)."""
        return self._routable

    @cached_property
    def _pods(self) -> frozenset[str]:
        return frozenset(t.pod for t in (*self.prefill, *self.decode))

    def has(self, pod: str) -> bool:
        """Whether ``pod`` is in the pool (a pod being drained or replaced has left the status)."""
        return pod in self._pods

    def problem(self) -> str:
        """Why no request can be routed, or empty."""
        if self.routable():
            return ""
        if not self.prefill or not self.decode:
            missing = " and ".join(r for r, t in (("prefill", self.prefill), ("decode", self.decode)) if not t)
            return f"no ready {missing} endpoint in the deployment's status"
        return "no ready prefill and decode pods of one pairing key (or a pair listed in status.rollout.pairings)"


def _targets(status: Obj, role: str, skipped: list[str]) -> tuple[Target, ...]:
    found = []
    for endpoint in (status.get(role) or {}).get("endpoints") or []:
        pod, ip, port, key = endpoint.get("pod"), endpoint.get("ip"), endpoint.get("httpPort"), endpoint.get("pairing")
        if not (pod and ip and port and key):
            skipped.append(
                f"{role} {pod or '?'}: no " + ("HTTP port" if not port else "pairing key" if not key else "address")
            )
            continue
        host = f"[{ip}]" if ":" in str(ip) else str(ip)
        revision, incarnation = str(endpoint.get("revision", "")), str(endpoint.get("incarnation", ""))
        found.append(Target(str(pod), f"http://{host}:{int(port)}", str(key), revision, incarnation))
    return tuple(found)


@dataclass
class Balancer:
    """Requests in flight per pod, and the choice of a pod: the least loaded one (``least-loaded``), or
    (``kv-aware``) among the pods at most :data:`LOAD_SLACK` requests busier than the least loaded, the one that
    was sent the longest leading part of the prompt (``prefixes``: its prefix cache most likely holds it), ties
    to the least loaded; then round-robin. A prompt none of them was sent goes (``ring``) where consistent hashing
    with bounded loads puts its first chunks (ring.py), so that router replicas, each knowing only what it sent,
    send a new prefix to the same pod; without ``ring``, to the least loaded pod."""

    policy: str = KV_AWARE
    outstanding: dict[str, int] = field(default_factory=dict)
    #: the round-robin position per set of candidates (prefill pods, each prefill pod's decode partners, ...)
    _turns: dict[tuple[int, str, str], int] = field(default_factory=dict)
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    #: kv-aware: how many leading chunks of the last chosen prefill pod's prompt it had been sent before
    last_matched: int = 0
    #: kv-aware: place prompts no pod was sent on the hash ring (bounded loads) rather than on the least loaded pod
    ring: bool = True
    #: the router replicas in front of the pool: each sends about 1/replicas of every pod's requests, so its counts
    #: times this estimate the pods' loads, and the slack and the cap are in requests of all replicas
    replicas: int = 1
    _rings: dict[tuple[str, ...], Ring] = field(default_factory=dict)

    def pick(
        self, candidates: Iterable[Target], exclude: Iterable[str] = (), keys: list[int] | None = None
    ) -> Target | None:
        """One of ``candidates`` (taken in the order given: the pool's are sorted by pod), ``exclude`` left out."""
        every = tuple(candidates)
        left = set(exclude)
        options = [t for t in every if t.pod not in left] if left else every
        if not options:
            return None
        outstanding = self.outstanding
        scale = self.replicas
        loads = [outstanding.get(t.pod, 0) * scale for t in options]
        fewest = min(loads)
        tied: list[Target] = []
        if keys and self.policy == KV_AWARE:
            # among the pods at most LOAD_SLACK busier than the least loaded: the longest match, then the least load
            best, best_load, matched = 0, 0, self.prefixes.matched
            holders = self.prefixes.holders(keys[0])  # the pods that can match at all
            for target, load in zip(options, loads, strict=True):
                if load > fewest + LOAD_SLACK or target.pod not in holders:
                    continue
                score = matched(target.pod, keys)
                if score == 0 or score < best or (score == best and load > best_load):
                    continue
                if score > best or load < best_load:
                    best, best_load, tied = score, load, [target]
                else:
                    tied.append(target)
            if not tied and self.ring:
                placed = self._place(every, left, keys, sum(loads), len(options))
                if placed is not None:
                    return placed
        if not tied:
            tied = [t for t, load in zip(options, loads, strict=True) if load == fewest]
        # the set of candidates, told apart by its size and ends (a tuple of hundreds of names per request costs more
        # than the choice; two sets that look alike share a turn counter, which only shifts whose turn it is)
        key = (len(options), options[0].pod, options[-1].pod)
        turn = self._turns[key] = self._turns.get(key, -1) + 1
        if len(self._turns) > 1024:  # pods come and go: forget old sets rather than grow without bound
            self._turns = {key: turn}
        return tied[turn % len(tied)]

    def _place(
        self, every: tuple[Target, ...], left: set[str], keys: list[int], total: int, count: int
    ) -> Target | None:
        """The pod the hash ring of ``every`` candidate gives the prompt, ``left`` excluded, its load within the
        cap (``total`` requests in flight at the ``count`` pods not excluded)."""
        position = anchor(keys)
        if position is None:
            return None
        names = tuple(t.pod for t in every)
        ring = self._rings.get(names)
        if ring is None:
            if len(self._rings) >= 64:  # pods come and go: forget old sets rather than grow without bound
                self._rings.clear()
            ring = self._rings[names] = Ring(names)
        limit = cap(total, count, slack=LOAD_SLACK)
        pod = ring.place(position, self.outstanding, left, math.ceil(limit / self.replicas))
        return next((t for t in every if t.pod == pod), None)

    def choose(
        self,
        pool: Pool,
        exclude: Iterable[str] = (),
        exclude_decodes: Iterable[str] = (),
        keys: list[int] | None = None,
    ) -> tuple[Target, Target] | None:
        """A (prefill, decode) pair for the next request, or None when none is left; ``exclude`` names prefill
        pods, ``exclude_decodes`` decode pods (ones that failed this request); ``keys``: the prompt's prefix keys
        (``prefixes.prefix_keys``), for the kv-aware policy. Decode affinity: the decode partner that was sent the
        prompt's prefix already holds those blocks, and reads only the rest."""
        avoided = set(exclude_decodes)
        candidates = pool.routable()
        if avoided:
            candidates = tuple(p for p in candidates if any(d.pod not in avoided for d in pool.decodes_for(p)))
        prefill = self.pick(candidates, exclude, keys)
        if prefill is None:
            return None
        decode = self.pick(pool.decodes_for(prefill), avoided, keys)
        if decode is None:
            return None
        if keys and self.policy == KV_AWARE:
            self.last_matched = self.prefixes.matched(prefill.pod, keys)
            self.prefixes.record(prefill.pod, keys)
            self.prefixes.record(decode.pod, keys)
        return prefill, decode

    def started(self, pod: str) -> None:
        self.outstanding[pod] = self.outstanding.get(pod, 0) + 1

    def finished(self, pod: str) -> None:
        left = self.outstanding.get(pod, 0) - 1
        if left > 0:
            self.outstanding[pod] = left
        else:
            self.outstanding.pop(pod, None)

    def load(self, pods: Mapping[str, str]) -> dict[str, int]:
        """In-flight requests of every pod named in ``pods`` (name -> role), zeros included."""
        return {pod: self.outstanding.get(pod, 0) for pod in pods}
