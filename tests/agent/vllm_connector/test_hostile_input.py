"""Hostile input through kvbridge's real connector halves: a fuzz of what crosses a process boundary into a vLLM
engine — ``kv_transfer_params`` (decode's and prefill's) and side-channel frames — driven through the hooks vLLM
calls (scheduler: ``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``request_finished``; worker: ``start_load_kv``, ``get_finished``), with real NIXL on host memory, vLLM's own
allocator (LBHNC), kvbridge's side channel and verification ``All``.

For every generated case: no hook raises (vLLM ends the engine on an exception from one), a request that loads
ends within a bound, and one that ends well holds exactly prefill's bytes (verified or failed, never wrong KV);
after each case a normal request moves byte-exact; the process's peak memory grows by less than a bound over the
run. Hosts are loopback or unresolvable and ports are the prefill's, a refused one or invalid: the fuzz never
leaves this machine nor touches another test's server.

Cost: one prefill and one decode pair (two NIXL agents) for the module; about 30 s alone on two cores.
"""

from __future__ import annotations

import json
import resource
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings
from kvbridge_agent.core.contract import EngineEnvironment, render_environment
from kvbridge_agent.core.handshake import ENVELOPE_VERSION, RankMetadata, agent_checksum
from kvbridge_agent.transfer.reads import ReadResult
from kvbridge_agent.vllm_connector.scheduler import ConnectorScheduler
from kvbridge_agent.vllm_connector.settings import ConnectorSettings
from kvbridge_agent.vllm_connector.worker import ConnectorWorker
from tests.hostile_values import JSON, NUMBERS, hostile_params
from tests.physical_kv import HEAD_SIZE, HEADS, LAYERS, fill, tokens_of

from .test_gpu_layouts import Side, allocate

MODEL = ModelGeometry(name="hostile", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_SIZE)
SIDE = Side(KVCacheLayout.LBHNC)
TOKENS = 70  # five 16-token blocks, the last one partly filled
PREFILL_BLOCKS = [3, 7, 1, 12, 5]
DECODE_BLOCKS = [9, 2, 14, 6, 11]
#: how long a loading request may take to end, whatever it was handed (handshake timeout 1.5 s, lease 10 s)
ENDS_WITHIN = 15.0
#: peak memory the whole fuzz may add (a 10^9-rank list took 1.5 GiB within seconds)
MEMORY_BOUND_MIB = 300


def connector_settings(role: Role) -> ConnectorSettings:
    env = EngineEnvironment(
        role=role,
        engine_id=f"{role.value}-hostile",
        model=MODEL,
        prefill=RoleSettings(block_size=SIDE.block),
        decode=RoleSettings(block_size=SIDE.block),
        transfer={"verification": "All", "handshake_timeout_seconds": 1.5, "lease_seconds": 10},
        side_channel_host="127.0.0.1",
        side_channel_listen_port=0,
    )
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role="kv_producer" if role is Role.PREFILL else "kv_consumer", kv_buffer_device="cuda"
        ),
        cache_config=SimpleNamespace(block_size=SIDE.block),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    return ConnectorSettings.from_vllm(config, render_environment(env), cpu_build=False)


def request(request_id: str, params: Any) -> Any:
    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=list(range(TOKENS)),
        num_prompt_tokens=TOKENS,
        kv_transfer_params=params,
        status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
        num_computed_tokens=TOKENS,
        trace_headers=None,
    )


def blocks_of(ids: list[int]) -> Any:
    return SimpleNamespace(get_unhashed_block_ids=lambda: ids, get_block_ids=lambda: (ids,))


@dataclass
class Pair:
    """One prefill engine and one decode engine (a scheduler and a TP-1 worker each), for the whole module."""

    prefill_scheduler: ConnectorScheduler
    prefill: ConnectorWorker
    prefill_views: dict[str, torch.Tensor]
    decode_scheduler: ConnectorScheduler
    decode: ConnectorWorker
    decode_views: dict[str, torch.Tensor]
    results: list[ReadResult]
    refused_port: int
    count: int = 0

    @property
    def side_channel_port(self) -> int:
        server = self.prefill_scheduler._server
        assert server is not None
        return server.port

    def offer(self) -> tuple[str, dict[str, Any]]:
        """Prefill finishes a prompt and offers it: the real transfer parameters of a fresh request."""
        self.count += 1
        request_id = f"p{self.count}"
        delay, params = self.prefill_scheduler.request_finished(
            request(request_id, {"do_remote_decode": True}), (PREFILL_BLOCKS,)
        )
        assert delay is True
        assert params is not None
        self.prefill.start_load_kv(self.prefill_scheduler.build_connector_meta())
        self.prefill_scheduler.take_digests(self.prefill.stats.take())
        return request_id, params

    def load(self, params: Any) -> str | None:
        """Decode loads a request handed ``params`` through every hook vLLM calls: ``None`` when the connector loads
        nothing for it, else ``""`` when it ended well or the failure's code. No hook may raise; a loading request
        ends in time, and a failed one hands all its blocks back to be recomputed."""
        self.count += 1
        request_id = f"d{self.count}"
        for view in self.decode_views.values():
            view.view(torch.int16)[DECODE_BLOCKS] = 0
        self.decode.stats.take()
        wanted = request(request_id, params)
        matched, asynchronous = self.decode_scheduler.get_num_new_matched_tokens(wanted, 0)
        loads = bool(matched and asynchronous)
        self.decode_scheduler.update_state_after_alloc(wanted, blocks_of(DECODE_BLOCKS), matched or 0)
        self.decode.start_load_kv(self.decode_scheduler.build_connector_meta())
        deadline = time.monotonic() + ENDS_WITHIN
        done = not loads
        while not done:
            assert time.monotonic() < deadline, f"request {request_id} never ended ({params!r:.300})"
            self.prefill.get_finished(set())
            _sending, received = self.decode.get_finished(set())
            done = request_id in (received or set())
            time.sleep(0.002)
        errors = self.decode.get_block_ids_with_load_errors()
        taken = self.decode.stats.take()
        failures: list[str] = [] if taken is None else list(taken.data.get("failed_reads", []))
        self.decode_scheduler.request_finished(wanted, (DECODE_BLOCKS,))
        self.prefill.get_finished(set())
        if not loads:
            assert not failures, failures
            return None
        if not failures:
            assert not errors, f"a request that ended well has load errors: {errors}"
            self.check_bytes()
            return ""
        assert errors == set(DECODE_BLOCKS), f"a failed request ({failures}) handed back {errors}"
        return failures[-1]

    def check_bytes(self) -> None:
        """Decode holds exactly prefill's KV of the prompt (whatever the request was handed)."""
        got = tokens_of(self.decode_views, DECODE_BLOCKS, SIDE)[:, :TOKENS]
        want = tokens_of(self.prefill_views, PREFILL_BLOCKS, SIDE)[:, :TOKENS]
        assert torch.equal(got, want), "a request that ended well holds other bytes than prefill computed"

    def normal_request_moves(self) -> None:
        _, params = self.offer()
        assert self.load(params) == ""


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    opened: list[Any] = []
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, never listening: a connection to it is refused at once
    try:
        prefill_scheduler = ConnectorScheduler(connector_settings(Role.PREFILL))
        opened.append(prefill_scheduler)
        prefill = ConnectorWorker(prefill_scheduler.settings, 0, "inc-prefill")
        opened.append(prefill)
        prefill_views = allocate(SIDE.layout)
        fill(prefill_views, SIDE, 0)
        prefill.register_kv_caches(prefill_views, SIDE.layout.name)
        handshake = prefill.get_handshake_metadata()
        assert handshake is not None
        prefill_scheduler.set_xfer_handshake_metadata({0: handshake})
        decode_scheduler = ConnectorScheduler(connector_settings(Role.DECODE))
        opened.append(decode_scheduler)
        decode = ConnectorWorker(decode_scheduler.settings, 0, "inc-decode")
        opened.append(decode)
        decode_views = allocate(SIDE.layout)
        decode.register_kv_caches(decode_views, SIDE.layout.name)
        assert decode.decode is not None
        results: list[ReadResult] = []
        polled = decode.decode.poll

        def poll() -> list[ReadResult]:
            found: list[ReadResult] = polled()
            results.extend(found)
            return found

        decode.decode.poll = poll  # type: ignore[method-assign]
        port = refused.getsockname()[1]
        built = Pair(prefill_scheduler, prefill, prefill_views, decode_scheduler, decode, decode_views, results, port)
        built.normal_request_moves()
        yield built
    finally:
        refused.close()
        for thing in reversed(opened):
            thing.shutdown()


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decode_survives_any_transfer_parameters_and_serves_on(pair: Pair, data: st.DataObject) -> None:
    """Any kv_transfer_params a client or a faulty prefill hands decode: no hook raises, the request ends in time,
    verified or failed with its blocks to recompute (never other bytes), and a normal request moves after it."""
    began = peak_mib()
    _, real = pair.offer()
    params = data.draw(hostile_params(real, (pair.side_channel_port, pair.refused_port)))
    code = pair.load(params)
    event(f"outcome: {'not loaded' if code is None else code or 'read, byte-exact'}")
    assert code != "INTERNAL_ERROR"  # a typed refusal, not an accident
    pair.normal_request_moves()
    assert peak_mib() - began < MEMORY_BOUND_MIB


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=st.one_of(JSON, st.dictionaries(st.sampled_from(["do_remote_decode", "kvbridge", "x"]), JSON)))
def test_prefill_survives_any_transfer_parameters(pair: Pair, params: Any) -> None:
    """What a client sends prefill (``do_remote_decode`` and anything beside it): every prefill hook returns."""
    scheduler = pair.prefill_scheduler
    pair.count += 1
    wanted = request(f"hp{pair.count}", params)
    scheduler.get_num_new_matched_tokens(wanted, 0)
    scheduler.update_state_after_alloc(wanted, blocks_of(PREFILL_BLOCKS), 0)
    _delay, answer = scheduler.request_finished(wanted, (PREFILL_BLOCKS,))
    pair.prefill.start_load_kv(scheduler.build_connector_meta())
    scheduler.take_digests(pair.prefill.stats.take())
    pair.prefill.get_finished({wanted.request_id})
    assert answer is None or isinstance(answer, dict)
    pair.normal_request_moves()


FRAMES = st.lists(st.binary(max_size=300) | JSON.map(lambda v: json.dumps(v).encode()), min_size=0, max_size=4)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    frames=FRAMES
    | st.fixed_dictionaries(
        {
            "version": st.sampled_from([2, 1, 3]) | JSON,
            "fingerprint": JSON,
            "type": st.sampled_from(["metadata", "heartbeat", "digest", "x"]) | JSON,
            "rank": NUMBERS | JSON,
            "requestIds": st.lists(st.text(max_size=20), max_size=300) | JSON,
            "tokens": st.lists(st.text(max_size=40), max_size=300) | JSON,
        }
    ).map(lambda h: [json.dumps(h).encode()])
)
def test_the_side_channel_survives_any_frames(pair: Pair, frames: list[bytes]) -> None:
    """Whatever a peer holding the key sends prefill's side channel: an answer or nothing, the listener serves on
    and a normal request moves after it."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(f"tcp://127.0.0.1:{pair.side_channel_port}")
    try:
        client.send_multipart([b"", *frames])
        if client.poll(200):  # a frame the listener drops (over its size bound) gets no answer
            client.recv_multipart()
    finally:
        client.close()
    server = pair.prefill_scheduler._server
    assert server is not None
    assert server.alive
    pair.normal_request_moves()


class FakePrefill:
    """A side channel that answers every metadata request with what the test sets, and passes every other request
    (digests, heartbeats) on to the real prefill's: a faulty (or hostile) prefill holding the key, as decode's
    handshake thread meets it."""

    def __init__(self, real_port: int) -> None:
        self.reply: list[bytes] = []
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self._real = f"tcp://127.0.0.1:{real_port}"
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            if not self._socket.poll(50):
                continue
            identity, _empty, *frames = self._socket.recv_multipart()
            if b'"metadata"' in frames[0]:
                self._socket.send_multipart([identity, b"", *self.reply])
                continue
            real = self._context.socket(zmq.REQ)
            real.setsockopt(zmq.LINGER, 0)
            real.connect(self._real)
            real.send_multipart(frames)
            if real.poll(2000):
                self._socket.send_multipart([identity, b"", *real.recv_multipart()])
            real.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self._socket.close()
        self._context.term()


@pytest.fixture(scope="module")
def fake_prefill(pair: Pair) -> Iterator[FakePrefill]:
    fake = FakePrefill(pair.side_channel_port)
    yield fake
    fake.close()


#: numbers near real ones as often as any (a cache's sizes, counts and offsets)
SMALL = st.integers(0, 64) | NUMBERS
METADATA_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "tpRank": SMALL,
    "tpSize": SMALL,
    "blockSize": SMALL,
    "numBlocks": SMALL,
    "tensorBases": st.lists(SMALL.map(lambda n: n * 4096), max_size=8) | st.integers(0, 5000).map(lambda n: [4096] * n),
    "regionBlockBytes": SMALL | st.sampled_from([2048, 4096, 8192, 12288]),
    "wireBlockSize": SMALL,
    "wireLayout": st.sampled_from(["HND", "NHD", "x"]),
    "kvLayout": st.sampled_from(["HND", "NHD", "x"]),
    "cacheKind": st.sampled_from(["Split", "BlocksFirst", "CrossLayer", "x"]),
    "deviceId": SMALL,
    "memoryType": st.sampled_from(["DRAM", "VRAM", "x"]),
    "engineId": st.sampled_from(["prefill-hostile", "another"]),
    "incarnation": st.sampled_from(["unmet", "other"]),
    "blockInterior": st.sampled_from(["", "vllm-cpu-attention/vec"]),
    "agentName": st.sampled_from(["another-agent", "", "x" * 600]),
    "physicalLayout": st.fixed_dictionaries(
        {
            "order": st.sampled_from(["LBHNC", "BLHNC", "BHLNC", "x"]),
            "shape": st.lists(SMALL, min_size=5, max_size=5),
            "strides": st.lists(SMALL, min_size=5, max_size=5),
        }
    )
    | JSON,
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decode_survives_any_handshake_reply(pair: Pair, fake_prefill: FakePrefill, data: st.DataObject) -> None:
    """Whatever a prefill holding the key answers decode's handshake (metadata of any size and shape, NIXL agent
    metadata cut or changed): the request fails typed or, if the metadata still describes prefill's cache, moves
    exactly its bytes; decode serves on."""
    handshake = pair.prefill.get_handshake_metadata()
    assert handshake is not None
    # in the side channel's words (camelCase), as the real prefill sends them
    metadata = json.loads(
        RankMetadata.model_validate_json(handshake.rank_metadata_json).model_dump_json(by_alias=True, exclude_none=True)
    )
    metadata["incarnation"] = "unmet"
    for name in data.draw(st.lists(st.sampled_from(sorted(METADATA_VALUES)), max_size=3, unique=True)):
        metadata[name] = data.draw(METADATA_VALUES[name] if data.draw(st.integers(0, 5)) else JSON)
    agent = handshake.agent_metadata
    cut = data.draw(st.sampled_from(["whole", "whole", "whole", "whole", "cut", "changed", "none"]))
    if cut == "cut":
        agent = agent[: data.draw(st.integers(0, len(agent) - 1))]
    elif cut == "changed":
        at = data.draw(st.integers(0, len(agent) - 1))
        agent = agent[:at] + bytes([agent[at] ^ data.draw(st.integers(1, 255))]) + agent[at + 1 :]
    elif cut == "none":
        agent = b""
    # a faulty peer: the checksum is of the metadata it meant to send (a hostile one computing it over what it sends
    # is inside the trust boundary: it holds the CURVE key, and UCX may abort on a corrupted address)
    checksum = agent_checksum(handshake.agent_metadata)
    header = {"version": ENVELOPE_VERSION, "fingerprint": pair.decode.settings.fingerprint, "agentSha256": checksum}
    fake_prefill.reply = [json.dumps(header).encode(), json.dumps(metadata).encode(), agent]
    _, real = pair.offer()
    params = json.loads(json.dumps(real))
    params["kvbridge"].update(remoteIncarnation="unmet", remotePort=fake_prefill.port)
    code = pair.load(params)
    event(f"outcome: {code or 'read, byte-exact'}")
    assert code != "INTERNAL_ERROR"
    pair.normal_request_moves()


def test_a_handshake_never_waits_behind_side_channels_that_do_not_answer(pair: Pair) -> None:
    """A client naming new prefill engines at an address that takes TCP and never answers holds one handshake
    thread each for the handshake timeout; a handshake with the real prefill (after it restarted, say) runs beside
    them rather than queued behind (the hostile review saw it end LEASE_EXPIRED behind eight), and past
    MAX_HANDSHAKES a request that needs one more fails at once, typed."""
    from kvbridge_agent.vllm_connector.failures import HANDSHAKE_BUSY, MAX_HANDSHAKES
    from kvbridge_agent.vllm_connector.messages import ReadOrder, transfer_params

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # takes connections, never answers: each handshake waits its whole timeout
    decode = pair.decode
    assert decode.decode is not None
    try:
        _, real = pair.offer()
        dead = []
        for n in range(MAX_HANDSHAKES - 1):
            hostile = json.loads(json.dumps(real))
            hostile["kvbridge"].update(remoteEngineId=f"dead-{n}", remotePort=silent.getsockname()[1])
            dead.append(transfer_params(hostile))
        for n, params in enumerate(dead):
            assert params is not None
            decode._start_or_fail(decode.decode, f"dead-{n}", ReadOrder([9], params))
        decode.decode.evict_peer("prefill-hostile")  # the real prefill must be met again: a handshake of its own
        began = time.monotonic()
        assert pair.load(real) == ""  # beside the dead ones, not behind them
        assert time.monotonic() - began < 1.5, "the real handshake waited for a dead one's timeout"
        assert len(decode._fetching) == MAX_HANDSHAKES - 1  # the dead ones still wait
        extra = json.loads(json.dumps(real))
        extra["kvbridge"].update(remoteEngineId="dead-more", remotePort=silent.getsockname()[1])
        more = transfer_params(extra)
        assert more is not None
        for n in range(2):  # one more fills the last thread; the next is refused at once
            named = more.model_copy(update={"remote_engine_id": f"more-{n}"})
            decode._start_or_fail(decode.decode, f"more-{n}", ReadOrder([9], named))
        (busy,) = [r for r in decode._results if r.request_id == "more-1"]
        assert (busy.ok, busy.code) == (False, HANDSHAKE_BUSY)
        deadline = time.monotonic() + ENDS_WITHIN
        while decode._fetching and time.monotonic() < deadline:  # the dead ones time out, typed
            decode.get_finished(set())
            time.sleep(0.05)
        decode.get_finished(set())
        taken = decode.stats.take()
        codes = sorted(taken.data.get("failed_reads", [])) if taken is not None else []
        assert codes == sorted([HANDSHAKE_BUSY] + ["HANDSHAKE_TIMEOUT"] * MAX_HANDSHAKES), codes
    finally:
        decode._results = []
        decode.get_block_ids_with_load_errors()
        silent.close()
    pair.normal_request_moves()
