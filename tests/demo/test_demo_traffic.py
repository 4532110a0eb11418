"""The demo's vLLM requests, counted as the report counts them (the real engines run in the slow demo test): an
answer equal to a single engine's is verified, a different one is TOKENS_DIFFER, a failed request or baseline is a
failure with its code."""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge_sim import demo_traffic, pd_requests
from kvbridge_sim.demo_traffic import Transfers


class Target:
    url = "http://decode"


class Pool:
    decode = (Target(),)


class Router:
    pool = Pool()


class Local:
    url = "http://router"
    router = Router()


async def one(monkeypatch: pytest.MonkeyPatch, status: int, got: list[int], want: list[int] | Exception) -> Transfers:
    async def send(_session: Any, _url: str, _body: Any) -> tuple[int, dict[str, Any]]:
        answer = {"choices": [{"token_ids": got}]} if status == 200 else {"error": {"code": "PREFILL_UNAVAILABLE"}}
        return status, answer

    async def baseline(*_args: Any, **_kwargs: Any) -> pd_requests.Completion:
        if isinstance(want, Exception):
            raise want
        return pd_requests.Completion(want, None, 0.1)

    monkeypatch.setattr(demo_traffic, "send", send)
    monkeypatch.setattr(pd_requests, "baseline", baseline)
    monkeypatch.setattr(demo_traffic, "tiny_model_prompt", lambda length, salt: [1] * length)
    result = Transfers(check="tokens")
    equal = await demo_traffic._vllm_request(Local(), None, "m", 40, ("d-0", "d request 1/4", 0), result)  # type: ignore[arg-type]
    assert equal == (result.verified == 1)
    return result


async def test_equal_tokens_are_verified(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    result = await one(monkeypatch, 200, [1, 2], [1, 2])
    assert (result.requests, result.verified, result.failures) == (1, 1, [])
    assert result.seconds > 0
    assert "d request 1/4 via the router: 40 prompt tokens, decode's 2 tokens equal a single engine's" in (
        capsys.readouterr().err
    )


async def test_other_tokens_a_failed_request_and_a_failed_baseline_are_failures(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    differ = await one(monkeypatch, 200, [1, 2], [1, 3])
    assert [f["code"] for f in differ.failures] == ["TOKENS_DIFFER"]
    assert "d request 1/4 via the router: TOKENS_DIFFER" in capsys.readouterr().err
    failed = await one(monkeypatch, 502, [], [1])
    assert [(f["request"], f["code"]) for f in failed.failures] == [("d-0", "PREFILL_UNAVAILABLE")]
    assert "d request 1/4: PREFILL_UNAVAILABLE" in capsys.readouterr().err
    no_baseline = await one(monkeypatch, 200, [1], pd_requests.PDRequestError("http://decode", 500, "boom"))
    assert [f["code"] for f in no_baseline.failures] == ["BASELINE_FAILED"]
    assert (no_baseline.requests, no_baseline.verified) == (1, 0)
