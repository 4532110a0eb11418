"""spec.tracing with real vLLM (CPU build, kvbridge's connector) behind the router and an OTLP/HTTP receiver here,
decoding the real OTLP protobuf the router, both vLLM engines and the connector export: one trace id across them,
each engine's spans under the router's call to it, and each child inside its parent's time; and a digest mismatch
recorded as the error of decode's check, in the caller's own trace; a retried decode as a sibling span."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from kvbridge_agent.core import Role
from kvbridge_agent.core import tracing as words
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.transfer.keys import load_keys
from kvbridge_router.proxy import Router, RouterConfig, listening
from kvbridge_router.tracing import Tracing
from kvbridge_sim import pd_requests
from kvbridge_sim.tiny_model import prompt
from kvbridge_sim.vllm_engines import Engines
from tests.kv_faults import overwrite_prefill_kv

from .conftest import DEPLOYMENTS, TRACES_PORT, TRACES_URL
from .routing import endpoint, pool

#: what the traced pair serves (the tiny mixture-of-experts model)
MODEL_NAME = str(DEPLOYMENTS["traced"]["spec"]["model"]["name"])
#: clocks of one machine; the router's call begins before the engine sees the request and ends after its answer
SLACK_NS = 5_000_000


@dataclass(frozen=True)
class Received:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    start: int
    end: int
    attributes: dict[str, object] = field(default_factory=dict)
    error: bool = False


class Receiver:
    """An OTLP/HTTP collector on a thread of its own (never blocked by the test's event loop): every span of every
    ExportTraceServiceRequest, decoded."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self._lock = threading.Lock()

    def take(self, data: bytes) -> None:
        export = ExportTraceServiceRequest.FromString(data)
        found = []
        for resource_spans in export.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    attributes: dict[str, object] = {}
                    for a in span.attributes:
                        kind = a.value.WhichOneof("value")
                        attributes[a.key] = getattr(a.value, kind) if kind else None
                    found.append(
                        Received(
                            span.name,
                            resource.get("service.name", ""),
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            span.start_time_unix_nano,
                            span.end_time_unix_nano,
                            attributes,
                            span.status.code == 2,  # STATUS_CODE_ERROR
                        )
                    )
        with self._lock:
            self.spans += found

    def of(self, trace_id: str, name: str) -> list[Received]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id and s.name == name]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            found.take(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            body = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", TRACES_PORT), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        server.shutdown()
        server.server_close()


def inside(child: Received, parent: Received) -> bool:
    return parent.start - SLACK_NS <= child.start and child.end <= parent.end + SLACK_NS


async def test_one_trace_across_the_router_both_engines_and_the_kv_transfer(
    receiver: Receiver, traced_engines: Engines
) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "tiny-traced-router"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=TRACES_URL)))  # real OTLP protobuf
    router = Router(RouterConfig(prefill_timeout=60, decode_timeout=120), tracing=Tracing(provider))
    served = contextlib.AsyncExitStack()
    port = await served.enter_async_context(listening(router))
    document = DEPLOYMENTS["traced"]
    router.set_pool(
        pool(
            [endpoint(traced_engines, "traced-prefill", document, Role.PREFILL)],
            [endpoint(traced_engines, "traced-decode", document, Role.DECODE)],
        )
    )
    body = {"model": MODEL_NAME, "prompt": prompt(70, salt=4040), "max_tokens": 4, "temperature": 0.0}
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with pd_requests.client_session(180) as session, session.post(url, json=body) as answer:
            assert answer.status == 200, await answer.text()
    finally:
        await served.aclose()
        provider.shutdown()
    [root] = [s for s in receiver.spans if s.name == words.ROUTER_REQUEST]  # the router's, flushed at shutdown
    trace = root.trace_id
    wanted = ("llm_request", words.PREFILL_OFFER, words.DECODE_READ)
    deadline = time.monotonic() + 60  # the engines' batch exporters, and the offer's span ends once decode read it
    while time.monotonic() < deadline and (
        len(receiver.of(trace, "llm_request")) < 2 or not all(receiver.of(trace, name) for name in wanted)
    ):
        await asyncio.sleep(0.5)
    names = sorted({s.name for s in receiver.spans if s.trace_id == trace})
    [prefill_call] = receiver.of(trace, words.ROUTER_PREFILL)
    [decode_call] = receiver.of(trace, words.ROUTER_DECODE)
    llm = {s.parent_id: s for s in receiver.of(trace, "llm_request")}
    assert set(llm) == {prefill_call.span_id, decode_call.span_id}, names  # vLLM's own span, under each call
    assert llm[prefill_call.span_id].service == "tiny-traced-prefill"
    assert llm[decode_call.span_id].service == "tiny-traced-decode"
    [offer] = receiver.of(trace, words.PREFILL_OFFER)
    [read] = receiver.of(trace, words.DECODE_READ)
    assert offer.parent_id == prefill_call.span_id, names
    assert read.parent_id == decode_call.span_id, names
    bytes_read, descriptors = read.attributes[words.BYTES], read.attributes[words.DESCRIPTORS]
    assert isinstance(bytes_read, int)
    assert isinstance(descriptors, int)
    assert bytes_read > 0
    assert descriptors > 0
    assert not read.error
    assert not offer.error
    for call in (prefill_call, decode_call):
        assert call.parent_id == root.span_id
        assert inside(call, root)
        assert inside(llm[call.span_id], call)
    assert inside(read, decode_call)
    assert offer.start >= prefill_call.start - SLACK_NS
    assert offer.end >= read.start  # held until decode read it
    [convert] = receiver.of(trace, words.DECODE_CONVERT)  # prefill's 32-token blocks merged into decode's 64
    assert convert.parent_id == decode_call.span_id, names
    assert convert.attributes[words.CONVERSION] == "MergeBlocks"
    assert read.end <= convert.start + SLACK_NS
    assert inside(convert, decode_call)
    checks = receiver.of(trace, words.DECODE_DIGEST_CHECK)
    for check in checks:  # the first minutes of an engine are verified (spec.transfer.verification: Sampled)
        assert check.attributes[words.VERIFIED] is True
        assert convert.end <= check.start + SLACK_NS
    dump = os.environ.get("KVBRIDGE_TRACE_DUMP")  # for docs/images (python -m kvbridge_sim.trace_timeline)
    if dump:
        Path(dump).write_text(json.dumps([asdict(s) for s in receiver.spans if s.trace_id == trace], indent=1))


async def test_a_digest_mismatch_is_an_error_on_decodes_check_in_the_callers_trace(
    receiver: Receiver, traced_engines: Engines
) -> None:
    """A caller's trace (its traceparent) through prefill and decode; prefill's KV overwritten after publish
    (tests/kv_faults.py): decode's digest check is a span of that trace with the error KV_DIGEST_MISMATCH, and the
    request fails loudly or is recomputed, never answered from the wrong KV."""
    assert traced_engines.keys_dir is not None
    keys = load_keys(str(traced_engines.keys_dir))
    trace = secrets.token_hex(16)
    headers = {words.TRACEPARENT: f"00-{trace}-{secrets.token_hex(8)}-01"}
    prefill, decode = traced_engines.engines["traced-prefill"].url, traced_engines.engines["traced-decode"].url
    tokens = prompt(73, salt=4141)
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=180)) as session:
        params = await pd_requests.prefill(session, prefill, MODEL_NAME, tokens)
        assert params["kvbridge"]["verify"] is True  # an engine's first minutes are verified (Sampled)
        assert overwrite_prefill_kv(KVTransferParams.model_validate(params["kvbridge"]), keys) == 1
        with contextlib.suppress(pd_requests.PDRequestError):  # failed loudly, or recomputed
            await pd_requests.decode(session, decode, MODEL_NAME, tokens, params, 4)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not receiver.of(trace, words.DECODE_DIGEST_CHECK):
        await asyncio.sleep(0.5)
    [check] = receiver.of(trace, words.DECODE_DIGEST_CHECK)
    assert check.error
    assert check.attributes[words.ERROR_CODE] == "KV_DIGEST_MISMATCH"
    assert check.attributes[words.VERIFIED] is False
    [read] = receiver.of(trace, words.DECODE_READ)
    assert not read.error  # the READs themselves completed: only the digest can tell
    assert {s.service for s in receiver.spans if s.trace_id == trace} >= {"tiny-traced-prefill", "tiny-traced-decode"}


async def test_a_retried_decode_is_a_sibling_span_in_the_same_trace(
    receiver: Receiver, traced_engines: Engines
) -> None:
    """A decode pod that answers 500 beside the real one (least-loaded policy, a few requests): a request that met it
    is retried on the real pair in the same trace — two sibling decode calls under the router's request, the first
    an error DECODE_FAILED, the second attempt 2 with retry_of — and the real engines' spans join that trace."""
    broken = web.Application()

    async def fail(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "a broken decode pod"}}, status=500)

    broken.router.add_post("/v1/completions", fail)
    broken_server = TestServer(broken, host="127.0.0.1")
    await broken_server.start_server()
    provider = TracerProvider(resource=Resource.create({"service.name": "tiny-traced-router"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=TRACES_URL)))
    config = RouterConfig(prefill_timeout=60, decode_timeout=120, policy="least-loaded")
    router = Router(config, tracing=Tracing(provider))
    served = contextlib.AsyncExitStack()
    port = await served.enter_async_context(listening(router))
    document = DEPLOYMENTS["traced"]
    real = endpoint(traced_engines, "traced-decode", document, Role.DECODE)
    failing = {**real, "pod": "broken-decode", "ip": "127.0.0.1", "httpPort": broken_server.port}
    router.set_pool(pool([endpoint(traced_engines, "traced-prefill", document, Role.PREFILL)], [failing, real]))
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with pd_requests.client_session(180) as session:
            for salt in range(3):  # some request meets the failing pod first
                body = {"model": MODEL_NAME, "prompt": prompt(40, salt=5050 + salt), "max_tokens": 4, "temperature": 0}
                async with session.post(url, json=body) as answer:
                    assert answer.status == 200, await answer.text()
    finally:
        await served.aclose()
        await broken_server.close()
        provider.shutdown()
    calls = [s for s in receiver.spans if s.name == words.ROUTER_DECODE]
    retried = sorted({s.trace_id for s in calls if s.error})
    assert retried, "no request met the failing decode pod"
    trace = retried[0]
    # the router's spans arrived with its provider's shutdown; the engines' come from separate exporters, each
    # batching on its own schedule: wait for the decode engine's llm_request under the retried call (the request
    # was prefilled twice, so two prefill llm_request spans may come first) and for the connector's read
    [root] = receiver.of(trace, words.ROUTER_REQUEST)
    first, second = sorted(receiver.of(trace, words.ROUTER_DECODE), key=lambda s: s.start)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (
        receiver.of(trace, words.DECODE_READ)
        and second.span_id in {s.parent_id for s in receiver.of(trace, "llm_request")}
    ):
        await asyncio.sleep(0.5)
    assert first.parent_id == second.parent_id == root.span_id  # siblings, not a new trace
    assert (first.error, first.attributes[words.ERROR_CODE], first.attributes[words.POD]) == (
        True,
        "DECODE_FAILED",
        "broken-decode",
    )
    assert (second.attributes[words.ATTEMPT], second.attributes[words.RETRY_OF]) == (2, "DECODE_FAILED")
    assert not second.error
    llm = {s.parent_id for s in receiver.of(trace, "llm_request")}
    assert second.span_id in llm  # the real decode engine's own span, under the retried call
    [read] = receiver.of(trace, words.DECODE_READ)
    assert read.parent_id == second.span_id


async def test_a_digest_mismatch_behind_the_router_is_the_error_under_its_decode_call(
    receiver: Receiver, traced_engines: Engines
) -> None:
    """Behind the router: the prefill pod is reached through a proxy that overwrites its KV after it answered (as
    a fault of the machine would), so decode's digest differs. The router's request fails (decode answers 500, no
    other pair), and its trace holds decode's digest check under the router's decode call, an error
    KV_DIGEST_MISMATCH; never an answer from the wrong KV."""
    assert traced_engines.keys_dir is not None
    keys = load_keys(str(traced_engines.keys_dir))
    real = traced_engines.engines["traced-prefill"].url
    overwritten: list[str] = []

    async def corrupting(request: web.Request) -> web.Response:
        forwarded = {
            k: v for k, v in request.headers.items() if k.lower() in ("traceparent", "tracestate", "content-type")
        }
        data = await request.read()
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session,
            session.post(f"{real}/v1/completions", data=data, headers=forwarded) as answer,
        ):
            body = await answer.json()
        params = (body.get("kv_transfer_params") or {}).get("kvbridge")
        if params:
            assert overwrite_prefill_kv(KVTransferParams.model_validate(params), keys) == 1
            overwritten.append(params["remoteRequestId"])
        return web.json_response(body, status=answer.status)

    proxy = web.Application()
    proxy.router.add_post("/v1/completions", corrupting)
    proxy_server = TestServer(proxy, host="127.0.0.1")
    await proxy_server.start_server()
    provider = TracerProvider(resource=Resource.create({"service.name": "tiny-traced-router"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=TRACES_URL)))
    router = Router(RouterConfig(prefill_timeout=60, decode_timeout=120), tracing=Tracing(provider))
    served = contextlib.AsyncExitStack()
    port = await served.enter_async_context(listening(router))
    document = DEPLOYMENTS["traced"]
    prefill = endpoint(traced_engines, "traced-prefill", document, Role.PREFILL)
    prefill = {**prefill, "ip": "127.0.0.1", "httpPort": proxy_server.port}
    router.set_pool(pool([prefill], [endpoint(traced_engines, "traced-decode", document, Role.DECODE)]))
    body = {"model": MODEL_NAME, "prompt": prompt(75, salt=6060), "max_tokens": 4, "temperature": 0.0}
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with pd_requests.client_session(180) as session, session.post(url, json=body) as answer:
            status = answer.status
    finally:
        await served.aclose()
        await proxy_server.close()
        provider.shutdown()
    assert overwritten, "the proxy saw no transfer parameters"
    assert status >= 500  # failed loudly: the only pair's KV was wrong
    [root] = [s for s in receiver.spans if s.name == words.ROUTER_REQUEST]
    trace = root.trace_id
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not receiver.of(trace, words.DECODE_DIGEST_CHECK):
        await asyncio.sleep(0.5)
    assert root.error
    calls = {s.span_id: s for s in receiver.of(trace, words.ROUTER_DECODE)}
    assert all(convert.parent_id in calls for convert in receiver.of(trace, words.DECODE_CONVERT))
    checks = receiver.of(trace, words.DECODE_DIGEST_CHECK)
    assert checks
    for check in checks:  # one per decode call (the router may try the pair again, prefilling again)
        assert check.parent_id in calls  # under the router's decode call
        assert check.error
        assert check.attributes[words.ERROR_CODE] == "KV_DIGEST_MISMATCH"
        assert calls[check.parent_id].error
