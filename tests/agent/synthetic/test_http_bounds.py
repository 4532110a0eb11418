"""The synthetic engine's HTTP server bounds its clients (synthetic/http_bounds.py): a client dribbling a request
a byte at a time is cut off once the request deadline has passed since its first byte (a socket timeout bounds
each read only: before, a byte every 0.05 s held the connection and its thread for as long as the client liked),
open connections are capped (one more is answered 503 at once), and the engine serves others throughout."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings
from kvbridge_agent.core.contract import EngineEnvironment, parse_environment, render_environment
from kvbridge_agent.synthetic.http_api import AgentHTTPServer

from .test_drain import SlowEngine

DEADLINE = 1.5
CAP = 4
BODY = b'{"requestId": "r", "numTokens": 4}'
REQUEST = b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)


@pytest.fixture
def server() -> Iterator[AgentHTTPServer]:
    http = AgentHTTPServer("127.0.0.1", 0, SlowEngine(0.0), request_seconds=DEADLINE, max_connections=CAP)  # type: ignore[arg-type]
    http.start()
    yield http
    http.shutdown()
    http.server_close()


def normal_request(port: int) -> tuple[int, float]:
    began = time.monotonic()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/prefill", data=BODY, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, time.monotonic() - began
    except urllib.error.HTTPError as exc:
        return exc.code, time.monotonic() - began
    except urllib.error.URLError:  # refused before it was read: the connection closed under the request
        return 0, time.monotonic() - began


def dribble(port: int, data: bytes, interval: float, limit: float) -> tuple[float, bytes]:
    """Send ``data`` one byte every ``interval``; returns when the server ended it (seconds since the first byte,
    and what it answered), or after ``limit`` (it did not)."""
    with socket.create_connection(("127.0.0.1", port), timeout=limit) as conn:
        began = time.monotonic()
        for byte in data:
            try:
                conn.sendall(bytes([byte]))
            except OSError:  # the server closed the connection
                return time.monotonic() - began, b""
            if time.monotonic() - began > limit:
                return limit, b"still open"
            ready = conn.recv(256, socket.MSG_PEEK | socket.MSG_DONTWAIT) if _readable(conn, interval) else None
            if ready is not None:
                try:
                    return time.monotonic() - began, conn.recv(256)
                except OSError:
                    return time.monotonic() - began, b""
    return time.monotonic() - began, b"sent it all"


def _readable(conn: socket.socket, seconds: float) -> bool:
    import select

    return bool(select.select([conn], [], [], seconds)[0])


@pytest.mark.parametrize(
    "data",
    [
        b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4000,  # a header that never ends
        b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nContent-Length: 4000\r\n\r\n" + b" " * 4000,  # a body that never ends
    ],
    ids=["header", "body"],
)
def test_a_dribbling_client_is_cut_off_at_the_deadline_while_others_are_served(
    server: AgentHTTPServer, data: bytes
) -> None:
    outcome: list[tuple[float, bytes]] = []
    slow = threading.Thread(target=lambda: outcome.append(dribble(server.port, data, 0.05, 3 * DEADLINE)))
    slow.start()
    time.sleep(0.3)
    for _ in range(3):  # served beside it, at once
        status, seconds = normal_request(server.port)
        assert (status, seconds < 1.0) == (200, True)
    slow.join(timeout=10)
    ((took, answer),) = outcome
    assert answer != b"still open", "a client sending a byte every 0.05 s held its connection past the deadline"
    assert DEADLINE - 0.1 < took < DEADLINE + 1.0, took
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer  # a body's: 408 (INVALID_REQUEST), closed


def test_connections_past_the_cap_are_refused_at_once_and_the_held_ones_are_served(server: AgentHTTPServer) -> None:
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(CAP)]
    try:
        time.sleep(0.2)  # each has its thread
        began = time.monotonic()
        status, _ = normal_request(server.port)
        assert status in (503, 0)  # the 503, or the connection closed as the request was sent
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
            answer = extra.recv(4096)
        assert time.monotonic() - began < 1.0
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503")
        assert b"Retry-After: 1" in head
        assert json.loads(body)["error"]["code"] == "TOO_MANY_CONNECTIONS"
        for conn in held:  # the connections it holds are served as ever
            conn.sendall(REQUEST)
            assert conn.recv(4096).startswith(b"HTTP/1.1 200")
        held.pop().close()  # a slot comes free once its connection ends
        deadline = time.monotonic() + 5
        while normal_request(server.port)[0] != 200:
            assert time.monotonic() < deadline, "a closed connection never gave its slot back"
            time.sleep(0.05)
    finally:
        for conn in held:
            conn.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(1, len(REQUEST) - 1), max_size=12, unique=True), keep_alive=st.booleans())
def test_a_request_split_anyhow_is_answered_as_a_whole(
    server: AgentHTTPServer, cuts: list[int], keep_alive: bool
) -> None:
    """The deadline reader hands http.server the same bytes however TCP splits them (two requests on one connection
    each get their own deadline)."""
    edges = [0, *sorted(cuts), len(REQUEST)]
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
        for _ in range(2 if keep_alive else 1):
            for start, end in itertools.pairwise(edges):
                conn.sendall(REQUEST[start:end])
                time.sleep(0.001)
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = conn.recv(4096)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer


def test_the_bounds_are_settings_rendered_only_when_changed() -> None:
    env = EngineEnvironment(
        role=Role.DECODE,
        engine_id="d-0",
        model=ModelGeometry(name="m", num_layers=1, num_kv_heads=1, head_dim=8),
        prefill=RoleSettings(),
        decode=RoleSettings(),
    )
    rendered = render_environment(env)
    assert not {"KVBRIDGE_HTTP_REQUEST_SECONDS", "KVBRIDGE_HTTP_MAX_CONNECTIONS"} & set(rendered)
    assert (env.http_request_seconds, env.http_max_connections) == (30.0, 256)
    changed: dict[str, Any] = {"http_request_seconds": 5.0, "http_max_connections": 32}
    rendered = render_environment(env.model_copy(update=changed))
    assert (rendered["KVBRIDGE_HTTP_REQUEST_SECONDS"], rendered["KVBRIDGE_HTTP_MAX_CONNECTIONS"]) == ("5.0", "32")
    parsed = parse_environment(rendered)
    assert (parsed.http_request_seconds, parsed.http_max_connections) == (5.0, 32)
