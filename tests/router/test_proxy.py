"""The router's HTTP front against engines that answer as vLLM's KV connectors do (aiohttp servers here; real
vLLM in tests/vllm/test_router.py): what prefill and decode receive, streaming, retries, timeouts, errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_operator.api.router_settings import RouterPolicy
from kvbridge_router.admission import MAX_FIELDS_APART, engine_request_id, parse
from kvbridge_router.encoding import with_field
from kvbridge_router.errors import RouteError
from kvbridge_router.policies.base import BY_LOAD, BY_TURN
from kvbridge_router.pool import Pool
from kvbridge_router.prefill import prefill_bytes, prefill_request
from kvbridge_router.prefixes import prefix_keys
from kvbridge_router.prompts import TokenIds
from kvbridge_router.proxy import Router, RouterConfig, listening
from kvbridge_sim.support import free_port

Obj = dict[str, Any]


REFUSAL = {"code": "INVALID_REQUEST_ID", "message": "the request id contains ':'"}


@dataclass
class FakeEngine:
    """A prefill or decode engine: what it was sent, and how it misbehaves."""

    name: str
    #: ok | 500 | 400 | slow | no-params | die-midstream | die-mid-event | huge | huge-chunked | DRAIN_ANSWERS
    #: (a shutting-down vLLM)
    mode: str = "ok"
    delay: float = 0.0
    received: list[Obj] = field(default_factory=list)
    #: when each request arrived (time.monotonic)
    arrived: list[float] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0
    server: TestServer | None = None
    #: prefill: the prompt tokens its prefix cache served, as vLLM adds them to the transfer parameters (None: not said)
    cached_tokens: int | None = None
    #: set: every request is answered this (status, body, content type): an engine's or a proxy's error
    scripted: tuple[int, bytes, str] | None = None
    #: seconds each of the next requests waits first, one taken per request (a cold engine compiling)
    delays: list[float] = field(default_factory=list)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.arrived.append(time.monotonic())
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.mode == "slow":
                await asyncio.sleep(30)
            await asyncio.sleep(self.delays.pop(0) if self.delays else self.delay)
            if self.scripted is not None:
                status, data, content_type = self.scripted
                return web.Response(body=data, status=status, content_type=content_type)
            if self.mode in ("500", "500-alive"):
                return web.json_response({"error": {"message": "engine dead"}}, status=500)
            if self.mode == "400":
                return web.json_response({"error": {"message": "prompt too long"}}, status=400)
            if self.mode.startswith("huge"):
                return await huge_answer(request, chunked=self.mode == "huge-chunked")
            params = body.get("kv_transfer_params") or {}
            if params.get("do_remote_decode"):
                answer: Obj = {"choices": [{"text": "x", "token_ids": [1]}]}
                if self.mode == "refuse":  # kvbridge's connector would not offer this request
                    answer["kv_transfer_params"] = {"do_remote_prefill": False, "kvbridge_error": REFUSAL}
                elif self.mode != "no-params":
                    answer["kv_transfer_params"] = {"remote_engine_id": self.name, "remote_block_ids": [7]}
                    if self.cached_tokens is not None:
                        answer["kv_transfer_params"]["remote_prefill_cached_tokens"] = self.cached_tokens
                return web.json_response(answer)
            tokens = [len(self.received), 2, 3]
            if self.mode in DRAIN_ANSWERS:
                return await drain_answer(request, self.mode, bool(body.get("stream")))
            if not body.get("stream"):
                return web.json_response(
                    {"choices": [{"token_ids": tokens}], "decode": self.name, "kv_from": params.get("remote_engine_id")}
                )
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for token in tokens:
                event = f"data: {json.dumps({'choices': [{'token_ids': [token]}]})}\n\n".encode()
                if self.mode == "die-mid-event" and token != tokens[0]:  # half an event, then gone
                    await response.write(event[: len(event) // 2])
                    await asyncio.sleep(0.05)
                    raise ConnectionResetError("decode died")
                await response.write(event)
                await asyncio.sleep(0.01)
                if self.mode == "die-midstream":
                    raise ConnectionResetError("decode died")
            await response.write(b"data: [DONE]\n\n")
            return response
        finally:
            self.in_flight -= 1

    async def health(self, _: web.Request) -> web.Response:
        """vLLM's /health: 200 unless the engine is dead (mode "500": it answered 500 and died; "500-alive": it
        failed a request and serves on)."""
        return web.json_response({}, status=503 if self.mode == "500" else 200)

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()

    @property
    def endpoint(self) -> Obj:
        assert self.server is not None
        return {"pod": self.name, "ip": "127.0.0.1", "httpPort": self.server.port, "pairing": "k"}


HUGE_BYTES = 8 << 20


async def huge_answer(request: web.Request, chunked: bool) -> web.StreamResponse:
    """An 8 MiB JSON answer, its length announced or chunked; it stops when the router hangs up."""
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    if chunked:
        response.enable_chunked_encoding()
    else:
        response.content_length = HUGE_BYTES
    await response.prepare(request)
    with contextlib.suppress(ConnectionError):
        await response.write(b'{"x": "')
        for _ in range(HUGE_BYTES // 65536 - 1):
            await response.write(b"x" * 65536)
        await response.write(b"x" * (65536 - 9) + b'"}')
        await response.write_eof()
    return response


#: what vLLM 0.32 answers while it shuts down (SIGTERM, --shutdown-timeout): its engine core rejects the request as
#: aborted — HTTP 200 without tokens — and once the core has exited a stream carries an error event
DRAIN_ANSWERS = ("aborted", "stream-role-then-abort", "stream-error-event", "stream-done-without-tokens")


async def drain_answer(request: web.Request, mode: str, stream: bool) -> web.StreamResponse:
    if not stream:
        return web.json_response({"choices": [{"index": 0, "text": "", "token_ids": None, "finish_reason": "abort"}]})
    answers: dict[str, list[dict[str, Any]]] = {
        "aborted": [{"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}],
        "stream-role-then-abort": [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]},
        ],
        "stream-error-event": [{"error": {"message": "EngineCore encountered an issue.", "code": 500}}],
        "stream-done-without-tokens": [{"choices": [{"index": 0, "text": "", "finish_reason": None}]}],
    }
    events = answers[mode]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in events:
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


@dataclass
class Rig:
    router: Router
    url: str
    session: aiohttp.ClientSession
    prefill: list[FakeEngine]
    decode: list[FakeEngine]
    #: the last answer's headers (post)
    headers: dict[str, str] = field(default_factory=dict)

    def route(self, prefill: list[Obj] | None = None, decode: list[Obj] | None = None) -> None:
        self.router.set_pool(
            Pool.from_status(
                {
                    "prefill": {"endpoints": prefill if prefill is not None else [e.endpoint for e in self.prefill]},
                    "decode": {"endpoints": decode if decode is not None else [e.endpoint for e in self.decode]},
                }
            )
        )

    async def post(self, body: Obj, path: str = "/v1/completions") -> tuple[int, Obj]:
        async with self.session.post(self.url + path, json=body) as r:
            text = await r.text()
            self.headers = dict(r.headers)
            return r.status, json.loads(text) if not body.get("stream") else {"events": text}


def closed_port_endpoint(name: str) -> Obj:
    """An endpoint nothing listens on: a killed pod whose address the status still lists."""
    return {"pod": name, "ip": "127.0.0.1", "httpPort": free_port(), "pairing": "k"}


@contextlib.asynccontextmanager
async def running_rig(config: RouterConfig, prefill: list[str], decode: list[str]) -> AsyncIterator[Rig]:
    """A router set as ``config`` in front of fake engines of these names, all started and stopped here."""
    engines = [FakeEngine(name) for name in (*prefill, *decode)]
    for engine in engines:
        await engine.start()
    router = Router(config)
    async with listening(router) as port, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        found = Rig(router, f"http://127.0.0.1:{port}", session, engines[: len(prefill)], engines[len(prefill) :])
        found.route()
        yield found
    for engine in engines:
        assert engine.server is not None
        await engine.server.close()


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    # no longer bound for a pod's first call (cold_timeout): these tests time calls out from the first
    config = RouterConfig(prefill_timeout=1.0, decode_timeout=5.0, decode_idle_timeout=1.0, cold_timeout=1.0)
    async with running_rig(config, ["prefill-0", "prefill-1"], ["decode-0"]) as found:
        yield found


async def test_a_prefill_pod_that_evicted_what_it_was_sent_is_forgotten_that_far(rig: Rig) -> None:
    """vLLM says in prefill's transfer parameters how many prompt tokens the pod's prefix cache served. A pod that
    held less of a prompt than the router had sent it evicted it, and (least recently used first) what it was sent
    before: the router forgets those at once, and counts it; the prompt itself, just computed again, stays."""
    rig.route(prefill=[rig.prefill[0].endpoint])  # one prefill pod: every request goes to it
    pod, index, block = rig.prefill[0], rig.router.balancer.prefixes, rig.router.config.block_tokens
    older = {"model": "m", "prompt": list(range(1000, 1000 + 4 * block)), "max_tokens": 2}
    prompt = {"model": "m", "prompt": list(range(4 * block)), "max_tokens": 2}
    older_keys, keys = prefix_keys(older, block), prefix_keys(prompt, block)

    def evictions() -> float | None:
        return rig.router.metrics.registry.get_sample_value("kvbridge_router_prefix_evictions_total")

    for body in (older, prompt):
        assert (await rig.post(body))[0] == 200
    pod.cached_tokens = 4 * block - 1  # all it could (vLLM computes the last token): held all of it
    assert (await rig.post(prompt))[0] == 200
    assert (index.matched(pod.name, older_keys), evictions()) == (4, 0)
    pod.cached_tokens = block  # one chunk of four: the second was evicted
    assert (await rig.post(prompt))[0] == 200
    assert (index.matched(pod.name, older_keys), index.matched(pod.name, keys), evictions()) == (0, 4, 1)
    assert pod.name not in index.holders(older_keys[0])  # no longer a holder of its first key
    pod.cached_tokens = -1  # not a count: the view stays as it is
    assert (await rig.post(older))[0] == 200
    assert (await rig.post(older))[0] == 200
    assert (index.matched(pod.name, keys), evictions()) == (4, 1)
    assert not rig.router.balancer._prefilling  # every prefill that was chosen has ended


def test_prefill_gets_one_token_no_stream_and_the_remote_decode_flag() -> None:
    body = {
        "model": "m",
        "prompt": [1, 2],
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"a": 1},
        "max_completion_tokens": 50,
        "temperature": 0,
    }
    sent = prefill_request(body)
    assert sent == {
        "model": "m",
        "prompt": [1, 2],
        "max_tokens": 1,
        "stream": False,
        "max_completion_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    assert body["max_tokens"] == 50  # the client's request is not changed
    parsed, plain = parse(json.dumps(body, indent=2).encode())
    assert (decoded(parsed), plain) == (body, True)
    assert isinstance(parsed["prompt"], TokenIds)  # kept as the client wrote it
    assert json.loads(prefill_bytes(parsed, plain)) == json.loads(prefill_bytes(body, plain)) == sent


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
PREFILL_NAMES = st.sampled_from(
    ["prompt", "stream", "max_tokens", "max_completion_tokens", "stream_options", "min_tokens"]
)


@settings(max_examples=300)
@given(
    st.dictionaries(PREFILL_NAMES | st.text(max_size=8), JSON_VALUES, max_size=8),
    st.sampled_from([(None, None), (2, None), (None, (" , ", " : ")), (1, (",", ": "))]),
    st.booleans(),
)
def test_a_body_parses_as_json_loads_parses_it_and_prefill_gets_the_same_request(
    body: dict[str, Any], layout: tuple[int | None, tuple[str, str] | None], ascii_only: bool
) -> None:
    """Whichever decoder takes it (msgspec's for plain JSON, the standard library's for the rest: infinities, lone
    surrogates), a body is what json.loads makes of it, and prefill's request, sent and parsed, is the request
    prefill_request builds."""
    indent, separators = layout
    raw = json.dumps(body, indent=indent, separators=separators, ensure_ascii=ascii_only).encode(
        "utf-8", "surrogatepass"
    )
    parsed, plain = parse(raw)
    assert decoded(parsed) == json.loads(raw) == body
    assert json.loads(prefill_bytes(parsed, plain)) == decoded(prefill_request(parsed))


def decoded(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with a prompt admission kept as token ids (prompts.TokenIds) made into its list of ints."""
    prompt = body.get("prompt")
    return {**body, "prompt": prompt.ids()} if isinstance(prompt, TokenIds) else body


@pytest.mark.parametrize(
    ("raw", "plain"),
    [
        (b'{"a": 1, "a": 2}', True),  # a repeated name: the last, as json.loads keeps it
        (b'{"a": 1e400}', False),  # out of a float's range: Infinity, as json.loads makes it
        (b'{"a": NaN}', False),
        (b'{"a": "\\ud800"}', False),  # a lone surrogate, escaped
        (b'\xef\xbb\xbf{"a": 1}', False),  # a BOM
        ('{"a": 1}'.encode("utf-16"), False),
    ],
)
def test_a_body_msgspec_refuses_is_what_json_loads_makes_of_it_and_is_sent_back_as_it_was(
    raw: bytes, plain: bool
) -> None:
    """msgspec writes a NaN back as null and cannot write a lone surrogate: such a body is the standard library's to
    parse and encode, and prefill gets the client's values."""
    parsed, was_plain = parse(raw)
    assert (parsed, was_plain) == (json.loads(raw), plain)
    sent = json.loads(prefill_bytes(parsed, was_plain))
    assert repr(sent["a"]) == repr(parsed["a"])


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": 1,}',
        b'{"a" 1}',
        b'{"a": 1} {}',
        b'{"a": [1, 2}',
        b"",
        b'{"a": 1',
        b'{"a": "\xff"}',
        b'{"prompt": "\xff", "prompt": [1, 2, 3]}',  # a value given twice: the first is checked too
        b'{"x": ["\xc0\x80"], "x": 1, "prompt": "hello"}',
    ],
)
def test_a_body_that_is_not_json_is_refused_as_json_loads_refuses_it(raw: bytes) -> None:
    with pytest.raises(RouteError) as refused:
        parse(raw)
    assert refused.value.code == "INVALID_JSON"
    with pytest.raises((json.JSONDecodeError, UnicodeDecodeError)):
        json.loads(raw)


def test_a_body_of_many_fields_is_decoded_whole_and_the_same() -> None:
    body = {f"f{index}": [index, {"x": index}] for index in range(MAX_FIELDS_APART)}
    for fields in (body, {**body, "prompt": [1, 2, 3]}):
        raw = json.dumps(fields).encode()
        parsed, plain = parse(raw)
        assert plain
        assert decoded(parsed) == json.loads(raw)
    assert parsed["prompt"] == [1, 2, 3]  # decoded with the rest, past MAX_FIELDS_APART fields


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(RouteError) as refused:
        parse(b"[1, 2]")
    assert refused.value.code == "INVALID_REQUEST"


def test_a_body_nesting_deeper_than_the_limit_is_refused_whichever_decoder_takes_it() -> None:
    deep = b'{"a": ' + b"[" * 65 + b"]" * 65 + b"}"
    deepest = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # past msgspec's own bound (a RecursionError)
    for raw in (deep, deep.replace(b"[]", b"[NaN]"), deepest):
        with pytest.raises(RouteError) as refused:
            parse(raw)
        assert refused.value.code == "INVALID_JSON"
    assert parse(b'{"a": ' + b"[" * 63 + b"]" * 63 + b"}")[1]


async def test_decode_gets_the_clients_request_and_prefills_parameters(rig: Rig) -> None:
    status, answer = await rig.post({"model": "m", "prompt": [1, 2, 3], "max_tokens": 3})
    assert status == 200
    sent = rig.decode[0].received[0]
    assert sent["max_tokens"] == 3
    assert sent["prompt"] == [1, 2, 3]
    assert sent["kv_transfer_params"] == {"remote_engine_id": answer["kv_from"], "remote_block_ids": [7]}
    status, _ = await rig.post({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions")
    assert status == 200
    assert rig.decode[0].received[-1]["messages"][0]["content"] == "hi"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt":[1,2],"max_tokens":3}',
        b' \r\n{ "prompt" : "hi",\n "max_tokens": 3 }\n\t',
        b'{"a":"}"}',
        '{"prompt":"caf\u00e9 \\ud800"}'.encode(),
    ],
)
def test_decode_gets_the_clients_bytes_with_the_transfer_parameters_appended(raw: bytes) -> None:
    params = {"remote_engine_id": "e", "remote_block_ids": [1, 2]}
    pieces = with_field(raw, "kv_transfer_params", params)
    assert pieces is not None
    assert isinstance(pieces[0], memoryview)
    assert pieces[0].obj is raw  # the client's bytes, not a copy
    out = b"".join(pieces)
    assert out.startswith(raw.rstrip()[:-1])  # the client's bytes unchanged, not re-encoded
    assert json.loads(out) == {**json.loads(raw), "kv_transfer_params": params}
    assert json.loads(b"".join(with_field(b"{ }", "k", 1) or [b""])) == {"k": 1}


def test_bodies_that_are_not_utf8_objects_are_encoded_again_instead() -> None:
    for raw in ('{"prompt": "x"}'.encode("utf-16"), b"\xef\xbb\xbf{}", b"[1]", b"", b"{"):
        assert with_field(raw, "k", 1) is None


async def test_streams_are_passed_through_chunk_by_chunk(rig: Rig) -> None:
    async with rig.session.post(rig.url + "/v1/completions", json={"prompt": [1], "stream": True}) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        text = (await r.read()).decode()
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["token_ids"][0] for e in events[:-1]] == [1, 2, 3]
    assert rig.decode[0].received[0]["stream"] is True


async def test_requests_spread_over_prefill_pods_by_load(rig: Rig) -> None:
    for engine in rig.prefill:
        engine.delay = 0.3
    results = await asyncio.gather(*(rig.post({"prompt": [i], "max_tokens": 1}) for i in range(6)))
    assert all(status == 200 for status, _ in results)
    assert [len(e.received) for e in rig.prefill] == [3, 3]
    assert max(e.peak for e in rig.prefill) <= 3


async def test_a_killed_prefill_pod_is_retried_on_another(rig: Rig) -> None:
    rig.route(prefill=[closed_port_endpoint("prefill-dead"), rig.prefill[1].endpoint])
    for i in range(4):
        status, answer = await rig.post({"prompt": [i], "max_tokens": 2})
        assert status == 200
        assert answer["kv_from"] == "prefill-1"
    metrics = await (await rig.session.get(rig.url + "/metrics")).text()
    assert 'kvbridge_router_prefill_retries_total{pod="prefill-dead"}' in metrics


async def test_a_failing_or_slow_prefill_is_retried_and_the_wait_is_bounded(rig: Rig) -> None:
    rig.prefill[0].mode = "500"
    rig.prefill[1].mode = "slow"
    started = time.monotonic()
    status, answer = await rig.post({"prompt": [1]})
    assert time.monotonic() - started < 5  # one timeout (1 s) and one quick failure, never a hang
    assert status in (502, 504)
    assert answer["error"]["code"] in ("PREFILL_FAILED", "PREFILL_TIMEOUT")
    assert "2 prefill pod(s) tried" in answer["error"]["message"]
    assert sorted(rig.headers["X-KVBridge-Pods"].split(",")) == ["prefill-0", "prefill-1"]  # named there, not above
    rig.prefill[1].mode = "ok"
    status, _ = await rig.post({"prompt": [1]})
    assert status == 200


async def test_a_500_from_a_healthy_prefill_is_the_requests_and_not_retried(rig: Rig) -> None:
    """Issue 34: a request that fails an engine must not be sent on to fail (or kill) the next one."""
    for engine in rig.prefill:
        engine.mode = "500-alive"
    status, answer = await rig.post({"prompt": [1]})
    assert (status, answer["error"]["code"]) == (502, "PREFILL_FAILED")
    assert "the engine is healthy" in answer["error"]["message"]
    assert sum(len(e.received) for e in rig.prefill) == 1
    assert rig.decode[0].received == []


async def test_a_request_that_leaves_engines_dead_is_sent_to_one_more_never_a_second(rig: Rig) -> None:
    third = FakeEngine("prefill-2", mode="500")
    await third.start()
    rig.prefill.append(third)
    rig.route()
    for engine in rig.prefill:
        engine.mode = "500"  # each answers 500 and is unhealthy after: maybe killed by the request
    status, answer = await rig.post({"prompt": [1]})
    assert (status, answer["error"]["code"]) == (502, "PREFILL_FAILED")
    assert sum(len(e.received) for e in rig.prefill) == 2  # the first and one more; the third is spared
    metrics = await (await rig.session.get(rig.url + "/metrics")).text()
    assert metrics.count('kvbridge_router_engines_lost_total{pod="prefill-') == 2


async def test_a_500_from_a_pod_that_left_the_pool_is_retried_elsewhere(rig: Rig) -> None:
    """A pod being drained (it left the status before its engine was told to stop) may fail what it still has."""
    leaving, staying = rig.prefill
    leaving.mode, leaving.delay = "500-alive", 0.3
    rig.route(prefill=[leaving.endpoint])
    request = asyncio.ensure_future(rig.post({"prompt": [1]}))
    await asyncio.sleep(0.1)
    rig.route(prefill=[staying.endpoint])
    status, answer = await request
    assert status == 200, answer
    assert answer["kv_from"] == "prefill-1"


async def test_a_healthy_decode_that_failed_its_kv_load_is_retried_on_another_pair(rig: Rig) -> None:
    """vLLM answers 500 for a KV load that failed (lease ended, digest mismatch, prefill restarted): prefill already
    took the request, so the pair failed, not the request."""
    second = await two_decodes(rig)
    rig.decode[0].mode = "500-alive"
    status, answer = await rig.post({"prompt": [5]})
    assert status == 200, answer
    assert answer["decode"] == "decode-1"
    assert len(second.received) == 1


async def test_a_prefill_that_offers_nothing_for_a_request_is_answered_not_retried(rig: Rig) -> None:
    for engine in rig.prefill:
        engine.mode = "refuse"
    status, answer = await rig.post({"prompt": [1]})
    assert (status, answer["error"]["code"]) == (502, "PREFILL_REFUSED")
    assert "INVALID_REQUEST_ID" in answer["error"]["message"]
    assert sum(len(e.received) for e in rig.prefill) == 1
    assert rig.decode[0].received == []


async def test_a_prefill_without_transfer_parameters_is_not_sent_to_decode(rig: Rig) -> None:
    for engine in rig.prefill:
        engine.mode = "no-params"
    status, answer = await rig.post({"prompt": [1]})
    assert status == 502
    assert answer["error"]["code"] == "PREFILL_NO_TRANSFER_PARAMS"
    assert rig.decode[0].received == []


async def test_a_request_prefill_refuses_is_the_clients_error_and_not_retried(rig: Rig) -> None:
    rig.prefill[0].mode = rig.prefill[1].mode = "400"
    status, answer = await rig.post({"prompt": [1]})
    assert status == 400
    assert answer["error"]["message"] == "prompt too long"  # the engine's own (tests/router/test_errors.py)
    assert rig.headers["X-KVBridge-Error-Code"] == "PREFILL_REFUSED"
    assert sum(len(e.received) for e in rig.prefill) == 1


async def test_decode_failures_are_clear_errors(rig: Rig) -> None:
    rig.route(decode=[closed_port_endpoint("decode-dead")])
    status, answer = await rig.post({"prompt": [1]})
    assert status == 502
    assert answer["error"]["code"] == "DECODE_UNAVAILABLE"
    assert "decode-dead" not in answer["error"]["message"]
    assert rig.headers["X-KVBridge-Pods"] == "decode-dead"
    rig.route()
    rig.decode[0].mode = "500"
    status, answer = await rig.post({"prompt": [1]})
    assert status == 502  # tried on every pair there is (one here), then a clear error
    assert answer["error"]["code"] == "DECODE_FAILED"
    assert len(rig.decode[0].received) == 1  # one decode pod: nothing else to try
    rig.decode[0].mode = "400"
    status, answer = await rig.post({"prompt": [1]})
    assert status == 400  # the client's fault: passed back, not retried


async def test_a_decode_that_dies_midstream_ends_the_stream_with_an_error_event(rig: Rig) -> None:
    rig.decode[0].mode = "die-midstream"
    async with rig.session.post(rig.url + "/v1/completions", json={"prompt": [1], "stream": True}) as r:
        assert r.status == 200
        text = (await r.read()).decode()
    assert '"code": "DECODE_UNAVAILABLE"' in text.split("\n\n")[-2]


async def test_a_decode_that_dies_mid_event_ends_the_stream_with_whole_events(rig: Rig) -> None:
    """Half an event is never passed on: the client reads the whole events, then the error event as one."""
    rig.decode[0].mode = "die-mid-event"
    async with rig.session.post(rig.url + "/v1/completions", json={"prompt": [1, 2], "stream": True}) as r:
        assert r.status == 200
        text = (await r.read()).decode()
    assert text.endswith("\n\n")
    events = [json.loads(event.removeprefix("data: ")) for event in text.split("\n\n") if event]
    assert len(events[0]["choices"][0]["token_ids"]) == 1  # the first token, whole
    assert events[-1]["error"]["code"] == "DECODE_UNAVAILABLE"
    assert len(events) == 2


async def test_no_pair_is_503_with_the_reason(rig: Rig) -> None:
    rig.route(decode=[])
    status, answer = await rig.post({"prompt": [1]})
    assert status == 503
    assert answer["error"]["code"] == "NO_ROUTE"
    assert "no ready decode endpoint" in answer["error"]["message"]
    async with rig.session.get(rig.url + "/health") as r:
        assert r.status == 503
        assert "decode" in (await r.json())["problem"]


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"{not json", "INVALID_JSON"),
        (b"[1, 2]", "INVALID_REQUEST"),
        (json.dumps({"prompt": [1], "kv_transfer_params": {"remote_host": "evil"}}).encode(), "INVALID_REQUEST"),
        (b"{" + b" " * (17 << 20) + b"}", "TOO_LARGE"),
    ],
)
async def test_bad_requests_are_refused_before_any_engine_sees_them(rig: Rig, data: bytes, code: str) -> None:
    async with rig.session.post(
        rig.url + "/v1/completions", data=data, headers={"Content-Type": "application/json"}
    ) as r:
        answer = await r.json()
    assert answer["error"]["code"] == code
    assert r.status == (413 if code == "TOO_LARGE" else 400)
    assert all(e.received == [] for e in rig.prefill + rig.decode)


async def test_health_models_and_metrics(rig: Rig) -> None:
    async with rig.session.get(rig.url + "/health") as r:
        assert r.status == 200
        assert (await r.json())["prefill"] == ["prefill-0", "prefill-1"]
    async with rig.session.get(rig.url + "/v1/models") as r:
        assert (await r.json())["data"][0]["id"] == "tiny"
    await rig.post({"prompt": [1], "stream": True})
    await rig.post({"prompt": [1]})
    metrics = await (await rig.session.get(rig.url + "/metrics")).text()
    for line in (
        'kvbridge_router_requests_total{outcome="ok",route="completions"} 2.0',
        "kvbridge_router_ttft_seconds_count 2.0",
        'kvbridge_router_endpoints{role="prefill"} 2.0',
        'kvbridge_router_outstanding_requests{pod="decode-0",role="decode"} 0.0',
        "kvbridge_router_overhead_seconds_count 2.0",
    ):
        assert line in metrics


async def test_a_pod_that_left_the_pool_leaves_the_metrics_once_nothing_is_in_flight(rig: Rig) -> None:
    """Months of rollouts must not grow the scrape: a departed pod's series go, not while a call to it runs."""
    for i in range(4):
        assert (await rig.post({"prompt": [i]}))[0] == 200
    series = 'kvbridge_router_pod_requests_total{pod="prefill-1",role="prefill"}'
    assert series in (await (await rig.session.get(rig.url + "/metrics")).text())
    rig.router.balancer.started("prefill-1")  # a call to it still in flight
    rig.route(prefill=[rig.prefill[0].endpoint])
    assert series in (await (await rig.session.get(rig.url + "/metrics")).text())
    rig.router.balancer.finished("prefill-1")
    rig.route(prefill=[rig.prefill[0].endpoint])
    metrics = await (await rig.session.get(rig.url + "/metrics")).text()
    assert 'pod="prefill-1"' not in metrics
    assert 'kvbridge_router_pod_requests_total{pod="prefill-0",role="prefill"}' in metrics
    assert (await rig.post({"prompt": [9]}))[0] == 200  # and the pods still in the pool are counted as before
    assert 'kvbridge_router_outstanding_requests{pod="prefill-0",role="prefill"} 0.0' in (
        await (await rig.session.get(rig.url + "/metrics")).text()
    )


async def test_a_decode_pod_that_cannot_be_reached_is_replaced_by_another(rig: Rig) -> None:
    """Connection refused: decode never got the request, so no block was read; another paired decode pod may."""
    rig.route(decode=[closed_port_endpoint("decode-dead"), rig.decode[0].endpoint])
    for i in range(3):
        status, answer = await rig.post({"prompt": [i]})
        assert status == 200
        assert answer["decode"] == "decode-0"


async def test_a_client_that_leaves_midstream_releases_the_decode_call(rig: Rig) -> None:
    for engine in rig.decode:
        engine.delay = 0.0
    async with rig.session.post(rig.url + "/v1/completions", json={"prompt": [1], "stream": True}) as r:
        await r.content.readany()  # the first chunk, then hang up
    await asyncio.sleep(0.3)
    assert rig.router.balancer.outstanding == {}
    status, _ = await rig.post({"prompt": [2]})  # and the router keeps serving
    assert status == 200


async def test_the_clients_authorization_and_one_request_id_reach_both_engines(rig: Rig) -> None:
    """vLLM started with --api-key checks Authorization on prefill and decode alike."""
    headers = {"Authorization": "Bearer sk-test", "Cookie": "not-forwarded"}
    async with rig.session.post(rig.url + "/v1/completions", json={"prompt": [1]}, headers=headers) as r:
        assert r.status == 200
    prefill = next(e for e in rig.prefill if e.headers).headers[0]
    decode = rig.decode[0].headers[0]
    for sent in (prefill, decode):
        assert sent["authorization"] == "Bearer sk-test"
        assert "cookie" not in sent
    assert prefill["x-request-id"] == decode["x-request-id"]
    assert prefill["x-request-id"].startswith("kvb-")


@pytest.mark.parametrize(
    "client_id", ["a:b", "x" * 300, "with space", "semi;colon", "\u00e9", "../../etc", "%00", "-" * 65]
)
async def test_a_hostile_client_request_id_never_reaches_the_engines(rig: Rig, client_id: str) -> None:
    """vLLM derives its request ids from X-Request-Id; kvbridge's connector cannot carry ':' or 256+ characters (it
    used to raise in vLLM's engine core): the router passes on only ids it knows are safe, and never refuses."""
    headers = {"X-Request-Id": client_id.encode("utf-8").decode("latin-1")}
    async with rig.session.post(rig.url + "/v1/completions", json={"prompt": [1]}, headers=headers) as r:
        assert r.status == 200
    sent = next(e for e in rig.prefill if e.headers).headers[0]["x-request-id"]
    assert sent.startswith("kvb-")
    assert re.fullmatch(r"[A-Za-z0-9._-]{1,100}", sent)
    assert rig.decode[0].headers[0]["x-request-id"] == sent


def test_engine_request_ids_are_the_clients_or_the_routers_with_a_random_suffix() -> None:
    """One draw of 16 random bytes a request: 12 hex digits of suffix, and 20 more for an id of the router's own."""
    own = [engine_request_id(None) for _ in range(1000)]
    assert all(re.fullmatch(r"kvb-[0-9a-f]{32}", i) for i in own)
    assert len(set(own)) == len(own)
    kept = [engine_request_id("req_1.a-b") for _ in range(1000)]
    assert all(re.fullmatch(r"req_1\.a-b-[0-9a-f]{12}", i) for i in kept)
    assert len(set(kept)) == len(kept)
    assert re.fullmatch(r"kvb-[0-9a-f]{32}", engine_request_id("a:b"))


async def test_a_clients_safe_request_id_is_kept_and_two_clients_ids_never_collide(rig: Rig) -> None:
    for _ in range(2):
        headers = {"X-Request-Id": "trace-42.a_b"}
        async with rig.session.post(rig.url + "/v1/completions", json={"prompt": [1]}, headers=headers) as r:
            assert r.status == 200
    ids = [h["x-request-id"] for e in rig.prefill for h in e.headers]
    assert len(ids) == 2
    assert all(i.startswith("trace-42.a_b-") for i in ids)
    assert ids[0] != ids[1]


async def two_decodes(rig: Rig) -> FakeEngine:
    second = FakeEngine("decode-1")
    await second.start()
    rig.decode.append(second)
    rig.route()
    return second


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_that_fails_before_the_first_byte_is_retried_on_another_pair_with_a_new_prefill(
    rig: Rig, stream: bool
) -> None:
    """A draining vLLM answers 500 (or its connection resets) after it had the request: it may have read the
    KV and prefill freed it, so the request is prefilled again and decoded on another pair, invisibly."""
    second = await two_decodes(rig)
    rig.decode[0].mode = "500"
    for i in range(4):
        status, answer = await rig.post({"prompt": [i], "stream": stream})
        assert status == 200, answer
        if not stream:
            assert answer["decode"] == "decode-1"
    prefills = sum(len(e.received) for e in rig.prefill)
    failed = len(rig.decode[0].received)
    assert prefills == 4 + failed  # each request that met the failing pod was prefilled once more
    ids = [h["x-request-id"] for e in rig.prefill for h in e.headers]
    assert len(set(ids)) == len(ids)  # the retry's prefill has its own id (the first pod may still hold the first)
    assert sum(i.endswith("-retry1") for i in ids) == failed
    assert len(second.received) == 4
    metrics = await (await rig.session.get(rig.url + "/metrics")).text()
    assert f'kvbridge_router_decode_retries_total{{pod="decode-0"}} {float(failed)}' in metrics


async def test_a_decode_that_hangs_before_the_first_byte_is_cut_at_its_bound_and_retried(rig: Rig) -> None:
    second = await two_decodes(rig)
    rig.decode[0].mode = "slow"  # answers nothing for 30 s: a pod stuck in its shutdown
    started = asyncio.get_running_loop().time()
    for i in range(2):
        async with rig.session.post(rig.url + "/v1/completions", json={"prompt": [i], "stream": True}) as r:
            assert r.status == 200
            assert "[DONE]" in (await r.text())
    assert asyncio.get_running_loop().time() - started < 10  # the 1 s chunk bound, not the 30 s hang
    assert len(second.received) == 2


async def test_the_whole_request_is_bounded_across_retries(rig: Rig) -> None:
    rig.router.config = RouterConfig(
        prefill_timeout=1.0, decode_timeout=5.0, decode_idle_timeout=3.0, request_timeout=1.5
    )
    await two_decodes(rig)
    for engine in rig.decode:
        engine.mode = "slow"
    started = asyncio.get_running_loop().time()
    async with rig.session.post(rig.url + "/v1/completions", json={"prompt": [1], "stream": True}) as r:
        answer = await r.json()
    assert answer["error"]["code"] == "DECODE_TIMEOUT"
    assert asyncio.get_running_loop().time() - started < 3  # request_timeout, not 2 x the chunk bound


@pytest.mark.parametrize("mode", DRAIN_ANSWERS)
@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_a_draining_engine_aborted_is_retried_never_passed_on(
    rig: Rig, mode: str, stream: bool
) -> None:
    """Found under load on real vLLM (a decode pod sent SIGTERM): 4 of 2,800 requests came back HTTP 200 with no
    tokens or as an error event, because the router passed on a stream's first bytes before any token. Each
    is now a failure before the first token, retried on another pair; the client gets the model's answer."""
    second = await two_decodes(rig)
    rig.decode[0].mode = mode
    for i in range(3):
        status, answer = await rig.post({"prompt": [i], "stream": stream})
        assert status == 200, answer
        if stream:
            events = answer["events"]
            assert "abort" not in events, events
            assert "error" not in events, events
            assert events.count("token_ids") == 3
            assert events.rstrip().endswith("data: [DONE]")
        else:
            assert answer["decode"] == "decode-1"
    assert len(second.received) == 3
    metrics = await (await rig.session.get(rig.url + "/metrics")).text()
    assert 'kvbridge_router_decode_retries_total{pod="decode-0"}' in metrics


def test_a_stream_is_held_back_only_until_its_first_token() -> None:
    """Chat's first event carries only the role: held; the first content releases everything held, in order."""
    from kvbridge_router.answers import Start, StreamStart

    start = StreamStart()
    assert start.feed(b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\nda') is Start.PENDING
    assert start.feed(b'ta: {"choices": [{"delta": {"content": "Hi"}}]}\n\n') is Start.STARTED
    assert start.held.count(b"data:") == 2
    assert StreamStart().feed(b'data: {"choices": [{"text": "", "finish_reason": "stop"}]}\n\n') is Start.STARTED
    assert StreamStart().end() is Start.FAILED  # nothing at all
    assert StreamStart().feed(b"data: not json\n\n") is Start.STARTED  # not vLLM's framing: passed on


@pytest.mark.parametrize("chunked", [False, True])
async def test_an_answer_over_the_size_bound_is_refused_unread_and_not_retried(rig: Rig, chunked: bool) -> None:
    """A 128 MiB prefill answer was buffered whole (router RSS 40 -> 687 MB); now refused past the bound."""
    rig.router.config = RouterConfig(
        prefill_timeout=1.0, decode_timeout=5.0, decode_idle_timeout=1.0, max_answer_bytes=1 << 20
    )
    huge = "huge-chunked" if chunked else "huge"
    for engine in rig.prefill:
        engine.mode = huge
    status, answer = await rig.post({"prompt": [1]})
    assert (status, answer["error"]["code"]) == (502, "PREFILL_ANSWER_TOO_LARGE"), answer
    assert str(1 << 20) in answer["error"]["message"]
    assert sum(len(e.received) for e in rig.prefill) == 1  # the request's answer, not the pod's fault
    assert rig.decode[0].received == []
    for engine in rig.prefill:
        engine.mode = "ok"
    rig.decode[0].mode = huge
    status, answer = await rig.post({"prompt": [1]})
    assert (status, answer["error"]["code"]) == (502, "DECODE_ANSWER_TOO_LARGE"), answer
    assert len(rig.decode[0].received) == 1
    assert rig.router.balancer.outstanding == {}
    rig.decode[0].mode = "ok"
    status, _ = await rig.post({"prompt": [1]})
    assert status == 200


def test_holding_a_stream_back_judges_each_event_once() -> None:
    """Each feed re-split and re-judged everything held: quadratic, about 2 s of the event loop for 1,000 empty
    events. Now each event is judged once, when its end arrives, wherever the chunks cut it."""
    from kvbridge_router.answers import Start, StreamStart

    judged: list[bytes] = []

    class Counted(StreamStart):
        def _judge(self, event: bytes) -> Start:
            judged.append(event)
            return super()._judge(event)

    empty = b'data: {"choices": [{"index": 0, "text": ""}]}\n\n'
    start = Counted()
    for _ in range(1000):
        assert start.feed(empty) is Start.PENDING
    assert len(judged) == 1000
    token = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
    for cut in (token[:10], token[10:-1]):  # the event's end, "\n\n", cut between two chunks
        assert start.feed(cut) is Start.PENDING
    assert start.feed(b"\n") is Start.STARTED
    assert len(judged) == 1001
    assert start.held == empty * 1000 + token  # all of it, in order, as it came
    tail = Counted()
    assert tail.feed(empty + token[:-2]) is Start.PENDING  # the last event without its end: judged at the end
    assert tail.end() is Start.STARTED
    assert tail.held == empty + token[:-2]
    assert Counted().feed(b"data: [DONE]\n\n") is Start.FAILED


async def test_the_whole_request_bounds_prefill_and_its_retries(rig: Rig) -> None:
    """Each prefill call had prefill_timeout whatever the time left: three slow pods kept a client 3 s past a 1.3 s
    request_timeout. Now each call gets at most the time left, and none is tried when none is left."""
    third = FakeEngine("prefill-2")
    await third.start()
    rig.prefill.append(third)
    rig.route()
    rig.router.config = RouterConfig(
        prefill_timeout=1.0, decode_timeout=5.0, decode_idle_timeout=1.0, request_timeout=1.3, cold_timeout=1.0
    )
    for engine in rig.prefill:
        engine.mode = "slow"
    started = asyncio.get_running_loop().time()
    status, answer = await rig.post({"prompt": [1]})
    took = asyncio.get_running_loop().time() - started
    assert (status, answer["error"]["code"]) == (504, "REQUEST_TIMEOUT"), answer
    assert "1.3 s" in answer["error"]["message"]
    assert "2 prefill pod(s) tried" in answer["error"]["message"]
    assert 1.2 < took < 2.2, took  # 1 s, then the 0.3 s left; not 3 x 1 s
    assert sum(len(e.received) for e in rig.prefill) == 2
    assert rig.decode[0].received == []
    assert rig.router.balancer.outstanding == {}


async def test_n_completions_are_n_pd_requests_joined_with_the_first_prefilled_alone(rig: Rig) -> None:
    """OpenAI's ``n``: n prefill calls (the first alone, so that the prefill pod's prefix cache holds the prompt
    for the others) and n decode calls of one completion each, seeded as vLLM seeds its own samples; one answer."""
    for engine in rig.prefill:
        engine.delay = 0.2
    status, answer = await rig.post({"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "n": 3, "seed": 7})
    assert status == 200, answer
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2]
    prefills = sorted((t, body) for e in rig.prefill for t, body in zip(e.arrived, e.received, strict=True))
    assert len(prefills) == 3
    assert all(t >= prefills[0][0] + 0.2 for t, _ in prefills[1:])  # after the first one's answer
    assert all("n" not in body for _, body in prefills)
    decoded = rig.decode[0].received
    assert sorted(body["seed"] for body in decoded) == [7, 8, 9]
    assert all("n" not in body and body["kv_transfer_params"]["remote_block_ids"] == [7] for body in decoded)
    ids = {headers["x-request-id"] for headers in rig.decode[0].headers}
    assert len(ids) == 3  # each sample its own request on the engines
    async with rig.session.get(rig.url + "/metrics") as r:
        assert "kvbridge_router_ttft_seconds_count 1.0" in await r.text()  # one client request, one first token


async def test_a_sample_that_fails_fails_the_request_and_no_call_is_left_behind(rig: Rig) -> None:
    rig.decode[0].mode = "400"
    status, answer = await rig.post({"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "n": 2})
    assert status == 400, answer
    for engine in rig.prefill:  # the other samples were cancelled or done: nothing counted in flight
        engine.mode = "slow"
    status, answer = await rig.post({"model": "m", "prompt": [4, 5, 6], "max_tokens": 3, "n": 2})
    assert status == 504, answer
    assert answer["error"]["code"] == "PREFILL_TIMEOUT"
    await asyncio.sleep(0.1)
    assert all(count == 0 for count in rig.router.balancer.outstanding.values())


async def test_samples_that_meet_the_same_lost_engine_count_it_once(rig: Rig) -> None:
    """An engine that answers 500 and is unhealthy after is one lost engine for the request, however many of its
    samples met it: each of them is served by the other pod, and the request is answered."""
    rig.prefill[0].mode = "500"  # answers 500, and /health 503 after
    status, answer = await rig.post({"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "n": 4})
    assert status == 200, answer
    assert len(answer["choices"]) == 4
    assert len(rig.prefill[0].received) >= 2  # several samples met it (the point of this test)
    metrics = await (await rig.session.get(rig.url + "/metrics")).text()
    assert 'kvbridge_router_engines_lost_total{pod="prefill-0",role="prefill"} 1.0' in metrics


@pytest.mark.parametrize(
    ("policy", "reason"), [(RouterPolicy.LEAST_LOADED, BY_LOAD), (RouterPolicy.ROUND_ROBIN, BY_TURN)]
)
async def test_every_pick_is_counted_by_policy_and_why(policy: RouterPolicy, reason: str) -> None:
    """``kvbridge_router_picks_total{policy, reason}``: one per choice, retries included; only the policies' few
    reasons as labels, whatever the prompts."""
    config = RouterConfig(prefill_timeout=1.0, decode_timeout=5.0, policy=policy.value)
    async with running_rig(config, ["prefill-0", "prefill-1"], ["decode-0"]) as rig:
        for prompt in ([1], [2, 3], list(range(40))):
            assert (await rig.post({"prompt": prompt}))[0] == 200
        metrics = await (await rig.session.get(rig.url + "/metrics")).text()
    picks = re.findall(r"^kvbridge_router_picks_total\{(.*)\} (\S+)$", metrics, re.MULTILINE)
    assert picks == [(f'policy="{policy.value}",reason="{reason}"', "3.0")]
