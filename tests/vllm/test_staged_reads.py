"""Staged reads (docs/protocol.md §4d) with kvbridge's connector inside real vLLM: both pods with 64 MiB staging
buffers and staging forced on decode; prefill's scheduler relays each stage request to its worker rank, which packs
(vllm_connector/stage_relay.py), decode READs the packed bytes. Greedy tokens equal a single engine's at block
edges, every transfer verified (``verification: All``), and decode's ``/metrics`` counts the reads as staged."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvbridge_sim import pd_requests
from kvbridge_sim.support import until
from kvbridge_sim.tiny_model import prompt
from kvbridge_sim.vllm_engines import MODEL_NAME, Engines, metric

MAX_TOKENS = 12
BLOCK = 32
#: a partial block, a block's edges, several blocks and a partial last one, close to the 512-token limit
LENGTHS = (7, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 3 * BLOCK + 13, 15 * BLOCK + 3)
STAGED = "vllm:kvbridge_staged_reads_total"
READS = "vllm:kvbridge_transfer_seconds_count"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with pd_requests.client_session(120) as s:
        yield s


async def test_staged_reads_give_a_single_engines_tokens_verified(
    kvbridge_staged_engines: Engines, session: aiohttp.ClientSession
) -> None:
    engines = kvbridge_staged_engines.engines
    prefill, decode = engines["kvbridge-staged-prefill"].url, engines["kvbridge-staged-decode"].url
    before = {name: await metric(session, decode, name) for name in (STAGED, READS)}
    for length in LENGTHS:
        tokens = prompt(length, salt=900 + length)
        params = await pd_requests.prefill(session, prefill, MODEL_NAME, tokens)
        assert params["kvbridge"]["verify"] is True  # verification All: decode checks prefill's digests
        got = await pd_requests.decode(session, decode, MODEL_NAME, tokens, params, MAX_TOKENS)
        want = await pd_requests.baseline(session, decode, MODEL_NAME, tokens, MAX_TOKENS, salt=f"staged-{length}")
        assert got.tokens == want.tokens, f"{length} tokens"
    seen: dict[str, float] = {}

    async def counted() -> bool:
        seen.update({name: await metric(session, decode, name) - before[name] for name in (STAGED, READS)})
        return seen[STAGED] == seen[READS] == len(LENGTHS)

    # vLLM's front end records them with its next stats update
    await until(counted, 15, lambda: f"{len(LENGTHS)} reads, all staged (got {seen})", interval=0.2)
    assert "prefill rank 0 stages from a 64 MiB buffer" in engines["kvbridge-staged-prefill"].log.read_text()
    decode_log = engines["kvbridge-staged-decode"].log.read_text()
    assert "decode rank 0 stages reads (staged) through a 64 MiB buffer" in decode_log
    assert "reading it directly" not in decode_log
    assert "directly for" not in decode_log
