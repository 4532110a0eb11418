"""A decode rank's stage exchanges off the thread that starts its reads (transfer/stage_asks.py): the starting thread
never calls the stager nor waits for it, nothing of the request is posted until a later poll finds the answer, the
staged read then completes as a direct one would, and the request's staging extent goes back on every path — a
refusal, a busy prefill or a stager that raised (read directly instead), the transfer timeout, an evicted peer, the
rank closed. Real NIXL agents on host memory (staged_harness)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvbridge_agent.core import KVBridgeError
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.core.stage_requests import STAGE_NOT_OFFERED, STAGE_SKIPPED, StageReply, StageRequest, StageState
from kvbridge_agent.transfer.decode_rank import DecodeRank
from kvbridge_agent.transfer.reads import TRANSFER_FAILED, TRANSFER_TIMEOUT, ReadResult
from kvbridge_agent.transfer.stage_asks import StageAsks

from .harness import model as region_model
from .staged_harness import Side, StagedPair, randomize

BLOCKS = [2, 5, 9]
#: how long a step may take while a stage exchange is in flight (the stagers here take 0.5 s or wait for a gate)
STEP_SECONDS = 0.25


class Gate:
    """A stager that records the thread it runs on, waits until the test opens it (or ``delay``), then answers as
    ``outcome`` says: prefill's pack, ``busy``, a refusal, or a bug."""

    def __init__(self, pair: StagedPair, delay: float | None = None, outcome: str = "pack") -> None:
        self.pair, self.delay, self.outcome = pair, delay, outcome
        self.opened = threading.Event()
        self.threads: list[threading.Thread] = []

    def __call__(self, params: KVTransferParams, request: StageRequest) -> StageReply:
        self.threads.append(threading.current_thread())
        if self.delay is not None:
            time.sleep(self.delay)
        elif not self.opened.wait(10):
            raise KVBridgeError("the test never opened the gate", code="TEST_GATE")
        if self.outcome == "busy":
            return StageReply(state=StageState.BUSY)
        if self.outcome == "refused":
            raise KVBridgeError("not held", code=STAGE_NOT_OFFERED)
        if self.outcome == "skipped":
            raise KVBridgeError("asked again in 29 s", code=STAGE_SKIPPED)
        if self.outcome == "bug":
            raise ZeroDivisionError("a bug in a stager")
        return self.pair.stage(params, request)


@pytest.fixture
def pair() -> Iterator[StagedPair]:
    built = StagedPair(region_model(), Side(None, tp=2), Side(None), blocks=16)
    rank = built.decode[0]
    assert rank.staging is not None
    rank.asks = StageAsks(rank.staging)
    yield built
    built.close()


def rank_of(pair: StagedPair) -> DecodeRank:
    return pair.decode[0]


def start(pair: StagedPair, stager: Gate, into: str = "buffer", timeout: float = 20.0) -> tuple[str, KVTransferParams]:
    """Offer a request and start decode's staged read of it on this thread, which must return at once."""
    rank = rank_of(pair)
    assert rank.staging is not None
    rank.staging.stager, rank.staging.mode, rank.staging.into = stager, "staged", into
    params = pair.offer(40, [3, 1, 7], seed=5)
    randomize(rank.cache, 1000)
    request_id = f"{params.remote_request_id}-asked"
    began = time.perf_counter()
    assert rank.start(request_id, params, BLOCKS, timeout) is None
    assert time.perf_counter() - began < STEP_SECONDS
    return request_id, params


def finish(pair: StagedPair, request_id: str, seconds: float = 10.0) -> ReadResult:
    """Poll the ranks until the request's result comes; every poll returns at once."""
    rank, until = rank_of(pair), time.monotonic() + seconds
    while time.monotonic() < until:
        began = time.perf_counter()
        results = {result.request_id: result for result in rank.poll()}
        assert time.perf_counter() - began < STEP_SECONDS
        for prefill in pair.prefill:
            prefill.poll()
        if request_id in results:
            return results[request_id]
        time.sleep(0.005)
    raise AssertionError(f"no result for {request_id} in {seconds} s")


def extent_held(pair: StagedPair) -> list[str]:
    staging = rank_of(pair).staging
    assert staging is not None
    return staging.pool.owners


def direct_bytes(pair: StagedPair) -> list[torch.Tensor]:
    """Decode's cache after a direct read of the same request (same content, same blocks, same starting bytes)."""
    [(result, tensors)] = pair.read(pair.offer(40, [3, 1, 7], seed=5), BLOCKS, "direct").values()
    assert result.ok
    return list(tensors)


def test_a_slow_exchange_runs_off_the_starting_thread_and_the_staged_read_completes(pair: StagedPair) -> None:
    stager = Gate(pair, delay=0.5)
    request_id, _ = start(pair, stager)
    rank = rank_of(pair)
    assert extent_held(pair) == [request_id]  # held while asking, nothing posted
    assert (rank._in_flight, rank._staged, rank.in_flight) == ({}, {}, 1)
    result = finish(pair, request_id)
    assert (result.ok, result.mode, result.into) == (True, "staged", "buffer"), result
    staged = [t.clone() for t in rank.cache.tensors]
    assert stager.threads
    assert all(t is not threading.current_thread() for t in stager.threads)
    assert all(t.name.startswith("kvbridge-stage") for t in stager.threads)
    assert result.stage_microseconds >= 0.5e6 * len(pair.prefill)  # one exchange per prefill rank read
    assert extent_held(pair) == []
    assert all(torch.equal(a, b) for a, b in zip(staged, direct_bytes(pair), strict=True))


@pytest.mark.parametrize("outcome", ["refused", "busy", "bug"])
def test_an_exchange_that_cannot_stage_reads_directly_in_a_later_poll(pair: StagedPair, outcome: str) -> None:
    stager = Gate(pair, outcome=outcome)
    request_id, _ = start(pair, stager)
    assert extent_held(pair) == [request_id]
    assert rank_of(pair).poll() == []  # nothing answered yet: nothing posted, no result
    stager.opened.set()
    result = finish(pair, request_id)
    assert (result.ok, result.mode) == (True, "direct"), result
    assert extent_held(pair) == []
    read = [t.clone() for t in rank_of(pair).cache.tensors]
    assert all(torch.equal(a, b) for a, b in zip(read, direct_bytes(pair), strict=True))


@pytest.mark.parametrize(("outcome", "warned"), [("refused", True), ("skipped", False)])
def test_a_skipped_exchange_is_not_warned_of_per_request(
    pair: StagedPair, outcome: str, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A stager that pauses a prefill engine says why once (``STAGE_SKIPPED``); each of its requests read directly
    meanwhile is a debug line, not a warning per request (30 s of them at full load)."""
    stager = Gate(pair, outcome=outcome)
    stager.opened.set()
    with caplog.at_level(logging.DEBUG, logger="kvbridge_agent.transfer.staged_reads"):
        request_id, _ = start(pair, stager)
        result = finish(pair, request_id)
    assert (result.ok, result.mode) == (True, "direct")
    said = [r for r in caplog.records if "reading it directly" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING if warned else logging.DEBUG]


def test_an_exchange_past_the_transfer_timeout_fails_and_its_answer_is_ignored(pair: StagedPair) -> None:
    stager = Gate(pair)
    request_id, _ = start(pair, stager, timeout=0.2)
    time.sleep(0.3)
    result = finish(pair, request_id)
    assert (result.ok, result.code, result.invalid_blocks) == (False, TRANSFER_TIMEOUT, BLOCKS)
    assert extent_held(pair) == []
    stager.opened.set()
    time.sleep(0.2)  # the exchange ends: nothing is posted for it
    assert rank_of(pair).poll() == []
    assert rank_of(pair).in_flight == 0


def test_an_evicted_peer_gives_the_extent_back_at_once_and_fails_the_request(pair: StagedPair) -> None:
    stager = Gate(pair)
    request_id, params = start(pair, stager)
    assert rank_of(pair).evict_peer(params.remote_engine_id)
    assert extent_held(pair) == []
    stager.opened.set()
    result = finish(pair, request_id)
    assert (result.ok, result.code, result.peer_failed) == (False, TRANSFER_FAILED, False)
    assert "evicted" in result.message
    assert rank_of(pair).poll() == []


def test_closing_the_rank_gives_the_extent_back_and_never_waits_for_the_exchange(pair: StagedPair) -> None:
    stager = Gate(pair, outcome="refused")
    request_id, _ = start(pair, stager)
    rank = rank_of(pair)
    assert rank.asks is not None
    assert rank.asks.requests == [request_id]
    began = time.perf_counter()
    rank.asks.close()  # what DecodeRank.close does first
    assert time.perf_counter() - began < STEP_SECONDS
    assert extent_held(pair) == []
    assert rank.in_flight == 0
    stager.opened.set()


def test_into_blocks_holds_no_extent_and_completes(pair: StagedPair) -> None:
    stager = Gate(pair)
    request_id, _ = start(pair, stager, into="blocks")
    assert extent_held(pair) == []
    stager.opened.set()
    result = finish(pair, request_id)
    assert (result.ok, result.mode, result.into) == (True, "staged", "blocks"), result
