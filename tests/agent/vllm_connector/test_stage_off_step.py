"""Decode's stage exchange runs off vLLM's step thread (vllm_connector/staging.py, transfer/stage_asks.py): with a
stager that takes 0.5 s per exchange, ``start_load_kv`` and every ``get_finished`` return at once, the stager never
runs on the step thread, and the staged read completes in a later step; a lease that ends during the exchange fails
the request ``LEASE_EXPIRED`` with its staging extent given back and the exchange's answer ignored."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from kvbridge_agent.core import RoleSettings, TransferSettings
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.core.stage_requests import StageReply, StageRequest
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.peers import LEASE_CLOCK_MARGIN_SECONDS, LEASE_EXPIRED
from kvbridge_agent.transfer.relayout import convert_for_side
from kvbridge_agent.transfer.stage_asks import StageAsks
from kvbridge_agent.transfer.transport import Transport
from kvbridge_agent.vllm_connector import staging
from kvbridge_agent.vllm_connector.messages import ReadOrder, StepMetadata
from kvbridge_agent.vllm_connector.staging import ConnectorStager
from kvbridge_agent.vllm_connector.worker import ConnectorWorker
from tests.agent.transfer.harness import model as region_model
from tests.agent.transfer.staged_harness import Side, StagedPair

from .test_admission import decode_scheduler

BLOCKS = [2, 5, 9]
#: how long one of vLLM's steps may take here while an exchange is in flight (each takes 0.5 s, or waits a gate)
STEP_SECONDS = 0.25


class Stager:
    """Prefill's pack after ``delay`` (or once ``opened``), recording the threads it runs on."""

    def __init__(self, pair: StagedPair, delay: float | None) -> None:
        self.pair, self.delay = pair, delay
        self.opened = threading.Event()
        self.threads: list[threading.Thread] = []

    def __call__(self, params: KVTransferParams, request: StageRequest) -> StageReply:
        self.threads.append(threading.current_thread())
        if self.delay is not None:
            time.sleep(self.delay)
        else:
            self.opened.wait(10)
        return self.pair.stage(params, request)


@pytest.fixture
def setup() -> Iterator[tuple[ConnectorWorker, StagedPair]]:
    """A decode worker whose rank is a staged pair's decode rank (registered, its prefill engine met), its stage
    exchanges off the step thread as ``staging.decode_rank`` sets them up."""
    pair = StagedPair(region_model(), Side(None, tp=2), Side(None), blocks=16)
    scheduler = decode_scheduler()
    worker = ConnectorWorker(scheduler.settings, 0, "inc")
    rank = pair.decode[0]
    assert rank.staging is not None
    rank.asks = StageAsks(rank.staging)
    rank.staging.mode, rank.staging.into = "staged", "buffer"
    worker.decode = rank
    try:
        yield worker, pair
    finally:
        worker.decode = None  # the pair closes its ranks
        worker.shutdown()
        scheduler.shutdown()
        pair.close()


def step(worker: ConnectorWorker, pair: StagedPair, meta: StepMetadata | None = None) -> set[str]:
    """One of vLLM's steps on this (the step) thread: its loads started, what finished; each hook returns at
    once."""
    began = time.perf_counter()
    worker.start_load_kv(meta or StepMetadata())
    _, done = worker.get_finished(set())
    assert time.perf_counter() - began < STEP_SECONDS
    for prefill in pair.prefill:
        prefill.poll()
    return done or set()


def order(pair: StagedPair, lease_seconds: float) -> tuple[str, StepMetadata]:
    params = pair.offer(40, [3, 1, 7], seed=5)
    expires_at = time.time() + LEASE_CLOCK_MARGIN_SECONDS + lease_seconds
    request_id = f"{params.remote_request_id}-vllm"
    return request_id, StepMetadata(to_read={request_id: ReadOrder(BLOCKS, params, expires_at=expires_at)})


def test_a_slow_stage_exchange_never_holds_up_vllm_s_step(
    setup: tuple[ConnectorWorker, StagedPair], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, pair = setup
    rank = pair.decode[0]
    assert rank.staging is not None
    stager = rank.staging.stager = Stager(pair, delay=0.5)
    modes: list[str] = []
    record = worker.stats.record_read

    def recorded(seconds: float, nbytes: int, descriptors: int, mode: str) -> None:
        modes.append(mode)
        record(seconds, nbytes, descriptors, mode)

    monkeypatch.setattr(worker.stats, "record_read", recorded)
    request_id, meta = order(pair, 60.0)
    steps, done = 1, step(worker, pair, meta)
    until = time.monotonic() + 10
    while request_id not in done and time.monotonic() < until:
        steps, done = steps + 1, step(worker, pair)
        time.sleep(0.01)
    assert request_id in done
    assert worker.get_block_ids_with_load_errors() == set()
    assert modes == ["staged"]
    assert steps > 10  # vLLM kept stepping while prefill's two ranks took 0.5 s each
    assert len(stager.threads) == len(pair.prefill)
    assert all(t is not threading.current_thread() and t.name.startswith("kvbridge-stage") for t in stager.threads)
    assert rank.staging.pool.owners == []


def test_a_lease_that_ends_during_the_exchange_fails_the_request_and_frees_its_extent(
    setup: tuple[ConnectorWorker, StagedPair], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, pair = setup
    rank = pair.decode[0]
    assert rank.staging is not None
    stager = rank.staging.stager = Stager(pair, delay=None)
    failures: list[str] = []
    monkeypatch.setattr(worker.stats, "record_failure", failures.append)
    request_id, meta = order(pair, 0.3)
    assert step(worker, pair, meta) == set()
    assert rank.staging.pool.owners == [request_id]  # held while asking
    time.sleep(0.4)
    assert step(worker, pair) == {request_id}
    assert failures == [LEASE_EXPIRED]
    assert worker.get_block_ids_with_load_errors() == set(BLOCKS)
    assert rank.staging.pool.owners == []
    stager.opened.set()  # the answer comes: ignored, nothing posted
    time.sleep(0.2)
    assert step(worker, pair) == set()
    assert rank.in_flight == 0


def test_the_connector_s_decode_rank_asks_off_the_step_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """``staging.decode_rank`` (what ``register_kv_caches`` builds) sets the rank's exchanges off vLLM's thread
    wherever it stages; without a staging buffer there is nothing to ask."""
    model, settings = region_model(), RoleSettings(tensor_parallel_size=1, block_size=16)
    for mib, asks in (("8", True), ("0", False)):
        monkeypatch.setenv("KVBRIDGE_STAGING_MIB", mib)
        cache = KVCache.allocate(model, 16, settings.kv_layout, 1, 0, 16)
        transport = Transport(f"decode-asks-{mib}")
        transport.register(cache.tensors)
        stager = ConnectorStager(None, 1.0)
        rank = staging.decode_rank(cache, transport, settings, TransferSettings(), convert_for_side, stager)
        try:
            assert (rank.asks is not None) is asks
        finally:
            rank.close()
            transport.close()
