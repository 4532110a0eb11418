"""A decode rank's stage exchanges (docs/protocol.md §4d): asked on the thread that starts a read, or off it.

:func:`ask` is the exchange itself: one stage request per prefill rank a read takes, through the rank's stager,
touching neither NIXL nor anything of the rank but what it is handed (so any thread may run it). A rank whose
reads start on a thread that must not wait for the network (vLLM's step thread) keeps :class:`StageAsks`: each
staged request's exchange runs on a small pool of its own while the request holds its staging extent and nothing
of it is posted; the thread that owns NIXL collects the answered ones on its next poll and posts their staged
READs then (``DecodeStaging.post``), or reads them directly. A request dropped meanwhile (its deadline or its
lease passed, its peer evicted, the rank closed) gives its extent back at once, and its exchange's answer is
ignored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge_agent.core import KVBridgeError
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.core.stage_requests import STAGE_SKIPPED, StageReply, StageRequest, StageState
from kvbridge_agent.core.staging import Choice
from kvbridge_agent.transfer.background import background_executor
from kvbridge_agent.transfer.reads import (
    TRANSFER_FAILED,
    TRANSFER_TIMEOUT,
    InFlight,
    ReadResult,
    RemotePeer,
    RequestIds,
)

if TYPE_CHECKING:
    from kvbridge_agent.transfer.staged_reads import DecodeStaging, StagedFlight, StagedRead

log = logging.getLogger(__name__)

#: asks one prefill rank to pack a request's segments for one read
Stager = Callable[[KVTransferParams, StageRequest], StageReply]
#: a stage exchange's round trip, smoothed over the exchanges made (weight of the newest)
EXCHANGE_WEIGHT = 0.2
#: stage exchanges one rank runs at once off its starting thread (each bounded by its stager)
ASK_THREADS = 4
#: requests one rank holds waiting for their exchange; past it a request is read directly (nothing queues long)
MAX_ASKING = 64


@dataclass
class Asked:
    """A request's stage exchange: prefill's replies, one per read (``None``: read it directly), each exchange's
    round trip less the pack it waited for (microseconds), whether a prefill rank had no room, why it failed."""

    replies: list[StageReply] | None = None
    exchanges: list[float] = field(default_factory=list)
    busy: bool = False
    why: str = ""
    #: the stager skipped it and said why once for all its requests (``STAGE_SKIPPED``): not logged per request
    skipped: bool = False
    #: when the exchange ended (``time.perf_counter``)
    ended: float = 0.0

    def smoothed(self, exchange_us: float) -> float:
        """A smoothed round trip (``CostModel.exchange_us``) moved by this request's exchanges."""
        for took in self.exchanges:
            exchange_us = (1 - EXCHANGE_WEIGHT) * exchange_us + EXCHANGE_WEIGHT * max(took, 1.0)
        return exchange_us


def ask(
    stager: Stager | None,
    params: KVTransferParams,
    reads: tuple[StagedRead, ...],
    ids: RequestIds,
    first: int,
) -> Asked:
    """Ask each prefill rank of the request's reads to pack its segments, stopping at the first that cannot (busy,
    a refusal, no answer, a reply that does not fit the read). Thread-safe: no NIXL, nothing shared written."""
    asked, replies = Asked(), list[StageReply]()
    if stager is None:
        return asked
    try:
        for read, (local_ids, _) in zip(reads, ids, strict=True):
            segments = read.segments
            count = local_ids.size // segments.runs
            started = time.perf_counter()
            reply = stager(
                params, StageRequest(rank=segments.prefill_rank, plan=segments.plan, first=first, count=count)
            )
            took = (time.perf_counter() - started) * 1e6 - reply.pack_microseconds * (not reply.prestaged)
            asked.exchanges.append(took)
            needed = local_ids.size * segments.target.length
            if reply.state is StageState.BUSY:
                asked.busy = True
                break
            if reply.bytes != needed:
                asked.why = f"prefill staged {reply.bytes} bytes, this read needs {needed}"
                break
            replies.append(reply)
        else:
            asked.replies = replies
    except (KVBridgeError, ValueError) as exc:  # a refusal, an exchange that failed, a reply out of bounds
        asked.why = str(exc)
        asked.skipped = isinstance(exc, KVBridgeError) and exc.code == STAGE_SKIPPED
    asked.ended = time.perf_counter()
    return asked


@dataclass
class Asking:
    """A staged request waiting for its exchange: its flight (nothing posted), its own copy of the descriptor ids,
    the staged flight holding its extent, the notification its READs carry."""

    flight: InFlight
    peer: RemotePeer
    ids: RequestIds
    staged: StagedFlight
    note: bytes
    future: Future[Asked]

    def failed(self, code: str, message: str, peer_failed: bool = True) -> ReadResult:
        """The request's result when it is dropped before anything of it was posted; ``peer_failed`` False when
        the peer is already forgotten (an eviction: saying it failed would have a caller forget its successor)."""
        flight = self.flight
        return ReadResult(flight.request_id, False, code, message, list(flight.blocks), peer_failed=peer_failed)

    def outcome(self) -> Asked:
        """The exchange's answer (a stager that raised something else: read directly)."""
        try:
            return self.future.result(timeout=0)
        except Exception as exc:  # a bug in a stager fails its staging, never the poll loop
            log.warning("the stage exchange of %s raised %r: reading it directly", self.flight.request_id, exc)
            return Asked(why=repr(exc), ended=time.perf_counter())


class StageAsks:
    """A rank's stage exchanges off the thread that starts its reads, on :data:`ASK_THREADS` threads of their own
    (module docstring). Every method but the exchange itself runs on the thread that owns NIXL."""

    def __init__(self, staging: DecodeStaging, threads: int = ASK_THREADS, limit: int = MAX_ASKING) -> None:
        self.staging, self.limit = staging, limit
        self._executor = background_executor(threads, "kvbridge-stage")
        self._asking: dict[str, Asking] = {}

    @property
    def requests(self) -> list[str]:
        """The requests whose exchange is in flight."""
        return list(self._asking)

    def submit(
        self,
        flight: InFlight,
        peer: RemotePeer,
        ids: RequestIds,
        first: int,
        choice: Choice,
        note: bytes,
    ) -> bool:
        """Take the request's extent and start its exchange; ``False``: read it directly now (no room here, or
        :attr:`limit` requests already wait)."""
        if len(self._asking) >= self.limit:
            return False
        staged = self.staging.reserve(flight, peer, ids, choice)
        if staged is None:
            return False
        kept = [(local.copy(), remote.copy()) for local, remote in ids]  # the rank reuses its id buffers
        try:
            future = self._executor.submit(ask, self.staging.stager, flight.params, peer.staged, kept, first)
        except RuntimeError:  # shut down
            self.staging.pool.release(flight.request_id)
            return False
        self._asking[flight.request_id] = Asking(flight, peer, kept, staged, note, future)
        return True

    def poll(self, now: float) -> tuple[list[ReadResult], list[Asking]]:
        """The requests that failed waiting (past their deadline at ``now``, ``time.monotonic``), and those whose
        exchange is answered, no longer held here (their extent is: the caller posts them)."""
        late = [r for r, asking in self._asking.items() if now > asking.flight.deadline]
        why = "its stage exchange did not end within the transfer timeout"
        failed = [self.drop(r).failed(TRANSFER_TIMEOUT, why) for r in late]
        done = [asking for asking in self._asking.values() if asking.future.done()]
        for asking in done:
            del self._asking[asking.flight.request_id]
        return failed, done

    def evicted(self, engine_id: str) -> list[ReadResult]:
        """Drop the requests of a prefill engine evicted: their results (the rank reports them with its next poll,
        as its other reads of that engine)."""
        why = f"prefill engine {engine_id} was evicted during the request's stage exchange"
        dropped = [r for r, a in self._asking.items() if a.flight.params.remote_engine_id == engine_id]
        return [self.drop(r).failed(TRANSFER_FAILED, why, peer_failed=False) for r in dropped]

    def drop(self, request_id: str) -> Asking:
        """Stop waiting for a request's exchange (its answer is ignored) and give its extent back; a caller that
        fails it (a lease that ended) reports :meth:`Asking.failed`."""
        asking = self._asking.pop(request_id)
        asking.future.cancel()
        self.staging.pool.release(request_id)
        return asking

    def close(self) -> None:
        for request_id in list(self._asking):
            self.drop(request_id)
        self._executor.shutdown(wait=False, cancel_futures=True)  # an exchange running ends within its bound
