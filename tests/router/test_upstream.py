"""The router's HTTP/1.1 client to the engines (kvbridge_router.upstream): connections kept alive and reused only
when the answer was read whole, every way an engine can fail mapped to one error, every wait bounded."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from kvbridge_router.upstream import BUFFER_BYTES, UnreachableError, Upstream, UpstreamError
from kvbridge_sim.support import free_port


async def serve(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[tuple[str, set[tuple[str, int]]]]:
    peers: set[tuple[str, int]] = set()

    async def counted(request: web.Request) -> web.StreamResponse:
        peers.add(request.transport.get_extra_info("peername") if request.transport else ("?", 0))
        return await handler(request)

    app = web.Application()
    app.router.add_post("/{tail:.*}", counted)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", peers
    finally:
        await runner.cleanup()


async def raw_server(answer: bytes, close: bool = True) -> tuple[str, asyncio.Server]:
    """A server that reads a request and writes ``answer`` verbatim (then closes, when ``close``)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        if close:
            writer.close()
        else:
            await asyncio.sleep(30)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", server


async def drain(upstream: Upstream, url: str, idle: float) -> int:
    """POST to ``url`` and read the answer's body chunk by chunk; its length."""
    base, path = url.rsplit("/", 1)
    async with upstream.post(base, "/" + path, b"{}", {}, 3) as got:
        return sum([len(chunk) async for chunk in got.chunks(idle_timeout=idle)])


async def echo(request: web.Request) -> web.Response:
    body = await request.read()
    close = {"Connection": "close"} if request.query.get("close") else {}
    return web.Response(
        body=body, content_type="application/json", headers={"X-Seen": request.headers.get("X-Request-Id", ""), **close}
    )


async def test_a_connection_is_reused_only_after_an_answer_read_whole() -> None:
    upstream = Upstream(keepalive=3.0)
    async for url, peers in serve(echo):
        for index in range(4):
            async with upstream.post(url, "/v1/completions", b'{"i": %d}' % index, {"X-Request-Id": "r"}, 3) as got:
                assert got.status == 200
                assert got.headers["x-seen"] == "r"
                assert got.content_type == "application/json"
                assert await got.read() == b'{"i": %d}' % index
        assert len(peers) == 1  # one connection for all four
        async with upstream.post(url, "/x?close=1", b"{}", {}, 3) as got:
            await got.read()
        async with upstream.post(url, "/x", b"{}", {}, 3) as got:  # the engine said close: a new connection
            await got.read()
        async with upstream.post(url, "/x", b"{}", {}, 3):
            pass  # left unread: this connection is not reused
        async with upstream.post(url, "/x", b"{}", {}, 3) as got:
            await got.read()
        assert len(peers) == 3
    upstream.close()


async def test_idle_connections_older_than_the_keepalive_are_not_used() -> None:
    upstream = Upstream(keepalive=0.05)
    async for url, peers in serve(echo):
        for _ in range(2):
            async with upstream.post(url, "/x", b"{}", {}, 3) as got:
                await got.read()
            await asyncio.sleep(0.1)
        assert len(peers) == 2
    upstream.close()


async def test_a_stream_comes_chunk_by_chunk_and_a_silent_one_is_cut_at_its_idle_bound() -> None:
    release = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(3):
            await response.write(b"data: %d\n\n" % index)
            await asyncio.sleep(0.02)
        if request.query.get("hang"):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(release.wait(), 10)
        await response.write_eof()
        return response

    upstream = Upstream(keepalive=3.0)
    async for url, _ in serve(stream):
        async with upstream.post(url, "/s", b"{}", {}, 3) as got:
            assert got.content_type == "text/event-stream"
            chunks = [chunk async for chunk in got.chunks(idle_timeout=2)]
        assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        assert len(chunks) >= 2  # as they came, not the whole body at the end
        with pytest.raises(TimeoutError):
            await drain(upstream, url + "/s?hang=1", idle=0.3)
        release.set()
    upstream.close()


async def test_no_connection_is_unreachable_and_a_broken_answer_is_an_upstream_error() -> None:
    upstream = Upstream(keepalive=3.0)
    with pytest.raises(UnreachableError):
        async with upstream.post(f"http://127.0.0.1:{free_port()}", "/x", b"{}", {}, 3):
            pass
    answers = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",  # closed mid-body
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",  # closed mid-chunk
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n5\r\nab",  # the coding's name in any case
        b"NOT HTTP AT ALL\r\n\r\n",  # malformed
        b"",  # closed before answering
    ]
    for answer in answers:
        url, server = await raw_server(answer)
        async with server:
            with pytest.raises(UpstreamError) as caught:
                async with upstream.post(url, "/x", b"{}", {}, 3) as got:
                    await got.read()
            assert not isinstance(caught.value, UnreachableError)  # it was sent: the engine may have it
    url, server = await raw_server(b"HTTP/1.1 200 OK\r\n" + b"X-Big: " + b"a" * (70 << 10) + b"\r\n\r\n", close=False)
    async with server:
        with pytest.raises(UpstreamError):
            async with upstream.post(url, "/x", b"{}", {}, 3):
                pass
    url, server = await raw_server(b"", close=False)  # never answers: the head's bound
    async with server:
        with pytest.raises(TimeoutError):
            async with upstream.post(url, "/x", b"{}", {}, 3, head_timeout=0.2):
                pass
    with pytest.raises(ValueError, match="line break"):
        upstream.post(url, "/x", b"{}", {"X-Request-Id": "a\r\nX-Evil: 1"}, 3)
    upstream.close()


async def test_a_body_faster_than_it_is_passed_on_pauses_the_engine() -> None:
    size = 4 * BUFFER_BYTES

    async def big(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(size // 65536):
            await response.write(b"x" * 65536)
        await response.write_eof()
        return response

    upstream = Upstream(keepalive=3.0)
    async for url, _ in serve(big):
        async with upstream.post(url, "/b", b"{}", {}, 3) as got:
            await asyncio.sleep(0.5)  # the router is slow to pass it on
            connection = got._connection
            assert connection._buffered <= BUFFER_BYTES + (1 << 18)  # reading paused near the bound
            total = 0
            async for chunk in got.chunks(idle_timeout=5):
                total += len(chunk)
            assert total == size
    upstream.close()


async def scripted_server(script: Callable[[int, int], list[bytes]]) -> tuple[str, asyncio.Server, list[int]]:
    """A server that reads each request whole (head and Content-Length body) and writes the pieces
    ``script(connection, request)`` gives, 50 ms apart; it keeps the connection open. The list counts connections."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = len(connections)
        connections.append(connection)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            for index in range(100):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                for piece in script(connection, index):
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.05)
            await reader.read()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", server, connections


def answer(body: bytes, *headers: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(h + b"\r\n" for h in headers)
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


async def test_interim_answers_are_skipped_and_the_final_one_is_the_answer() -> None:
    """A 100 Continue taken as the answer left the real answer on the connection for the next request: one
    client's kv_transfer_params handed to another's decode."""
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    hints = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"

    def script(_: int, index: int) -> list[bytes]:
        if index == 0:
            return [interim, answer(b"first", b"X-Final: 1")]  # apart: the interim alone in its packet
        return [interim + hints + interim + answer(b"second")]  # together: one packet

    upstream = Upstream(keepalive=3.0)
    url, server, connections = await scripted_server(script)
    async with server:
        for expected in (b"first", b"second"):
            async with upstream.post(url, "/x", b"{}", {}, 3, head_timeout=3) as got:
                assert got.status == 200
                assert "link" not in got.headers  # the interim answers' headers are not the answer's
                assert await got.read() == expected
        assert len(connections) == 1  # each answer whole on the one connection
        url, server, _ = await scripted_server(lambda _, __: [interim * 40])
        async with server:
            with pytest.raises(UpstreamError, match="interim"):
                async with upstream.post(url, "/x", b"{}", {}, 3, head_timeout=3):
                    pass
    upstream.close()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\nraw bytes",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n",
        b"HTTP/1.1 600 Odd\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 099 Odd\r\nContent-Length: 0\r\n\r\n",
    ],
)
async def test_a_switching_bodiless_or_odd_status_is_an_error_and_the_connection_is_dropped(head: bytes) -> None:
    upstream = Upstream(keepalive=3.0)
    url, server, connections = await scripted_server(lambda c, i: [head] if (c, i) == (0, 0) else [answer(b"ok")])
    async with server:
        with pytest.raises(UpstreamError) as caught:
            async with upstream.post(url, "/x", b"{}", {}, 3, head_timeout=3) as got:
                await got.read()
        assert not isinstance(caught.value, UnreachableError)
        assert "status" in str(caught.value)
        async with upstream.post(url, "/x", b"{}", {}, 3, head_timeout=3) as got:
            assert await got.read() == b"ok"
        assert len(connections) == 2  # not reused
    upstream.close()


async def test_bytes_on_an_idle_connection_discard_it() -> None:
    """An engine writing after its answer was complete: those bytes are no later request's answer."""

    def script(connection: int, index: int) -> list[bytes]:
        if (connection, index) == (0, 0):
            return [answer(b"ok"), b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"]  # then a stray head
        if connection == 0:
            return [b"stray", answer(b"second")]
        return [answer(b"second")]

    upstream = Upstream(keepalive=3.0)
    url, server, connections = await scripted_server(script)
    async with server:
        async with upstream.post(url, "/x", b"{}", {}, 3, head_timeout=3) as got:
            assert await got.read() == b"ok"
        await asyncio.sleep(0.3)  # the stray head arrives while the connection is idle in the pool
        async with upstream.post(url, "/x", b"{}", {}, 3, head_timeout=3) as got:
            assert await got.read() == b"second"
        assert len(connections) == 2
        # and stray bytes right behind an answer, in its last packet: the answer stands, the connection goes
        url, server, connections = await scripted_server(lambda _, __: [answer(b"ok") + answer(b"stray")])
        async with server:
            for _ in range(2):
                async with upstream.post(url, "/x", b"{}", {}, 3, head_timeout=3) as got:
                    assert await got.read() == b"ok"
            assert len(connections) == 2
    upstream.close()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n",
        b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n",
    ],
)
async def test_an_answer_delimited_by_closing_the_connection_is_complete_when_it_closes(head: bytes) -> None:
    upstream = Upstream(keepalive=3.0)
    body = b'{"kv_transfer_params": {"a": 1}}' * 1000
    url, server = await raw_server(head + body)
    async with server:
        for _ in range(2):
            async with upstream.post(url, "/x", b"{}", {}, 3) as got:
                assert got.status == 200
                assert await got.read() == body
                assert not got._connection.reusable
    upstream.close()


async def test_an_answer_over_the_limit_is_refused_without_reading_the_rest_and_its_connection_closed() -> None:
    from kvbridge_router.upstream import AnswerTooLargeError

    closed = asyncio.Event()
    answer = {"chunked": False}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        announced = b"HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n"  # a gigabyte announced
        writer.write(chunked if answer["chunked"] else announced)
        with contextlib.suppress(ConnectionError):
            for _ in range(200):  # up to 12.5 MiB, 64 KiB at a time, unless the router hangs up first
                piece = b"x" * 65536
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if answer["chunked"] else piece)
                await writer.drain()
                await asyncio.sleep(0.001)
            await asyncio.wait_for(reader.read(), 10)  # the router closes the connection
        closed.set()
        writer.close()

    upstream = Upstream(keepalive=3.0)
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        for answer["chunked"] in (False, True):
            closed.clear()
            async with upstream.post(url, "/x", b"{}", {}, 3, head_timeout=3) as got:
                with pytest.raises(AnswerTooLargeError) as caught:
                    await got.read(limit=1 << 20)
                assert caught.value.limit == 1 << 20
                assert isinstance(caught.value, UpstreamError)
            await asyncio.wait_for(closed.wait(), 5)
            assert got._connection.transport is None
    upstream.close()
