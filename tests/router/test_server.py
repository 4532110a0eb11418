"""The router's HTTP server (server.py, connection.py, request.py, response.py) on raw sockets: framing, keep-alive,
pipelining, bounds and clients that misbehave; handlers here are small stand-ins (the router's own routes are
tests/router/test_proxy.py's and test_hostile_input.py's)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import time
from collections.abc import AsyncIterator

import pytest

from kvbridge_router import connection as connection_module
from kvbridge_router.connection import MAX_HEAD_BYTES, MAX_HEADERS, MAX_PIPELINED
from kvbridge_router.request import BodyTooLargeError, Request
from kvbridge_router.response import Response, StreamResponse, json_response
from kvbridge_router.server import Handler, Server
from kvbridge_sim.support import until

HEAD_TIMEOUT = 0.5


async def echo(request: Request) -> Response:
    try:
        body = await asyncio.wait_for(request.read(), 2)
    except BodyTooLargeError as exc:
        return Response(str(exc).encode(), 413, "text/plain")
    except (ConnectionResetError, TimeoutError) as exc:
        return Response(type(exc).__name__.encode(), 400, "text/plain")
    return json_response({"path": request.path, "bytes": len(body), "body": body.decode(errors="replace")})


async def health(_: Request) -> Response:
    return json_response({"ok": True})


async def stream(request: Request) -> StreamResponse:
    answer = StreamResponse(headers={"Content-Type": "text/event-stream"})
    await answer.prepare(request)
    for word in (b"one", b"two", b"three"):
        await answer.write(b"data: " + word + b"\n\n")
    await answer.write_eof()
    return answer


async def broken(_: Request) -> Response:
    raise ValueError("a handler's bug")


@contextlib.asynccontextmanager
async def running(
    routes: dict[tuple[str, str], Handler], header_timeout: float = 5.0, max_body: int = 1 << 20
) -> AsyncIterator[tuple[Server, int]]:
    """A server of ``routes`` on a free port while the block runs: the server and its port."""
    server = Server(routes, header_timeout=header_timeout, keepalive=30.0, max_body_bytes=max_body)
    listener = await asyncio.get_running_loop().create_server(server, "127.0.0.1", 0)
    try:
        yield server, int(listener.sockets[0].getsockname()[1])
    finally:
        listener.close()
        await server.shutdown(1.0)


@contextlib.asynccontextmanager
async def serving(max_body: int = 1 << 20) -> AsyncIterator[int]:
    """The stand-in routes above, served: the port."""
    routes: dict[tuple[str, str], Handler] = {("POST", "/echo"): echo, ("GET", "/health"): health}
    routes["GET", "/stream"] = stream
    routes["GET", "/broken"] = broken
    async with running(routes, HEAD_TIMEOUT, max_body) as (_, port):
        yield port


async def exchange(port: int, data: bytes, *, answers: int = 1, half_close: bool = False) -> list[bytes]:
    """Send ``data``, read ``answers`` whole answers (Content-Length or chunked), and what is left until close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        if half_close:
            writer.write_eof()
        got = []
        for _ in range(answers):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            fields = {k.lower(): v for k, _, v in (line.partition(": ") for line in head.decode().split("\r\n")[1:])}
            if "content-length" in fields:
                body = await reader.readexactly(int(fields["content-length"])) if b"HEAD" not in data[:4] else b""
            elif fields.get("transfer-encoding") == "chunked":
                body = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
            else:
                body = await asyncio.wait_for(reader.read(), 5)
            got.append(head + body)
        return got
    finally:
        writer.close()


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    return await asyncio.wait_for(reader.read(), seconds)


async def test_routes_404_405_head_and_a_handlers_bug() -> None:
    async with serving() as port:
        (found,) = await exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status(found) == 200
        assert found.endswith(b'{"ok": true}')
        (missing,) = await exchange(port, b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status(missing) == 404
        assert b"NOT_FOUND" in missing
        (wrong,) = await exchange(port, b"DELETE /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status(wrong) == 405
        assert b"Allow: POST\r\n" in wrong
        (head,) = await exchange(port, b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status(head) == 200
        assert head.endswith(b"\r\n\r\n")
        assert b"Content-Length: 12\r\n" in head
        (bug,) = await exchange(port, b"GET /broken HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status(bug) == 500
        assert b"INTERNAL_ERROR" in bug
        assert b"a handler's bug" not in bug


async def test_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    body = b'{"a": 1}'
    one = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
    chunked = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    async with serving() as port:
        answers = await exchange(port, one + b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n" + chunked, answers=3)
    assert [status(a) for a in answers] == [200, 200, 200]
    assert answers[0].endswith(b'"body": "{\\"a\\": 1}"}')
    assert answers[1].endswith(b"d\r\ndata: three\n\n\r\n0\r\n\r\n")
    assert answers[2].endswith(b'"bytes": 5, "body": "abcde"}')


async def test_http_1_0_closes_unless_kept_alive_and_streams_until_close() -> None:
    async with serving() as port:
        (plain,) = await exchange(port, b"GET /health HTTP/1.0\r\n\r\n")
        assert b"Connection: close" in plain
        kept = await exchange(port, b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" * 2, answers=2)
        assert all(b"Connection: close" not in a for a in kept)
        (streamed,) = await exchange(port, b"GET /stream HTTP/1.0\r\n\r\n")
        assert b"Transfer-Encoding" not in streamed
        assert streamed.endswith(b"data: three\n\n")


async def test_expect_100_continue_is_answered_when_the_body_is_read() -> None:
    async with serving() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"{}")
            final = await asyncio.wait_for(reader.readuntil(b"}"), 5)
            assert status(final) == 200
        finally:
            writer.close()


async def test_a_body_past_the_limit_is_refused_and_an_unfinished_one_closes_the_connection() -> None:
    async with serving(max_body=100) as port:
        chunk = b"x" * 64
        data = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        data += b"%x\r\n%b\r\n" % (len(chunk), chunk) * 3 + b"0\r\n\r\n"
        refused, after = await exchange(port, data + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", answers=2)
        assert status(refused) == 413
        assert b"exceeds 100 bytes" in refused
        assert status(after) == 200  # the body arrived whole: its framing holds, the connection serves on
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:  # 200 bytes of a body of 100,000: answered, and the rest not read as a request
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"x" * 200)
            answer = await closed_within(reader, 5)
            writer.write(b"x" * 50_000)  # still sending: read and dropped, not a reset of the answer
        finally:
            writer.close()
        assert status(answer) == 413
        assert b"Connection: close" in answer


async def test_an_upgrade_is_answered_in_http_1_1_with_its_body_read_by_its_length() -> None:
    """llhttp stops at the head of a request asking to switch protocols (``curl --http2 -d`` sends one): the server
    reads its body by Content-Length, whole or in pieces, answers in HTTP/1.1 and closes; a chunked one is refused."""
    async with serving(max_body=1000) as port:
        ask = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        (answer,) = await exchange(port, ask + b"HTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n")
        assert status(answer) == 200
        assert b"Connection: close" in answer
        head = b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nContent-Length: %d\r\n\r\n"
        # the body with its head, then what follows it (not read: the connection closes after the answer)
        (whole,) = await exchange(port, head % 7 + b'{"a":1}GET /health HTTP/1.1\r\n\r\n')
        assert status(whole) == 200
        assert json.loads(whole.split(b"\r\n\r\n", 1)[1])["body"] == '{"a":1}'
        assert b"Connection: close" in whole
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:  # the body in pieces after the head
            writer.write(head % 10 + b"abc")
            await asyncio.sleep(0.05)
            writer.write(b"defg")
            await asyncio.sleep(0.05)
            writer.write(b"hij")
            pieces = await closed_within(reader, 5)
        finally:
            writer.close()
        assert json.loads(pieces.split(b"\r\n\r\n", 1)[1])["body"] == "abcdefghij"
        pipelined = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + head % 7 + b'{"a":2}'
        first, second = await exchange(port, pipelined, answers=2)
        assert (status(first), status(second)) == (200, 200)
        assert json.loads(second.split(b"\r\n\r\n", 1)[1])["body"] == '{"a":2}'
        (large,) = await exchange(port, head % 2000 + b"x" * 2000)
        assert status(large) == 413
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:  # the client stops sending halfway: its handler reads the loss, nothing hangs
            writer.write(head % 10 + b"abc")
            writer.write_eof()
            cut = await closed_within(reader, 5)
        finally:
            writer.close()
        assert status(cut) == 400
        assert cut.endswith(b"ConnectionResetError")
        chunked = b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
        (refused,) = await exchange(port, chunked + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        assert status(refused) == 400


async def test_an_upgrades_body_pipelined_or_answered_early_is_read_or_dropped_never_reset() -> None:
    """Behind another request, the upgrade's body still to come is read when its turn comes (reading resumes); a
    body answered early (413) is read and dropped while the answer goes out, so a client still sending gets it."""
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nContent-Length: %d\r\n\r\n"
    async with serving(max_body=1000) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + head % 10 + b"abc")
            await asyncio.sleep(0.1)
            writer.write(b"defghij")
            both = await closed_within(reader, 5)
        finally:
            writer.close()
        assert both.count(b"HTTP/1.1 200 OK") == 2
        assert both.endswith(b'"body": "abcdefghij"}')
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(head % (4 << 20))
            for _ in range(64):  # the whole 4 MiB, as a client that reads only once it has sent
                writer.write(b"x" * 65536)
                await writer.drain()
            answer = await closed_within(reader, 5)
        finally:
            writer.close()
        assert status(answer) == 413


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
async def test_curl_asking_for_http2_with_a_body_is_answered() -> None:
    async with serving() as port:
        curl = await asyncio.create_subprocess_exec(
            *("curl", "-sS", "--http2", "-H", "Content-Type: application/json", "-d", '{"prompt":"hi"}'),
            *("-w", "\n%{http_code}", f"http://127.0.0.1:{port}/echo"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(curl.communicate(), 10)
    body, _, code = out.decode().rpartition("\n")
    assert (code, err) == ("200", b"")
    assert json.loads(body)["body"] == '{"prompt":"hi"}'


@pytest.mark.parametrize(
    ("head", "code"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(MAX_HEADERS + 1)) + b"\r\n", 431),
        (b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
        (b"POST /echo HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    ],
)
async def test_a_malformed_head_is_refused_and_the_connection_closed(
    head: bytes, code: int, caplog: pytest.LogCaptureFixture
) -> None:
    async with serving() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(head)
            answer = await closed_within(reader, 5)
        finally:
            writer.close()
    assert status(answer) == code
    assert b"Connection: close" in answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    assert [r.levelname for r in caplog.records if "malformed" in r.getMessage()] == ["WARNING"]


@pytest.mark.parametrize(
    "flood",
    [
        b"".join(b"X-%d: %b\r\n" % (i, b"a" * 4000) for i in range(200)),  # each field within its bound, too many
        b"X-Endless: " + b"a" * (MAX_HEAD_BYTES + 100_000),  # one field that never ends: cut at the head's bound
    ],
)
async def test_a_flood_of_head_is_cut_at_its_bound_and_answered(flood: bytes) -> None:
    async with serving() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /health HTTP/1.1\r\n" + flood)
            answer = await closed_within(reader, 5)
        finally:
            writer.close()
    assert status(answer) == 431


async def test_a_slow_head_and_an_idle_connection_are_closed_in_time() -> None:
    async with serving() as port:
        for sent in (b"", b"GET /health HTTP/1.1\r\nHo"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                started = time.monotonic()
                writer.write(sent)
                assert await closed_within(reader, HEAD_TIMEOUT + 3) == b""
                assert HEAD_TIMEOUT * 0.9 <= time.monotonic() - started < HEAD_TIMEOUT + 2
            finally:
                writer.close()


async def test_a_client_that_leaves_mid_body_or_half_closes() -> None:
    async with serving() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        writer.write_eof()  # the request's body will never come: the handler reads that the client left
        answer = await closed_within(reader, 5)
        writer.close()
        assert status(answer) == 400
        assert answer.endswith(b"ConnectionResetError")
        # a whole request, then the client's side closed: still answered
        (whole,) = await exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", half_close=True)
        assert status(whole) == 200


async def test_a_stopping_server_finishes_the_request_it_serves() -> None:
    started = asyncio.Event()

    async def slow(request: Request) -> Response:
        started.set()
        await asyncio.sleep(0.3)
        return json_response({"done": True})

    async with running({("GET", "/slow"): slow}) as (server, port):
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        call = asyncio.ensure_future(exchange(port, b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"))
        await asyncio.wait_for(started.wait(), 5)
        await server.shutdown(5.0)
        (answer,) = await call
        assert await closed_within(idle_reader, 2) == b""  # an idle connection is closed at once
        idle_writer.close()
    assert status(answer) == 200
    assert b"Connection: close" in answer


async def test_a_client_that_takes_nothing_is_cut_and_frees_its_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed answer to a client that reads nothing fills the buffers; the handler's own timeout fires while it
    waits for them, and its error event waits again: each wait is bounded, the connection is aborted, the handler
    learns that the client is gone, and the server stops at once."""
    monkeypatch.setattr(connection_module, "SEND_TIMEOUT_SECONDS", 0.5)
    outcome: list[str] = []

    async def flood(request: Request) -> StreamResponse:
        assert request.transport is not None
        request.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        answer = StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            async with asyncio.timeout(0.3):  # as the router's decode timeout
                await answer.prepare(request)
                while True:
                    await answer.write(b"x" * 65536)
        except TimeoutError:
            outcome.append("timeout")
            try:
                await answer.write(b"data: error\n\n")  # as the router's error event mid-stream
            except ConnectionResetError:
                outcome.append("gone")
        return answer

    async with running({("GET", "/flood"): flood}) as (server, port):
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(("127.0.0.1", port))
            client.sendall(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")  # and then reads nothing
            await until(lambda: len(outcome) == 2, 5, "the handler to learn that the client is gone")
            assert outcome == ["timeout", "gone"]
            await until(lambda: not server.connections, 5, "the connection to be cut")
            started = time.monotonic()
            await server.shutdown(30.0)
            assert time.monotonic() - started < 1


async def test_a_handler_that_fails_mid_stream_ends_the_connection_not_the_answer_inside_it() -> None:
    async def failing(request: Request) -> StreamResponse:
        answer = StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        await answer.write(b"data: one\n\n")
        raise KeyError("a bug mid-stream")

    async with running({("GET", "/s"): failing}) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\nGET /s HTTP/1.1\r\nHost: x\r\n\r\n")
        got = await closed_within(reader, 5)
        writer.close()
    assert got.count(b"HTTP/1.1") == 1  # no second head inside the first answer, the next request not served
    assert got.endswith(b"data: one\n\n\r\n")  # without the last chunk: the client sees the stream cut


async def test_trailers_are_not_headers_and_http_1_0_keep_alive_is_said() -> None:
    seen: list[str | None] = []

    async def show(request: Request) -> Response:
        await request.read()
        seen.append(request.headers.get("X-Request-Id"))
        return json_response({})

    async with running({("POST", "/t"): show, ("GET", "/t"): show}) as (_, port):
        chunked = b"POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-Request-Id: forged\r\n\r\n"
        (answer,) = await exchange(port, chunked)
        assert status(answer) == 200
        (kept,) = await exchange(port, b"GET /t HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        assert b"Connection: keep-alive\r\n" in kept
    assert seen == [None, None]


async def test_requests_read_ahead_are_bounded_and_not_served_once_the_client_left() -> None:
    served: list[str] = []

    async def slow(request: Request) -> Response:
        served.append(request.path)
        await asyncio.sleep(0.2)
        return json_response({})

    async with running({("GET", "/slow"): slow}) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" * (MAX_PIPELINED + 50))
        got = await asyncio.wait_for(reader.read(), 30)  # those read ahead answered, then the connection closed
        writer.close()
    assert got.count(b"HTTP/1.1 200") == MAX_PIPELINED + 1


async def test_a_half_closed_client_that_takes_nothing_is_dropped_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer left in the buffer (under the pause mark, so no handler waits for it), then a malformed request and
    the client's side shut: the connection is closed with its bytes unsent, and dropped after the send bound."""
    monkeypatch.setattr(connection_module, "SEND_TIMEOUT_SECONDS", 0.5)

    async def small(request: Request) -> Response:
        assert request.transport is not None
        request.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        return Response(b"x" * 40_000)

    async with running({("GET", "/small"): small}) as (server, port):
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(("127.0.0.1", port))
            client.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
            await until(lambda: all(c.idle for c in server.connections), 5, "the answer to be written")
            client.sendall(b"GARBAGE\r\n\r\n")
            client.shutdown(socket.SHUT_WR)
            await until(lambda: not server.connections, 5, "the connection to be dropped")


async def test_trailers_that_never_end_are_refused() -> None:
    async with serving() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-T: ")
            for _ in range(MAX_HEAD_BYTES // 65536 + 2):
                writer.write(b"a" * 65536)
                await writer.drain()
            answer = await closed_within(reader, 5)
        finally:
            writer.close()
    assert status(answer) in (400, 413)  # the handler's read fails first, or the framing bound answers


async def test_targets_that_are_no_path_and_requests_after_a_close_are_quiet(caplog: pytest.LogCaptureFixture) -> None:
    async with serving() as port:
        (connect,) = await exchange(port, b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        assert status(connect) == 400
        (absolute,) = await exchange(port, b"GET http://router:8000/health HTTP/1.1\r\nHost: router\r\n\r\n")
        assert status(absolute) == 200
        closing = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(closing)
        got = await closed_within(reader, 5)
        writer.close()
        assert got.count(b"HTTP/1.1 200") == 1
        upgrade = b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nContent-Length: 0\r\n\r\n"
        (no_body,) = await exchange(port, upgrade)
        assert status(no_body) == 200
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()] == [
        "refused a malformed HTTP request (400 the request target is not a path or an http URL)"
    ]
