"""Decode's checks and vLLM's step (vllm_connector/verifying.py, ``DecodeChecks``): a check whose prefill digests are
there when its READs complete is given ``CHECK_JOIN_SECONDS`` on vLLM's thread, so that its request is released in
that step; a longer check, or one still waiting for prefill's digests, never holds the step past that. Units with
the comparison replaced by a timed stand-in: milliseconds each."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvbridge_agent.transfer.reads import ReadResult
from kvbridge_agent.vllm_connector import verifying
from kvbridge_agent.vllm_connector.verifying import CHECK_JOIN_SECONDS, DecodeChecks

DECODE: Any = SimpleNamespace(cache=SimpleNamespace(tensors=[torch.zeros(1)]))
ORDER: Any = SimpleNamespace(local_block_ids=[3, 4], params=None)
PARAMS: Any = SimpleNamespace(digests=None)


def checks(monkeypatch: pytest.MonkeyPatch, compare_seconds: float, fetched: threading.Event) -> DecodeChecks:
    """Checks whose fetch of prefill's digests returns once ``fetched`` is set, and whose comparison takes
    ``compare_seconds`` and passes."""

    def compare(decode: Any, result: ReadResult, *rest: Any) -> ReadResult:
        time.sleep(compare_seconds)
        return result

    monkeypatch.setattr(verifying.DecodeChecks, "_compare", staticmethod(compare))

    def fetch(params: Any, until: float | None) -> Any:
        if not fetched.wait(timeout=10):
            raise TimeoutError("the test never released the fetch")
        return object()

    return DecodeChecks(fetch)


def read_completes(found: DecodeChecks, request_id: str) -> None:
    found.expect(request_id, ORDER, PARAMS, None)
    time.sleep(0.01)  # the fetch thread answers (when released)
    assert found.start(DECODE, ReadResult(request_id, True, bytes=64)) is None


def test_a_quick_check_is_released_in_the_step_its_reads_complete(monkeypatch: pytest.MonkeyPatch) -> None:
    fetched = threading.Event()
    fetched.set()
    found = checks(monkeypatch, 0.005, fetched)
    read_completes(found, "r1")
    began = time.perf_counter()
    assert [r.request_id for r in found.finished(join=2.0)] == ["r1"]  # a join longer than this loaded machine needs
    assert time.perf_counter() - began < 1.0  # back as soon as the check is done, not at the join's end
    assert found.joined_seconds < 1.0  # what the step waited (digest_wait_seconds)
    assert CHECK_JOIN_SECONDS <= 0.002  # the default: a pause once per completed read, never a step's length
    found.shutdown()


def test_a_long_check_holds_the_step_no_longer_than_the_join(monkeypatch: pytest.MonkeyPatch) -> None:
    fetched = threading.Event()
    fetched.set()
    found = checks(monkeypatch, 0.2, fetched)
    read_completes(found, "r1")
    began = time.perf_counter()
    assert found.finished() == []
    assert time.perf_counter() - began < CHECK_JOIN_SECONDS + 0.02
    assert CHECK_JOIN_SECONDS <= found.joined_seconds < CHECK_JOIN_SECONDS + 0.02
    time.sleep(0.3)
    assert [r.request_id for r in found.finished()] == ["r1"]  # in a later step, once done
    found.shutdown()


def test_a_check_waiting_for_prefills_digests_does_not_hold_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    fetched = threading.Event()
    found = checks(monkeypatch, 0.0, fetched)
    read_completes(found, "r1")
    began = time.perf_counter()
    assert found.finished(join=5.0) == []  # nothing to join: the digests are still on their way
    assert time.perf_counter() - began < 0.05
    assert found.joined_seconds == 0.0
    fetched.set()
    deadline = time.monotonic() + 5
    released: list[ReadResult] = []
    while not released and time.monotonic() < deadline:
        released = found.finished()
        time.sleep(0.005)
    assert [r.request_id for r in released] == ["r1"]
    found.shutdown()


def test_without_a_join_the_request_goes_a_step_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: a check not joined is not released in the step its READs complete."""
    fetched = threading.Event()
    fetched.set()
    found = checks(monkeypatch, 0.1, fetched)
    read_completes(found, "r1")
    assert found.finished(join=0.0) == []
    time.sleep(0.3)
    assert [r.request_id for r in found.finished(join=0.0)] == ["r1"]
    found.shutdown()
