"""One error shape through the router (issue 59): whichever role refused, the client gets the engine's OpenAI error
object (message, type, param, code) with the engine's status; the router's own errors are the same shape with its
stable codes; no pod name is in a body (the log and the ``X-KVBridge-*`` headers have them); error bodies are
bounded, whatever an engine or a proxy in front of it answers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_router.errors import ERROR_CODE, PODS, REFUSED_BY, RouteError
from kvbridge_router.proxy import RouterConfig
from kvbridge_router.refusals import MAX_ERROR_BYTES, MAX_FIELD_CHARS, MAX_MESSAGE_CHARS, engine_error

from .test_proxy import Rig, closed_port_endpoint, running_rig

#: what vLLM 0.32 answers a request naming a model it does not serve, and one over its context length
UNKNOWN_MODEL = {
    "error": {"message": "The model `gpt-4` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}
}
TOO_LONG = {
    "error": {
        "message": "This model's maximum context length is 2048 tokens. However, your request has 4000 input tokens.",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
}
FIELDS = ["code", "message", "param", "type"]


def vllm(status: int, error: dict[str, Any]) -> tuple[int, bytes, str]:
    return status, json.dumps(error).encode(), "application/json"


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    config = RouterConfig(prefill_timeout=1.0, decode_timeout=5.0, decode_idle_timeout=1.0, cold_timeout=1.0)
    async with running_rig(config, ["prefill-0", "prefill-1"], ["decode-0"]) as found:
        yield found


def no_pod_named(answer: dict[str, Any]) -> None:
    text = json.dumps(answer)
    for pod in ("prefill-0", "prefill-1", "decode-"):
        assert pod not in text, text


@pytest.mark.parametrize(("status", "error"), [(404, UNKNOWN_MODEL), (400, TOO_LONG)])
async def test_a_request_prefill_refuses_gets_the_engines_own_error_and_status(
    rig: Rig, status: int, error: dict[str, Any]
) -> None:
    for engine in rig.prefill:
        engine.scripted = vllm(status, error)
    got, answer = await rig.post({"prompt": "hello", "model": "gpt-4"})
    assert (got, answer) == (status, error)  # message, type, param and code as vLLM wrote them; no pod, no string
    assert rig.headers[REFUSED_BY] == "prefill"
    assert rig.headers[PODS] in ("prefill-0", "prefill-1")
    assert rig.headers[ERROR_CODE] == "PREFILL_REFUSED"
    assert sum(len(e.received) for e in rig.prefill) == 1  # the request's fault: not sent to another pod
    assert rig.decode[0].received == []


async def test_a_request_decode_refuses_gets_the_same_shape(rig: Rig) -> None:
    rig.decode[0].scripted = vllm(400, TOO_LONG)
    for stream in (False, True):
        got, answer = await rig.post({"prompt": "hello", "stream": stream})
        assert got == 400
        assert (answer if not stream else json.loads(answer["events"])) == TOO_LONG
        assert (rig.headers[REFUSED_BY], rig.headers[PODS], rig.headers[ERROR_CODE]) == (
            "decode",
            "decode-0",
            "DECODE_REFUSED",
        )


async def test_an_error_that_is_not_json_becomes_an_openai_error_with_the_routers_code(rig: Rig) -> None:
    page = b"<html><body>\r\n<h1>403 Forbidden</h1>\r\n</body></html>"  # a proxy in front of the engine
    for engine in rig.prefill:
        engine.scripted = (403, page, "text/html")
    got, answer = await rig.post({"prompt": "hello"})
    assert got == 403
    assert answer == {
        "error": {
            "message": "<html><body> <h1>403 Forbidden</h1> </body></html>",
            "type": "invalid_request_error",
            "param": None,
            "code": "PREFILL_REFUSED",
        }
    }
    rig.decode[0].scripted = (400, b"", "text/plain")
    for engine in rig.prefill:
        engine.scripted = None
    got, answer = await rig.post({"prompt": "hello"})
    assert got == 400
    assert answer["error"]["message"] == "the engine answered HTTP 400 without a message"
    assert answer["error"]["code"] == "DECODE_REFUSED"


async def test_an_engines_5xx_is_the_routers_error_with_the_engines_message(rig: Rig) -> None:
    """A 5xx is no refusal: the router's 502 with its code, the engine's message in its own (not its JSON)."""
    for engine in rig.prefill:
        engine.mode = "500-alive"  # healthy: the request's failure, not sent on
        engine.scripted = vllm(500, {"error": {"message": "EngineCore hit NaN", "type": "InternalServerError"}})
    got, answer = await rig.post({"prompt": "hello"})
    assert got == 502
    assert sorted(answer["error"]) == FIELDS
    assert answer["error"]["code"] == "PREFILL_FAILED"
    assert answer["error"]["type"] == "server_error"
    assert answer["error"]["message"].startswith("the prefill engine answered HTTP 500: EngineCore hit NaN (")
    assert "{" not in answer["error"]["message"]
    no_pod_named(answer)
    assert rig.headers[REFUSED_BY] == "router"
    for engine in rig.prefill:
        engine.mode, engine.scripted = "ok", None
    rig.decode[0].scripted = vllm(503, {"error": {"message": "server overloaded"}})
    got, answer = await rig.post({"prompt": "hello"})
    assert (got, answer["error"]["code"]) == (502, "DECODE_FAILED")
    assert answer["error"]["message"].startswith("the decode engine answered HTTP 503: server overloaded")
    no_pod_named(answer)
    assert rig.headers[PODS] == "decode-0"


def test_the_agent_workers_error_keeps_its_code_and_names_its_field_as_param() -> None:
    body = {"error": {"code": "LEASE_EXPIRED", "field": "kv_transfer_params", "message": "gone", "invalidBlocks": [3]}}
    assert engine_error(400, json.dumps(body).encode(), "DECODE_REFUSED") == {
        "message": "gone",
        "type": "invalid_request_error",
        "param": "kv_transfer_params",
        "code": "LEASE_EXPIRED",
    }


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"x" * (MAX_ERROR_BYTES + 1), f"the prefill engine answered HTTP 400 with an error over {MAX_ERROR_BYTES}"),
        (json.dumps({"error": {"message": "m" * 40_000}}).encode(), "m" * 100),
        (b"[" * 20_000 + b"]" * 20_000, "[" * 100),  # nesting no JSON reader takes: the text, bounded
        (b'{"error": {"message": {"a": [1, 2]}, "code": NaN, "param": 7, "type": null, "x": 1}}', '{"a": [1, 2]}'),
        ('{"error": "\udcff\\u0000 bad \\ud800"}'.encode("utf-8", "surrogateescape"), "\ufffd"),
    ],
    ids=["over-the-read-bound", "long-message", "deep-nesting", "odd-fields", "bad-bytes"],
)
async def test_huge_and_hostile_error_bodies_are_bounded(rig: Rig, body: bytes, message: str) -> None:
    for engine in rig.prefill:
        engine.scripted = (400, body, "application/json")
    got, answer = await rig.post({"prompt": "hello"})
    assert got == 400
    error = answer["error"]
    assert sorted(error) == FIELDS
    assert message in error["message"]
    assert len(error["message"]) <= MAX_MESSAGE_CHARS
    assert error["param"] is None or len(error["param"]) <= MAX_FIELD_CHARS
    assert len(json.dumps(answer)) < 2 * MAX_MESSAGE_CHARS + 4 * MAX_FIELD_CHARS
    got, _ = await rig.post({"prompt": "hello"})  # the router serves on
    assert got == 400


async def test_the_routers_own_errors_are_openai_errors_with_stable_codes_and_no_pod_names(rig: Rig) -> None:
    rig.route(prefill=[closed_port_endpoint("prefill-dead")])
    got, answer = await rig.post({"prompt": "hello"})
    assert (got, answer["error"]["code"], answer["error"]["type"]) == (502, "PREFILL_UNAVAILABLE", "server_error")
    assert sorted(answer["error"]) == FIELDS
    assert "prefill-dead" not in json.dumps(answer)
    assert "127.0.0.1" not in json.dumps(answer)
    assert (rig.headers[REFUSED_BY], rig.headers[PODS]) == ("router", "prefill-dead")
    rig.route(decode=[])
    got, answer = await rig.post({"prompt": "hello"})
    assert (got, answer["error"]["code"]) == (503, "NO_ROUTE")
    assert sorted(answer["error"]) == FIELDS
    assert (rig.headers[REFUSED_BY], rig.headers[ERROR_CODE]) == ("router", "NO_ROUTE")
    rig.route()
    rig.decode[0].mode = "die-midstream"
    got, answer = await rig.post({"prompt": "hello", "stream": True})
    last = json.loads(answer["events"].split("\n\n")[-2].removeprefix("data: "))
    assert sorted(last["error"]) == FIELDS
    assert last["error"]["code"] == "DECODE_UNAVAILABLE"
    no_pod_named(last)


def test_a_pod_name_cannot_break_the_answers_head() -> None:
    error = RouteError(504, "PREFILL_TIMEOUT", "m", pods=["p-0", "evil\r\nSet-Cookie: x=1"])
    assert error.response().headers[PODS] == "p-0,evil??Set-Cookie??x?1"


@settings(max_examples=300, deadline=None)
@given(
    status=st.integers(400, 599),
    body=st.one_of(
        st.binary(max_size=300),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=300),
            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
            max_leaves=20,
        ).map(lambda value: json.dumps({"error": value}).encode()),
        st.fixed_dictionaries(
            {},
            optional={
                "message": st.text(max_size=9000) | st.integers(),
                "type": st.text(max_size=300) | st.none(),
                "param": st.text(max_size=300) | st.integers(),
                "code": st.integers(-(2**60), 2**60) | st.text(max_size=300) | st.booleans() | st.floats(),
            },
        ).map(lambda error: json.dumps({"error": error}).encode()),
    ),
)
def test_any_error_body_becomes_one_bounded_openai_error_object(status: int, body: bytes) -> None:
    error = engine_error(status, body, "PREFILL_REFUSED")
    assert sorted(error) == FIELDS
    assert isinstance(error["message"], str)
    assert 0 < len(error["message"]) <= MAX_MESSAGE_CHARS
    assert isinstance(error["type"], str)
    assert 0 < len(error["type"]) <= MAX_FIELD_CHARS
    assert error["param"] is None or (isinstance(error["param"], str) and len(error["param"]) <= MAX_FIELD_CHARS)
    code = error["code"]
    if isinstance(code, str):
        assert len(code) <= MAX_FIELD_CHARS
    else:
        assert code is None or (type(code) is int and abs(code) < 2**53)
    json.dumps(error, allow_nan=False)  # any client reads it
    assert error["message"].encode("utf-8")  # no lone surrogate: every client's JSON reader takes it
    assert not any(ord(c) < 0x20 and c not in "\t\n" for c in error["message"])
