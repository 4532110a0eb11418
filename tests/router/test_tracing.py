"""The router's traces: one trace per request with spans for admission, each choice, each engine call (retries as
siblings), W3C trace context to both engines; a client's valid context continued, a hostile one ignored; off, no
span and no header."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode

from kvbridge_agent.core import tracing as words
from kvbridge_router.policies.base import BY_LOAD, BY_PREFIX, BY_RING
from kvbridge_router.proxy import RouterConfig
from kvbridge_router.tracing import OFF, Tracing

from .test_proxy import Obj, Rig, running_rig, two_decodes

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture
def exported() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
async def traced(exported: InMemorySpanExporter) -> AsyncIterator[Rig]:
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(1.0)))
    provider.add_span_processor(SimpleSpanProcessor(exported))
    config = RouterConfig(prefill_timeout=1.0, decode_timeout=5.0, decode_idle_timeout=1.0)
    async with running_rig(config, ["prefill-0"], ["decode-0"]) as rig:
        rig.router.tracing = Tracing(provider)
        yield rig


async def post(rig: Rig, headers: Sequence[tuple[str, str]] = (), body: Obj | None = None) -> int:
    async with rig.session.post(rig.url + "/v1/completions", json=body or {"prompt": [1, 2, 3]}, headers=headers) as r:
        await r.read()
        return r.status


def by_name(spans: Sequence[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    found: dict[str, list[ReadableSpan]] = {}
    for span in sorted(spans, key=lambda s: s.start_time or 0):
        found.setdefault(span.name, []).append(span)
    return found


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    assert span.context is not None
    return f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"


async def test_one_request_is_one_trace_and_each_engine_gets_its_calls_context(
    traced: Rig, exported: InMemorySpanExporter
) -> None:
    assert await post(traced) == 200
    spans = by_name(exported.get_finished_spans())
    assert sorted(spans) == sorted(
        [words.ROUTER_REQUEST, words.ROUTER_ADMISSION, words.ROUTER_CHOOSE, words.ROUTER_PREFILL, words.ROUTER_DECODE]
    )
    [root] = spans[words.ROUTER_REQUEST]
    trace_id, root_id = hex_ids(root)
    assert root.parent is None
    assert root.kind is SpanKind.SERVER
    assert root.attributes is not None
    assert root.attributes[words.HTTP_STATUS] == 200
    for name in (words.ROUTER_ADMISSION, words.ROUTER_CHOOSE, words.ROUTER_PREFILL, words.ROUTER_DECODE):
        [child] = spans[name]
        assert child.parent is not None
        assert f"{child.parent.span_id:016x}" == root_id
        assert hex_ids(child)[0] == trace_id
    [choice] = spans[words.ROUTER_CHOOSE]
    assert choice.attributes is not None
    assert (choice.attributes[words.PREFILL_POD], choice.attributes[words.DECODE_POD]) == ("prefill-0", "decode-0")
    assert choice.attributes[words.POLICY] == "kv-aware"
    assert choice.attributes[words.PREFIX_CHUNKS] == 0  # a prompt shorter than a block: no chunk to score
    for engine, name in ((traced.prefill[0], words.ROUTER_PREFILL), (traced.decode[0], words.ROUTER_DECODE)):
        [call] = spans[name]
        assert call.kind is SpanKind.CLIENT
        version, sent_trace, parent, flags = engine.headers[0]["traceparent"].split("-")
        assert (version, sent_trace, parent) == ("00", trace_id, hex_ids(call)[1])
        assert int(flags, 16) & 1  # sampled (OpenTelemetry also sets W3C's random-trace-id bit)
        assert "tracestate" not in engine.headers[0]


async def test_a_clients_valid_trace_context_is_continued(traced: Rig, exported: InMemorySpanExporter) -> None:
    assert await post(traced, [("traceparent", CLIENT), ("tracestate", "vendor=abc,other@tenant=x")]) == 200
    [root] = by_name(exported.get_finished_spans())[words.ROUTER_REQUEST]
    assert hex_ids(root)[0] == TRACE_ID
    assert root.parent is not None
    assert f"{root.parent.span_id:016x}" == "00f067aa0ba902b7"
    for engine in (traced.prefill[0], traced.decode[0]):
        assert engine.headers[0]["traceparent"].startswith(f"00-{TRACE_ID}-")
        assert engine.headers[0]["tracestate"] == "vendor=abc,other@tenant=x"


async def test_an_unsampled_caller_is_obeyed(traced: Rig, exported: InMemorySpanExporter) -> None:
    assert await post(traced, [("traceparent", CLIENT[:-2] + "00")]) == 200
    assert exported.get_finished_spans() == ()
    assert traced.decode[0].headers[0]["traceparent"].startswith(f"00-{TRACE_ID}-")
    flags = traced.decode[0].headers[0]["traceparent"].rpartition("-")[2]
    assert not int(flags, 16) & 1  # the engines are told not to record either


HOSTILE = [
    [("traceparent", CLIENT.upper())],
    [("traceparent", f"00-{'0' * 32}-00f067aa0ba902b7-01")],
    [("traceparent", f"00-{TRACE_ID}-{'0' * 16}-01")],
    [("traceparent", f"ff-{TRACE_ID}-00f067aa0ba902b7-01")],
    [("traceparent", CLIENT + "-extra")],
    [("traceparent", CLIENT + ",00-" + TRACE_ID + "-00f067aa0ba902b7-01")],
    [("traceparent", CLIENT), ("traceparent", CLIENT)],
    [("traceparent", "x" * 8000)],
    [("traceparent", CLIENT[:10] + " " + CLIENT[11:])],
    [("traceparent", "00-\u00e9" + TRACE_ID[1:] + "-00f067aa0ba902b7-01")],
]


@pytest.mark.parametrize("headers", HOSTILE)
async def test_a_hostile_traceparent_starts_a_new_trace_never_an_error(
    traced: Rig, exported: InMemorySpanExporter, headers: list[tuple[str, str]]
) -> None:
    assert await post(traced, [(k, v.encode("utf-8").decode("latin-1")) for k, v in headers]) == 200
    [root] = by_name(exported.get_finished_spans())[words.ROUTER_REQUEST]
    trace_id = hex_ids(root)[0]
    assert root.parent is None
    assert trace_id != TRACE_ID
    for engine in (traced.prefill[0], traced.decode[0]):
        assert engine.headers[0]["traceparent"].startswith(f"00-{trace_id}-")  # the router's own, not the client's
        assert "tracestate" not in engine.headers[0]


@pytest.mark.parametrize(
    "state",
    [
        "UPPER=1",
        "a=1,a=2",
        ",".join(f"k{i}=v" for i in range(33)),
        "k=" + "v" * 600,
        "k=v\tx=y=z",
        "k=a,b",
        "k=",
    ],
)
async def test_a_hostile_tracestate_is_dropped_whole_and_the_trace_goes_on(
    traced: Rig, exported: InMemorySpanExporter, state: str
) -> None:
    assert await post(traced, [("traceparent", CLIENT), ("tracestate", state)]) == 200
    [root] = by_name(exported.get_finished_spans())[words.ROUTER_REQUEST]
    assert hex_ids(root)[0] == TRACE_ID
    for engine in (traced.prefill[0], traced.decode[0]):
        assert "tracestate" not in engine.headers[0]


async def test_a_retried_decode_is_a_sibling_span_with_the_failures_code(
    traced: Rig, exported: InMemorySpanExporter
) -> None:
    await two_decodes(traced)
    traced.decode[0].mode = "500"
    traced.router.balancer.policy = "least-loaded"
    for _ in range(3):  # some request meets the failing pod first
        assert await post(traced) == 200
    spans = exported.get_finished_spans()
    retried = {
        hex_ids(s)[0] for s in spans if s.name == words.ROUTER_DECODE and s.status.status_code is StatusCode.ERROR
    }
    assert retried, "no request met the failing decode pod"
    trace_id = next(iter(retried))
    mine = by_name([s for s in spans if hex_ids(s)[0] == trace_id])
    first, second = mine[words.ROUTER_DECODE]
    [root] = mine[words.ROUTER_REQUEST]
    assert first.parent == second.parent == root.context
    assert first.attributes is not None
    assert second.attributes is not None
    assert first.attributes[words.ERROR_CODE] == "DECODE_FAILED"
    assert first.attributes[words.POD] == "decode-0"
    assert (second.attributes[words.ATTEMPT], second.attributes[words.RETRY_OF]) == (2, "DECODE_FAILED")
    assert second.status.status_code is not StatusCode.ERROR
    assert len(mine[words.ROUTER_PREFILL]) == 2  # prefilled again for the other pair, in the same trace


async def test_each_choice_says_why_on_its_span_and_in_the_metrics(traced: Rig, exported: InMemorySpanExporter) -> None:
    """The policy's reason (policies/base.py's ``BY_*``) is the choice span's ``kvbridge.choice.reason`` and a label
    of ``kvbridge_router_picks_total``: a prompt no pod was sent is placed by the hash ring, the same prompt again by
    its prefix."""
    prompt = {"prompt": list(range(1, 2 * traced.router.config.block_tokens + 5))}  # two whole blocks
    for _ in range(2):
        assert await post(traced, body=prompt) == 200
    choices = by_name(exported.get_finished_spans())[words.ROUTER_CHOOSE]
    said = [((c.attributes or {})[words.CHOICE_REASON], (c.attributes or {})[words.PREFIX_HIT_CHUNKS]) for c in choices]
    assert said == [(BY_RING, 0), (BY_PREFIX, 2)]
    picks = traced.router.metrics.registry.get_sample_value
    for reason in (BY_RING, BY_PREFIX):
        assert picks("kvbridge_router_picks_total", {"policy": "kv-aware", "reason": reason}) == 1.0
    assert picks("kvbridge_router_picks_total", {"policy": "kv-aware", "reason": BY_LOAD}) is None


async def test_the_samples_of_n_are_siblings_under_one_request_each_numbered(
    traced: Rig, exported: InMemorySpanExporter
) -> None:
    assert await post(traced, body={"prompt": [1, 2, 3], "n": 3}) == 200
    spans = by_name(exported.get_finished_spans())
    [root] = spans[words.ROUTER_REQUEST]
    for name in (words.ROUTER_CHOOSE, words.ROUTER_PREFILL, words.ROUTER_DECODE):
        assert all(s.parent == root.context for s in spans[name])
        numbered = sorted(int(str((s.attributes or {}).get(words.SAMPLE, -1))) for s in spans[name])
        assert numbered == [0, 1, 2], name
        assert all((s.attributes or {})[words.ATTEMPT] == 1 for s in spans[name])  # none is a retry
    assert words.SAMPLE not in (root.attributes or {})


async def test_a_refused_request_ends_its_span_with_the_code(traced: Rig, exported: InMemorySpanExporter) -> None:
    headers = {"Content-Type": "application/json"}
    async with traced.session.post(traced.url + "/v1/completions", data=b"{", headers=headers) as r:
        assert r.status == 400
    spans = by_name(exported.get_finished_spans())
    [root], [admission] = spans[words.ROUTER_REQUEST], spans[words.ROUTER_ADMISSION]
    assert root.attributes is not None
    assert root.attributes[words.ERROR_CODE] == "INVALID_JSON"
    assert admission.status.status_code is StatusCode.ERROR
    assert traced.prefill[0].received == []


async def test_off_no_span_and_no_header_reaches_an_engine() -> None:
    config = RouterConfig(prefill_timeout=1.0, decode_timeout=5.0, decode_idle_timeout=1.0)
    async with running_rig(config, ["prefill-0"], ["decode-0"]) as rig:
        assert not rig.router.tracing.enabled
        assert await post(rig, [("traceparent", CLIENT)]) == 200
        for engine in (rig.prefill[0], rig.decode[0]):
            assert "traceparent" not in engine.headers[0]
            assert "tracestate" not in engine.headers[0]


def test_the_environment_turns_tracing_on() -> None:
    assert not Tracing.from_environment({}).enabled
    assert Tracing().request({}, "/v1/completions", "completions") is OFF
    off = {words.ENV_ENDPOINT: "http://127.0.0.1:4318/v1/traces", words.ENV_SDK_DISABLED: "true"}
    assert not Tracing.from_environment(off).enabled
    for protocol in ("grpc", "http/protobuf"):
        tracing = Tracing.from_environment({words.ENV_ENDPOINT: "http://127.0.0.1:9", words.ENV_PROTOCOL: protocol})
        assert tracing.enabled
        tracing.shutdown()  # nothing batched: returns at once


async def scrape(rig: Rig, accept: str) -> tuple[str, str]:
    async with rig.session.get(rig.url + "/metrics", headers={"Accept": accept}) as r:
        assert r.status == 200
        return r.headers["Content-Type"], await r.text()


OPENMETRICS_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


async def test_the_ttft_histogram_carries_the_traces_id_as_an_exemplar(
    traced: Rig, exported: InMemorySpanExporter
) -> None:
    """A scraper that accepts OpenMetrics (Prometheus with exemplar storage) gets each TTFT bucket's last request's
    trace id as its exemplar, which Grafana links to the trace; a plain scraper gets the text format, unchanged."""
    assert await post(traced, [("traceparent", CLIENT)]) == 200
    kind, text = await scrape(traced, OPENMETRICS_ACCEPT)
    assert kind.startswith("application/openmetrics-text")
    exemplars = [
        line for line in text.splitlines() if line.startswith("kvbridge_router_ttft_seconds_bucket") and "#" in line
    ]
    assert exemplars, text
    assert all(f'trace_id="{TRACE_ID}"' in line for line in exemplars)
    kind, text = await scrape(traced, "text/plain")
    assert kind.startswith("text/plain; version=0.0.4")
    assert "trace_id" not in text
    assert "kvbridge_router_ttft_seconds_bucket" in text


async def test_off_the_histogram_has_no_exemplar() -> None:
    config = RouterConfig(prefill_timeout=1.0, decode_timeout=5.0, decode_idle_timeout=1.0)
    async with running_rig(config, ["prefill-0"], ["decode-0"]) as rig:
        assert await post(rig, [("traceparent", CLIENT)]) == 200
        _, text = await scrape(rig, OPENMETRICS_ACCEPT)
        assert "trace_id" not in text
        assert "kvbridge_router_ttft_seconds_count 1" in text
