"""SIGTERM drains the agent worker: requests in flight finish, new ones get 503 DRAINING (a router retries them on
another pair), and the wait is bounded."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.synthetic.http_api import AgentHTTPServer


class SlowEngine:
    """Just what the HTTP API calls for a prefill: it takes ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def rank_of(self, header: str | None) -> int | None:
        return None

    def prefill(self, request_id: str, num_tokens: int, *options: Any) -> KVTransferParams:
        time.sleep(self.seconds)
        return KVTransferParams(
            remote_engine_id="p",
            remote_incarnation="i",
            remote_host="127.0.0.1",
            remote_port=1,
            remote_request_id=request_id,
            remote_block_ids=[0],
            num_tokens=num_tokens,
            remote_tp_size=1,
            fingerprint="f",
            expires_at=time.time() + 60,
        )


def post(port: int) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/prefill",
        method="POST",
        data=json.dumps({"requestId": "r", "numTokens": 4}).encode(),
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_in_flight_requests_finish_and_new_ones_are_refused_while_draining() -> None:
    server = AgentHTTPServer("127.0.0.1", 0, SlowEngine(1.0))  # type: ignore[arg-type]
    server.start()
    try:
        answers: list[tuple[int, dict[str, Any]]] = []
        first = threading.Thread(target=lambda: answers.append(post(server.port)))
        first.start()
        time.sleep(0.3)  # the request is in flight
        drained: list[int] = []
        drainer = threading.Thread(target=lambda: drained.append(server.drain(10)))
        started = time.monotonic()
        drainer.start()
        time.sleep(0.2)
        status, body = post(server.port)
        assert (status, body["error"]["code"]) == (503, "DRAINING")
        first.join(10)
        drainer.join(10)
        assert answers[0][0] == 200  # the request in flight finished
        assert drained == [0]
        assert time.monotonic() - started < 3
    finally:
        server.shutdown()
        server.server_close()


def test_the_drain_is_bounded() -> None:
    server = AgentHTTPServer("127.0.0.1", 0, SlowEngine(5.0))  # type: ignore[arg-type]
    server.start()
    try:
        threading.Thread(target=lambda: post(server.port), daemon=True).start()
        time.sleep(0.3)
        started = time.monotonic()
        assert server.drain(0.5) == 1  # one still running when the bound ran out
        assert time.monotonic() - started < 2
    finally:
        server.shutdown()
        server.server_close()
