"""kvbridge's own connector (``spec.engine.connector: KVBridge``) inside real vLLM, run with exactly what the
operator renders: equal greedy tokens, a negative control, CURVE, a lease that ended, a prefill restart."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvbridge_agent.core import Role
from kvbridge_agent.core.handshake import HandshakeError, KVTransferParams
from kvbridge_agent.transfer.keys import generate_keys, load_keys
from kvbridge_agent.transfer.side_channel import SideChannelClient
from kvbridge_sim import pd_requests, tiny_model
from kvbridge_sim.support import until
from kvbridge_sim.tiny_model import prompt
from kvbridge_sim.vllm_engines import MODEL_NAME, Engines, metric
from tests.kv_faults import overwrite_prefill_kv

from .assertions import assert_pd_equals_single_engine, registered_cache_groups
from .conftest import DEPLOYMENTS
from .routing import endpoint, pod_calls, pool, running_router, streamed_tokens

MAX_TOKENS = 12
BLOCK = 32
#: a partial single block, one block, several blocks and a partial last one, and close to the 512-token limit
LENGTHS = (7, BLOCK, 3 * BLOCK + 13, 15 * BLOCK + 3)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with pd_requests.client_session(120) as s:
        yield s


def urls(engines: Engines) -> tuple[str, str, str]:
    return engines.engines["kvbridge-prefill"].url, engines.engines["kvbridge-decode"].url, MODEL_NAME


@pytest.mark.parametrize("length", LENGTHS)
async def test_decode_tokens_equal_a_single_engine(
    kvbridge_engines: Engines, session: aiohttp.ClientSession, length: int
) -> None:
    prefill, decode, model = urls(kvbridge_engines)
    tokens = prompt(length, salt=100 + length)
    params = await pd_requests.prefill(session, prefill, model, tokens)
    assert params["do_remote_prefill"] is True
    assert params["kvbridge"]["numTokens"] == length
    assert params["kvbridge"]["expiresAt"] > time.time()  # the lease travels with the parameters
    if "digests" in params["kvbridge"]:  # taken on prefill's digest thread before vLLM sent the answer
        assert set(params["kvbridge"]["digests"]) == {"key", "heads", "rows"}
    got = await pd_requests.decode(session, decode, model, tokens, params, MAX_TOKENS)
    want = await pd_requests.baseline(session, decode, model, tokens, MAX_TOKENS, salt=f"kvb-baseline-{length}")
    assert got.tokens == want.tokens


async def test_the_router_pairs_only_compatible_kvbridge_pods_and_answers_as_a_single_engine(
    kvbridge_engines: Engines, session: aiohttp.ClientSession
) -> None:
    """kvbridge's router in front of KVBridgeConnector pods, with a decode pod of another pairing key (64-token
    blocks, another deployment) in its pool: every request goes to the compatible decode pod and answers as a
    single engine would, streamed or not."""
    _, decode, model = urls(kvbridge_engines)
    async with running_router() as (router, url):
        router.set_pool(
            pool(
                [endpoint(kvbridge_engines, "kvbridge-prefill", DEPLOYMENTS["kvbridge"], Role.PREFILL)],
                [
                    endpoint(kvbridge_engines, "kvbridge-decode", DEPLOYMENTS["kvbridge"], Role.DECODE),
                    endpoint(kvbridge_engines, "kvbridge-decode-64", DEPLOYMENTS["kvbridge-merge"], Role.DECODE),
                ],
            )
        )
        for index, length in enumerate((9, 2 * BLOCK + 1)):
            tokens = prompt(length, salt=300 + index)
            want = await pd_requests.baseline(session, decode, model, tokens, MAX_TOKENS, salt=f"kvb-router-{index}")
            body = {
                "model": model,
                "prompt": tokens,
                "max_tokens": MAX_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            async with session.post(f"{url}/v1/completions", json=body) as response:
                answer = await response.json()
            assert answer["choices"][0]["token_ids"] == want.tokens
            async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as response:
                assert streamed_tokens(await response.text()) == want.tokens
        assert await pod_calls(session, url, "decode", "kvbridge-decode") == 4
        assert await pod_calls(session, url, "decode", "kvbridge-decode-64") == 0


async def test_negative_control_decode_uses_the_transferred_kv(
    kvbridge_engines: Engines, session: aiohttp.ClientSession
) -> None:
    """Another prompt's KV (same length) under this prompt's tokens changes the answer: decode really computes
    from what it read, it does not recompute the prompt."""
    prefill, decode, model = urls(kvbridge_engines)
    tokens, other = prompt(3 * BLOCK, salt=7), prompt(3 * BLOCK, salt=8)
    foreign = await pd_requests.prefill(session, prefill, model, other)
    got = await pd_requests.decode(session, decode, model, tokens, foreign, MAX_TOKENS)
    want = await pd_requests.baseline(session, decode, model, tokens, MAX_TOKENS, salt="kvb-negative")
    assert got.tokens != want.tokens


async def test_a_peer_without_the_key_gets_no_metadata(kvbridge_engines: Engines, tmp_path: Path) -> None:
    assert kvbridge_engines.keys_dir is not None
    host = kvbridge_engines.engines["kvbridge-prefill"].ip
    stranger = generate_keys(tmp_path / "stranger")
    with pytest.raises(HandshakeError):  # CURVE: the listener never answers a client without the deployment's key
        SideChannelClient(host, 5600, "", stranger, 2.0).fetch([0])


async def test_a_read_after_the_lease_fails_the_request_and_decode_keeps_serving(
    kvbridge_engines: Engines, session: aiohttp.ClientSession
) -> None:
    prefill, decode, model = urls(kvbridge_engines)
    tokens = prompt(2 * BLOCK + 5, salt=11)
    params = await pd_requests.prefill(session, prefill, model, tokens)
    params["kvbridge"]["expiresAt"] = time.time() - 5  # as if decode came back after prefill's lease ended
    with pytest.raises(pd_requests.PDRequestError):
        await pd_requests.decode(session, decode, model, tokens, params, MAX_TOKENS)  # fails, never stale KV
    await assert_pd_equals_single_engine(
        session,
        prefill,
        decode,
        model,
        prompt(2 * BLOCK + 5, salt=12),
        MAX_TOKENS,
        salt="kvb-after-lease",
        what="after an expired lease",
    )


async def test_a_restarted_prefill_is_met_again_without_restarting_decode(
    kvbridge_engines: Engines, session: aiohttp.ClientSession
) -> None:
    prefill, decode, model = urls(kvbridge_engines)
    before = await pd_requests.disaggregated(session, prefill, decode, model, prompt(40, salt=21), MAX_TOKENS)
    assert len(before.tokens) == MAX_TOKENS
    kvbridge_engines.stop(["kvbridge-prefill"])
    kvbridge_engines.start(["kvbridge-prefill"])  # a new process: a new incarnation, new NIXL agent
    assert kvbridge_engines.running("kvbridge-decode")
    await assert_pd_equals_single_engine(
        session,
        prefill,
        decode,
        model,
        prompt(3 * BLOCK + 1, salt=22),
        MAX_TOKENS,
        salt="kvb-after-restart",
        what="after the prefill restart",
    )


async def test_a_decode_prompt_longer_than_prefills_fails_alone(
    kvbridge_engines: Engines, session: aiohttp.ClientSession
) -> None:
    """vLLM's own connector kills the decode engine through an assert here; kvbridge fails that request."""
    prefill, decode, model = urls(kvbridge_engines)
    tokens = prompt(2 * BLOCK, salt=31)
    params = await pd_requests.prefill(session, prefill, model, tokens)
    longer = tokens + prompt(BLOCK, salt=32)
    with pytest.raises(pd_requests.PDRequestError):
        await pd_requests.decode(session, decode, model, longer, params, MAX_TOKENS)
    await assert_pd_equals_single_engine(
        session,
        prefill,
        decode,
        model,
        prompt(BLOCK + 3, salt=33),
        MAX_TOKENS,
        salt="kvb-after-mismatch",
        what="after a mismatched prompt",
    )


@pytest.mark.parametrize(
    ("prefill_engine", "decode_engine", "conversion"),
    [
        ("kvbridge-prefill", "kvbridge-decode-64", "decode merges two 32-token blocks into each 64-token block"),
        ("kvbridge-prefill-64", "kvbridge-decode", "prefill splits each 64-token block into two 32-token blocks"),
    ],
)
@pytest.mark.parametrize("length", [7, 3 * BLOCK + 13, 10 * BLOCK + 5])
async def test_block_size_conversions_nixl_gets_wrong_on_cpu_give_equal_tokens(
    kvbridge_engines: Engines,
    session: aiohttp.ClientSession,
    prefill_engine: str,
    decode_engine: str,
    conversion: str,
    length: int,
) -> None:
    """NixlConnector re-lays received CPU-attention blocks as token rows and scrambles the dimension-major keys
    (wrong tokens, no error; refused for it). kvbridge's connector converts CPU attention's own block interior
    (``cpu_blocks``), on either side."""
    prefill, decode = kvbridge_engines.engines[prefill_engine].url, kvbridge_engines.engines[decode_engine].url
    model = MODEL_NAME
    tokens = prompt(length, salt=400 + length + len(prefill_engine))
    await assert_pd_equals_single_engine(
        session, prefill, decode, model, tokens, MAX_TOKENS, salt=f"kvb-{decode_engine}-{length}", what=conversion
    )


async def test_decode_exports_transfers_and_failures_on_vllms_metrics(
    kvbridge_engines: Engines, session: aiohttp.ClientSession
) -> None:
    """vLLM's /metrics carries the connector's figures: each read's time, bytes and descriptors, failures by code."""
    prefill, decode, model = urls(kvbridge_engines)
    names = {
        "reads": ("vllm:kvbridge_transfer_seconds_count",),
        "descriptors": ("vllm:kvbridge_descriptors_per_request_sum",),
        "bytes": ("vllm:kvbridge_transfer_bytes_sum",),
        "expired": ("vllm:kvbridge_failed_transfers_total", 'code="LEASE_EXPIRED"'),
    }

    async def figures() -> dict[str, float]:
        return {key: await metric(session, decode, *name) for key, name in names.items()}

    before = await figures()
    await pd_requests.disaggregated(session, prefill, decode, model, prompt(3 * BLOCK + 13, salt=51), MAX_TOKENS)
    params = await pd_requests.prefill(session, prefill, model, prompt(BLOCK, salt=52))
    params["kvbridge"]["expiresAt"] = time.time() - 5
    with pytest.raises(pd_requests.PDRequestError):
        await pd_requests.decode(session, decode, model, prompt(BLOCK, salt=52), params, MAX_TOKENS)
    # 109 tokens: 4 blocks of 32, per layer (2 layers) and block 2 KV heads x 2 (K, V) x 32 tokens x 64 x 2 bytes =
    # 16 KiB; one descriptor per layer and block, or per layer and run of blocks adjacent in both caches
    # (NIXL merges them, docs/protocol.md §4c): 2 (one run of 4) to 8 (none adjacent), as the engines' allocators
    # placed them
    want = {"reads": 1, "bytes": 8 * 16384, "expired": 1}
    got: dict[str, float] = {}

    async def recorded() -> bool:
        nonlocal got
        after = await figures()
        got = {key: after[key] - before[key] for key in names}
        return {key: got[key] for key in want} == want and 2 <= got["descriptors"] <= 8

    # vLLM's front end records them with its next stats update
    await until(recorded, 10, lambda: f"the decode figures {want} (got {got})", interval=0.2)


async def test_prefill_exports_the_kv_it_holds_for_readers(
    kvbridge_engines: Engines, session: aiohttp.ClientSession
) -> None:
    """The prefill scaling signal (and what the pod's preStop waits on): ``vllm:kvbridge_held_bytes`` rises by a
    request's blocks when prefill holds them and falls when decode has read them."""
    prefill, decode, model = urls(kvbridge_engines)
    one_block = BLOCK * 2 * 2 * 2 * 64 * 2  # 32 tokens x 2 layers x (K, V) x 2 KV heads x 64 x 2 bytes

    async def held_after(condition: Any, what: str) -> float:
        value = 0.0

        async def reached() -> bool:
            nonlocal value
            value = await metric(session, prefill, "vllm:kvbridge_held_bytes")
            return bool(condition(value))

        # vLLM's front end records them with its next stats update
        await until(reached, 10, lambda: f"{what}: vllm:kvbridge_held_bytes is {value}", interval=0.2)
        return value

    tokens = prompt(BLOCK, salt=61)
    params = await pd_requests.prefill(session, prefill, model, tokens)
    during = await held_after(lambda v: v >= one_block, "held for decode")
    await pd_requests.decode(session, decode, model, tokens, params, MAX_TOKENS)
    await held_after(lambda v: v <= during - one_block, "read by decode")


async def test_kv_overwritten_after_publish_never_gives_other_tokens(
    kvbridge_engines: Engines, session: aiohttp.ClientSession
) -> None:
    """Verification (issue 27, spec.transfer.verification, Sampled: every request of the first minutes): prefill's
    KV memory overwritten from outside its process after it answered, before decode read it. Decode's digest differs
    from prefill's: the request fails (kv_load_failure_policy) or is recomputed, never answered with other tokens,
    and the mismatch is counted by peer; decode keeps serving. The negative control reads the same fault without
    verification (the parameters' ``verify`` cleared) and answers other tokens, so this test can fail."""
    assert kvbridge_engines.keys_dir is not None
    keys = load_keys(str(kvbridge_engines.keys_dir))
    prefill, decode, model = urls(kvbridge_engines)
    for verified in (True, False):
        tokens = prompt(2 * BLOCK + 9, salt=40 + verified)
        salt = f"kvb-overwritten-{verified}"
        want = await pd_requests.baseline(session, decode, model, tokens, MAX_TOKENS, salt=salt)
        params = await pd_requests.prefill(session, prefill, model, tokens)
        assert params["kvbridge"]["verify"] is True
        assert overwrite_prefill_kv(KVTransferParams.model_validate(params["kvbridge"]), keys) == 1
        if not verified:
            params["kvbridge"]["verify"] = False
        before = await metric(session, decode, "vllm:kvbridge_digest_mismatches_total")
        try:
            got = (await pd_requests.decode(session, decode, model, tokens, params, MAX_TOKENS)).tokens
        except pd_requests.PDRequestError:
            got = None  # failed loudly
        if verified:
            assert got is None or got == want.tokens, "decode answered other tokens than a single engine"
            assert await metric(session, decode, "vllm:kvbridge_digest_mismatches_total") == before + 1
        else:
            assert got is not None
            assert got != want.tokens, "the overwritten KV did not change the answer: the fault proves nothing"
    await assert_pd_equals_single_engine(
        session,
        prefill,
        decode,
        model,
        prompt(2 * BLOCK + 5, salt=44),
        MAX_TOKENS,
        salt="kvb-after-overwrite",
        what="after a digest mismatch",
    )


#: client request ids vLLM turns into its own (``cmpl-<id>-...``) that kvbridge cannot carry: a ':' (its
#: notification separator) and ids past 256 characters raised in request_finished, fatal to vLLM's engine core
HOSTILE_IDS = ("a:b", "x" * 300, "tab\there")


async def test_hostile_request_ids_fail_their_own_request_and_the_engines_keep_serving(
    kvbridge_engines: Engines, session: aiohttp.ClientSession
) -> None:
    """Straight to prefill: the answer says why nothing was offered (INVALID_REQUEST_ID), nothing stays held and
    the engine keeps serving; through the router: the ids never reach vLLM, every answer equals a single engine's."""
    prefill, decode, model = urls(kvbridge_engines)
    tokens = prompt(BLOCK + 3, salt=61)
    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": 1,
        "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    held = await metric(session, prefill, "vllm:kvbridge_held_requests")
    for request_id in HOSTILE_IDS:
        async with session.post(f"{prefill}/v1/completions", json=body, headers={"X-Request-Id": request_id}) as r:
            assert r.status == 200, await r.text()
            params = (await r.json())["kv_transfer_params"]
        assert params["kvbridge_error"]["code"] == "INVALID_REQUEST_ID"
        assert params["do_remote_prefill"] is False
        assert await pd_requests.healthy(session, prefill)
    assert await metric(session, prefill, "vllm:kvbridge_held_requests") <= held  # nothing offered, nothing held
    async with running_router() as (router, url):
        router.set_pool(
            pool(
                [endpoint(kvbridge_engines, "kvbridge-prefill", DEPLOYMENTS["kvbridge"], Role.PREFILL)],
                [endpoint(kvbridge_engines, "kvbridge-decode", DEPLOYMENTS["kvbridge"], Role.DECODE)],
            )
        )
        want = await pd_requests.baseline(session, decode, model, tokens, MAX_TOKENS, salt="kvb-hostile-ids")
        for request_id in HOSTILE_IDS:
            request = {**body, "max_tokens": MAX_TOKENS, "ignore_eos": True, "return_token_ids": True}
            del request["kv_transfer_params"]
            async with session.post(f"{url}/v1/completions", json=request, headers={"X-Request-Id": request_id}) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["choices"][0]["token_ids"] == want.tokens
        assert await pod_calls(session, url, "prefill", "kvbridge-prefill") == len(HOSTILE_IDS)  # never retried


async def test_prefill_says_how_many_prompt_tokens_its_prefix_cache_served(
    kvbridge_engines: Engines, session: aiohttp.ClientSession
) -> None:
    """What the router reads to see a prefill pod's evictions (router.md): vLLM adds ``remote_prefill_cached_tokens``
    to the transfer parameters kvbridge's connector returns. A prompt sent again is served from the prefix cache,
    every whole block of it."""
    prefill, decode, model = urls(kvbridge_engines)
    tokens = prompt(2 * BLOCK + 3, salt=990)
    served = []
    for _ in range(2):
        params = await pd_requests.prefill(session, prefill, model, tokens)
        served.append(params.get("remote_prefill_cached_tokens"))
        await pd_requests.decode(session, decode, model, tokens, params, MAX_TOKENS)
    assert served == [0, 2 * BLOCK]


async def test_forged_transfer_parameters_fail_that_request_and_decode_keeps_serving(
    kvbridge_engines: Engines, session: aiohttp.ClientSession
) -> None:
    prefill, decode, model = urls(kvbridge_engines)
    tokens = prompt(2 * BLOCK, salt=71)
    params = await pd_requests.prefill(session, prefill, model, tokens)
    for forged in ({"remoteRequestId": "a:b"}, {"remotePort": 0}, {"remoteBlockIds": "all"}):
        bad = {**params, "kvbridge": {**params["kvbridge"], **forged}}
        with pytest.raises(pd_requests.PDRequestError):
            await pd_requests.decode(session, decode, model, tokens, bad, MAX_TOKENS)
        assert await pd_requests.healthy(session, decode)
    await assert_pd_equals_single_engine(
        session,
        prefill,
        decode,
        model,
        prompt(BLOCK + 9, salt=72),
        MAX_TOKENS,
        salt="kvb-after-forged",
        what="after forged parameters",
    )


# -- engines of their own, last: each phase of engines starts once (tests/vllm/conftest.py) --


@pytest.mark.parametrize("length", [7, 40, 3 * BLOCK + 13, 10 * BLOCK + 5])
async def test_a_hybrid_model_gives_equal_tokens_with_every_transfer_verified(
    kvbridge_hybrid_engines: Engines, session: aiohttp.ClientSession, length: int
) -> None:
    """A model with a 32-token sliding window on one layer and full attention on the other, prompts of up to ten
    windows: vLLM's CPU build serves it with its hybrid allocator (two KV cache groups overlaid in one layer slot),
    and kvbridge's connector moves each group's blocks (cache_geometry.group_slots; nothing renders
    ``--disable-hybrid-kv-cache-manager``). Every transfer verified (``verification: All``); tokens equal a single
    engine's."""
    engines = kvbridge_hybrid_engines.engines
    prefill, decode = engines["kvbridge-hybrid-prefill"].url, engines["kvbridge-hybrid-decode"].url
    for name in ("kvbridge-hybrid-prefill", "kvbridge-hybrid-decode"):
        assert "--disable-hybrid-kv-cache-manager" not in engines[name].spec.argv
        assert registered_cache_groups(engines[name].log) == [2], kvbridge_hybrid_engines.log_tails([name])
    model = tiny_model.HYBRID.name
    tokens = prompt(length, salt=700 + length)
    params = await pd_requests.prefill(session, prefill, model, tokens)
    assert params["kvbridge"]["verify"] is True
    got = await pd_requests.decode(session, decode, model, tokens, params, MAX_TOKENS)
    want = await pd_requests.baseline(session, decode, model, tokens, MAX_TOKENS, salt=f"kvb-hybrid-{length}")
    assert got.tokens == want.tokens


@pytest.mark.parametrize("length", [7, 3 * BLOCK + 13, 15 * BLOCK + 3])
async def test_prefill_tp2_to_decode_tp1_gives_equal_tokens(
    kvbridge_tp2_engines: Engines, session: aiohttp.ClientSession, length: int
) -> None:
    """Each decode rank reads both prefill ranks' heads (one plan per prefill engine, two remote agents)."""
    engines = kvbridge_tp2_engines.engines
    prefill, decode = engines["kvbridge-prefill-tp2"].url, engines["kvbridge-decode-tp2"].url
    await assert_pd_equals_single_engine(
        session,
        prefill,
        decode,
        MODEL_NAME,
        prompt(length, salt=600 + length),
        MAX_TOKENS,
        salt=f"kvb-tp2-{length}",
        what="prefill TP 2 -> decode TP 1",
    )
    other = prompt(3 * BLOCK, salt=700)  # negative control: another prompt's KV under this prompt's tokens
    foreign = await pd_requests.prefill(session, prefill, MODEL_NAME, other)
    tokens = prompt(3 * BLOCK, salt=701)
    got = await pd_requests.decode(session, decode, MODEL_NAME, tokens, foreign, MAX_TOKENS)
    want = await pd_requests.baseline(
        session, decode, MODEL_NAME, tokens, MAX_TOKENS, salt=f"kvb-tp2-negative-{length}"
    )
    assert got.tokens != want.tokens
