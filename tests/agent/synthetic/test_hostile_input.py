"""Hostile input through the synthetic engine's HTTP API: a fuzz of decode's and prefill's routes (their transfer
parameters with fields replaced, bodies of any JSON shape, raw requests with any ``Content-Length``) against real
engine processes with real NIXL. Each case gets an answer (a typed error, or a success that verified its bytes),
the engines stay up, and a normal request moves after it. The side channel's own fuzz runs against the vLLM
connector's listener, the same ``SideChannelServer`` (tests/agent/vllm_connector/test_hostile_input.py).

Cost: two engine processes for the module (about 3 s to start); the cases about 15 s on two busy cores.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings, TransferSettings
from kvbridge_agent.core.contract import EngineEnvironment
from kvbridge_agent.synthetic.processes import EngineProcess, start_engine
from kvbridge_agent.transfer.keys import generate_keys
from kvbridge_sim.support import running
from tests.hostile_values import JSON, NUMBERS, hostile_params

MODEL = ModelGeometry(name="tiny", num_layers=1, num_kv_heads=2, head_dim=8)
TRANSFER = TransferSettings(lease_seconds=5, handshake_timeout_seconds=1.5)
#: an answer to any case within this long (a handshake that times out takes 1.5 s)
ANSWER_WITHIN = 20.0


def env(role: Role, engine_id: str, keys_dir: Path) -> EngineEnvironment:
    return EngineEnvironment(
        role=role,
        engine_id=engine_id,
        model=MODEL,
        prefill=RoleSettings(),
        decode=RoleSettings(),
        transfer=TRANSFER,
        keys_dir=str(keys_dir),
        num_blocks=4096,  # unread offers hold their blocks for the 5 s lease
        http_port=0,
        side_channel_listen_port=0,
        transfer_timeout_seconds=5,
    )


class Engines:
    def __init__(self, prefill: EngineProcess, decode: EngineProcess, refused_port: int) -> None:
        self.prefill, self.decode, self.refused_port = prefill, decode, refused_port
        self.count = 0

    def next_id(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def offer(self) -> dict[str, Any]:
        status, body = self.prefill.post("/v1/prefill", {"requestId": self.next_id("p"), "numTokens": 40})
        assert status == 200, body
        params: dict[str, Any] = body["kvTransferParams"]
        return params

    @property
    def ports(self) -> tuple[int, int]:
        return int(self.prefill.ready["sideChannelPort"]), self.refused_port

    def serving(self) -> None:
        """Both engines are up and a normal request moves byte-exact (the engine verifies what it read)."""
        assert self.prefill.process.poll() is None, self.prefill.log_tail()
        assert self.decode.process.poll() is None, self.decode.log_tail()
        status, body = self.decode.post(
            "/v1/decode", {"requestId": self.next_id("d"), "kvTransferParams": self.offer()}
        )
        assert status == 200, body
        assert body["verified"] is True


def answered(status: int, body: dict[str, Any]) -> str:
    """The outcome of one case: ``ok``, or the typed error's code (an INTERNAL_ERROR is an accident, not a refusal)."""
    if status == 200:
        return "ok"
    code = str(body.get("error", {}).get("code", ""))
    assert code, (status, body)
    assert code != "INTERNAL_ERROR", body
    assert 400 <= status < 600, (status, body)
    return code


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    keys = tmp_path_factory.mktemp("hostile") / "keys"
    generate_keys(keys)
    started: list[EngineProcess] = []
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, never listening: a connection to it is refused at once
    try:
        started.append(start_engine(env(Role.PREFILL, "prefill-hostile", keys)))
        started.append(start_engine(env(Role.DECODE, "decode-hostile", keys)))
        built = Engines(started[0], started[1], refused.getsockname()[1])
        built.serving()
        yield built
    finally:
        refused.close()
        for engine in started:
            engine.stop()
        assert not [pid for engine in started for pid in engine.pids if running(pid)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), prefix_hit=st.one_of(st.just(0), NUMBERS, JSON), request_id=st.one_of(st.just(""), JSON))
def test_decode_answers_any_transfer_parameters_and_serves_on(
    engines: Engines, data: st.DataObject, prefix_hit: Any, request_id: Any
) -> None:
    params = data.draw(hostile_params(engines.offer(), engines.ports, envelope=False))
    body = {"requestId": request_id or engines.next_id("d"), "kvTransferParams": params, "prefixHitBlocks": prefix_hit}
    status, answer = engines.decode.post("/v1/decode", body, timeout=ANSWER_WITHIN)
    event(f"decode: {answered(status, answer)}")
    if status == 200:
        assert answer["verified"] is True  # what it read is prefill's, checked byte by byte
    engines.serving()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    route=st.sampled_from(["/v1/prefill", "/v1/completions", "/v1/chat/completions"]),
    body=st.dictionaries(
        st.sampled_from(["requestId", "numTokens", "blockAllocation", "prompt", "kv_transfer_params", "stream", "x"]),
        JSON | NUMBERS,
        max_size=5,
    ),
)
def test_prefill_and_completion_routes_answer_any_body(engines: Engines, route: str, body: dict[str, Any]) -> None:
    target = engines.prefill if route == "/v1/prefill" or engines.count % 2 else engines.decode
    status, answer = target.post(route, body, timeout=ANSWER_WITHIN)
    event(f"{route}: {answered(status, answer)}")
    engines.serving()


def raw_post(engine: EngineProcess, head: bytes, body: bytes) -> bytes:
    """A request written by hand (any ``Content-Length``, any bytes), and the first bytes of the answer."""
    port = int(engine.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WITHIN) as conn:
        conn.sendall(head + body)
        conn.shutdown(socket.SHUT_WR)  # nothing more comes: a server waiting for more bytes sees the end
        return conn.recv(64)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    length=st.one_of(st.integers(-10, 1 << 40).map(str), st.sampled_from(["", "abc", "1e3", "-0", " 5", "0x10"])),
    body=st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode()),
)
def test_raw_requests_of_any_length_are_answered(engines: Engines, length: str, body: bytes) -> None:
    head = f"POST /v1/decode HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()
    answer = raw_post(engines.decode, head, body)
    status = answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/") else b""
    event(f"raw: {status.decode() or 'closed'}")
    assert status != b"500", answer
    engines.serving()
