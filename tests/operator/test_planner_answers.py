"""What the planner makes of Prometheus' answers, and of a metrics URL that is not Prometheus (issue 56, findings 2,
4 and 6): every answer becomes a number, "no series" or a typed refusal; a pass over a deployment whose metrics
URL answers something malformed holds with ``MetricsMissing``, in the status and a ``PlannerHeld`` event; only
Prometheus' own ``error``/``errorType`` strings, bounded and cleaned, reach them; and with the planner on, neither
role may be scaled to 0 (nothing would bring it back).

The fake Prometheus here is an aiohttp server whose answer to each query a test sets; the Kubernetes API is the
recording client of test_reconcile_decide.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import SpecError
from kvbridge_operator.api.autoscaling import PLANNER_MIN_REPLICAS, AutoscalingSpec
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.cli.main import main
from kvbridge_operator.controller.autoscaling import plan_pass
from kvbridge_operator.planner.prometheus import (
    MAX_ANSWER_BYTES,
    MAX_SHOWN,
    NOT_PROMETHEUS,
    PROMETHEUS_ERROR,
    PROMETHEUS_MALFORMED,
    PrometheusError,
    Unanswered,
    instant,
    read_answer,
    read_bounds,
)
from kvbridge_operator.planner.sizing import METRICS_MISSING

from .test_operator import example
from .test_overlays import condition, reconciled
from .test_planner_prometheus import PROFILE
from .test_reconcile_decide import FakeClient

ROOT = Path(__file__).parents[2]
NAME, NAMESPACE = "llama3-8b", "default"
#: control characters and C1 controls: none may reach a status or an event
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def vector(value: str) -> bytes:
    return json.dumps(
        {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1.5, value]}]}}
    ).encode()


def idle(query: str) -> bytes:
    """A deployment without traffic, as Prometheus reports it: no requests (so 0/0 lengths and latencies: NaN), none
    decoding, the engines scraped a second ago."""
    if query.startswith("time() -"):
        return vector("1")
    if ("request_success_total" in query and "/" not in query) or "prefix_cache" in query or "running" in query:
        return vector("0")
    return vector("NaN")


Answerer = Callable[[str], tuple[int, str, bytes]]


@pytest.fixture
async def metrics_url() -> AsyncIterator[tuple[str, list[Answerer]]]:
    """A fake metrics URL; a test sets what it answers by putting an ``Answerer`` in the list."""
    answering: list[Answerer] = [lambda query: (200, "application/json", idle(query))]

    async def query(request: web.Request) -> web.Response:
        status, content_type, body = answering[-1](request.query.get("query", ""))
        redirect = {"Location": "/elsewhere"} if 300 <= status < 400 else {}
        return web.Response(status=status, body=body, content_type=content_type, headers=redirect)

    async def elsewhere(request: web.Request) -> web.Response:  # where a redirect points: a fine answer
        return web.Response(body=vector("5"), content_type="application/json")

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    app.router.add_get("/elsewhere", elsewhere)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}", answering
    finally:
        await server.close()


def planned(url: str, **roles: Obj) -> Obj:
    """The example deployment with the planner on, reading ``url``; ``roles`` overlays prefill and decode."""
    document = example("synthetic/llama3-8b-hetero-tp")
    document["metadata"] |= {"namespace": NAMESPACE, "uid": "u-1"}
    for role, overlay in roles.items():
        document["spec"][role] |= overlay
    document["spec"]["autoscaling"] = {
        "enabled": True,
        "prometheusUrl": url,
        "ttft": {"milliseconds": 500},
        "itl": {"milliseconds": 30, "percentile": 90},
        "profile": {"name": "profile"},
        "stabilizationWindowSeconds": 0,
    }
    document["status"] = {"prefill": {"replicas": 2}, "decode": {"replicas": 1}}
    return document


def kube() -> FakeClient:
    profile = {"metadata": {"name": "profile"}, "data": {"profile.json": json.dumps(PROFILE)}}
    roles = {
        ("disaggregatedroles", f"{NAME}-{role}"): {"metadata": {"resourceVersion": "1"}, "spec": {"replicas": n}}
        for role, n in (("prefill", 2), ("decode", 1))
    }
    return FakeClient({("configmaps", "profile"): profile, **roles})


def written(client: FakeClient) -> tuple[Obj, list[Obj]]:
    """What the pass wrote: status.autoscaling and the events it posted."""
    [status] = [body["status"]["autoscaling"] for (verb, plural, _), body in client.bodies if verb == "patch/status"]
    events = [body for (verb, plural, _), body in client.bodies if verb == "create" and plural == "events"]
    return status, events


def scaled(client: FakeClient) -> dict[str, int]:
    return {
        name.rsplit("-", 1)[1]: body["spec"]["replicas"]
        for (verb, plural, name), body in client.bodies
        if verb == "patch" and plural == "disaggregatedroles"
    }


# --- finding 4: answers that parse but are no vector or scalar -------------------------------------------------------
MALFORMED: list[tuple[str, bytes]] = [
    ("data-null", b'{"status": "success", "data": null}'),
    ("data-list", b'{"status": "success", "data": []}'),
    ("data-missing", b'{"status": "success"}'),
    ("scalar-abc", b'{"status": "success", "data": {"resultType": "scalar", "result": "abc"}}'),
    ("scalar-null", b'{"status": "success", "data": {"resultType": "scalar", "result": null}}'),
    ("scalar-pair-abc", b'{"status": "success", "data": {"resultType": "scalar", "result": [1, "abc"]}}'),
    ("scalar-pair-number", b'{"status": "success", "data": {"resultType": "scalar", "result": [1, 2]}}'),
    ("matrix", b'{"status": "success", "data": {"resultType": "matrix", "result": [{"values": [[1, "1"]]}]}}'),
    ("string", b'{"status": "success", "data": {"resultType": "string", "result": [1, "x"]}}'),
    ("no-result-type", b'{"status": "success", "data": {"result": []}}'),
    ("vector-no-value", b'{"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}}]}}'),
    ("vector-value-null", b'{"status": "success", "data": {"resultType": "vector", "result": [{"value": null}]}}'),
    ("vector-result-dict", b'{"status": "success", "data": {"resultType": "vector", "result": {"a": 1}}}'),
    ("vector-of-null", b'{"status": "success", "data": {"resultType": "vector", "result": [null]}}'),
    ("value-abc", vector("abc")),
    ("value-empty", vector("")),
    ("value-underscores", vector("1_000")),
    ("value-long", vector("1" * 10_000)),
    (
        "value-not-a-string",
        json.dumps({"status": "success", "data": {"resultType": "vector", "result": [{"value": [1, 3]}]}}).encode(),
    ),
    (
        "value-huge-int",
        b'{"status": "success", "data": {"resultType": "scalar", "result": [1' + b"0" * 500 + b', "1"]}}',
    ),
    (
        "many-series",
        json.dumps(
            {"status": "success", "data": {"resultType": "vector", "result": [{"value": [1, "1"]}] * 10_000}}
        ).encode(),
    ),
    ("deep", b'{"status": "success", "data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    (
        "huge",
        b'{"status": "success", "data": {"resultType": "vector", "result": []}, "pad": "'
        + b"x" * (2 * MAX_ANSWER_BYTES)
        + b'"}',
    ),
    ("status-other", b'{"status": "pending"}'),
    ("not-an-object", b"[1, 2, 3]"),
    ("null", b"null"),
    ("number", b"42"),
]


@pytest.mark.parametrize(("body"), [body for _, body in MALFORMED], ids=[name for name, _ in MALFORMED])
def test_an_answer_that_is_no_vector_or_scalar_is_a_typed_refusal(body: bytes) -> None:
    answer = read_answer(200, body)
    assert isinstance(answer, Unanswered), answer
    assert answer.code in (PROMETHEUS_MALFORMED, NOT_PROMETHEUS)
    assert len(answer.message) <= MAX_SHOWN
    assert not CONTROL.search(answer.message)
    assert "abc" not in answer.message
    assert "xxxx" not in answer.message


@pytest.mark.parametrize(
    ("body", "value"),
    [
        (vector("3.5"), 3.5),
        (vector("-2"), -2.0),
        (vector("+Inf"), math.inf),
        (vector("-Inf"), -math.inf),
        (vector("1e3"), 1000.0),
        (b'{"status": "success", "data": {"resultType": "scalar", "result": [1.5, "7"]}}', 7.0),
        (b'{"status": "success", "data": {"resultType": "vector", "result": []}}', None),
        # what Prometheus adds around its data is ignored: warnings, infos, stats
        (b'{"status": "success", "warnings": ["w"], "data": {"resultType": "scalar", "result": [1, "2"]}}', 2.0),
    ],
)
def test_numbers_and_no_series_read_as_prometheus_writes_them(body: bytes, value: float | None) -> None:
    assert read_answer(200, body) == value


def test_nan_reads_as_nan_which_the_sizing_reports_where_it_matters() -> None:
    answer = read_answer(200, vector("NaN"))
    assert isinstance(answer, float)
    assert math.isnan(answer)


def test_two_series_where_one_was_expected_is_refused() -> None:
    body = {"status": "success", "data": {"resultType": "vector", "result": [{"value": [1, "1"]}] * 2}}
    answer = read_answer(200, json.dumps(body).encode())
    assert isinstance(answer, Unanswered)
    assert answer.code == PROMETHEUS_MALFORMED
    assert "2 series" in answer.message


JSON = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=30,
)
#: a sample as Prometheus writes one, or nearly: [Unix time, value], the value a number's text or anything else
SAMPLE = st.tuples(
    st.floats(0, 2e9) | st.integers() | JSON,
    st.sampled_from(["1", "0", "-2.5", "1e3", "NaN", "+Inf", "-Inf", ".5", "1e999", "1_0", " 1", "inf", ""])
    | st.from_regex(r"\A[-+]?[0-9]{1,30}(\.[0-9]{0,30})?([eE][-+]?[0-9]{1,4})?\Z")
    | JSON,
).map(list)
#: JSON shaped like Prometheus' answers, so that the search reaches the data's checks and not only the envelope's
SHAPED = st.fixed_dictionaries(
    {"status": st.sampled_from(["success", "error"]) | JSON},
    optional={
        "data": st.fixed_dictionaries(
            {"resultType": st.sampled_from(["vector", "scalar", "matrix", "string"]) | JSON},
            optional={
                "result": SAMPLE
                | st.lists(st.fixed_dictionaries({"value": SAMPLE}, optional={"metric": JSON}), max_size=3)
                | JSON
            },
        )
        | JSON,
        "error": st.text(max_size=300) | JSON,
        "errorType": st.text(max_size=30) | JSON,
        "warnings": JSON,
    },
)
#: success answers of the right shape but for their samples: the values' checks
NEAR = st.builds(
    lambda kind, result: {"status": "success", "data": {"resultType": kind, "result": result}},
    st.sampled_from(["vector", "scalar"]),
    SAMPLE | st.lists(st.fixed_dictionaries({"metric": st.just({}), "value": SAMPLE}), max_size=2),
)


@settings(max_examples=1500, deadline=None)
@given(st.sampled_from([200, 400, 404, 422, 500, 503]), NEAR | SHAPED | JSON)
def test_any_json_answer_is_a_number_no_series_or_a_typed_refusal(status: int, body: object) -> None:
    answer = read_answer(status, json.dumps(body).encode())
    assert answer is None or isinstance(answer, float | Unanswered)
    if isinstance(answer, Unanswered):
        assert answer.code in (PROMETHEUS_MALFORMED, NOT_PROMETHEUS, PROMETHEUS_ERROR)
        assert len(answer.message) <= MAX_SHOWN
        assert not CONTROL.search(answer.message)
    elif status != 200:
        pytest.fail(f"HTTP {status} read as an answer: {answer}")


@settings(max_examples=500, deadline=None)
@given(st.sampled_from([200, 404, 500]), st.binary(max_size=200))
def test_any_bytes_are_a_number_no_series_or_a_typed_refusal(status: int, body: bytes) -> None:
    answer = read_answer(status, body)
    assert answer is None or isinstance(answer, float | Unanswered)


@pytest.mark.parametrize(
    ("name", "body"),
    [
        m
        for m in MALFORMED
        if m[0] in ("data-null", "data-list", "scalar-abc", "scalar-null", "scalar-pair-abc", "matrix", "huge", "deep")
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
async def test_a_pass_over_a_malformed_answer_holds_with_metrics_missing_status_and_event(
    metrics_url: tuple[str, list[Answerer]], name: str, body: bytes
) -> None:
    url, answering = metrics_url
    answering.append(lambda query: (200, "application/json", body))
    client = kube()
    async with ClientSession() as session:
        decision = await plan_pass(client, session, planned(url), now=1e9)
    assert decision is not None
    assert decision.held
    assert decision.reason == METRICS_MISSING
    status, events = written(client)
    assert (status["state"], status["held"], status["planned"]) == (METRICS_MISSING, True, "2/1")
    [event] = events
    assert (event["type"], event["reason"]) == ("Warning", "PlannerHeld")
    assert event["message"].startswith(f"{METRICS_MISSING}: Prometheus at {url}: ")
    assert scaled(client) == {}


# --- finding 6: only Prometheus' own error strings reach the status ---------------------------------------------------
HTML = b"<html><head><title>Admin</title></head><body>secret-token-1234 internal page</body></html>"


@pytest.mark.parametrize("status", [200, 401, 404, 500])
def test_an_answer_that_is_not_prometheus_is_named_by_its_status_alone(status: int) -> None:
    answer = read_answer(status, HTML)
    assert answer == Unanswered(NOT_PROMETHEUS, f"HTTP {status} from the metrics URL (not a Prometheus API answer)")


def test_prometheus_own_error_is_shown_bounded_and_cleaned() -> None:
    body = {
        "status": "error",
        "errorType": "bad_data",
        "error": "parse error at char 4:\x1b[31m unexpected\n" + "x" * 5000,
    }
    answer = read_answer(400, json.dumps(body).encode())
    assert isinstance(answer, Unanswered)
    assert answer.code == PROMETHEUS_ERROR
    assert answer.message.startswith("Prometheus: bad_data: parse error at char 4: [31m unexpected ")
    assert len(answer.message) <= MAX_SHOWN
    assert not CONTROL.search(answer.message)
    # an error answer's other fields (data, anything) never show, whatever they hold
    sneaky = {"status": "error", "errorType": "timeout", "error": "query timed out", "data": HTML.decode()}
    assert read_answer(503, json.dumps(sneaky).encode()) == Unanswered(
        PROMETHEUS_ERROR, "Prometheus: timeout: query timed out"
    )
    # an error of the wrong types: no Prometheus answer
    odd = read_answer(500, json.dumps({"status": "error", "error": {"html": HTML.decode()}}).encode())
    assert odd == Unanswered(NOT_PROMETHEUS, "HTTP 500 from the metrics URL (not a Prometheus API answer)")


#: another server's answers: a page, and JSON that is no Prometheus answer (before, 300 characters of its text went
#: into the status and the event, escape sequences included)
FOREIGN = [("text/html", HTML), ("application/json", json.dumps({"message": "secret-token-1234 \x1b[2J"}).encode())]


@pytest.mark.parametrize(("content_type", "body"), FOREIGN, ids=["html", "json"])
async def test_a_pass_against_some_other_server_shows_no_byte_of_its_body(
    metrics_url: tuple[str, list[Answerer]], content_type: str, body: bytes
) -> None:
    url, answering = metrics_url
    answering.append(lambda query: (404, content_type, body))
    client = kube()
    async with ClientSession() as session:
        decision = await plan_pass(client, session, planned(url), now=1e9)
    assert decision is not None
    assert decision.reason == METRICS_MISSING
    status, [event] = written(client)
    for text in (status["message"], event["message"]):
        assert "secret-token" not in text
        assert "<html" not in text
        assert not CONTROL.search(text)
        assert "HTTP 404 from the metrics URL (not a Prometheus API answer)" in text


async def test_a_redirect_is_not_followed(metrics_url: tuple[str, list[Answerer]]) -> None:
    """A redirect would take the operator's GET elsewhere (its target answers 5 here): it is an answer that is not
    Prometheus'."""
    url, answering = metrics_url
    async with ClientSession() as session:
        answering.append(lambda query: (302, "text/plain", b""))
        with pytest.raises(PrometheusError, match="HTTP 302 from the metrics URL") as caught:
            await instant(session, url, "up")
    assert caught.value.code == NOT_PROMETHEUS


@pytest.mark.parametrize(
    "url",
    [
        "http://user:pass@prometheus:9090",
        "http://user@prometheus:9090",
        "http://prometheus:9090/?query=x",
        "http://prometheus:9090/#x",
        "ftp://prometheus:9090",
        "file:///etc/passwd",
        "http://prometheus:9090/\x00",
        "http://prometheus:9090/a b",
        "http://",
        "prometheus:9090",
    ],
)
def test_a_metrics_url_with_credentials_a_query_or_another_scheme_is_refused(url: str) -> None:
    document = planned(url)
    with pytest.raises(SpecError) as caught:
        parse_deployment(document)
    assert caught.value.field == "spec.autoscaling.prometheusUrl"


@pytest.mark.parametrize(
    "url",
    ["http://prometheus.monitoring:9090", "https://10.0.0.7:9090/prometheus/", "http://[fd00::7]:9090", ""],
)
def test_a_plain_metrics_url_is_accepted(url: str) -> None:
    assert AutoscalingSpec.model_validate({"prometheusUrl": url}).prometheus_url == url


# --- finding 2: no role at 0 with the planner on ----------------------------------------------------------------------
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_planner_refuses_a_minimum_of_zero(role: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_deployment(planned("http://prometheus:9090", **{role: {"minReplicas": 0, "replicas": 1}}))
    assert (caught.value.code, caught.value.field) == (PLANNER_MIN_REPLICAS, f"spec.{role}.minReplicas")
    assert "set minReplicas: 1 or more; scale from zero is not supported" in caught.value.message
    without = planned("http://prometheus:9090", **{role: {"minReplicas": 0, "replicas": 1}})
    without["spec"]["autoscaling"]["enabled"] = False
    assert getattr(parse_deployment(without).spec, role).min_replicas == 0  # an autoscaler of your own may


def test_the_operator_and_plan_report_a_minimum_of_zero_as_any_invalid_spec(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same path as every spec problem: the reconcile writes Compatible=False, reason InvalidSpec, with a
    Warning event, and applies nothing; ``kvbridge plan --json`` lists the problem with its code and field."""
    document = planned("http://prometheus:9090", decode={"minReplicas": 0})
    status, events, applied = reconciled(document)
    assert not applied
    compatible = condition(status)
    assert (compatible["status"], compatible["reason"]) == ("False", "InvalidSpec")
    assert "spec.decode.minReplicas: 0 lets the planner" in compatible["message"]
    assert [(e.type, e.reason) for e in events] == [("Warning", "InvalidSpec")]
    (tmp_path / "dd.json").write_text(json.dumps({k: v for k, v in document.items() if k != "status"}))
    assert main(["plan", "-f", str(tmp_path / "dd.json"), "--json"]) == 2
    [entry] = json.loads(capsys.readouterr().out)
    [problem] = entry["problems"]
    assert (problem["code"], problem["field"]) == (PLANNER_MIN_REPLICAS, "spec.decode.minReplicas")


def test_the_default_minimum_is_one() -> None:
    dd = parse_deployment(planned("http://prometheus:9090"))
    assert (dd.spec.prefill.min_replicas, dd.spec.decode.min_replicas) == (1, 1)


async def test_an_idle_deployment_keeps_one_engine_of_each_role(metrics_url: tuple[str, list[Answerer]]) -> None:
    """Before: with the default minimum (0) one idle pass scaled both roles to 0, after which decode's series
    were gone and every pass held at 0/0. Now the default minimum is 1: an idle deployment keeps a pair, whose
    series the next pass reads."""
    url, _ = metrics_url
    client = kube()
    async with ClientSession() as session:
        decision = await plan_pass(client, session, planned(url), now=1e9)
    assert decision is not None
    assert not decision.held, decision
    assert (decision.prefill, decision.decode) == (1, 1)
    assert scaled(client) == {"prefill": 1}


def test_the_egress_policy_the_docs_recommend_is_a_valid_network_policy_selecting_the_operator() -> None:
    """docs/autoscaling.md recommends a NetworkPolicy on the operator's egress (the metrics URL's reach): it must be
    one Kubernetes takes, and select the chart's operator pod."""
    page = (ROOT / "docs" / "autoscaling.md").read_text()
    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", page, re.DOTALL) if "kind: NetworkPolicy" in b]
    policy = yaml.safe_load(block)
    kubernetes_validate.validate(policy, "1.30", strict=True)
    rendered = yaml.safe_load_all((ROOT / "deploy" / "kvbridge.yaml").read_text())  # the chart, rendered
    [operator] = [d for d in rendered if d and d["kind"] == "Deployment"]
    labels = operator["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["metadata"]["namespace"] == operator["metadata"]["namespace"]


@pytest.mark.parametrize(
    "metric", [{"le": "1", "token=hunter2-" + "k" * 60: "x"}, {"le": "1", "token=hunter2": "v" * 70}]
)
def test_a_label_name_from_the_body_is_never_shown(metric: dict[str, str]) -> None:
    body = json.dumps(
        {"status": "success", "data": {"resultType": "vector", "result": [{"metric": metric, "value": [1, "1"]}]}}
    )
    answer = read_bounds(200, body.encode())
    assert isinstance(answer, Unanswered)
    assert answer.code == PROMETHEUS_MALFORMED
    assert "hunter2" not in answer.message
    assert "metric" in answer.message
