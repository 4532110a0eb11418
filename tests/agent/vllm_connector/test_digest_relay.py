"""The digest relay (vllm_connector/digest_relay.py): a prefill rank's digests reach the scheduler's side channel
the moment they are taken, with no engine step in between; its frames are parsed with bounds (hypothesis)."""

from __future__ import annotations

import os
import stat
import time
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from vllm.v1.kv_cache_layout import KVCacheLayout

from kvbridge_agent.core import Role
from kvbridge_agent.core.digest import RequestDigests, new_key, to_bytes
from kvbridge_agent.core.handshake import DigestState
from kvbridge_agent.transfer.digest import Digester
from kvbridge_agent.vllm_connector import digest_relay
from kvbridge_agent.vllm_connector.digest_relay import PROTOCOL, DigestReceiver, DigestSender, parse, relay_address
from kvbridge_agent.vllm_connector.messages import DigestOrder, StepMetadata
from kvbridge_agent.vllm_connector.scheduler import ConnectorScheduler
from kvbridge_agent.vllm_connector.worker import ConnectorWorker
from tests.physical_kv import fill

from .test_gpu_layouts import PREFILL_BLOCKS, TOKENS, Side, allocate
from .test_gpu_layouts import settings as connector_settings

TIMEOUT = 5.0


def wait_for(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=6), st.booleans())
def test_any_frame_parses_or_is_refused_with_a_reason(frames: list[bytes], tagged: bool) -> None:
    if tagged and frames:
        frames[0] = PROTOCOL
    try:
        request_id, heads, data = parse(frames)
    except (ValueError, UnicodeDecodeError):
        return
    assert 0 < len(request_id.encode()) <= digest_relay.MAX_REQUEST_ID_BYTES
    assert 0 < len(heads) <= digest_relay.MAX_HEADS
    assert len(data) % (8 * len(heads)) == 0


def test_a_frame_round_trips_and_bad_ones_are_dropped() -> None:
    incarnation = uuid.uuid4().hex[:16]
    got: list[tuple[str, list[int], bytes]] = []
    receiver = DigestReceiver(incarnation, lambda *frame: got.append(frame))
    sender = DigestSender(incarnation)
    try:
        folder = os.path.dirname(relay_address(incarnation).removeprefix("ipc://"))
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        bad = DigestSender(incarnation)  # a local peer sending frames that are not the relay's
        bad._socket.send_multipart([b"nope"])
        bad._socket.send_multipart([PROTOCOL, b"r", b"\x00", b"12345678"])  # heads of an odd byte count
        bad.close()
        sender.send("r1", [0, 1], bytes(range(16)) * 2)
        wait_for(lambda: got, "the frame never arrived")
        assert got == [("r1", [0, 1], bytes(range(16)) * 2)]
    finally:
        sender.close()
        receiver.close()
    assert not os.path.exists(relay_address(incarnation).removeprefix("ipc://"))


def prefill_pair(closing: list[Any]) -> tuple[ConnectorScheduler, ConnectorWorker, bytes, list[int]]:
    """A prefill engine's scheduler half and one worker on DRAM, and a request it verifies (not digested yet)."""
    side = Side(KVCacheLayout.LBHNC)
    scheduler = ConnectorScheduler(connector_settings(Role.PREFILL, side, side))
    closing.append(scheduler)
    worker = ConnectorWorker(scheduler.settings, 0, uuid.uuid4().hex[:16])
    closing.append(worker)
    views = allocate(side.layout)
    fill(views, side, 0)
    worker.register_kv_caches(views, side.layout.name)
    handshake = worker.get_handshake_metadata()
    assert handshake is not None
    scheduler.set_xfer_handshake_metadata({0: handshake})
    assert scheduler._relay is not None
    key, blocks = new_key(), PREFILL_BLOCKS[: -(-TOKENS // side.block)]
    scheduler._digests["p1"] = RequestDigests(key, {})  # what _order_digests records for a verified request
    scheduler._verifying.add("p1")
    assert scheduler._published_digests("p1")[0] is DigestState.PENDING
    return scheduler, worker, key, list(blocks)


def test_a_digest_done_after_its_step_is_published_without_waiting_for_another(
    closing: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode asking prefill's side channel for a request's digests gets them as soon as the rank took them, when
    that was after the step's output went: no further ``get_finished``, no step output in between."""
    scheduler, worker, key, blocks = prefill_pair(closing)
    original = Digester.request

    def slow(digester: Digester, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.3)
        return original(digester, *args, **kwargs)

    monkeypatch.setattr(Digester, "request", slow)
    worker.wait_for_save(StepMetadata(to_digest={"p1": DigestOrder(blocks, TOKENS, key)}))
    worker.get_finished(set())  # the step's output goes while the digest runs
    wait_for(lambda: scheduler._published_digests("p1")[0] is DigestState.READY, "never published")
    _state, published = scheduler._published_digests("p1")
    assert worker.prefill is not None
    assert published is not None
    assert to_bytes(published.heads) == to_bytes(worker.prefill.digest(key, blocks, TOKENS))


def test_a_digest_done_within_its_step_goes_with_the_steps_output_only(closing: list[Any]) -> None:
    """Done before the step's output is taken, a digest rides in it (the scheduler has it before the request's
    answer leaves); relaying it too would only cost prefill's core: nothing reaches the relay."""
    scheduler, worker, key, blocks = prefill_pair(closing)
    worker.wait_for_save(StepMetadata(to_digest={"p1": DigestOrder(blocks, TOKENS, key)}))
    wait_for(lambda: worker.prefill is not None and not worker._digesting.running("p1"), "never digested")
    time.sleep(0.3)  # a relayed frame would have arrived by now
    assert scheduler._published_digests("p1")[0] is DigestState.PENDING
    worker.get_finished(set())
    scheduler.take_digests(worker.stats.take())  # vLLM's update_connector_output of that step
    _state, published = scheduler._published_digests("p1")
    assert _state is DigestState.READY
    assert published is not None
    assert worker.prefill is not None
    assert to_bytes(published.heads) == to_bytes(worker.prefill.digest(key, blocks, TOKENS))
