"""A mixture-of-experts model P/D with kvbridge's connector, on vLLM's CPU build: the tiny random-weight Mixtral (4
experts, 2 per token), expert parallelism on, prefill blocks of 32 tokens merged into decode's 64 (the traced pair
of conftest serves it). Experts hold no KV, so the plan is the dense model's; what is proven is that vLLM running
exactly what kvbridge renders for a MoE model gives decode the same greedy tokens as a single engine. (Named to run
right before test_tracing, on the same two engines: they start once for both.)

What the CPU build does not run: data parallelism with experts. With ``--data-parallel-size 2`` (and expert
parallelism) vLLM 0.32's CPU build starts both ranks, then its first forward dies in the MoE layer: the CPU
communicator has no ``all_gatherv`` (``NotImplementedError``), which the experts' all-gather dispatch needs, so the
operator refuses DP on the CPU build (``DATA_PARALLEL_ON_CPU``, docs/vllm.md). EP size 1 is what runs here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvbridge_agent.core import Role
from kvbridge_sim import pd_requests
from kvbridge_sim.tiny_model import MOE, prompt
from kvbridge_sim.vllm_engines import Engines, rendered_template, vllm_parts

from .assertions import assert_pd_equals_single_engine
from .conftest import DEPLOYMENTS

MAX_TOKENS = 12


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with pd_requests.client_session(120) as s:
        yield s


def test_both_roles_run_the_moe_model_with_expert_parallelism() -> None:
    for role in Role:
        command = " ".join(vllm_parts(rendered_template(DEPLOYMENTS["traced"], role))[0])
        assert "--enable-expert-parallel" in command
        assert MOE.name in command


@pytest.mark.parametrize("length", [7, 64, 101])
async def test_moe_decode_tokens_equal_a_single_engine(
    traced_engines: Engines, session: aiohttp.ClientSession, length: int
) -> None:
    prefill, decode = traced_engines.engines["traced-prefill"], traced_engines.engines["traced-decode"]
    await assert_pd_equals_single_engine(
        session,
        prefill.url,
        decode.url,
        MOE.name,
        prompt(length, salt=7000 + length),
        MAX_TOKENS,
        salt=f"moe-baseline-{length}",
        what=f"MoE {length} tokens",
    )
    for engine in (prefill, decode):  # vLLM ran its MoE kernels, as the expert-parallel rank 0 of 1
        log = engine.log.read_text(errors="replace")
        assert "Worker_EP0" in log
        assert "MoE backend" in log


async def test_moe_negative_control_decode_follows_the_transferred_kv(
    traced_engines: Engines, session: aiohttp.ClientSession
) -> None:
    prefill, decode = traced_engines.engines["traced-prefill"], traced_engines.engines["traced-decode"]
    x, y = prompt(101, salt=7500), prompt(101, salt=7501)
    params = await pd_requests.prefill(session, prefill.url, MOE.name, x)
    crossed = await pd_requests.decode(session, decode.url, MOE.name, y, params, MAX_TOKENS)
    alone = await pd_requests.baseline(session, decode.url, MOE.name, y, MAX_TOKENS, salt="moe-negative")
    assert crossed.tokens != alone.tokens
