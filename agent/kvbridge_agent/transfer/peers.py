"""Decode meeting a prefill engine: its ranks' metadata over the side channel, and whether a lease still holds.

Both decode engines use it — the synthetic engine (``engine.py``, which hands the metadata to its rank processes)
and vLLM's connector (``vllm_connector.worker``, where each TP rank fetches its own) — so a restarted prefill,
a mixed-up incarnation and the lease margin mean the same thing in both. Every connection decode opens to a prefill
side channel (handshake, digests, heartbeats, stage requests) goes through :class:`PrefillService`: only to an
address of its deployment's prefill pods, when it knows their Service (``KVBRIDGE_PREFILL_SERVICE``; docs/protocol.md
§5).
"""

from __future__ import annotations

import ipaddress
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from kvbridge_agent.core.admission import REMOTE_HOST_NOT_ALLOWED, under_service
from kvbridge_agent.core.digest import KV_DIGEST_UNAVAILABLE, RequestDigests
from kvbridge_agent.core.handshake import DigestState, HandshakeError, KVTransferParams, RankMetadata
from kvbridge_agent.core.stage_requests import StageReply, StageRequest
from kvbridge_agent.transfer.keys import CurveKeys
from kvbridge_agent.transfer.side_channel import SideChannelClient, send_heartbeats

LEASE_EXPIRED = "LEASE_EXPIRED"
STALE_PEER = "STALE_PEER"
#: the side channel the parameters point at serves another engine than they name (a mixed-up DP rank port)
WRONG_PEER = "WRONG_PEER"
#: decode refuses a read this close to the prefill's lease end (clock skew between the two hosts)
LEASE_CLOCK_MARGIN_SECONDS = 1.0

PrefillRanks = dict[int, tuple[RankMetadata, bytes]]
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
#: how long the Service's addresses are trusted before they are looked up again
SERVICE_TTL_SECONDS = 5.0
#: a host the addresses do not hold looks them up again (a prefill pod newer than the answer), at most this often
SERVICE_REFRESH_SECONDS = 1.0
#: names under the Service (a pod's own name) remembered at most (their answers expire as the Service's do)
_MAX_NAMES = 256


def resolve(name: str) -> list[str]:
    """Every address ``name`` resolves to (the system's resolver: a pod's search path and cluster DNS)."""
    return [str(info[4][0]) for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)]


def _address(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.partition("%")[0])  # a link-local scope is not part of the address
    except ValueError:
        return None


class PrefillService:
    """Where decode may open side channels: the addresses of its deployment's prefill pods, which the prefill role's
    headless Service ``name`` resolves to (it publishes pods that are not ready yet or are draining: a prefill pod
    is met as it starts to serve and read from until its leases end), or a name under the Service that resolves
    into them only. Looked up on the calling thread's time (a handshake, digest or heartbeat thread; never vLLM's
    step), within ``timeout``, cached :data:`SERVICE_TTL_SECONDS`; a host outside the answer looks it up once more
    (a new pod), at most every :data:`SERVICE_REFRESH_SECONDS`; a failed lookup keeps the last answer. Without a
    name every host is reachable (nothing to check against)."""

    def __init__(
        self,
        name: str | None,
        timeout: float,
        *,
        lookup: Callable[[str], Iterable[str]] = resolve,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name.removesuffix(".").lower() if name else None
        self.timeout, self._lookup, self._clock = timeout, lookup, clock
        self._lock = threading.Lock()
        #: name -> when it was looked up, its addresses (the last good ones) and why the last lookup failed
        self._answers: dict[str, tuple[float, frozenset[IPAddress], str]] = {}
        #: lookups in flight: their future and when they started
        self._pending: dict[str, tuple[Future[frozenset[IPAddress]], float]] = {}
        self._executor: ThreadPoolExecutor | None = None

    def address(self, host: str) -> str:
        """The address to connect to for ``host`` (a side channel's host in transfer parameters): ``host`` itself
        without a Service, else the one of the Service's addresses it is or resolves to. Raises
        :class:`HandshakeError` (:data:`REMOTE_HOST_NOT_ALLOWED`) for any other."""
        if self.name is None:
            return host
        given = _address(host)
        if given is None and not under_service(host, self.name):
            raise self._refusal(host, "neither an address nor a name under it")
        wanted = frozenset({given}) if given is not None else self._resolved(host.lower(), refresh=False)[0]
        if not wanted:
            raise self._refusal(host, "the name resolves to no address")
        members, error = self._resolved(self.name, refresh=False)
        if not wanted <= members:
            members, error = self._resolved(self.name, refresh=True)
        if not wanted <= members:
            why = f"the lookup failed: {error}" if error else f"not among its {len(members)} address(es)"
            raise self._refusal(host, why)
        return str(min(wanted, key=str))

    def admitted(self, params: KVTransferParams) -> KVTransferParams:
        """``params`` to connect by: their host replaced by the address :meth:`address` admits."""
        address = self.address(params.remote_host)
        return params if address == params.remote_host else params.model_copy(update={"remote_host": address})

    def _refusal(self, host: str, why: str) -> HandshakeError:
        return HandshakeError(
            f"{host!r} is not an address of this deployment's prefill pods (Service {self.name}: {why}; "
            "KVBRIDGE_PREFILL_SERVICE): decode opens no connection to it",
            field="kvTransferParams.remoteHost",
            code=REMOTE_HOST_NOT_ALLOWED,
        )

    def _resolved(self, name: str, refresh: bool) -> tuple[frozenset[IPAddress], str]:
        """``name``'s addresses and why its last lookup failed: the cached answer while fresh (``refresh``: unless
        older than the refresh floor), else a lookup (one in flight per name, waited for within the timeout)."""
        now = self._clock()
        with self._lock:
            at, addresses, error = self._answers.get(name, (-math.inf, frozenset(), ""))
            if now - at < (SERVICE_REFRESH_SECONDS if refresh else SERVICE_TTL_SECONDS):
                return addresses, error
            pending = self._pending.get(name)
            started = pending is None
            if pending is None:
                self._executor = self._executor or ThreadPoolExecutor(2, thread_name_prefix="kvbridge-resolve")
                pending = self._pending[name] = (self._executor.submit(self._addresses_of, name), now)
            future, since = pending
        if started:  # outside the lock: on a lookup done already, the callback runs at once
            future.add_done_callback(lambda done: self._settle(name, done, now))
        wait([future], timeout=max(self.timeout - (now - since), 0))  # a lookup that hangs is waited for once
        if not future.done():  # its answer is kept when it comes
            return addresses, f"no answer within {self.timeout:g} s"
        self._settle(name, future, now)
        with self._lock:
            return self._answers[name][1:]

    def _settle(self, name: str, future: Future[frozenset[IPAddress]], at: float) -> None:
        """Keep a finished lookup's answer (once: its callback and its waiter both call this)."""
        with self._lock:
            if self._pending.get(name, (None, at))[0] is not future:
                return
            del self._pending[name]
            kept = self._answers.get(name, (at, frozenset(), ""))[1]
            try:
                found, error = future.result(), ""
            except Exception as exc:  # socket.gaierror (no such name, no server), or what the resolver raised
                found, error = kept, str(exc) or type(exc).__name__  # a failed lookup keeps the last answer
            self._answers[name] = (at, found, error)
            while len(self._answers) > _MAX_NAMES + 1:
                del self._answers[next(n for n in self._answers if n != self.name)]

    def _addresses_of(self, name: str) -> frozenset[IPAddress]:
        return frozenset(a for a in map(_address, self._lookup(name)) if a is not None)

    def reachable(self, waiting: Mapping[str, KVTransferParams]) -> dict[str, KVTransferParams]:
        """The waiting requests whose prefill host is reachable, each to be reached at its admitted address (a
        heartbeat goes nowhere else; a request left out fails at its handshake)."""
        reached: dict[str, KVTransferParams] = {}
        for request_id, params in waiting.items():
            try:
                reached[request_id] = self.admitted(params)
            except HandshakeError:
                continue
        return reached


def renew_leases(
    waiting: Mapping[str, KVTransferParams], service: PrefillService, fingerprint: str, keys: CurveKeys | None
) -> dict[str, float]:
    """Decode's heartbeats (``side_channel.send_heartbeats``) to the prefill hosts :class:`PrefillService` admits."""
    return send_heartbeats(service.reachable(waiting), fingerprint, keys)


def fetch_prefill_ranks(
    params: KVTransferParams,
    ranks: Sequence[int],
    fingerprint: str,
    keys: CurveKeys | None,
    timeout: float,
    service: PrefillService | None = None,
) -> tuple[str, PrefillRanks]:
    """The metadata of these prefill ranks (one exchange each, all within ``timeout``) and the incarnation they
    all run; a host ``service`` does not admit is refused before any connection (:data:`REMOTE_HOST_NOT_ALLOWED`),
    ranks of another engine than the parameters name (:data:`WRONG_PEER`) or of different incarnations (an engine
    restarting under decode's feet) after it."""
    host = service.address(params.remote_host) if service is not None else params.remote_host
    fetched = SideChannelClient(host, params.remote_port, fingerprint, keys, timeout).fetch(ranks)
    served = sorted({meta.engine_id for meta, _ in fetched.values()} - {params.remote_engine_id})
    if served:  # checked first: nothing of another engine may be taken for this one's (its incarnation included)
        raise HandshakeError(
            f"the side channel at {params.remote_host}:{params.remote_port} serves {', '.join(served)}, not "
            f"{params.remote_engine_id}, which the transfer parameters name: each data-parallel rank listens on base "
            "port + its rank; prefill the request again",
            code=WRONG_PEER,
        )
    incarnations = {meta.incarnation for meta, _ in fetched.values()}
    if len(incarnations) != 1:
        raise HandshakeError(
            f"{params.remote_engine_id}'s ranks report different incarnations {sorted(incarnations)}",
            code="PEER_INCOMPATIBLE",
        )
    return incarnations.pop(), fetched


def fetch_digests(
    params: KVTransferParams,
    fingerprint: str,
    keys: CurveKeys | None,
    timeout: float,
    until: float,
    service: PrefillService | None = None,
) -> RequestDigests:
    """Prefill's key and digests of a request to verify (docs/protocol.md §8), from a host ``service`` admits. A
    prefill that has not digested it yet (vLLM's ranks report one engine step after the offer) is asked again until
    ``until`` (Unix time: the lease); none to be had is :data:`KV_DIGEST_UNAVAILABLE` — also when decode's own policy
    (``All``) asks for a request prefill did not digest (``params.verify`` false): it is not used unverified."""
    host = service.address(params.remote_host) if service is not None else params.remote_host
    client = SideChannelClient(host, params.remote_port, fingerprint, keys, timeout)
    delay = 0.002
    while True:
        state, digests = client.digests(params.remote_request_id, params.lease_token)
        if state is DigestState.READY and digests is not None:
            return digests
        if state is DigestState.UNKNOWN and not params.verify:
            raise HandshakeError(
                f"decode verifies every request (spec.transfer.verification: All) and prefill "
                f"{params.remote_engine_id} did not digest {params.remote_request_id} (its verification is not "
                "All): not used unverified",
                code=KV_DIGEST_UNAVAILABLE,
            )
        if state is DigestState.UNKNOWN or time.time() + delay > until:
            raise HandshakeError(
                f"prefill {params.remote_engine_id} has no digests of {params.remote_request_id} ({state.value}): "
                "its lease ended or it restarted; prefill the request again",
                code=KV_DIGEST_UNAVAILABLE,
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


class SideChannelStager:
    """Decode: a rank's stage requests (docs/protocol.md §4d) over prefill's side channel, with the deployment's
    side-channel keys, each within ``timeout``; to the host its engine admitted for the request (``hosts``, by
    prefill's request id: the synthetic engine's), else the host :meth:`ask` is given, else the parameters' own."""

    def __init__(self, keys: CurveKeys | None, timeout: float) -> None:
        self.keys, self.timeout = keys, timeout
        #: prefill's request id -> the admitted host of its side channel
        self.hosts: dict[str, str] = {}

    def __call__(self, params: KVTransferParams, request: StageRequest) -> StageReply:
        return self.ask(self.hosts.get(params.remote_request_id, params.remote_host), params, request)

    def ask(self, host: str, params: KVTransferParams, request: StageRequest) -> StageReply:
        """One stage exchange with the side channel at ``host``; a refusal or no answer in time raises
        :class:`HandshakeError` (prefill's code, or ``HANDSHAKE_TIMEOUT``)."""
        client = SideChannelClient(host, params.remote_port, params.fingerprint, self.keys, self.timeout)
        return client.stage(params.remote_request_id, params.lease_token, request)


def require_incarnation(params: KVTransferParams, incarnation: str) -> None:
    """The request's blocks exist only in the incarnation that computed them."""
    if incarnation != params.remote_incarnation:
        raise HandshakeError(
            f"{params.remote_engine_id} now runs incarnation {incarnation}, not {params.remote_incarnation}: the "
            "request's blocks are gone; prefill it again",
            code=STALE_PEER,
        )


def require_address(params: KVTransferParams, address: tuple[str, int] | None) -> None:
    """An incarnation's side channel does not move: parameters naming a known incarnation at another address than
    decode met it at point at another engine's listener (:data:`WRONG_PEER`; ``address`` None: not met yet)."""
    if address is not None and address != (params.remote_host, params.remote_port):
        raise HandshakeError(
            f"{params.remote_engine_id} incarnation {params.remote_incarnation} listens at {address[0]}:{address[1]}, "
            f"and these transfer parameters name {params.remote_host}:{params.remote_port}: each data-parallel rank "
            "listens on base port + its rank; prefill the request again",
            code=WRONG_PEER,
        )


def lease_left(expires_at: float | None, now: float | None = None) -> float:
    """Seconds decode may still read within prefill's lease ending at ``expires_at`` (Unix time), less
    :data:`LEASE_CLOCK_MARGIN_SECONDS`; ``inf`` for parameters without an expiry."""
    if expires_at is None:
        return float("inf")
    return expires_at - LEASE_CLOCK_MARGIN_SECONDS - (time.time() if now is None else now)
