"""The connector's spans: the request's trace context from vLLM's ``trace_headers`` checked into the ranks' orders,
and the offer, digest, READ and digest-check spans parented to it, with their attributes and failure codes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kvbridge_agent.core import Role
from kvbridge_agent.core import tracing as words
from kvbridge_agent.core.digest import KV_DIGEST_MISMATCH
from kvbridge_agent.transfer.reads import ReadResult
from kvbridge_agent.vllm_connector.messages import OfferOrder, StepMetadata
from kvbridge_agent.vllm_connector.scheduler import ConnectorScheduler
from kvbridge_agent.vllm_connector.settings import ConnectorSettings
from kvbridge_agent.vllm_connector.tracing import Spans
from kvbridge_agent.vllm_connector.worker import ConnectorWorker

from .test_scheduler import UnreadRank, environ, prefill_scheduler, published, request, vllm_config

PARENT = "00f067aa0ba902b7"
TRACE = {"traceparent": f"00-4bf92f3577b34da6a3ce929d0e0e4736-{PARENT}-01"}


@pytest.fixture
def exported() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def spans(exported: InMemorySpanExporter) -> Spans:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    return Spans(tracer=provider.get_tracer("test"))


def traced(req: Any, headers: dict[str, str] | None) -> Any:
    req.trace_headers = headers
    return req


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (TRACE, TRACE),
        ({**TRACE, "tracestate": "a=1"}, {**TRACE, "tracestate": "a=1"}),
        ({**TRACE, "tracestate": "A=1"}, TRACE),
        ({"traceparent": TRACE["traceparent"].upper()}, {}),
        (None, {}),
    ],
)
def test_the_orders_carry_the_requests_checked_trace_context(
    headers: dict[str, str] | None, expected: dict[str, str]
) -> None:
    prefill = prefill_scheduler()
    decode = ConnectorScheduler(ConnectorSettings.from_vllm(vllm_config("kv_consumer"), environ(Role.DECODE)))
    try:
        prefill.request_finished(traced(request("p9", 64, {"do_remote_decode": True}), headers), ([1, 2],))
        assert prefill.build_connector_meta().to_offer["p9"].trace == expected
        req = traced(request("d9", 70, published(prefill)), headers)
        assert decode.get_num_new_matched_tokens(req, 0)[0] == 70
        blocks = SimpleNamespace(get_unhashed_block_ids=lambda: [4, 5, 6], get_block_ids=lambda: ([4, 5, 6],))
        decode.update_state_after_alloc(req, blocks, 70)
        assert decode.build_connector_meta().to_read["d9"].trace == expected
    finally:
        prefill.shutdown()
        decode.shutdown()


def one(exported: InMemorySpanExporter, name: str) -> ReadableSpan:
    [span] = [s for s in exported.get_finished_spans() if s.name == name]
    assert span.parent is not None
    assert f"{span.parent.span_id:016x}" == PARENT
    return span


@pytest.fixture
def prefill_worker(spans: Spans) -> Iterator[ConnectorWorker]:
    settings = ConnectorSettings.from_vllm(vllm_config("kv_producer"), environ(Role.PREFILL, lease=1))
    worker = ConnectorWorker(settings, 0, "inc")
    worker.spans = spans

    worker.prefill = UnreadRank()  # type: ignore[assignment]
    yield worker
    worker.prefill = None  # the stand-in has no transport to close
    worker.shutdown()


def test_an_offer_that_nobody_read_is_a_span_ending_with_lease_expired(
    prefill_worker: ConnectorWorker, exported: InMemorySpanExporter
) -> None:
    offer = OfferOrder([1, 2, 3], time.time() + 0.2, digest_tokens=64, digest_key=b"k" * 16, trace=TRACE)
    prefill_worker.start_load_kv(StepMetadata(to_offer={"held": offer, "plain": OfferOrder([4], time.time() + 0.2)}))
    prefill_worker.get_finished({"held", "plain"})
    time.sleep(0.3)
    assert prefill_worker.get_finished(set())[0] == {"held", "plain"}
    span = one(exported, words.PREFILL_OFFER)
    assert span.attributes is not None
    assert span.attributes[words.BLOCKS] == 3
    assert span.attributes[words.ERROR_CODE] == "LEASE_EXPIRED"
    assert span.status.status_code is StatusCode.ERROR
    assert one(exported, words.PREFILL_DIGEST).attributes == {words.TP_RANK: 0, words.TOKENS: 64}
    assert len(exported.get_finished_spans()) == 2  # the request without a trace context has none


def decode_worker(spans: Spans) -> ConnectorWorker:
    settings = ConnectorSettings.from_vllm(vllm_config("kv_consumer"), environ(Role.DECODE))
    worker = ConnectorWorker(settings, 0, "inc")
    worker.spans = spans
    return worker


@pytest.mark.parametrize(
    ("result", "checked", "read_error", "check_error"),
    [
        (ReadResult("r", True, bytes=4096, descriptors=8, seconds=0.002), False, "", None),
        (ReadResult("r", True, bytes=4096, descriptors=8, seconds=0.002), True, "", ""),
        (
            ReadResult("r", False, KV_DIGEST_MISMATCH, "x", [1], bytes=4096, descriptors=8, seconds=0.002),
            True,
            "",
            KV_DIGEST_MISMATCH,
        ),
        (
            ReadResult("r", False, "TRANSFER_FAILED", "x", [1], bytes=0, descriptors=8, seconds=0.0),
            False,
            "TRANSFER_FAILED",
            None,
        ),
    ],
)
def test_a_read_is_a_span_with_bytes_and_descriptors_then_its_check(
    spans: Spans,
    exported: InMemorySpanExporter,
    result: ReadResult,
    checked: bool,
    read_error: str,
    check_error: str | None,
) -> None:
    worker = decode_worker(spans)
    try:
        began = time.time_ns()
        worker._traced["r"] = (TRACE, began, {words.BLOCKS: 1, words.REMOTE_ENGINE: "prefill-0"})
        if checked:
            worker._checks.started_ns["r"] = began + 2_000_000
        worker._read_spans(result)
    finally:
        worker.shutdown()
    read = one(exported, words.DECODE_READ)
    assert read.attributes is not None
    assert (read.attributes[words.BYTES], read.attributes[words.DESCRIPTORS]) == (result.bytes, 8)
    assert read.attributes.get(words.ERROR_CODE, "") == read_error
    if check_error is None:
        assert [s.name for s in exported.get_finished_spans()] == [words.DECODE_READ]
        return
    check = one(exported, words.DECODE_DIGEST_CHECK)
    assert check.attributes is not None
    assert check.attributes[words.VERIFIED] is result.ok
    assert check.attributes.get(words.ERROR_CODE, "") == check_error
    assert read.end_time is not None
    assert check.start_time is not None
    assert read.end_time <= check.start_time


def test_a_conversion_is_a_span_between_the_reads_and_the_check(spans: Spans, exported: InMemorySpanExporter) -> None:
    result = ReadResult("r", True, bytes=4096, descriptors=8, seconds=0.005, convert_seconds=0.002, conversion="merge")
    worker = decode_worker(spans)
    try:
        began = time.time_ns()
        worker._traced["r"] = (TRACE, began, {words.BLOCKS: 3, words.REMOTE_ENGINE: "prefill-0"})
        worker._checks.started_ns["r"] = began + 6_000_000
        worker._read_spans(result)
    finally:
        worker.shutdown()
    read, convert, check = (
        one(exported, name) for name in (words.DECODE_READ, words.DECODE_CONVERT, words.DECODE_DIGEST_CHECK)
    )
    assert convert.attributes == {words.TP_RANK: 0, words.CONVERSION: "merge", words.BLOCKS: 3}
    assert (read.start_time, read.end_time) == (began, began + 3_000_000)
    assert (convert.start_time, convert.end_time) == (began + 3_000_000, began + 5_000_000)
    assert check.start_time == began + 6_000_000  # after the conversion


def test_off_nothing_is_recorded(exported: InMemorySpanExporter) -> None:
    spans = Spans(environ={})
    assert not spans.enabled
    spans.record(words.DECODE_READ, TRACE, 1, 2, {})
    assert Spans(environ={words.ENV_ENDPOINT: "http://127.0.0.1:9"}).enabled
    assert not Spans(environ={words.ENV_ENDPOINT: "http://127.0.0.1:9", words.ENV_SDK_DISABLED: "TRUE"}).enabled
