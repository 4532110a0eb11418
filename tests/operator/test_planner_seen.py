"""The planner's decisions seen, not just logged (issue 61): each pass as the operator's Prometheus series (the
decision per role with its reason and change, what it read, the targets, the corrections, when it passed) and as
events (``Planned`` with why, ``PlannerHeld``, ``PlannerResumed``, ``TargetUnreachable``).

Passes run against the fake Prometheus and the recording API client of test_planner_answers.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge_operator.api.objects import Obj
from kvbridge_operator.controller.autoscaling import plan_pass
from kvbridge_operator.controller.metrics import REGISTRY
from kvbridge_operator.planner.sizing import METRICS_MISSING, SIZED, TARGET_UNREACHABLE

from .test_planner_answers import NAME, NAMESPACE, Answerer, kube, planned, vector, written

#: a busy deployment as Prometheus reports it: 20 requests/s of 1,000 prompt tokens (none cached) and 100 output
#: tokens, 40 decoding, TTFT 0.3 s, ITL 20 ms, scraped a second ago
BUSY = {
    "time() -": "1",
    "prompt_tokens_total": "1000",
    "generation_tokens_total": "100",
    "prefix_cache_hits": "0",
    "prefix_cache_queries": "20000",
    "num_requests_running": "40",
    "kvbridge_router_ttft": "0.3",
    "inter_token_latency": "0.02",
    "request_success_total": "20",
}


@pytest.fixture
async def prometheus() -> AsyncIterator[tuple[str, list[Answerer]]]:
    """A fake Prometheus answering each query as the last ``Answerer`` of the list says."""
    answering: list[Answerer] = [busy]

    async def query(request: web.Request) -> web.Response:
        status, content_type, body = answering[-1](request.query.get("query", ""))
        return web.Response(status=status, body=body, content_type=content_type)

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}", answering
    finally:
        await server.close()


def busy(query: str) -> tuple[int, str, bytes]:
    if query.startswith("count by (le)"):  # a histogram's bucket bounds
        result = [{"metric": {"le": le}, "value": [1.5, "1"]} for le in ("0.01", "0.025", "0.05", "0.5", "+Inf")]
        return (
            200,
            "application/json",
            json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode(),
        )
    value = next((v for k, v in BUSY.items() if k in query), "NaN")
    return 200, "application/json", vector(value)


def series(name: str, **labels: str) -> float | None:
    """A sample of the operator's registry, read afresh (None: not there)."""
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def ours(**labels: str) -> dict[str, str]:
    return {"namespace": NAMESPACE, "deployment": NAME, **labels}


async def test_a_pass_is_seen_as_series_of_its_decision_inputs_targets_and_corrections(
    prometheus: tuple[str, list[Answerer]],
) -> None:
    url, _answering = prometheus
    before = {
        role: series("kvbridge_operator_planner_decisions_total", **ours(role=role, reason=SIZED, change="up")) or 0.0
        for role in ("prefill", "decode")
    }
    client = kube()
    async with ClientSession() as session:
        decision = await plan_pass(client, session, planned(url), now=1e9)
    assert decision is not None
    assert decision.reason == SIZED
    assert decision.prefill > 2
    assert decision.decode > 1
    for role, wanted in (("prefill", decision.prefill), ("decode", decision.decode)):
        after = series("kvbridge_operator_planner_decisions_total", **ours(role=role, reason=SIZED, change="up"))
        assert after == before[role] + 1
        assert series("kvbridge_operator_planned_replicas", **ours(role=role)) == wanted
        assert series("kvbridge_operator_planner_correction", **ours(role=role)) is not None
    observed = {
        figure: series("kvbridge_operator_planner_observed", **ours(figure=figure))
        for figure in ("request_rate", "prompt_tokens", "output_tokens", "decode_running", "ttft_seconds")
    }
    assert observed == {
        "request_rate": 20.0,
        "prompt_tokens": 1000.0,
        "output_tokens": 100.0,
        "decode_running": 40.0,
        "ttft_seconds": 0.3,
    }
    assert series("kvbridge_operator_planner_observed", **ours(figure="predicted_rate")) == decision.predicted_rate
    assert series("kvbridge_operator_planner_target_seconds", **ours(target="ttft", percentile="95")) == 0.5
    assert series("kvbridge_operator_planner_target_seconds", **ours(target="itl", percentile="90")) == 0.03
    assert series("kvbridge_operator_planner_last_pass_timestamp_seconds", **ours()) == 1e9
    _, [event] = written(client)
    assert (event["type"], event["reason"]) == ("Normal", "Planned")
    # what it asks for, what it asked before, and why: the rate and lengths it sized for
    assert event["message"].startswith(f"{decision.prefill} prefill, {decision.decode} decode: ")
    assert "req/s predicted (20 seen)" in event["message"]


async def test_a_held_pass_counts_as_held_reads_nan_and_resuming_is_an_event(
    prometheus: tuple[str, list[Answerer]],
) -> None:
    url, answering = prometheus
    answering.append(lambda query: (200, "application/json", b'{"status": "success", "data": null}'))
    client = kube()
    document = planned(url)
    async with ClientSession() as session:
        held = await plan_pass(client, session, document, now=1e9)
        assert held is not None
        assert held.held
        assert series("kvbridge_operator_planner_decisions_total", **ours(role="decode", reason=METRICS_MISSING))
        assert math.isnan(series("kvbridge_operator_planner_observed", **ours(figure="request_rate")) or 0.0)
        status, [event] = written(client)
        assert event["reason"] == "PlannerHeld"
        answering.pop()  # Prometheus answers again: the next pass sizes, and says it resumed
        client = kube()
        document["status"]["autoscaling"] = status
        resumed = await plan_pass(client, session, document, now=1e9 + 60)
    assert resumed is not None
    assert not resumed.held
    _, events = written(client)
    assert [e["reason"] for e in events] == ["PlannerResumed", "Planned"]
    assert events[0]["message"].startswith(f"{METRICS_MISSING} no more: ")
    assert events[1]["message"].startswith(f"{resumed.prefill} prefill, {resumed.decode} decode (was 2/1): ")


async def test_a_target_no_engine_meets_is_a_warning_once(prometheus: tuple[str, list[Answerer]]) -> None:
    url, _answering = prometheus
    document: Obj = planned(url)
    document["spec"]["autoscaling"]["ttft"] = {"milliseconds": 1}  # 1,000 tokens take 125 ms on an idle engine
    client = kube()
    async with ClientSession() as session:
        decision = await plan_pass(client, session, document, now=1e9)
        assert decision is not None
        assert decision.reason == TARGET_UNREACHABLE
        status, events = written(client)
        assert [e["reason"] for e in events] == [TARGET_UNREACHABLE, "Planned"]
        assert events[0]["type"] == "Warning"
        assert "prefill" in events[0]["message"]
        client = kube()
        document["status"]["autoscaling"] = status
        again = await plan_pass(client, session, document, now=1e9 + 60)
    assert again is not None
    assert again.reason == TARGET_UNREACHABLE
    assert written(client)[1] == []  # said once, not every pass
    assert json.dumps(status)  # the status stays JSON
