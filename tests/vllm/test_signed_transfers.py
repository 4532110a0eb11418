"""spec.router.signTransfers with real vLLM engines and kvbridge's connector (issue 56, "signed means bound"):
through the signing router decode reads and answers as a single engine (prefill's hash of the prompt equals
decode's, for token ids and for text); the router's parameters replayed with another prompt of the same length, or
to another decode pod, fail that request only, and decode keeps serving."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from kvbridge_agent.core import Role
from kvbridge_agent.core.signing import signed
from kvbridge_router.proxy import RouterConfig
from kvbridge_sim import pd_requests
from kvbridge_sim.support import fixed_address
from kvbridge_sim.tiny_model import prompt
from kvbridge_sim.vllm_engines import MODEL_NAME, Engines, rendered_template

from .conftest import DEPLOYMENTS, _phase
from .routing import endpoint, pool, running_router

MAX_TOKENS = 8
TOKEN = b"0123456789abcdef" * 4
#: the decode engine holding the router's token (its pod name, as the operator's downward API gives it)
DECODE = "kvbridge-decode-signed"


@pytest.fixture
def signed_engines(all_engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Engines:
    """kvbridge's prefill and a decode engine of the same deployment that mounts the router's token."""
    if DECODE not in all_engines.engines:
        token = tmp_path_factory.mktemp("router-token") / "token"
        token.write_bytes(TOKEN + b"\n")
        env = {"KVBRIDGE_KEYS_DIR": str(all_engines.keys_dir), "KVBRIDGE_TRANSFER_TOKEN_FILE": str(token)}
        template = rendered_template(DEPLOYMENTS["kvbridge"], Role.DECODE)
        all_engines.add(DECODE, template, fixed_address(40), (1,), env=env)
    return _phase(all_engines, ["kvbridge-prefill", DECODE])


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with pd_requests.client_session(180) as s:
        yield s


async def test_through_the_signing_router_decode_answers_as_a_single_engine(
    signed_engines: Engines, session: aiohttp.ClientSession
) -> None:
    decode = signed_engines.engines[DECODE].url
    config = RouterConfig(prefill_timeout=60, decode_timeout=120, transfer_token=TOKEN)
    async with running_router(config) as (router, url):
        router.set_pool(
            pool(
                [endpoint(signed_engines, "kvbridge-prefill", DEPLOYMENTS["kvbridge"], Role.PREFILL)],
                [endpoint(signed_engines, DECODE, DEPLOYMENTS["kvbridge"], Role.DECODE)],
            )
        )
        tokens = prompt(45, salt=560)
        want = await pd_requests.baseline(session, decode, MODEL_NAME, tokens, MAX_TOKENS, salt="signed-ids")
        body = {"model": MODEL_NAME, "prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        async with session.post(f"{url}/v1/completions", json={**body, "return_token_ids": True}) as answer:
            text = await answer.text()
        assert answer.status == 200, text + signed_engines.log_tails([DECODE])
        assert list(json.loads(text)["choices"][0]["token_ids"]) == want.tokens
        # text: both engines tokenize it, and must hash the same ids
        body = {"model": MODEL_NAME, "prompt": "the signed router binds this prompt", "max_tokens": MAX_TOKENS}
        async with session.post(f"{url}/v1/completions", json=body) as answer:
            text = await answer.text()
        assert answer.status == 200, text + signed_engines.log_tails([DECODE])


async def test_a_replay_with_another_prompt_or_to_another_pod_fails_that_request_only(
    signed_engines: Engines, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    prefill, decode = signed_engines.engines["kvbridge-prefill"].url, signed_engines.engines[DECODE].url
    tokens = prompt(70, salt=561)
    params = await pd_requests.prefill(session, prefill, MODEL_NAME, tokens)
    until = time.time() + 120
    for_decode = signed(TOKEN, params, decode_pod=DECODE, expires_at=until)  # as the router hands it
    other = prompt(70, salt=562)  # the same length: the token count alone cannot tell
    assert other != tokens
    with pytest.raises(pd_requests.PDRequestError):
        await pd_requests.decode(session, decode, MODEL_NAME, other, for_decode, MAX_TOKENS)
    elsewhere = signed(TOKEN, params, decode_pod="kvbridge-decode-other", expires_at=until)
    with pytest.raises(pd_requests.PDRequestError):
        await pd_requests.decode(session, decode, MODEL_NAME, tokens, elsewhere, MAX_TOKENS)
    late = signed(TOKEN, params, decode_pod=DECODE, expires_at=time.time() - 60)
    with pytest.raises(pd_requests.PDRequestError):
        await pd_requests.decode(session, decode, MODEL_NAME, tokens, late, MAX_TOKENS)
    log = signed_engines.engines[DECODE].log_tail(20000)
    for code in ("TRANSFER_PROMPT_MISMATCH", "TRANSFER_WRONG_DECODE", "TRANSFER_SIGNATURE_EXPIRED"):
        assert code in log, log[-3000:]
    # the parameters with their own prompt, for this pod: read, and the tokens a single engine gives
    got = await pd_requests.decode(session, decode, MODEL_NAME, tokens, for_decode, MAX_TOKENS)
    want = await pd_requests.baseline(session, decode, MODEL_NAME, tokens, MAX_TOKENS, salt="signed-replay")
    assert got.tokens == want.tokens
