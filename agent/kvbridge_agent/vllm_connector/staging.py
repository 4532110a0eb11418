"""Staged reads in the connector (docs/protocol.md §4d): each rank's staging buffer, prefill's relay, decode's stager.

Both roles take their buffer from ``KVBRIDGE_STAGING_MIB`` (off by default, docs/environment.md) and decode its
``auto`` / ``direct`` / ``staged`` choice from ``KVBRIDGE_STAGING_MODE``, as the synthetic engine's ranks do.

- Prefill: a rank with a buffer serves stage requests on its own thread (``stage_relay.StageServer``, bound before
  the buffer is announced: a rank that cannot listen announces none); the scheduler's side channel relays each
  stage request to the rank it names (``stage_relay.StageRelay``, within ``stage_relay.RELAY_SECONDS``, less than
  decode's :data:`STAGE_WAIT_SECONDS`, so that decode hears why). A request's
  staged bytes go back when its readers' notifications arrive or its lease ends (``PrefillRank.poll`` /
  ``forget``, which the worker drives each step): the same rules as its blocks.
- Decode: ``DecodeRank`` asks its stager off vLLM's step thread (``transfer.stage_asks.StageAsks``: a few
  threads of the rank's own), so a staged request never holds up the running sequences: the step that starts it
  (``start_load_kv``, or ``get_finished`` for reads that waited for a handshake) takes its staging extent and
  starts the exchange, posting nothing; the first ``get_finished`` after the answer posts its staged READs (NIXL
  calls stay on vLLM's thread), or its direct ones where prefill refused, was busy or did not answer. Meanwhile
  its extent is held; a lease that ends (:func:`abandon_expired`: ``LEASE_EXPIRED``), the transfer timeout, an
  evicted peer or the shutdown gives it back and the answer is ignored. Each exchange is bounded by
  :data:`STAGE_WAIT_SECONDS` (at most one per prefill rank the read takes, and one exchange that fails ends the
  request's staging), and a prefill engine whose exchange failed (no answer, its rank gone, a plan it refuses) is
  not asked again for :data:`PAUSE_SECONDS`: its requests are read directly (``STAGE_SKIPPED``). The stager asks
  the side channel at the address the handshake admitted (``PrefillService``, on the handshake thread: no DNS on
  a stage thread), with the deployment's keys.

What the transfer layer cannot stage is read directly, never failed: a peer whose reads do not stage
(``DecodeStaging.attach``: no buffer on prefill, pieces that differ, segments of rows under ``MIN_ROW_BYTES``),
several KV cache groups (``DecodeRank.start`` stages only one group's list of blocks), a plan prefill refuses, a
full buffer (``busy``).
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from kvbridge_agent.core import KVBridgeError, RoleSettings, TransferPlan, TransferSettings
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.core.stage_requests import (
    STAGE_NOT_OFFERED,
    STAGE_OUT_OF_RANGE,
    STAGE_SKIPPED,
    StageReply,
    StageRequest,
)
from kvbridge_agent.transfer.decode_rank import DecodeRank
from kvbridge_agent.transfer.keys import CurveKeys
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.peers import LEASE_EXPIRED, SideChannelStager, lease_left
from kvbridge_agent.transfer.prefill_rank import PrefillRank
from kvbridge_agent.transfer.reads import ReadResult
from kvbridge_agent.transfer.relayout import Converter
from kvbridge_agent.transfer.stage_asks import StageAsks
from kvbridge_agent.transfer.staging import staging_bytes, staging_mode
from kvbridge_agent.transfer.transport import Transport

from .stage_relay import StageServer

log = logging.getLogger(f"vllm.kvbridge.{__name__.rsplit('.', 1)[-1]}")  # shown by vLLM's log handler

#: decode: the longest one stage exchange waits (less where the handshake timeout is less), on a stage thread
STAGE_WAIT_SECONDS = 1.0
#: decode: the prefill engines and incarnations a missing address is said once for, at most
MAX_NAMED = 1024
#: decode: how long a prefill engine whose stage exchange failed is read directly without asking
PAUSE_SECONDS = 30.0
#: refusals that concern one request only: the engine is asked again for the next
_PER_REQUEST = (STAGE_NOT_OFFERED, STAGE_OUT_OF_RANGE)


def buffer_bytes(cache: KVCache) -> int:
    """A rank's staging buffer from the environment (0: none)."""
    return staging_bytes(os.environ, sum(t.numel() * t.element_size() for t in cache.tensors))


def prefill_rank(
    cache: KVCache,
    transport: Transport,
    plan: TransferPlan,
    engine_id: str,
    incarnation: str,
    convert: Converter,
) -> tuple[PrefillRank, StageServer | None]:
    """A prefill rank, with a staging buffer and the server of its stage requests where the environment asks for one
    and the rank can listen."""
    nbytes, server = buffer_bytes(cache), None
    if nbytes:
        try:
            server = StageServer(incarnation, cache.tp_rank)
        except (OSError, zmq.ZMQError) as exc:
            log.warning("kvbridge: rank %d cannot serve stage requests (%s): it stages nothing", cache.tp_rank, exc)
            nbytes = 0
    try:
        rank = PrefillRank(cache, transport, plan, engine_id, incarnation, convert, staging_bytes=nbytes)
    except BaseException:
        if server is not None:
            server.close()
        raise
    if server is not None:
        server.start(rank.stage)
        log.info("kvbridge: prefill rank %d stages from a %d MiB buffer", cache.tp_rank, nbytes >> 20)
    return rank, server


def decode_rank(
    cache: KVCache,
    transport: Transport,
    settings: RoleSettings,
    transfer: TransferSettings,
    convert: Converter,
    stager: ConnectorStager,
) -> DecodeRank:
    """A decode rank, with a staging buffer, its cost model, the mode the environment asks for and stage exchanges
    off vLLM's thread, if any."""
    nbytes = buffer_bytes(cache)
    rank = DecodeRank(cache, transport, settings, transfer, convert, staging_bytes=nbytes, stager=stager)
    if rank.staging is not None:
        rank.staging.mode = staging_mode(os.environ)
        rank.asks = StageAsks(rank.staging)
        log.info(
            "kvbridge: decode rank %d stages reads (%s) through a %d MiB buffer",
            cache.tp_rank,
            rank.staging.mode,
            nbytes >> 20,
        )
    return rank


def abandon_expired(decode: DecodeRank, expiry: dict[str, tuple[float, list[int]]]) -> list[ReadResult]:
    """Decode, each step: the requests whose prefill lease (``expiry``: the worker's, by request) ended while their
    stage exchange was in flight fail ``LEASE_EXPIRED``, their staging extent given back, the answer ignored."""
    asks, now = decode.asks, time.time()
    if asks is None:
        return []
    ended = [r for r in asks.requests if r in expiry and lease_left(expiry[r][0], now) <= 0]
    why = "prefill's lease on the blocks ended during the request's stage exchange"
    return [asks.drop(request_id).failed(LEASE_EXPIRED, why) for request_id in ended]


class ConnectorStager:
    """Decode: a rank's stage requests, each bounded, from the rank's stage threads (module docstring)."""

    def __init__(self, keys: CurveKeys | None, timeout: float) -> None:
        self._side_channel = SideChannelStager(keys, min(timeout, STAGE_WAIT_SECONDS))
        #: per prefill engine: the incarnation met and the address its side channel was admitted at
        self._hosts: dict[str, tuple[str, str]] = {}
        #: per prefill engine: until when it is read directly, after a failed exchange
        self._paused: dict[str, float] = {}
        #: the engines and incarnations whose missing address was said (bounded)
        self._unadmitted: set[tuple[str, str]] = set()

    @property
    def timeout(self) -> float:
        return self._side_channel.timeout

    def admit(self, params: KVTransferParams, host: str) -> None:
        """The handshake thread: where this prefill engine's current incarnation is asked to stage."""
        self._hosts[params.remote_engine_id] = (params.remote_incarnation, host)

    def __call__(self, params: KVTransferParams, request: StageRequest) -> StageReply:
        engine = params.remote_engine_id
        admitted = self._hosts.get(engine)
        if admitted is None or admitted[0] != params.remote_incarnation:
            if (engine, params.remote_incarnation) not in self._unadmitted and len(self._unadmitted) < MAX_NAMED:
                self._unadmitted.add((engine, params.remote_incarnation))  # said once (requests say it in debug)
                log.warning("kvbridge: reading %s directly: no admitted address of its side channel", engine)
            raise KVBridgeError(f"no admitted address of {engine}'s side channel", code=STAGE_SKIPPED)
        left = self._paused.get(engine, 0.0) - time.monotonic()
        if left > 0:
            raise KVBridgeError(f"{engine} failed a stage exchange: asked again in {left:.0f} s", code=STAGE_SKIPPED)
        try:
            return self._side_channel.ask(admitted[1], params, request)
        except KVBridgeError as exc:  # HandshakeError: prefill's refusal, or no answer in time
            if exc.code not in _PER_REQUEST:
                self._pause(engine, f"{exc.code}: {exc.message}")
            raise
        except (zmq.ZMQError, OSError) as exc:
            self._pause(engine, str(exc))
            raise KVBridgeError(f"the stage exchange with {engine} failed: {exc}", code=STAGE_SKIPPED) from exc

    def _pause(self, engine: str, why: str) -> None:
        self._paused[engine] = time.monotonic() + PAUSE_SECONDS
        log.warning(
            "kvbridge: reading %s directly for %g s: its stage exchange failed (%s)", engine, PAUSE_SECONDS, why
        )
