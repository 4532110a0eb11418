"""Decode meeting a prefill engine: its ranks' metadata over the side channel, and whether a lease still holds.

Both decode engines use it — the synthetic engine (``engine.py``, which hands the metadata to its rank processes)
and vLLM's connector (``vllm_connector.worker``, where each TP rank fetches its own) — so a restarted prefill,
a mixed-up incarnation and the lease margin mean the same thing in both.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvbridge_agent.core.digest import KV_DIGEST_UNAVAILABLE, RequestDigests
from kvbridge_agent.core.handshake import DigestState, HandshakeError, KVTransferParams, RankMetadata
from kvbridge_agent.transfer.keys import CurveKeys
from kvbridge_agent.transfer.side_channel import SideChannelClient

LEASE_EXPIRED = "LEASE_EXPIRED"
STALE_PEER = "STALE_PEER"
#: the side channel the parameters point at serves another engine than they name (a mixed-up DP rank port)
WRONG_PEER = "WRONG_PEER"
#: decode refuses a read this close to the prefill's lease end (clock skew between the two hosts)
LEASE_CLOCK_MARGIN_SECONDS = 1.0

PrefillRanks = dict[int, tuple[RankMetadata, bytes]]


def fetch_prefill_ranks(
    params: KVTransferParams, ranks: Sequence[int], fingerprint: str, keys: CurveKeys | None, timeout: float
) -> tuple[str, PrefillRanks]:
    """The metadata of these prefill ranks (one exchange each, all within ``timeout``) and the incarnation they
    all run; ranks of another engine than the parameters name (:data:`WRONG_PEER`) or of different incarnations
    (an engine restarting under decode's feet) are refused."""
    fetched = SideChannelClient(params.remote_host, params.remote_port, fingerprint, keys, timeout).fetch(ranks)
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
    params: KVTransferParams, fingerprint: str, keys: CurveKeys | None, timeout: float, until: float
) -> RequestDigests:
    """Prefill's key and digests of a request to verify (docs/protocol.md §8). A prefill that has not digested it
    yet (vLLM's ranks report one engine step after the offer) is asked again until ``until`` (Unix time: the lease);
    none to be had is :data:`KV_DIGEST_UNAVAILABLE` — also when decode's own policy (``All``) asks for a request
    prefill did not digest (``params.verify`` false): it is not used unverified."""
    client = SideChannelClient(params.remote_host, params.remote_port, fingerprint, keys, timeout)
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
