"""Real vLLM, run with exactly what kvbridge renders, gives the same greedy tokens with P/D as without.

Every prompt is token ids of an exact length; baselines run on the decode engine with a ``cache_salt`` so
they never reuse blocks that P/D requests left in its prefix cache. Each test uses prompts of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvbridge_agent.core import Role
from kvbridge_sim import pd_requests
from kvbridge_sim.tiny_model import prompt
from kvbridge_sim.vllm_engines import MODEL_NAME, Engines, rendered_template, vllm_parts

from .assertions import assert_pd_equals_single_engine
from .conftest import DEPLOYMENTS, SHORT_LEASE_BLOCKS, SHORT_LEASE_SECONDS

MAX_TOKENS = 12
BLOCK = 32
#: one block, a partial single block, several full blocks, several blocks and a partial last one
LENGTHS = {"one-block": BLOCK, "partial-block": 7, "three-blocks": 3 * BLOCK, "partial-last": 3 * BLOCK + 13}


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with pd_requests.client_session(120) as s:
        yield s


def test_one_decode_serves_every_prefill_size() -> None:
    """The decode pods of the TP 1 and TP 2 deployments run the same vLLM command and environment, so one
    decode engine stands for both (vLLM's NixlConnector learns each prefill's TP size at handshake)."""
    decodes = [vllm_parts(rendered_template(DEPLOYMENTS[name], Role.DECODE)) for name in ("tp1", "tp2")]
    assert decodes[0] == decodes[1]


async def equal_tokens(engines: Engines, session: aiohttp.ClientSession, prefill: str, length: str, salt: int) -> None:
    model = MODEL_NAME
    tokens = prompt(LENGTHS[length], salt=salt)
    source, decode = engines.engines[prefill], engines.engines["decode"]
    await assert_pd_equals_single_engine(
        session, source.url, decode.url, model, tokens, MAX_TOKENS, salt=f"baseline-{salt}", what=f"{prefill} {length}"
    )


async def crossed_kv(engines: Engines, session: aiohttp.ClientSession, prefill: str, salt: int) -> None:
    """Decode given prompt Y with prompt X's KV cache answers differently from Y alone: the KV really moved
    (a decode that ignored it and recomputed Y would answer like the single engine). Same token count, so vLLM
    accepts the request."""
    model = MODEL_NAME
    x, y = prompt(3 * BLOCK + 5, salt=salt), prompt(3 * BLOCK + 5, salt=salt + 1)
    source, decode = engines.engines[prefill], engines.engines["decode"]
    params = await pd_requests.prefill(session, source.url, model, x)
    crossed = await pd_requests.decode(session, decode.url, model, y, params, MAX_TOKENS)
    alone = await pd_requests.baseline(session, decode.url, model, y, MAX_TOKENS, salt=f"negative-{salt}")
    assert crossed.tokens != alone.tokens


# prefill TP 1 -> decode TP 1 (these run first: the TP 2 phase stops the TP 1 prefills)
@pytest.mark.parametrize("length", list(LENGTHS))
async def test_tp1_decode_tokens_equal_a_single_engine(
    tp1_engines: Engines, session: aiohttp.ClientSession, length: str
) -> None:
    await equal_tokens(tp1_engines, session, "prefill-tp1", length, salt=list(LENGTHS).index(length))


async def test_tp1_negative_control_decode_follows_the_transferred_kv(
    tp1_engines: Engines, session: aiohttp.ClientSession
) -> None:
    await crossed_kv(tp1_engines, session, "prefill-tp1", salt=500)


async def test_tp1_an_expired_lease_gives_wrong_tokens_with_nixl_connector(
    tp1_engines: Engines, session: aiohttp.ClientSession
) -> None:
    """Known behaviour of vLLM's NixlConnector (docs/troubleshooting.md, "lease"): when decode reads after
    prefill's lease ran out and the blocks were reused, decode answers HTTP 200 with wrong tokens. kvbridge
    renders the lease (leaseSeconds -> kv_lease_duration) with a default long enough for these machines."""
    engines = tp1_engines
    model = MODEL_NAME
    prefill, decode = engines.engines["prefill-short-lease"], engines.engines["decode"]
    x = prompt(3 * BLOCK + 5, salt=700)
    params = await pd_requests.prefill(session, prefill.url, model, x)
    await asyncio.sleep(SHORT_LEASE_SECONDS + 3)  # no decode heartbeat: the lease runs out, prefill frees the blocks
    for index in range(SHORT_LEASE_BLOCKS // 12 + 2):  # other prompts reuse every free block
        await pd_requests.baseline(session, prefill.url, model, prompt(12 * BLOCK, salt=800 + index), 1, salt="fill")
    late = await pd_requests.decode(session, decode.url, model, x, params, MAX_TOKENS)
    want = await pd_requests.baseline(session, decode.url, model, x, MAX_TOKENS, salt="late-baseline")
    assert "Releasing expired KV blocks" in prefill.log_tail(200_000)
    assert late.tokens != want.tokens  # silently wrong: this is why the lease must outlast decode's queueing


# prefill TP 2 -> decode TP 1: decode reads half of the KV heads from each prefill rank
@pytest.mark.parametrize("length", list(LENGTHS))
async def test_tp2_decode_tokens_equal_a_single_engine(
    tp2_engines: Engines, session: aiohttp.ClientSession, length: str
) -> None:
    await equal_tokens(tp2_engines, session, "prefill-tp2", length, salt=100 + list(LENGTHS).index(length))


async def test_tp2_negative_control_decode_follows_the_transferred_kv(
    tp2_engines: Engines, session: aiohttp.ClientSession
) -> None:
    await crossed_kv(tp2_engines, session, "prefill-tp2", salt=600)
