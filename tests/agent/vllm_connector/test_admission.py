"""Decode's scheduler half bounds transfer parameters by its own deployment (core/admission.py), through the hooks
vLLM calls: a token count past vLLM's ``max_model_len``, more block ids than the tokens fill, a ``remoteHost``
outside ``KVBRIDGE_PREFILL_HOSTS``. Each fails its own request, typed, before anything is recorded for it (no
heartbeat, no handshake, no connection), and the next request loads. A ``remoteHost`` that is not an address of the
deployment's prefill Service (``KVBRIDGE_PREFILL_SERVICE``) fails on the worker's handshake thread, before any
connection, and the scheduler's heartbeats skip it."""

from __future__ import annotations

import copy
import select
import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvbridge_agent.core import Role
from kvbridge_agent.core.contract import EngineEnvironment, render_environment
from kvbridge_agent.vllm_connector.messages import transfer_params
from kvbridge_agent.vllm_connector.scheduler import ConnectorScheduler
from kvbridge_agent.vllm_connector.settings import ConnectorSettings
from kvbridge_agent.vllm_connector.worker import ConnectorWorker

from .test_scheduler import MODEL, blocks_of, prefill_scheduler, published, request, vllm_config


def decode_scheduler(
    max_model_len: int | None = None, hosts: list[str] | None = None, service: str | None = None
) -> ConnectorScheduler:
    env = EngineEnvironment(
        role=Role.DECODE,
        engine_id="decode-0",
        model=MODEL,
        prefill={"block_size": 32},
        decode={"block_size": 32},
        side_channel_host="127.0.0.1",
        side_channel_listen_port=0,
        prefill_hosts=hosts,
        prefill_service=service,
    )
    config = vllm_config("kv_consumer")
    if max_model_len is not None:
        config.model_config = type("ModelConfig", (), {"max_model_len": max_model_len, "dtype": None})()
    return ConnectorScheduler(ConnectorSettings.from_vllm(config, render_environment(env)))


@pytest.fixture
def prefill() -> Iterator[ConnectorScheduler]:
    scheduler = prefill_scheduler()
    yield scheduler
    scheduler.shutdown()


def load(decode: ConnectorScheduler, params: dict[str, Any], tokens: int = 70) -> str:
    """Decode takes a request of ``tokens`` handed ``params`` through vLLM's scheduler hooks: the refusal of its
    order (empty: it is read). A refused one is never waited on (no heartbeat renews its lease on prefill)."""
    req = request("d1", tokens, copy.deepcopy(params))  # vLLM's hooks change the request's parameters
    assert decode.get_num_new_matched_tokens(req, 0) == (tokens, True)  # vLLM allocates, then fails its blocks
    decode.update_state_after_alloc(req, blocks_of([1, 2, 3]), tokens)
    order = decode.build_connector_meta().to_read["d1"]
    if order.refused:
        assert decode._waiting == {}
        assert order.params is None
    else:
        assert set(decode._waiting) == {"d1"}
        decode.transfers_done(None, {"d1"})
    return order.refused


def test_a_token_count_past_the_model_s_length_is_refused(prefill: ConnectorScheduler) -> None:
    """numTokens is bounded by vLLM's max_model_len, not by the schema's 2^24 (a request vLLM lets in has a prompt
    within it: parameters naming more tokens were computed for another request, or forged)."""
    decode = decode_scheduler(max_model_len=69)
    try:
        refused = load(decode, published(prefill))
        assert refused.startswith("INVALID_TRANSFER_PARAMS: kv_transfer_params.kvbridge.numTokens: numTokens 70")
        assert "69 tokens" in refused
    finally:
        decode.shutdown()
    decode = decode_scheduler(max_model_len=70)
    try:
        assert load(decode, published(prefill)) == ""
    finally:
        decode.shutdown()


def test_more_block_ids_than_the_tokens_fill_are_refused(prefill: ConnectorScheduler) -> None:
    """70 tokens fill 3 blocks of 32: a fourth id (or a million) is not prefill's answer for them."""
    decode = decode_scheduler()
    try:
        params = published(prefill)
        assert len(params["kvbridge"]["remoteBlockIds"]) == 3
        params["kvbridge"]["remoteBlockIds"] = [7, 8, 9, 10]
        refused = load(decode, params)
        assert refused.startswith("INVALID_TRANSFER_PARAMS: kv_transfer_params.kvbridge.remoteBlockIds: 4 block ids")
        params["kvbridge"]["remoteBlockIds"] = [7, 8, 9]
        assert load(decode, params) == ""
    finally:
        decode.shutdown()


def test_a_remote_host_outside_the_prefill_hosts_is_refused_before_any_connection(
    prefill: ConnectorScheduler,
) -> None:
    """With KVBRIDGE_PREFILL_HOSTS set, parameters naming another host fail REMOTE_HOST_NOT_ALLOWED at admission:
    no heartbeat and no handshake ever connect to it (the worker reports the request's blocks invalid at once)."""
    decode = decode_scheduler(hosts=["10.0.0.0/8", "dd-prefill.ns.svc"])
    worker = ConnectorWorker(decode.settings, 0, "inc")
    try:
        params = published(prefill)
        assert params["kvbridge"]["remoteHost"] == "127.0.0.1"
        for host in ("127.0.0.1", "169.254.169.254", "::1", "metadata.google.internal", "dd-prefill.ns.svc.evil"):
            params["kvbridge"]["remoteHost"] = host
            refused = load(decode, params)
            assert refused.startswith("REMOTE_HOST_NOT_ALLOWED: kv_transfer_params.kvbridge.remoteHost:"), refused
        req = request("d2", 70, copy.deepcopy(params))
        decode.get_num_new_matched_tokens(req, 0)
        decode.update_state_after_alloc(req, blocks_of([1, 2, 3]), 70)
        result = worker._start_read(None, "d2", decode.build_connector_meta().to_read["d2"])  # type: ignore[arg-type]
        assert result is not None
        assert (result.ok, result.code, result.invalid_blocks) == (False, "REMOTE_HOST_NOT_ALLOWED", [1, 2, 3])
        assert worker._fetching == {}  # no handshake started
        for host in ("10.1.2.3", "p-0.dd-prefill.ns.svc", "DD-Prefill.ns.svc."):
            params["kvbridge"]["remoteHost"] = host
            assert load(decode, params) == "", host
    finally:
        worker.shutdown()
        decode.shutdown()
    decode = decode_scheduler(hosts=["127.0.0.0/8"])  # what the local runner's pods use (127.0.0.N)
    try:
        params = published(prefill)
        assert load(decode, params) == ""
    finally:
        decode.shutdown()


@pytest.fixture
def stranger() -> Iterator[socket.socket]:
    """A TCP listener outside the prefill Service (where a forged remoteHost points), to count connections."""
    listener = socket.socket()
    listener.bind(("127.0.0.2", 0))
    listener.listen(8)
    yield listener
    listener.close()


def test_a_host_outside_the_prefill_service_fails_on_the_handshake_thread_before_any_connection(
    prefill: ConnectorScheduler, stranger: socket.socket
) -> None:
    """KVBRIDGE_PREFILL_SERVICE names the prefill pods (here ``localhost``: 127.0.0.1, from the hosts file, a real
    lookup). Parameters naming another host pass the scheduler (no DNS on vLLM's thread), then fail their handshake,
    REMOTE_HOST_NOT_ALLOWED, on the handshake thread: the listener there is never connected to, the request's
    blocks are invalid. The heartbeat thread skips them too. Before, decode connected to it."""
    decode = decode_scheduler(service="localhost")
    worker = ConnectorWorker(decode.settings, 0, "inc")
    checked_on: list[str] = []
    address = worker._service.address

    def checked(host: str) -> str:
        checked_on.append(threading.current_thread().name)
        return address(host)

    worker._service.address = checked  # type: ignore[method-assign]
    try:
        params = published(prefill)
        params["kvbridge"].update(remoteHost="127.0.0.2", remotePort=stranger.getsockname()[1])
        req = request("d1", 70, copy.deepcopy(params))
        assert decode.get_num_new_matched_tokens(req, 0) == (70, True)  # admitted by the scheduler: nothing resolved
        decode.update_state_after_alloc(req, blocks_of([1, 2, 3]), 70)
        order = decode.build_connector_meta().to_read["d1"]
        assert order.refused == ""
        rank = SimpleNamespace(peers={})  # decode's rank: no peer met yet
        assert worker._start_read(rank, "d1", order) is None  # type: ignore[arg-type]  # waits for its handshake
        [(future, _, _)] = worker._fetching.values()
        assert future.exception(timeout=10) is not None
        worker._finish_handshakes(rank)  # type: ignore[arg-type]
        [result] = worker._results
        assert (result.ok, result.code, result.invalid_blocks) == (False, "REMOTE_HOST_NOT_ALLOWED", [1, 2, 3])
        assert "not among its" in result.message
        assert checked_on
        assert all(name.startswith("kvbridge-handshake") for name in checked_on)  # never vLLM's thread
        assert decode._service.reachable(dict(decode._waiting)) == {}  # the heartbeat thread's view: skipped
        assert not select.select([stranger], [], [], 0.3)[0]  # nothing ever connected to it
        # the prefill's own address (127.0.0.1) is reached: the handshake connects and gets its rank
        admitted = transfer_params(published(prefill))
        assert admitted is not None
        assert admitted.remote_host == "127.0.0.1"
        assert list(worker._fetch(admitted)) == [0]
    finally:
        worker.shutdown()
        decode.shutdown()
