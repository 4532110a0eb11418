"""Verification off vLLM's thread (vllm_connector/verifying.py): with a digest made slow, vLLM's hooks return at
once, the digests run on kvbridge's threads, prefill converts a request's blocks only after its digest, and decode
reports a request to vLLM only in a step after its check passed — a wrong byte still fails the request.

Each test moves one request between real connector halves with real NIXL on DRAM (test_gpu_layouts' harness):
about a second each, most of it the slowed digests.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_cache_layout import KVCacheLayout

from kvbridge_agent.core import Role
from kvbridge_agent.core.digest import new_key, to_bytes
from kvbridge_agent.transfer.digest import Digester
from kvbridge_agent.vllm_connector.messages import DigestOrder, OfferOrder, StepMetadata
from kvbridge_agent.vllm_connector.stats import DIGESTS
from kvbridge_agent.vllm_connector.worker import ConnectorWorker
from tests.physical_kv import fill

from .test_gpu_layouts import (
    DECODE_BLOCKS,
    PREFILL_BLOCKS,
    TOKENS,
    Side,
    allocate,
    blocks_of,
    check_bytes,
    request,
    settings,
    transfer,
)

#: how long each slowed digest takes: far longer than any hook may hold vLLM's thread here
SLOW = 0.3
#: the most a hook may take while a digest runs beside it
HOOK_BOUND = 0.1


class Recorder:
    """Digests made slow; which thread ran each and when it ended; how long each worker hook took."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.digests: list[tuple[str, Any, float]] = []  # (thread, digester, ended)
        self.hooks: list[tuple[str, float]] = []  # (hook, seconds)
        self.reported: dict[str, float] = {}  # request -> when decode first reported it received
        original = Digester.request

        def slow(digester: Digester, *args: Any, **kwargs: Any) -> Any:
            time.sleep(SLOW)
            found = original(digester, *args, **kwargs)
            self.digests.append((threading.current_thread().name, digester, time.monotonic()))
            return found

        monkeypatch.setattr(Digester, "request", slow)
        for hook in ("wait_for_save", "start_load_kv", "get_finished"):
            monkeypatch.setattr(ConnectorWorker, hook, self._timed(hook, getattr(ConnectorWorker, hook)))

    def _timed(self, hook: str, method: Any) -> Any:
        def timed(worker: ConnectorWorker, *args: Any) -> Any:
            began = time.perf_counter()
            found = method(worker, *args)
            self.hooks.append((hook, time.perf_counter() - began))
            if hook == "get_finished" and worker.decode is not None:
                for request_id in found[1] or ():
                    self.reported.setdefault(request_id, time.monotonic())
            return found

        return timed


def test_decode_checks_on_its_own_thread_and_reports_after_the_check(
    monkeypatch: pytest.MonkeyPatch, closing: list[Any]
) -> None:
    recorder = Recorder(monkeypatch)
    outcome = transfer(KVCacheLayout.LBHNC, KVCacheLayout.LBHNC, closing)
    assert [(r.ok, r.code) for r in outcome.results] == [(True, "")]
    assert outcome.load_errors == set()
    check_bytes(outcome)
    [decode] = [w for w in closing if isinstance(w, ConnectorWorker) and w.decode is not None]
    assert decode.decode is not None
    checks = [(thread, ended) for thread, digester, ended in recorder.digests if digester is decode.decode.digester]
    assert len(checks) == 1
    [(thread, ended)] = checks
    assert thread.startswith("kvbridge-check"), thread
    assert recorder.reported["d1"] >= ended  # released to vLLM only after its check
    decode_hooks = [seconds for hook, seconds in recorder.hooks if hook == "get_finished"]
    assert max(decode_hooks) < HOOK_BOUND, max(decode_hooks)


def test_a_mismatch_found_on_the_check_thread_fails_the_request(
    monkeypatch: pytest.MonkeyPatch, closing: list[Any]
) -> None:
    Recorder(monkeypatch)
    outcome = transfer(KVCacheLayout.LBHNC, KVCacheLayout.LBHNC, closing, lie=True)
    assert [(r.ok, r.code) for r in outcome.results] == [(True, "")]  # the READs themselves completed
    assert outcome.load_errors == set(outcome.decode_blocks)
    [decode] = [w for w in closing if isinstance(w, ConnectorWorker) and w.decode is not None]
    assert decode.stats.data["failed_reads"] == ["KV_DIGEST_MISMATCH"]
    assert decode.stats.data["digest_mismatches"] == ["prefill-layouts"]


def test_reads_done_as_they_are_posted_start_their_check_in_the_post(
    monkeypatch: pytest.MonkeyPatch, closing: list[Any]
) -> None:
    """Once the prefill engine is known, a request's READs are posted in ``start_load_kv``. On host memory with UCX's
    error handling ``none`` (shared-memory transports) they complete inside the post, so their check starts right
    there (beside the forward where vLLM calls ``start_load_kv`` before it; this vLLM calls it after the forward for
    asynchronous loads): the first ``get_finished`` after it reports the request without waiting (a check started
    only at ``get_finished`` and longer than the join would go a step later). With ``peer`` (the default) UCX's
    control messages go over TCP loopback and the READs complete once prefill next polls: their check starts in that
    later step."""
    monkeypatch.setenv("KVBRIDGE_UCX_ERROR_HANDLING", "none")
    recorder = Recorder(monkeypatch)
    transfer(KVCacheLayout.LBHNC, KVCacheLayout.LBHNC, closing)  # d1: the handshake, its READs posted after it
    prefill_scheduler, prefill, decode_scheduler, decode = closing[:4]
    blocks = PREFILL_BLOCKS[: -(-TOKENS // Side(KVCacheLayout.LBHNC).block)]
    _, params = prefill_scheduler.request_finished(request("p2", {"do_remote_decode": True}), (blocks,))
    prefill.start_load_kv(prefill_scheduler.build_connector_meta())
    prefill_scheduler.take_digests(prefill.stats.take())
    wanted = request("d2", params)
    assert decode_scheduler.get_num_new_matched_tokens(wanted, 0) == (TOKENS, True)
    decode_scheduler.update_state_after_alloc(wanted, blocks_of(DECODE_BLOCKS[: len(blocks)]), TOKENS)
    checks = len(recorder.digests)
    decode.start_load_kv(decode_scheduler.build_connector_meta())
    deadline = time.monotonic() + 10
    while len(recorder.digests) == checks:  # whatever vLLM does before get_finished: d2's check runs meanwhile
        assert time.monotonic() < deadline, "the check never ran beside the forward"
        time.sleep(0.02)
    _, received = decode.get_finished(set())
    assert received == {"d2"}
    assert decode._checks.joined_seconds == 0.0  # the step did not wait for it


def prefill_worker(closing: list[Any]) -> tuple[ConnectorWorker, list[int]]:
    """A prefill rank's worker half on vLLM's LBHNC views of host memory, filled; the blocks of one prompt."""
    side = Side(KVCacheLayout.LBHNC)
    worker = ConnectorWorker(settings(Role.PREFILL, side, side), 0, "inc-prefill")
    closing.append(worker)
    views = allocate(side.layout)
    fill(views, side, 0)
    worker.register_kv_caches(views, side.layout.name)
    return worker, PREFILL_BLOCKS[: -(-TOKENS // side.block)]


def digests_out(worker: ConnectorWorker) -> list[Any]:
    """The digests in the output of the step that just ended."""
    taken = worker.stats.take()
    return [] if taken is None else list(taken.data.get(DIGESTS, []))


def test_prefill_digests_after_the_forward_on_its_own_thread(
    monkeypatch: pytest.MonkeyPatch, closing: list[Any]
) -> None:
    """The prompt's step returns at once; the digests come out with the output of a later step, equal to the ones
    taken on vLLM's thread."""
    recorder = Recorder(monkeypatch)
    worker, blocks = prefill_worker(closing)
    assert worker.prefill is not None
    key = new_key()
    began = time.perf_counter()
    worker.wait_for_save(StepMetadata(to_digest={"p1": DigestOrder(list(blocks), TOKENS, key)}))
    worker.get_finished(set())
    assert time.perf_counter() - began < HOOK_BOUND
    assert digests_out(worker) == []  # not done yet: not in this step's output
    deadline = time.monotonic() + 10
    reported: list[Any] = []
    while not reported:
        assert time.monotonic() < deadline, "the digest never came out"
        time.sleep(0.02)
        worker.get_finished(set())
        reported = digests_out(worker)
    [(request_id, heads, data)] = reported
    assert request_id == "p1"
    [(thread, _digester, _ended)] = recorder.digests
    assert thread.startswith("kvbridge-digest"), thread
    monkeypatch.undo()
    assert (heads, data) == to_bytes(worker.prefill.digest(key, list(blocks), TOKENS))


def offer_after_slow_digest(worker: ConnectorWorker, blocks: list[int]) -> list[float]:
    """When the offer called its conversion, with the request's (slowed) digest started just before."""
    assert worker.prefill is not None
    converted: list[float] = []
    convert = worker.prefill.convert

    def recording(*args: Any) -> bool:
        converted.append(time.monotonic())
        return convert(*args)

    worker.prefill.convert = recording
    worker.wait_for_save(StepMetadata(to_digest={"p1": DigestOrder(list(blocks), TOKENS, new_key())}))
    worker.start_load_kv(StepMetadata(to_offer={"p1": OfferOrder(list(blocks), time.time() + 30)}))
    return converted


def test_an_offer_that_re_lays_the_blocks_waits_for_their_digest(
    monkeypatch: pytest.MonkeyPatch, closing: list[Any]
) -> None:
    """As on vLLM's CPU build splitting its blocks for the wire: the digest reads them as computed first."""
    recorder = Recorder(monkeypatch)
    worker, blocks = prefill_worker(closing)
    worker._offer_waits_for_digest = True
    converted = offer_after_slow_digest(worker, blocks)
    [(_thread, _digester, ended)] = recorder.digests
    assert len(converted) == 1
    assert converted[0] >= ended


def test_an_offer_that_leaves_the_blocks_as_computed_does_not_wait(
    monkeypatch: pytest.MonkeyPatch, closing: list[Any]
) -> None:
    """vLLM's layouts are never re-laid (decode's READs pair the runs): the offer goes on while the digest runs, and
    the blocks go back to vLLM only once the digest has read them, however early their reader is done."""
    recorder = Recorder(monkeypatch)
    worker, blocks = prefill_worker(closing)
    assert not worker._offer_waits_for_digest
    began = time.monotonic()
    converted = offer_after_slow_digest(worker, blocks)
    assert len(converted) == 1
    assert converted[0] - began < SLOW  # not behind the slowed digest
    worker._done_sending.add("p1")  # its reader done before the digest (a READ completed at once)
    assert worker.get_finished({"p1"})[0] is None  # not freed: the digest still reads its blocks
    deadline = time.monotonic() + 10
    freed = None
    while freed is None:
        assert time.monotonic() < deadline, "the blocks were never freed"
        time.sleep(0.02)
        freed = worker.get_finished(set())[0]
    assert freed == {"p1"}
    assert recorder.digests[0][2] > converted[0]
    assert time.monotonic() >= recorder.digests[0][2]  # freed once the digest was done
