"""``kvbridge-router`` in front of real vLLM prefill and decode engines (NixlConnector, exactly the rendered pods):
a single engine's greedy tokens, streamed or not; a prefill pod killed while requests go on."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvbridge_agent.core import Role
from kvbridge_operator.api.router_settings import RouterPolicy
from kvbridge_router.pool import Pool
from kvbridge_router.proxy import RouterConfig
from kvbridge_sim import pd_requests
from kvbridge_sim.tiny_model import prompt
from kvbridge_sim.vllm_engines import MODEL_NAME, Engines

from .conftest import DEPLOYMENTS
from .routing import endpoint, pod_calls, pool, running_router, streamed_tokens

MAX_TOKENS = 12
BLOCK = 32


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with pd_requests.client_session(180) as s:
        yield s


def _pool_of(engines: Engines, prefill: list[str]) -> Pool:
    return pool(
        [
            endpoint(engines, name, DEPLOYMENTS["short-lease" if "short" in name else "tp1"], Role.PREFILL)
            for name in prefill
        ],
        [endpoint(engines, "decode", DEPLOYMENTS["tp1"], Role.DECODE)],
    )


async def _via_router(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    tokens: list[int],
    stream: bool,
) -> tuple[int, list[int], str]:
    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    async with session.post(f"{url}/v1/completions", json=body) as response:
        text = await response.text()
    if response.status != 200:
        return response.status, [], text
    if stream:
        return 200, streamed_tokens(text), text
    return 200, list(json.loads(text)["choices"][0]["token_ids"]), text


async def test_router_answers_as_a_single_engine_streamed_or_not(
    tp1_engines: Engines, session: aiohttp.ClientSession
) -> None:
    model = MODEL_NAME
    decode = tp1_engines.engines["decode"]
    async with running_router() as (router, url):
        router.set_pool(_pool_of(tp1_engines, ["prefill-tp1"]))
        for index, length in enumerate((7, BLOCK, 3 * BLOCK + 13)):
            tokens = prompt(length, salt=900 + index)
            want = await pd_requests.baseline(session, decode.url, model, tokens, MAX_TOKENS, salt=f"router-{index}")
            status, got, text = await _via_router(session, url, model, tokens, stream=False)
            assert status == 200, text
            assert got == want.tokens, f"{length} tokens via the router: {got} != single engine {want.tokens}"
            status, streamed, text = await _via_router(session, url, model, tokens, stream=True)
            assert status == 200, text
            assert streamed == want.tokens, f"{length} tokens streamed via the router: {streamed} != {want.tokens}"
            assert text.rstrip().endswith("data: [DONE]")
        assert await pod_calls(session, url, "prefill", "prefill-tp1") == 6
        assert await pod_calls(session, url, "decode", "decode") == 6


async def test_chat_completions_through_the_router_as_a_single_engine(
    tp1_engines: Engines, session: aiohttp.ClientSession
) -> None:
    """What an OpenAI SDK's ``chat.completions`` sends: the local model's chat template applies on both engines,
    and P/D answers as the decode engine alone does."""
    model = MODEL_NAME
    decode = tp1_engines.engines["decode"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    async with session.post(f"{decode.url}/v1/chat/completions", json=body | {"cache_salt": "chat"}) as response:
        alone = await response.json()
    assert response.status == 200, alone
    async with running_router() as (router, url):
        router.set_pool(_pool_of(tp1_engines, ["prefill-tp1"]))
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            answer = await response.json()
        assert response.status == 200, answer
        assert await pod_calls(session, url, "prefill", "prefill-tp1") == 1
    assert answer["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS


async def _prefix_hits(session: aiohttp.ClientSession, url: str) -> float:
    """The engine's prefix-cache hits so far, in tokens (vLLM's own counter)."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total")
    )


async def test_n_sampled_completions_as_a_single_engine_samples_them(
    tp1_engines: Engines, session: aiohttp.ClientSession
) -> None:
    """OpenAI's ``n`` with a seed and a temperature: the router's n P/D requests sample what one engine's n samples
    do (vLLM seeds its samples seed, seed + 1, ...), and the prefill engine computes the prompt once (the later
    samples' prefills hit its prefix cache)."""
    model, n = MODEL_NAME, 3
    decode, prefill = tp1_engines.engines["decode"], tp1_engines.engines["prefill-tp1"]
    tokens = prompt(3 * BLOCK + 13, salt=1313)
    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": MAX_TOKENS,
        "n": n,
        "seed": 11,
        "temperature": 0.8,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    async with session.post(f"{decode.url}/v1/completions", json=body | {"cache_salt": "samples"}) as response:
        alone = await response.json()
    assert response.status == 200, alone
    want = [choice["token_ids"] for choice in sorted(alone["choices"], key=lambda c: c["index"])]
    assert len({tuple(t) for t in want}) > 1  # sampled: the seeds tell the samples apart
    hits = await _prefix_hits(session, prefill.url)
    async with running_router() as (router, url):
        router.set_pool(_pool_of(tp1_engines, ["prefill-tp1"]))
        async with session.post(f"{url}/v1/completions", json=body) as response:
            answer = await response.json()
        assert response.status == 200, answer
        assert await pod_calls(session, url, "prefill", "prefill-tp1") == n
        assert await pod_calls(session, url, "decode", "decode") == n
    assert [choice["index"] for choice in answer["choices"]] == list(range(n))
    assert [choice["token_ids"] for choice in answer["choices"]] == want
    assert answer["usage"]["prompt_tokens"] == len(tokens)
    assert answer["usage"]["completion_tokens"] == n * MAX_TOKENS
    assert await _prefix_hits(session, prefill.url) - hits >= (n - 1) * 3 * BLOCK  # the prompt's 3 blocks, reused


async def test_router_keeps_serving_while_a_prefill_pod_is_killed(
    tp1_engines: Engines, session: aiohttp.ClientSession
) -> None:
    """Two prefill pods of one pairing key; one is killed while the status still lists it (the operator has not
    seen it yet): every request is retried on the other and answers as a single engine. With only the dead pod
    listed, requests fail at once with 502, never hang. The pod killed is the short-lease one: the survivor must
    hold its blocks long enough for decode to read them on a loaded machine (30 s, not 2). (The pod's restart and
    the requests that reach its new engine through the router are `make demo`'s, checked in tests/demo/test_demo.py;
    this file runs last, so the killed engine is not started again here: that would cost a minute and a half.)"""
    model = MODEL_NAME
    decode = tp1_engines.engines["decode"]
    # least-loaded: an idle pool's requests take turns, so the dead pod is tried first by every other request (the
    # kv-aware ring places each new prompt by its keys, which may put all four on the live pod)
    config = RouterConfig(
        prefill_timeout=30, decode_timeout=120, connect_timeout=2, policy=RouterPolicy.LEAST_LOADED.value
    )
    async with running_router(config) as (router, url):
        router.set_pool(_pool_of(tp1_engines, ["prefill-tp1", "prefill-short-lease"]))
        tp1_engines.stop(["prefill-short-lease"])  # the process is gone; its address stays in the pool
        for index in range(4):
            tokens = prompt(2 * BLOCK + 3, salt=950 + index)
            status, got, text = await _via_router(session, url, model, tokens, stream=index % 2 == 1)
            assert status == 200, f"{text}\n{tp1_engines.log_tails(['prefill-tp1', 'decode'])}"
            want = await pd_requests.baseline(
                session, decode.url, model, tokens, MAX_TOKENS, salt=f"router-kill-{index}"
            )
            assert got == want.tokens
        metrics = await (await session.get(f"{url}/metrics")).text()
        assert 'kvbridge_router_prefill_retries_total{pod="prefill-short-lease"}' in metrics  # tried and skipped
        router.set_pool(_pool_of(tp1_engines, ["prefill-short-lease"]))
        started = time.monotonic()
        status, _, text = await _via_router(session, url, model, prompt(40, salt=960), stream=False)
        assert status == 502
        assert "PREFILL_UNAVAILABLE" in text
        assert "prefill-short-lease" not in text  # pod names go to the log and X-KVBridge-Pods, never the body
        assert time.monotonic() - started < 10
