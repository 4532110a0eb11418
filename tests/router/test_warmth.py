"""Warm before it times out (issue 59): a pod's first call of a kind of request gets ``cold_timeout`` instead of the
usual bounds (vLLM's CPU build compiles on its first logprobs request: 60-90 s), against engines whose first answers
are slow; later calls of that kind get the usual bounds again, and a restarted pod is cold again."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from kvbridge_router.proxy import RouterConfig
from kvbridge_router.warmth import Warmth, kind

from .test_proxy import Rig, running_rig

#: the usual bounds here, and the cold one
USUAL, COLD, SLOW = 0.4, 5.0, 1.2


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    config = RouterConfig(prefill_timeout=USUAL, decode_timeout=10.0, decode_idle_timeout=USUAL, cold_timeout=COLD)
    async with running_rig(config, ["prefill-0"], ["decode-0"]) as found:
        yield found


async def timed(rig: Rig, body: dict[str, object]) -> tuple[int, str, float]:
    started = time.monotonic()
    status, answer = await rig.post(body)
    code = answer.get("error", {}).get("code", "") if isinstance(answer.get("error"), dict) else ""
    return status, code, time.monotonic() - started


async def test_a_cold_prefill_pods_first_request_of_each_kind_waits_for_it(rig: Rig) -> None:
    prefill = rig.prefill[0]
    prefill.delays = [SLOW]  # compiling: its first answer takes three times the usual bound
    status, _, took = await timed(rig, {"prompt": [1]})
    assert status == 200
    assert took >= SLOW
    prefill.delays = [SLOW]  # warm for plain completions: the usual bound again (a stuck pod is cut off)
    status, code, took = await timed(rig, {"prompt": [1]})
    assert (status, code) == (504, "PREFILL_TIMEOUT")
    assert took < SLOW
    prefill.delays = [SLOW]  # its first logprobs request: another path, cold
    status, _, _ = await timed(rig, {"prompt": [1], "logprobs": 3})
    assert status == 200
    prefill.delays = [SLOW]
    status, code, _ = await timed(rig, {"prompt": [1], "logprobs": 5})
    assert (status, code) == (504, "PREFILL_TIMEOUT")


async def test_a_cold_decode_pods_first_stream_waits_for_its_first_chunk(rig: Rig) -> None:
    decode = rig.decode[0]
    decode.delays = [SLOW]
    status, answer = await rig.post({"prompt": [1], "stream": True})
    assert status == 200
    assert '"token_ids": [1]' in answer["events"]
    decode.delays = [SLOW]  # warm: a stream's usual bound for its first chunk
    status, answer = await rig.post({"prompt": [1], "stream": True})
    assert "DECODE_TIMEOUT" in answer["events"]


async def test_a_restarted_pod_is_cold_again(rig: Rig) -> None:
    prefill = rig.prefill[0]
    status, _ = await rig.post({"prompt": [1]})
    assert status == 200
    restarted = {**prefill.endpoint, "incarnation": "uid:1"}  # its containers restarted: a new engine, compiling
    rig.route(prefill=[{**prefill.endpoint, "incarnation": "uid:0"}])
    rig.route(prefill=[restarted])
    prefill.delays = [SLOW]
    status, _, took = await timed(rig, {"prompt": [1]})
    assert status == 200
    assert took >= SLOW


async def test_the_cold_bound_stays_within_the_requests_own() -> None:
    config = RouterConfig(prefill_timeout=USUAL, decode_idle_timeout=USUAL, cold_timeout=COLD, request_timeout=0.8)
    async with running_rig(config, ["prefill-0"], ["decode-0"]) as rig:
        rig.prefill[0].delays = [SLOW]
        status, code, took = await timed(rig, {"prompt": [1]})
        assert (status, code) == (504, "REQUEST_TIMEOUT")
        assert took < SLOW


def test_a_requests_kind_is_its_route_and_the_paths_it_asks_for() -> None:
    assert kind("completions", {"prompt": "x"}) == "completions"
    assert kind("completions", {"prompt": "x", "logprobs": 0}) == "completions+logprobs"
    assert kind("completions", {"prompt": "x", "logprobs": None, "echo": False}) == "completions"
    assert kind("chat", {"logprobs": False, "top_logprobs": None}) == "chat"
    assert kind("chat", {"logprobs": True, "response_format": {"type": "json_object"}}) == "chat+logprobs+structured"
    assert kind("chat", {"response_format": {"type": "text"}}) == "chat"
    assert kind("completions", {"prompt_logprobs": 1}) == "completions+prompt_logprobs"


def test_a_pod_is_cold_per_kind_until_it_answered_and_forgotten_when_it_leaves() -> None:
    warmth = Warmth()
    assert warmth.cold("p-0", "completions")
    warmth.warmed("p-0", "completions")
    assert not warmth.cold("p-0", "completions")
    assert warmth.cold("p-0", "completions+logprobs")
    assert warmth.cold("p-1", "completions")
    warmth.keep_only(["p-1"])
    assert warmth.cold("p-0", "completions")
