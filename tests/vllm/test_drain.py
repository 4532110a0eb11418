"""A pod's main process sent SIGTERM under load, as a kubelet does when a pod is deleted (here without the preStop
and without the status changing: the router keeps choosing the pod until it fails): real vLLM with kvbridge's
connector, two prefill and two decode pods rendered by the operator (``--shutdown-timeout`` included), the router
in front. No request fails, none hangs, none answers other tokens than a single engine (but
at a tie of the engine's two best tokens, where a batch may take either: pd_requests.divergence)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from kvbridge_agent.core import Role
from kvbridge_router.proxy import RouterConfig
from kvbridge_sim import pd_requests, pods
from kvbridge_sim.vllm_engines import MODEL_NAME, Engines

from .conftest import DEPLOYMENTS, SUMMARY
from .routing import endpoint, pool, running_router

CLIENTS = 4
#: the drain bound rendered for the deployment (spec.transfer.drainSeconds) plus a margin: the grace a kubelet gives
GRACE_SECONDS = 45.0


@dataclass
class Answer:
    prompt: list[int]
    max_tokens: int
    stream: bool
    status: int
    tokens: list[int]
    finish: str | None
    seconds: float
    error: str = ""


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with pd_requests.client_session(180) as s:
        yield s


def parse(text: str, stream: bool) -> tuple[list[int], str | None, str]:
    """Token ids, finish reason and an error of a completion (SSE events split on blank lines: generated text may
    hold any character, line separators included)."""
    if not stream:
        choice = json.loads(text)["choices"][0]
        return list(choice.get("token_ids") or []), choice.get("finish_reason"), ""
    tokens: list[int] = []
    finish: str | None = None
    for event in text.split("\n\n"):
        data = event.strip().removeprefix("data: ")
        if not data or data == "[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            return tokens, finish, json.dumps(chunk["error"])[:300]
        for choice in chunk.get("choices", []):
            tokens += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
    return tokens, finish, ""


async def client(
    session: aiohttp.ClientSession, url: str, model: str, index: int, until: float, answers: list[Answer]
) -> None:
    rnd = random.Random(index)
    while time.monotonic() < until:
        prompt = [rnd.randint(5, 900) for _ in range(rnd.randint(16, 300))]
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": rnd.randint(4, 16),
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": index % 2 == 1,
        }
        started = time.monotonic()
        try:
            async with session.post(f"{url}/v1/completions", json=body) as response:
                text = await response.text()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            text, status = repr(exc), -1
        tokens, finish, error = parse(text, body["stream"]) if status == 200 else ([], None, text[:300])
        answers.append(
            Answer(
                prompt, body["max_tokens"], body["stream"], status, tokens, finish, time.monotonic() - started, error
            )
        )


async def test_sigterm_to_a_decode_then_a_prefill_pod_under_load_loses_no_request(
    kvbridge_pairs: Engines, session: aiohttp.ClientSession
) -> None:
    engines = kvbridge_pairs
    model = MODEL_NAME
    document = DEPLOYMENTS["kvbridge"]
    config = RouterConfig(prefill_timeout=60, decode_timeout=120, connect_timeout=2, request_timeout=120)
    answers: list[Answer] = []
    async with running_router(config) as (router, url):
        router.set_pool(
            pool(
                [
                    endpoint(engines, name, document, Role.PREFILL)
                    for name in ("kvbridge-prefill", "kvbridge-prefill-b")
                ],
                [endpoint(engines, name, document, Role.DECODE) for name in ("kvbridge-decode", "kvbridge-decode-b")],
            )
        )
        loop = asyncio.get_running_loop()
        until = time.monotonic() + 40
        load = [asyncio.create_task(client(session, url, model, i, until, answers)) for i in range(CLIENTS)]
        ended: dict[str, float] = {}

        def terminate(name: str) -> None:  # a kubelet's SIGTERM to the container's main process, then its grace
            process = engines.engines[name].process
            assert process is not None
            started = time.monotonic()
            pods.terminate(process, GRACE_SECONDS)
            ended[name] = time.monotonic() - started
            engines.engines[name].process = None

        await asyncio.sleep(5)
        decode_end = threading.Thread(target=terminate, args=("kvbridge-decode-b",))
        decode_end.start()
        await asyncio.sleep(8)
        prefill_end = threading.Thread(target=terminate, args=("kvbridge-prefill-b",))
        prefill_end.start()
        await asyncio.gather(*load)
        await loop.run_in_executor(None, decode_end.join, GRACE_SECONDS + 20)
        await loop.run_in_executor(None, prefill_end.join, GRACE_SECONDS + 20)
    failed = [a for a in answers if a.status != 200 or a.error]
    cut = [a for a in answers if a not in failed and (len(a.tokens) != a.max_tokens or a.finish != "length")]
    logs = engines.log_tails(["kvbridge-decode-b", "kvbridge-prefill-b"], 1500)
    SUMMARY["drainLoadRequests"] = len(answers)  # printed at the session's end: the guard below has a margin
    assert len(answers) > 100, f"the load sent only {len(answers)} requests"
    assert not failed, f"{len(failed)} of {len(answers)} failed: {[(a.status, a.error) for a in failed[:5]]}\n{logs}"
    assert not cut, f"{len(cut)} of {len(answers)} answered HTTP 200 without their tokens: {cut[:3]}"
    assert max(a.seconds for a in answers) < config.request_timeout
    assert set(ended) == {"kvbridge-decode-b", "kvbridge-prefill-b"}
    # the answers are the model's: a sample compared with a single engine (a survivor, its cache salted)
    decode = engines.engines["kvbridge-decode"].url
    ties = 0
    for index, answer in enumerate(random.Random(0).sample(answers, 24)):
        want = await pd_requests.baseline(
            session, decode, model, answer.prompt, answer.max_tokens, salt=f"drain-{index}", top=2
        )
        # the load batched this answer with others: at a tie of the engine's two best tokens either may come
        # (pd_requests.TIE_NATS); anywhere else, a difference is a fault
        why = pd_requests.divergence(answer.tokens, want)
        assert why is None, f"request {index} ({'streamed' if answer.stream else 'whole'}): {why}"
        ties += answer.tokens != want.tokens
    SUMMARY["drainTiesTaken"] = ties
