"""Verification off the engine's thread: prefill's digests and decode's checks run on kvbridge's own threads,
overlapped with vLLM's next steps and with the READs; vLLM's thread only starts them and takes what is done.

- Prefill (:class:`PrefillDigests`): the digest of a request whose prompt a step completed starts right after that
  step's forward (``wait_for_save``) and runs beside the next steps. Its digests reach the scheduler with the output of
  the step in which they are done, and decode fetches them from prefill's side channel while it reads (a prefill still
  digesting answers ``pending``). A digest done after its step's output has gone is also relayed to the scheduler the
  moment it is taken (digest_relay.py); one done before goes with that output, which the scheduler takes before the
  request's answer leaves, so relaying it too would only cost prefill's core a message and its parse per request. The
  request's blocks stay as computed until then: prefill converts a request's blocks in place for its readers (vLLM's CPU
  build splitting them for the wire) only after its digest is taken (:meth:`PrefillDigests.wait`), and hands them back
  to vLLM only after it (:meth:`PrefillDigests.running`); an offer that leaves them as computed does not wait for it.
- Decode (:class:`DecodeChecks`): prefill's digests are fetched while the READs run; when the READs (and decode's
  conversions) are done, the digest of what this rank now holds is taken and compared on a thread, and the request is
  reported to vLLM in the step its check completes — never before, so no KV is used unverified, and a mismatch fails
  that request alone. The READs are polled right after a step posts them too: a read done inside its post (host memory,
  UCX's shared-memory transports) starts its check there: beside the forward where vLLM calls ``start_load_kv`` before
  it (a step with a synchronous load), a little ahead of ``get_finished`` where it calls it after (this vLLM, for
  asynchronous loads). A check whose prefill digests are already there when its READs complete usually takes less than a
  millisecond: vLLM's thread gives it up to :data:`CHECK_JOIN_SECONDS` (GIL released) before it returns, so that the
  request goes in that step, not the next (a whole decode step of latency saved, for at most that pause once per
  completed read; a longer check simply goes in a later step).

Both digest the cache's own memory while vLLM computes other requests' blocks: a request's blocks are not written
after its prompt is computed (prefill: held for its readers; decode: not yet handed to vLLM). On a GPU the thread's
work is ordered after what vLLM's stream had queued when it started (a CUDA event).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, replace

import torch

from kvbridge_agent.core.digest import KV_DIGEST_MISMATCH, KV_DIGEST_UNAVAILABLE, HeadDigests, RequestDigests, to_bytes
from kvbridge_agent.core.handshake import HandshakeError, KVTransferParams
from kvbridge_agent.transfer.background import background_executor
from kvbridge_agent.transfer.decode_rank import DecodeRank
from kvbridge_agent.transfer.prefill_rank import PrefillRank
from kvbridge_agent.transfer.reads import ReadResult, Verify

from .digest_relay import DigestSender
from .failures import request_failure
from .messages import DigestOrder, ReadOrder

log = logging.getLogger(f"vllm.kvbridge.{__name__.rsplit('.', 1)[-1]}")  # shown by vLLM's log handler

#: how long an offer waits for its request's digest before converting the blocks in place (a digest takes
#: milliseconds; past this the request is offered undigested and decode, finding no digests, fails it)
DIGEST_WAIT_SECONDS = 10.0
#: decode's fetches of prefill's digests in flight at once (each mostly waits on the network or a pending answer)
FETCH_THREADS = 8
#: the threads that take digests (one: the engine keeps the cores; a digest is a pass over memory)
DIGEST_THREADS = 1
#: how long vLLM's thread waits, in the step a request's READs complete, for the check that step started (when
#: prefill's digests are there): the request is then released in that step rather than the next
CHECK_JOIN_SECONDS = 0.002


def fence(device: torch.device) -> Callable[[], None]:
    """What a digest thread runs first so that it reads what the engine's stream has written by now."""
    if device.type != "cuda":
        return lambda: None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return lambda: torch.cuda.current_stream(device).wait_event(event)


@dataclass
class PrefillDigest:
    """One request's digest on prefill, done: its digests, or why there are none; when it began and ended (ns)."""

    request_id: str
    order: DigestOrder
    digests: HeadDigests | None
    error: str
    began_ns: int
    ended_ns: int


class PrefillDigests:
    """Prefill: digests taken on a thread after the step that completed each request's prompt; with an
    ``incarnation``, one done only after that step's output has gone is also relayed to the scheduler the moment it
    is taken (digest_relay.py)."""

    def __init__(self, incarnation: str | None = None) -> None:
        self._incarnation = incarnation
        self._relay: DigestSender | None = None
        self._executor = background_executor(DIGEST_THREADS, "kvbridge-digest")
        self._lock = threading.Lock()
        self._running: dict[str, Future[None]] = {}
        self._done: list[PrefillDigest] = []
        self._taken = 0  # the steps whose digests :meth:`take` handed over so far

    def start(self, rank: PrefillRank, request_id: str, order: DigestOrder) -> None:
        """Digest ``order`` on the thread, after what the engine has queued so far."""
        wait = fence(rank.cache.tensors[0].device)
        began, step = time.time_ns(), self._taken

        def digest() -> None:
            digests, error = None, ""
            try:
                wait()
                digests = rank.digest(order.key, order.block_ids, order.num_tokens, order.block_layers)
            except Exception as exc:  # its answer goes without digests; decode then finds none: fails, typed
                error = request_failure(exc, "DIGEST_FAILED", request_id)[1]
                log.error("kvbridge: cannot digest %s: %s", request_id, error)
            with self._lock:
                self._done.append(PrefillDigest(request_id, order, digests, error, began, time.time_ns()))
                self._running.pop(request_id, None)
                late = self._taken != step  # its step's output has gone without it
            if late and digests is not None:
                self._relayed(request_id, digests)

        with self._lock:
            self._running[request_id] = self._executor.submit(digest)

    def _relayed(self, request_id: str, digests: HeadDigests) -> None:
        """On the digest thread: hand the scheduler the digests now (they also go with the next step's output)."""
        if self._incarnation is None:
            return
        try:
            self._relay = self._relay or DigestSender(self._incarnation)
            self._relay.send(request_id, *to_bytes(digests))
        except Exception as exc:  # (OSError, zmq.ZMQError, ...) the digests still go with the steps' output
            log.warning("kvbridge: no digest relay (%s): digests go with the steps' output only", exc)
            self._incarnation = None

    def wait(self, request_id: str, timeout: float = DIGEST_WAIT_SECONDS) -> float:
        """Until the request's digest (if one runs) is done: before its blocks are converted in place. Returns
        how long it waited (seconds; 0.0 when the digest was done)."""
        with self._lock:
            running = self._running.get(request_id)
        if running is None or running.done():
            return 0.0
        began = time.perf_counter()
        try:
            running.result(timeout=timeout)
        except TimeoutError:
            log.error("kvbridge: the digest of %s took over %.0f s; offered without it", request_id, timeout)
        return time.perf_counter() - began

    def running(self, request_id: str) -> bool:
        """Whether the request's digest is still being taken: its blocks are neither freed nor re-laid until it is."""
        with self._lock:
            running = self._running.get(request_id)
        return running is not None and not running.done()

    def take(self) -> list[PrefillDigest]:
        """The digests done since the last call (on vLLM's thread: they go out with this step's output)."""
        with self._lock:
            done, self._done = self._done, []
            self._taken += 1
        return done

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._relay is not None:
            self._relay.close()


@dataclass
class _Check:
    expected: Future[RequestDigests]
    order: ReadOrder
    result: ReadResult | None = None  # the READs' result, once they completed
    checked: Future[ReadResult] | None = None
    started_ns: int = 0


class DecodeChecks:
    """Decode: prefill's digests fetched while the READs run, then the check of what this rank holds, on threads."""

    def __init__(self, fetch: Callable[[KVTransferParams, float | None], RequestDigests]) -> None:
        self._fetch = fetch
        self._fetches = background_executor(FETCH_THREADS, "kvbridge-digest-fetch", "kvbridge-fetch")
        self._checks = background_executor(DIGEST_THREADS, "kvbridge-check")
        self._pending: dict[str, _Check] = {}
        self._started: list[_Check] = []  # the checks started since the last :meth:`finished`
        #: how long the last :meth:`finished` held vLLM's thread for a check started in its step (seconds)
        self.joined_seconds = 0.0
        self._mismatches: list[str] = []  # the prefill engines whose digests differed, since the last take
        #: when each request's check began (ns), kept for its trace until the read's span is recorded
        self.started_ns: dict[str, int] = {}

    def expect(self, request_id: str, order: ReadOrder, params: KVTransferParams, until: float | None) -> None:
        """A read to verify is posted: prefill's digests, carried by its parameters or fetched beside the READs."""
        if params.digests is None:
            expected = self._fetches.submit(self._fetch, params, until)
        else:
            expected = Future()
            try:
                expected.set_result(params.digests.request_digests())
            except ValueError as exc:  # rows that are not whole rows of the heads: the check fails the request
                expected.set_exception(HandshakeError(f"the parameters' digests: {exc}", code=KV_DIGEST_UNAVAILABLE))
        self._pending[request_id] = _Check(expected, order)

    def start(self, decode: DecodeRank, result: ReadResult) -> ReadResult | None:
        """A read completed: its check starts (``None``: the result comes with :meth:`finished`), or it needs none."""
        check = self._pending.get(result.request_id)
        if check is None or check.result is not None:
            return result
        if not result.ok:
            del self._pending[result.request_id]
            check.expected.cancel()
            return result
        check.result, check.started_ns = result, time.time_ns()
        self.started_ns[result.request_id] = check.started_ns
        wait = fence(decode.cache.tensors[0].device)
        outcome: Future[ReadResult] = Future()
        check.checked = outcome

        def compare(expected: Future[RequestDigests]) -> None:
            try:
                outcome.set_result(self._compare(decode, result, check.order, expected, wait))
            except Exception as exc:  # whatever the digests brought fails this request, never vLLM's step
                code, message = request_failure(exc, KV_DIGEST_UNAVAILABLE, result.request_id)
                failed = replace(
                    result, ok=False, code=code, message=message, invalid_blocks=list(check.order.local_block_ids)
                )
                outcome.set_result(failed)

        check.expected.add_done_callback(lambda expected: self._submit(compare, expected, outcome))
        self._started.append(check)
        return None

    def _submit(
        self,
        compare: Callable[[Future[RequestDigests]], None],
        expected: Future[RequestDigests],
        outcome: Future[ReadResult],
    ) -> None:
        try:
            self._checks.submit(compare, expected)
        except RuntimeError:  # shut down
            outcome.cancel()

    @staticmethod
    def _compare(
        decode: DecodeRank,
        result: ReadResult,
        order: ReadOrder,
        expected: Future[RequestDigests],
        wait: Callable[[], None],
    ) -> ReadResult:
        """On the check thread: prefill's digests against this rank's, over every local block of the request."""
        params = order.params
        if params is None:  # never: only orders with parameters are read
            raise HandshakeError("a refused order reached the check")
        peer = decode.peers.get(params.remote_engine_id)
        if peer is None:
            raise HandshakeError(f"{params.remote_engine_id} was evicted during the check")
        wait()
        blocks = order.all_block_ids or list(order.local_block_ids)
        tokens = order.digest_tokens or params.num_tokens
        return decode.verified(result, Verify(expected.result(), blocks, tokens, order.block_layers), peer)

    def forget(self, request_id: str) -> None:
        """A read that ended before its check started (refused, failed, expired)."""
        check = self._pending.pop(request_id, None)
        if check is not None:
            check.expected.cancel()

    def finished(self, join: float = CHECK_JOIN_SECONDS) -> list[ReadResult]:
        """The checks done since the last call, on vLLM's thread: released to vLLM in this step. The checks started
        since the last call whose prefill digests are there are given up to ``join`` seconds to finish first."""
        started, self._started = self._started, []
        quick = [c.checked for c in started if c.checked is not None and c.expected.done() and not c.checked.done()]
        self.joined_seconds = 0.0
        if quick and join > 0:
            began = time.perf_counter()
            wait(quick, timeout=join)
            self.joined_seconds = time.perf_counter() - began
        results = []
        for request_id, check in list(self._pending.items()):
            if check.checked is None or not check.checked.done():
                continue
            del self._pending[request_id]
            if check.checked.cancelled():  # the engine is shutting down
                invalid = list(check.order.local_block_ids)
                results.append(ReadResult(request_id, False, "SHUTDOWN", "the check was cancelled", invalid))
                continue
            result = check.checked.result()
            if result.code == KV_DIGEST_MISMATCH and check.order.params is not None:
                self._mismatches.append(check.order.params.remote_engine_id)
            results.append(result)
        return results

    def take_mismatches(self) -> list[str]:
        """The prefill engines whose digests differed from what was read, one entry per request, since the last
        call."""
        taken, self._mismatches = self._mismatches, []
        return taken

    @property
    def checking(self) -> int:
        """Reads whose READs are done and whose check is not."""
        return sum(1 for check in self._pending.values() if check.result is not None)

    def shutdown(self) -> None:
        self._fetches.shutdown(wait=False, cancel_futures=True)
        self._checks.shutdown(wait=False, cancel_futures=True)
