"""Bad input against the real ``kvbridge-router`` process: every malformed request gets a clear 4xx before any engine
sees it, a stalled or truncated body neither hangs nor leaks a traceback, and the router keeps serving.

A fixed corpus of hostile requests, then a seeded fuzz of mutations of a valid request; the engines are stand-ins
in this process that record what reaches them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvbridge_sim.support import free_port, until

from .test_proxy import FakeEngine

BODY_TIMEOUT = 1.0
HEADER_TIMEOUT = 1.0
VALID = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}


@dataclass
class RouterProcess:
    url: str
    port: int
    log: Path
    engines: list[FakeEngine]
    session: aiohttp.ClientSession

    async def post(
        self, data: bytes, headers: dict[str, str] | None = None, path: str = "/v1/completions"
    ) -> tuple[int, Any]:
        async with self.session.post(
            self.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
        ) as r:
            text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text

    def reached_engines(self) -> int:
        return sum(len(e.received) for e in self.engines)


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[RouterProcess]:
    engines = [FakeEngine("prefill-0"), FakeEngine("decode-0")]
    for engine in engines:
        await engine.start()
    status = {
        "status": {"prefill": {"endpoints": [engines[0].endpoint]}, "decode": {"endpoints": [engines[1].endpoint]}}
    }
    (tmp_path / "dd.json").write_text(json.dumps(status))
    port, log = free_port(), tmp_path / "router.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvbridge_router",
                "--status-file",
                str(tmp_path / "dd.json"),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--body-timeout",
                str(BODY_TIMEOUT),
                "--header-timeout",
                str(HEADER_TIMEOUT),
                "--prefill-timeout",
                "5",
                "--decode-timeout",
                "5",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
            url = f"http://127.0.0.1:{port}"

            async def healthy() -> bool:
                assert process.poll() is None, log.read_text()
                async with session.get(url + "/health") as r:
                    return r.status == 200

            await until(
                healthy, 30, lambda: f"the router to come up: {log.read_text()}", tolerate=(aiohttp.ClientError,)
            )
            yield RouterProcess(url, port, log, engines, session)
            async with session.get(url + "/health") as r:  # still serving after all of it
                assert r.status == 200, log.read_text()
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for engine in engines:
            if engine.server is not None:
                await engine.server.close()
    text = log.read_text()
    assert "Traceback" not in text, text


def _nested(depth: int) -> bytes:
    return b'{"prompt": [1], "x": ' + b"[" * depth + b"]" * depth + b"}"


HOSTILE: list[tuple[str, bytes, dict[str, str], int, str]] = [
    ("not JSON", b"{not json", {}, 400, "INVALID_JSON"),
    ("a JSON array", b"[1, 2]", {}, 400, "INVALID_REQUEST"),
    ("nested 100 000 deep", _nested(100_000), {}, 400, "INVALID_JSON"),
    ("nested 65 deep", _nested(64), {}, 400, "INVALID_JSON"),
    ("a 5000-digit integer", b'{"prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}", {}, 400, "INVALID_JSON"),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', {}, 400, "INVALID_JSON"),
    (
        "an unknown charset",
        json.dumps(VALID).encode(),
        {"Content-Type": "application/json; charset=klingon"},
        415,
        "UNSUPPORTED_MEDIA_TYPE",
    ),
    (
        "latin-1",
        json.dumps(VALID).encode(),
        {"Content-Type": "application/json; charset=latin-1"},
        415,
        "UNSUPPORTED_MEDIA_TYPE",
    ),
    ("a form", b"prompt=hello", {"Content-Type": "application/x-www-form-urlencoded"}, 415, "UNSUPPORTED_MEDIA_TYPE"),
    ("max_tokens lots", json.dumps({**VALID, "max_tokens": "lots"}).encode(), {}, 400, "INVALID_REQUEST"),
    ("max_tokens 0", json.dumps({**VALID, "max_tokens": 0}).encode(), {}, 400, "INVALID_REQUEST"),
    ("max_tokens true", json.dumps({**VALID, "max_tokens": True}).encode(), {}, 400, "INVALID_REQUEST"),
    ("stream yes", json.dumps({**VALID, "stream": "yes"}).encode(), {}, 400, "INVALID_REQUEST"),
    ("no prompt", json.dumps({"model": "tiny"}).encode(), {}, 400, "INVALID_REQUEST"),
    ("an empty prompt", json.dumps({**VALID, "prompt": ""}).encode(), {}, 400, "INVALID_REQUEST"),
    ("two prompts", json.dumps({**VALID, "prompt": ["a", "b"]}).encode(), {}, 400, "INVALID_REQUEST"),
    ("negative token ids", json.dumps({**VALID, "prompt": [1, -2]}).encode(), {}, 400, "INVALID_REQUEST"),
    ("a number as model", json.dumps({**VALID, "model": 7}).encode(), {}, 400, "INVALID_REQUEST"),
    ("n 3 streamed", json.dumps({**VALID, "n": 3, "stream": True}).encode(), {}, 400, "INVALID_REQUEST"),
    ("n 17", json.dumps({**VALID, "n": 17}).encode(), {}, 400, "INVALID_REQUEST"),
    ("n 0", json.dumps({**VALID, "n": 0}).encode(), {}, 400, "INVALID_REQUEST"),
    ("n true", json.dumps({**VALID, "n": True}).encode(), {}, 400, "INVALID_REQUEST"),
    ("n 2.0", json.dumps({**VALID, "n": 2.0}).encode(), {}, 400, "INVALID_REQUEST"),
    (
        "the client's kv_transfer_params",
        json.dumps({**VALID, "kv_transfer_params": {"remote_host": "evil"}}).encode(),
        {},
        400,
        "INVALID_REQUEST",
    ),
    ("17 MiB", b'{"prompt": "' + b"a" * (17 << 20) + b'"}', {}, 413, "TOO_LARGE"),
]
CHAT_HOSTILE = [
    ("no messages", {"model": "tiny"}),
    ("messages a string", {"messages": "hi"}),
    ("a message without role", {"messages": [{"content": "hi"}]}),
    ("content a number", {"messages": [{"role": "user", "content": 5}]}),
]


async def test_every_hostile_request_gets_its_4xx_and_reaches_no_engine(router: RouterProcess) -> None:
    for what, data, headers, status, code in HOSTILE:
        got, answer = await router.post(data, headers)
        assert (got, answer["error"]["code"]) == (status, code), (what, answer)
        assert answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["message"], what
    for what, body in CHAT_HOSTILE:
        got, answer = await router.post(json.dumps(body).encode(), path="/v1/chat/completions")
        assert (got, answer["error"]["code"]) == (400, "INVALID_REQUEST"), (what, answer)
        assert answer["error"]["param"], what
    assert router.reached_engines() == 0
    got, answer = await router.post(json.dumps(VALID).encode())  # and a good one still goes through
    assert got == 200, answer
    assert router.reached_engines() == 2


async def _raw(port: int, head: bytes, body: bytes = b"", wait: float = 0.0, close: bool = False) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        if close:
            await asyncio.sleep(wait)
            return b""
        return await asyncio.wait_for(reader.read(65536), timeout=BODY_TIMEOUT + 10)
    finally:
        writer.close()


def _head(length: int, extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        + extra
        + f"Content-Length: {length}\r\n\r\n".encode()
    )


async def test_bodies_that_lie_stall_or_break_off_are_answered_at_once_or_within_the_bound(
    router: RouterProcess,
) -> None:
    started = time.monotonic()
    answer = await _raw(router.port, _head(1_000_000_000), b"{}")  # a gigabyte announced: refused unread
    assert b" 413 " in answer.split(b"\r\n")[0]
    assert b"TOO_LARGE" in answer
    assert time.monotonic() - started < 5
    started = time.monotonic()
    answer = await _raw(router.port, _head(1000), b'{"pro')  # two bytes of a thousand, then silence
    assert b" 408 " in answer.split(b"\r\n")[0]
    assert b"BODY_TIMEOUT" in answer
    assert BODY_TIMEOUT * 0.9 <= time.monotonic() - started < BODY_TIMEOUT + 5
    await _raw(router.port, _head(100), b'{"prompt": ', wait=0.3, close=True)  # the client leaves mid-body
    many = b"".join(f"X-Junk-{i}: {i}\r\n".encode() for i in range(200))
    answer = await _raw(router.port, _head(2, many), b"{}")
    assert answer.split(b"\r\n")[0].split()[1] in (b"400", b"431"), answer[:200]
    answer = await _raw(router.port, _head(2, b"X-Huge: " + b"a" * 20_000 + b"\r\n"), b"{}")
    assert answer.split(b"\r\n")[0].split()[1] in (b"400", b"431"), answer[:200]
    await asyncio.sleep(0.5)
    assert router.reached_engines() == 0
    gone = [line for line in router.log.read_text().splitlines() if "BODY_INCOMPLETE" in line]
    assert len(gone) == 1, router.log.read_text()  # a dropped client is one line
    malformed = [line for line in router.log.read_text().splitlines() if "malformed HTTP request" in line]
    assert len(malformed) == 2, router.log.read_text()


def _mutations(rng: random.Random) -> bytes:
    """A valid request with one thing broken: a field's type, the bytes, the nesting, or its end."""
    body: dict[str, Any] = {**VALID, "stream": rng.random() < 0.3}
    junk = [None, "", "x" * rng.randint(1, 50), -1, 0, 2**63, 1.5, True, [], {}, [None], {"a": [1]}, "\u0000"]
    kind = rng.randrange(5)
    if kind == 0:
        body[
            rng.choice(["prompt", "max_tokens", "stream", "model", "n", "max_completion_tokens", "stream_options"])
        ] = rng.choice(junk)
    elif kind == 1:
        data = bytearray(json.dumps(body).encode())
        for _ in range(rng.randint(1, 5)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    elif kind == 2:
        depth = rng.randint(60, 3000)
        body["prompt"] = json.loads("[" * depth + "1" + "]" * depth) if depth < 900 else [1]
        if depth >= 900:
            return json.dumps(body).encode()[:-1] + b', "deep": ' + b"[" * depth + b"]" * depth + b"}"
    elif kind == 3:
        return json.dumps(body).encode()[: rng.randint(0, 30)]
    else:
        body.pop("prompt")
        body[rng.choice(["messages", "input", "text"])] = rng.choice(junk)
    return json.dumps(body).encode()


async def test_a_fuzz_of_broken_requests_never_gets_a_5xx(router: RouterProcess) -> None:
    rng = random.Random(2026)
    refused = 0
    for _ in range(300):
        status, answer = await router.post(_mutations(rng))
        assert status < 500, answer
        if status >= 400:
            refused += 1
            assert isinstance(answer, dict), answer
            assert answer["error"]["code"], answer
    assert refused > 200  # most mutations are refused; the rest happened to stay valid and were served


async def _closed_after(reader: asyncio.StreamReader, started: float) -> float:
    """Seconds from ``started`` until the router closed the connection (it answers nothing)."""
    assert await asyncio.wait_for(reader.read(), HEADER_TIMEOUT + 5) == b""
    return time.monotonic() - started


async def test_a_connection_without_a_whole_request_head_is_closed_within_the_bound(router: RouterProcess) -> None:
    """A client that connects and sends nothing, or half a head, held a connection (and a file descriptor) for as
    long as it liked: aiohttp's keep-alive timer (an hour) was all there was."""
    for sent in (b"", b"P", b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Le"):
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        try:
            started = time.monotonic()
            writer.write(sent)
            took = await _closed_after(reader, started)
            assert HEADER_TIMEOUT * 0.9 <= took < HEADER_TIMEOUT + 3, (sent, took)
        finally:
            writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    try:  # a request served on a kept-alive connection, then half of the next one's head
        body = json.dumps(VALID).encode()
        writer.write(_head(len(body)) + body)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert b" 200 " in head.split(b"\r\n")[0]
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        await asyncio.sleep(HEADER_TIMEOUT * 1.5)  # idle between requests is not a late head
        writer.write(b"POST /v1/completions HTTP/1.1\r\n")
        took = await _closed_after(reader, time.monotonic())
        assert HEADER_TIMEOUT * 0.9 <= took < HEADER_TIMEOUT + 3, took
    finally:
        writer.close()
    assert router.reached_engines() == 2
