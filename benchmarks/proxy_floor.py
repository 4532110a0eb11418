"""The floor under the router's cost per request (not a test): the least a P/D proxy in Python does.

    .venv/bin/python benchmarks/proxy_floor.py --port P --prefill-port A --decode-port B

``benchmarks/router_overhead.py --floor`` runs it beside the router, taking turns, as the ceiling beside a transfer:
an ``asyncio.Protocol`` server on uvloop that parses each request with ``httptools`` (llhttp) and its body with
msgspec, writes prefill's one-token copy with msgspec, sends it and then the client's body with the transfer
parameters to the engines over kept-alive connections, and passes decode's answer back. Nothing else: no checks,
no choice, no metrics, no timeouts, no retries, no streaming. What the router costs above this is its own code and
aiohttp's server; what this costs is the event loop, the system calls and the parsing that any Python router pays.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import httptools
import msgspec
import uvloop

_DECODE = msgspec.json.Decoder()
_ENCODE = msgspec.json.Encoder().encode


class _Messages(asyncio.Protocol):
    """One HTTP/1.1 connection, each message parsed by llhttp as it arrives and handed over whole
    (:meth:`message`)."""

    def __init__(self, parser: httptools.HttpRequestParser | httptools.HttpResponseParser) -> None:
        self._parser = parser
        self._body: list[bytes] = []
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body, self._body = b"".join(self._body), []
        self.message(body)

    def message(self, body: bytes) -> None:
        raise NotImplementedError


class _Engine(_Messages):
    """One kept-alive connection to an engine: a request at a time, its answer's body whole."""

    def __init__(self) -> None:
        super().__init__(httptools.HttpResponseParser(self))
        self._answer: asyncio.Future[bytes] | None = None

    def message(self, body: bytes) -> None:
        answer, self._answer = self._answer, None
        if answer is not None:
            answer.set_result(body)

    async def post(self, body: bytes) -> bytes:
        if self._transport is None:
            raise ConnectionError("not connected")
        self._answer = asyncio.get_running_loop().create_future()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
        self._transport.writelines((head, b"Content-Length: %d\r\n\r\n" % len(body), body))
        return await self._answer


class _Engines:
    """Kept-alive connections to one engine."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._idle: list[_Engine] = []

    async def post(self, body: bytes) -> bytes:
        if self._idle:
            engine = self._idle.pop()
        else:
            _, engine = await asyncio.get_running_loop().create_connection(_Engine, "127.0.0.1", self._port)
        answer = await engine.post(body)
        self._idle.append(engine)
        return answer


class _Client(_Messages):
    """A client's connection: each request prefilled, then decoded, decode's answer passed back."""

    def __init__(self, prefill: _Engines, decode: _Engines) -> None:
        super().__init__(httptools.HttpRequestParser(self))
        self._prefill, self._decode = prefill, decode
        self._url = b""

    def on_url(self, url: bytes) -> None:
        self._url = url

    def message(self, body: bytes) -> None:
        if self._url.startswith(b"/v1/"):
            asyncio.get_running_loop().create_task(self._route(body))
        else:  # /health, for the benchmark's wait
            self._answer(b'{"ok":true}')

    async def _route(self, raw: bytes) -> None:
        body: dict[str, Any] = _DECODE.decode(raw)
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        params = _DECODE.decode(await self._prefill.post(_ENCODE(first)))["kv_transfer_params"]
        self._answer(await self._decode.post(_ENCODE({**body, "kv_transfer_params": params})))

    def _answer(self, body: bytes) -> None:
        if self._transport is not None:
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            self._transport.writelines((head, body))


async def serve(port: int, prefill_port: int, decode_port: int) -> None:
    prefill, decode = _Engines(prefill_port), _Engines(decode_port)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(prefill, decode), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill-port", type=int, required=True)
    parser.add_argument("--decode-port", type=int, required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.prefill_port, args.decode_port))
