"""The two-step prefill/decode request against vLLM's OpenAI server, and the single-engine baseline.

What a P/D router does with vLLM's NixlConnector: POST the prompt to a prefill engine with
``kv_transfer_params: {do_remote_decode: true}`` and ``max_tokens: 1``; POST the same prompt to a decode engine
with the ``kv_transfer_params`` prefill returned. Prompts are token ids (exact lengths, no tokenizer needed);
sampling is greedy and ignores the end-of-sequence token, so every answer has exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvbridge_operator.api.objects import Obj

#: vLLM's HTTP server closes an idle kept-alive connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s). A client that
#: keeps it longer (aiohttp's default is 15 s) may send its next request down a connection the server is closing
#: and get "Server disconnected"; so idle connections are dropped on our side first.
KEEPALIVE_SECONDS = 3.0


def client_session(total_seconds: float) -> aiohttp.ClientSession:
    """A session for talking to vLLM servers: every request bounded by ``total_seconds``, idle connections
    closed before the server's keep-alive timeout."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=total_seconds),
        connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_SECONDS),
    )


class PDRequestError(Exception):
    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {body[:500]}")
        self.status = status


@dataclass(frozen=True)
class Completion:
    tokens: list[int]
    kv_transfer_params: Obj | None
    seconds: float
    #: with ``logprobs``: at each generated position, the best next tokens' log probabilities, by token id
    top: tuple[dict[int, float], ...] = ()


#: how close (nats) a single engine's two best next tokens may be for the same engine, batched with other requests,
#: to choose the second: the tiny model's bf16 logits are 1/32 apart where they are largest (4-8), and a batch sums
#: in another order, moving a logit by an ulp or two. Measured on one engine without P/D: 120 random prompts answered
#: alone and then all at once, 2 answers differed, each at a position where the two best were exactly tied alone.
TIE_NATS = 1 / 16


async def complete(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int, **extra: Any
) -> Completion:
    """One greedy completion; raises :class:`PDRequestError` for a non-200 answer."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    started = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise PDRequestError(url, response.status, await response.text())
        answer: Obj = await response.json()
    choice = answer["choices"][0]
    logprobs = choice.get("logprobs") or {}
    top = tuple(
        {int(token.removeprefix("token_id:")): value for token, value in (position or {}).items()}
        for position in logprobs.get("top_logprobs") or ()
    )
    return Completion(list(choice["token_ids"]), answer.get("kv_transfer_params"), time.perf_counter() - started, top)


async def prefill(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], **extra: Any) -> Obj:
    """Prefill only: computes the prompt's KV cache and returns the ``kv_transfer_params`` for decode."""
    done = await complete(session, url, model, prompt, 1, kv_transfer_params={"do_remote_decode": True}, **extra)
    if not done.kv_transfer_params:
        raise PDRequestError(url, 200, "prefill returned no kv_transfer_params (is it a kv_producer with a connector?)")
    return done.kv_transfer_params


async def decode(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], params: Obj, max_tokens: int
) -> Completion:
    """Decode with the KV cache pulled from the prefill engine named in ``params``."""
    return await complete(session, url, model, prompt, max_tokens, kv_transfer_params=params)


async def disaggregated(
    session: aiohttp.ClientSession, prefill_url: str, decode_url: str, model: str, prompt: list[int], max_tokens: int
) -> Completion:
    params = await prefill(session, prefill_url, model, prompt)
    return await decode(session, decode_url, model, prompt, params, max_tokens)


async def baseline(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int, salt: str, top: int = 0
) -> Completion:
    """A single-engine run; ``cache_salt`` keeps it from reusing blocks that P/D requests left in the cache. ``top``:
    with each position's ``top`` best next tokens (:func:`divergence` reads two)."""
    extra: dict[str, Any] = {"logprobs": top, "return_tokens_as_token_ids": True} if top else {}
    return await complete(session, url, model, prompt, max_tokens, cache_salt=salt, **extra)


def divergence(tokens: list[int], want: Completion) -> str | None:
    """None when ``tokens`` are the single engine's, or equal up to a position where the engine alone had a tie (its
    two best next tokens within :data:`TIE_NATS`, ``tokens`` taking the other; what follows cannot be compared); else
    where and how they differ. ``want``: a :func:`baseline` with ``top`` ≥ 2. For answers given while the engine
    batched other requests: greedy tokens of one engine are not batch-invariant at a tie, with or without P/D."""
    if tokens == want.tokens:
        return None
    if len(tokens) != len(want.tokens):
        return f"{len(tokens)} tokens, the single engine {len(want.tokens)}"
    at = next(index for index, (got, wanted) in enumerate(zip(tokens, want.tokens, strict=True)) if got != wanted)
    best = want.top[at] if at < len(want.top) else {}
    got, wanted = tokens[at], want.tokens[at]
    if got in best and wanted in best and best[wanted] - best[got] <= TIE_NATS:
        return None
    shown = {token: round(value, 4) for token, value in best.items()}
    return f"token {at}: {got}, the single engine {wanted} (its best there: {shown}; a tie is within {TIE_NATS} nats)"


async def healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(f"{url}/health") as response:
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False
