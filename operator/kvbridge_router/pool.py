"""Which prefill and decode pods a request may use, read from a DisaggregatedDeployment's status; pure.

A prefill pod and a decode pod are a pair when their pairing keys are equal (one spec, one checked plan) or
listed together in ``status.rollout.pairings`` (a mix of old and new pods the operator checked during a rollout).
Nothing else is paired: pods of different keys that are not listed were never checked and may exchange KV
caches wrongly. Among the pairs, the balancer's policy (policies/) chooses a prefill pod and a decode pod paired
with it; the balancer holds what the policies read: the requests in flight per pod, what each pod was sent, the turn
counters and hash rings of each set of candidates.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.router_settings import RouterPolicy
from kvbridge_router.policies import POLICIES, Choice, Policy
from kvbridge_router.policies.base import Candidates, candidates_of
from kvbridge_router.policies.kv_aware import LOAD_SLACK
from kvbridge_router.prefixes import PrefixIndex
from kvbridge_router.ring import Ring

KV_AWARE = RouterPolicy.KV_AWARE.value
LEAST_LOADED = RouterPolicy.LEAST_LOADED.value
ROUND_ROBIN = RouterPolicy.ROUND_ROBIN.value
__all__ = ["KV_AWARE", "LEAST_LOADED", "LOAD_SLACK", "ROUND_ROBIN", "Balancer", "Choice", "Pool", "Target"]
#: prefix keys of what was sent kept for the next report to the other replicas (peering.py, every 0.05 s by
#: default): 2 MiB of them in a report, what 1,200 prompts of 1,700 tokens hold; past it, the peers miss the rest
SENT_KEYS = 1 << 18
#: and records of them (a report holds at most 65,535: peers.MAX_RECORDS)
SENT_RECORDS = 1 << 15


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


class _Loads(Mapping[str, int]):
    """A balancer's estimate of each pod's requests in flight, over every replica (a view, not a copy): what the
    ring's bounded loads compare with the cap. Pods with none are absent."""

    def __init__(self, balancer: Balancer) -> None:
        self._balancer = balancer

    def __getitem__(self, pod: str) -> int:
        if pod not in self._balancer.outstanding and pod not in self._balancer._peer_loads:
            raise KeyError(pod)
        return self._balancer.load_of(pod)

    def get(self, pod: str, default: int = 0) -> int:  # type: ignore[override]
        return self._balancer.load_of(pod) or default

    def __iter__(self) -> Iterator[str]:
        return iter(self._balancer.outstanding.keys() | self._balancer._peer_loads.keys())

    def __len__(self) -> int:
        return len(self._balancer.outstanding.keys() | self._balancer._peer_loads.keys())


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
    """What the router's policy reads and writes, and its choice: requests in flight per pod (here and, as reported,
    at the other replicas), what each pod was sent (``prefixes``, for ``kv-aware``), the turn counter per set of
    candidates and their hash rings. The choice is the policy's (``policy``, one of :data:`POLICIES`), returned as
    a :class:`Choice` by :meth:`decide`; nothing of it is left here for the caller to read."""

    #: the policy's name (``--policy``)
    policy: str = KV_AWARE
    #: this replica's requests in flight per pod (pods with none are absent)
    outstanding: dict[str, int] = field(default_factory=dict, init=False)
    #: the round-robin position per set of candidates (prefill pods, each prefill pod's decode partners, ...)
    _turns: dict[tuple[int, str, str], int] = field(default_factory=dict)
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    #: the last choice of :meth:`choose` (tests and benchmarks read it; the router reads :meth:`decide`'s answer)
    last: Choice | None = field(default=None, init=False)
    #: kv-aware: per prefill pod, the records whose prefill is in flight: tick -> the prompt's first key
    _prefilling: dict[str, dict[int, int]] = field(default_factory=dict)
    #: kv-aware: place prompts no pod was sent on the hash ring (bounded loads) rather than on the least loaded pod
    ring: bool = True
    #: the router replicas in front of the pool: each sends about 1/replicas of every pod's requests, so that the
    #: slack and the cap are in requests of all replicas; a pod's load is this replica's count, plus the others' as
    #: they reported them (:meth:`set_peers`), plus this replica's count again for each one not heard from (all of
    #: them without reports: its counts times ``replicas``)
    replicas: int = 1
    #: the other replicas' requests in flight per pod, summed over their fresh reports (peers.py; pods with none are
    #: absent)
    _peer_loads: dict[str, int] = field(default_factory=dict)
    #: the replicas that sent no fresh report: each is taken to send what this one does (its counts once more)
    _unheard: int = field(default=-1)
    #: kv-aware with peers: the (pod, prefix keys) since this replica's last report (:meth:`drain_sent`): prefill pods
    #: whose prefill of the prompt ended, decode pods as chosen
    sent: list[tuple[str, list[int]]] | None = None
    _sent_keys: int = 0
    #: (pod, last key) of each record in ``sent``
    _sent_marks: set[tuple[str, int]] = field(default_factory=set)
    #: records not kept for want of room since the last drain
    sent_dropped: int = 0
    #: the sets of candidates seen, by the identity of their tuple (checked: ``targets is``)
    _candidates: dict[int, Candidates] = field(default_factory=dict)
    #: the hash rings, by the candidates' names (each prefill pod's decode partners are a tuple of their own, most
    #: often of the same pods: one ring for all)
    _rings: dict[tuple[str, ...], Ring] = field(default_factory=dict)
    _unit: Policy | None = field(default=None, init=False, repr=False)

    @property
    def unit(self) -> Policy:
        """The policy named ``policy``."""
        unit = self._unit
        if unit is None or unit.name != self.policy:
            unit = self._unit = POLICIES[RouterPolicy(self.policy)]
        return unit

    def decide(
        self,
        pool: Pool,
        exclude: Iterable[str] = (),
        exclude_decodes: Iterable[str] = (),
        keys: list[int] | None = None,
    ) -> Choice | None:
        """The policy's (prefill, decode) pair for the next request and why, or None when none is left; ``exclude``
        names prefill pods, ``exclude_decodes`` decode pods (ones that failed this request); ``keys``: the prompt's
        prefix keys (``prefixes.prefix_keys``), for a policy that scores them."""
        return self.unit.choose(self, pool, keys or [], exclude, exclude_decodes)

    def choose(
        self,
        pool: Pool,
        exclude: Iterable[str] = (),
        exclude_decodes: Iterable[str] = (),
        keys: list[int] | None = None,
    ) -> tuple[Target, Target] | None:
        """:meth:`decide`'s pair alone, the choice kept as ``last`` (what the tests read)."""
        choice = self.decide(pool, exclude, exclude_decodes, keys)
        if choice is None:
            return None
        self.last = choice
        return choice.prefill, choice.decode

    @property
    def last_matched(self) -> int:
        return self.last.matched if self.last else 0

    @property
    def last_ticks(self) -> list[int]:
        return list(self.last.ticks) if self.last else []

    @property
    def last_tick(self) -> int:
        return self.last.tick if self.last else 0

    def pick(
        self, candidates: Iterable[Target], exclude: Iterable[str] = (), keys: list[int] | None = None
    ) -> Target | None:
        """One of ``candidates`` (taken in the order given: the pool's are sorted by pod), ``exclude`` left out, as
        the policy picks one pod (another decode pod for a retry, one for /v1/models)."""
        return self.unit.pick(self, tuple(candidates), exclude, keys)

    # -- what the policies read ------------------------------------------------------------------------------------

    def candidates(self, every: tuple[Target, ...]) -> Candidates:
        """``every`` as a choice reads it, built on its first choice."""
        known = self._candidates.get(id(every))
        if known is not None and known.targets is every:
            return known
        if len(self._candidates) >= 1024:  # pools come and go: forget old sets rather than grow without bound
            self._candidates.clear()
        known = self._candidates[id(every)] = candidates_of(every)
        return known

    def next_turn(self, key: tuple[int, str, str]) -> int:
        """The next turn of the set of candidates ``key`` tells apart."""
        turn = self._turns[key] = self._turns.get(key, -1) + 1
        if len(self._turns) > 1024:  # pods come and go: forget old sets rather than grow without bound
            self._turns = {key: turn}
        return turn

    def ring_of(self, names: tuple[str, ...]) -> Ring:
        """The hash ring of the candidates ``names``, built once."""
        ring = self._rings.get(names)
        if ring is None:
            if len(self._rings) >= 64:  # pods come and go: forget old sets rather than grow without bound
                self._rings.clear()
            ring = self._rings[names] = Ring(names)
        return ring

    def busy(self) -> tuple[str, ...]:
        """The pods with requests in flight, here or at other replicas (a pod may be named twice)."""
        return (*self.outstanding, *self._peer_loads)

    def in_flight(self) -> Mapping[str, int]:
        """Each pod's requests in flight over every replica (:meth:`load_of`), a view."""
        return _Loads(self)

    def sending(self, prefill: str, decode: str, keys: list[int]) -> int:
        """kv-aware: ``prefill`` and ``decode`` were chosen for the prompt of ``keys``; its record's tick at the
        prefill pod (written at the index's next use, or at :meth:`flush`)."""
        tick = self.prefixes.record(prefill, keys, later=True)
        if tick:
            self._prefilling.setdefault(prefill, {})[tick] = keys[0]
        self.prefixes.record(decode, keys, later=True)
        self._report(decode, keys)  # the prefill pod's once its prefill ends (:meth:`prefilled`)
        return tick

    def flush(self) -> None:
        """Write the index records of the last choice (a router calls this once it sent the prefill request, so that
        the engine starts on it while the index is written; any other use of the index writes them first)."""
        self.prefixes.flush()

    def _report(self, pod: str, keys: list[int]) -> None:
        """For the next report to the other replicas (with peers): ``pod`` holds the prompt of ``keys``."""
        if self.sent is None or not keys:
            return
        mark = (pod, keys[-1])  # the last chained key stands for the whole prompt
        if mark in self._sent_marks:  # in this report already (a prompt's samples, a hot prompt): said once
            return
        if self._sent_keys + len(keys) <= SENT_KEYS and len(self.sent) < SENT_RECORDS:
            self.sent.append((pod, keys))
            self._sent_marks.add(mark)
            self._sent_keys += len(keys)
        else:  # the peers miss it: a cache hit at most
            self.sent_dropped += 1

    def believed(self, pod: str, keys: list[int], matched: int) -> list[int]:
        """The ticks of the prompt's leading chunks the pod holds (:meth:`observed` compares them with its answer);
        none while a prefill of a prompt with the same first chunk is in flight there (a copy this request may
        overtake, or one still filling the cache: its chunks are not cached yet, whatever their ticks say, even after
        a later copy failed). Other replicas report a prefill pod's prompts once its prefill ended."""
        pending = self._prefilling.get(pod)
        if pending and keys[0] in pending.values():
            return []
        return self.prefixes.ticks(pod, keys, matched)

    def prefilled(self, pod: str, tick: int, keys: list[int], matched: int, computed: bool) -> None:
        """The prefill call of the choice that recorded ``keys`` at ``tick`` (``Choice.tick``), ``matched`` of them
        found held (``Choice.matched``), ended: ``computed`` (reported to the other replicas from now), or not
        (failed, timed out, cancelled: the pod never cached the rest, which is forgotten unless sent again since).
        Every choice with keys is followed by this once."""
        pending = self._prefilling.get(pod)
        if pending is not None:
            pending.pop(tick, None)
            if not pending:
                del self._prefilling[pod]
        if computed:
            self._report(pod, keys)
        else:
            self.prefixes.unrecord(pod, keys[matched:], tick)

    def observed(self, pod: str, ticks: list[int], held: int) -> int:
        """A prefill pod's answer said it held ``held`` leading chunks of a prompt of which this router believed it held
        ``len(ticks)`` (``Choice.ticks``: only chunks whose prefill this router saw end): two or more
        fewer, and its cache evicted the first chunk it lacked, and what it was sent before that; those are forgotten
        (:meth:`PrefixIndex.lost`). Not for a shortfall of one chunk (vLLM's hits can be a block coarser than the
        router's chunks: speculative decoding drops one). The keys forgotten."""
        if held >= len(ticks) - 1:
            return 0
        return self.prefixes.lost(pod, ticks[max(held, 0)])

    def started(self, pod: str) -> None:
        self.outstanding[pod] = self.outstanding.get(pod, 0) + 1

    def finished(self, pod: str) -> None:
        if pod not in self.outstanding:
            return
        left = self.outstanding[pod] - 1  # at least 0: a pod in outstanding has a request in flight
        if left > 0:
            self.outstanding[pod] = left
        else:
            del self.outstanding[pod]

    def drain_sent(self) -> tuple[list[tuple[str, list[int]]], int]:
        """What was sent since the last drain, for a report, and how many records were dropped for want of room."""
        sent, dropped = self.sent or [], self.sent_dropped
        self.sent = [] if self.sent is not None else None
        self._sent_keys = self.sent_dropped = 0
        self._sent_marks = set()
        return sent, dropped

    def load_of(self, pod: str) -> int:
        """The requests in flight at ``pod``, over every replica: this one's count, plus the others' as reported, plus
        this one's again for each replica not heard from (:meth:`set_peers`)."""
        return self.outstanding.get(pod, 0) * (1 + self.unheard) + self._peer_loads.get(pod, 0)

    @property
    def unheard(self) -> int:
        """The other replicas this one has no fresh report of (all of them, ``replicas - 1``, until told)."""
        return self.replicas - 1 if self._unheard < 0 else self._unheard

    def set_peers(self, loads: Mapping[str, int], heard: int) -> None:
        """The other replicas' requests in flight per pod, summed over the ``heard`` replicas with a fresh report
        (peers.py): a pod's load is then this replica's count, plus theirs, plus this replica's count again for each
        replica unheard of (as without reports)."""
        self._unheard = max(0, self.replicas - 1 - heard)
        self._peer_loads = {pod: count for pod, count in loads.items() if count > 0}

    def keep_only(self, pods: Iterable[str]) -> None:
        """Forget pods that left the pool (their prefixes, the other replicas' counts of them), so that pods coming and
        going for months cost nothing; this replica's requests in flight are counted until they end."""
        kept = set(pods)
        self.prefixes.keep_only(kept)
        self._peer_loads = {pod: count for pod, count in self._peer_loads.items() if pod in kept}
        self._candidates.clear()

    def load(self, pods: Mapping[str, str]) -> dict[str, int]:
        """In-flight requests of every pod named in ``pods`` (name -> role), zeros included."""
        return {pod: self.outstanding.get(pod, 0) for pod in pods}
