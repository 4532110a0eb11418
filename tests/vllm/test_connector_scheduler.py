"""KVBridgeConnector inside vLLM's own scheduler, without a model (as vLLM's connector unit tests do): the
request lifecycle on both roles, with block accounting — every block freed exactly once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings
from kvbridge_agent.core.contract import EngineEnvironment, render_environment
from kvbridge_agent.core.handshake import KVTransferParams

pytest.importorskip("vllm")

BLOCK = 32
BLOCKS = 64
MODEL = ModelGeometry(name="m", num_layers=2, num_kv_heads=2, head_dim=64)


def make_scheduler(model_path: Path, role: Role, monkeypatch: pytest.MonkeyPatch) -> Any:
    import torch
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    env = EngineEnvironment(
        role=role,
        engine_id=f"{role.value}-0",
        model=MODEL,
        prefill=RoleSettings(block_size=BLOCK),
        decode=RoleSettings(block_size=BLOCK),
        side_channel_host="127.0.0.1",
        side_channel_listen_port=0,
    )
    for name, value in render_environment(env).items():
        monkeypatch.setenv(name, value)
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_path), dtype="bfloat16", max_model_len=512, seed=0),
        cache_config=CacheConfig(block_size=BLOCK),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=512, max_model_len=512, is_encoder_decoder=False
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVBridgeConnector",
            kv_role=role_name(role),
            kv_connector_module_path="kvbridge_agent.vllm_connector",
        ),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = BLOCKS
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(
        num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )
    return Scheduler(config, kv_cache_config, StructuredOutputManager(config), block_size=BLOCK)


def role_name(role: Role) -> str:
    return "kv_producer" if role is Role.PREFILL else "kv_consumer"


@pytest.fixture
def decode(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    scheduler = make_scheduler(tiny_model_path, Role.DECODE, monkeypatch)
    yield scheduler
    scheduler.connector.shutdown()


@pytest.fixture
def prefill(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    scheduler = make_scheduler(tiny_model_path, Role.PREFILL, monkeypatch)
    from kvbridge_agent.core.handshake import RankMetadata
    from kvbridge_agent.vllm_connector.messages import RankHandshake

    meta = RankMetadata(
        engine_id="prefill-0",
        incarnation="inc",
        agent_name="a",
        tp_rank=0,
        tp_size=1,
        block_size=BLOCK,
        kv_layout="HND",
        cache_kind="Split",
        num_blocks=BLOCKS,
        tensor_bases=[4096],
        region_block_bytes=16384,
        wire_block_size=BLOCK,
        wire_layout="HND",
        memory_type="DRAM",
        device_id=0,
    )
    scheduler.connector.set_xfer_handshake_metadata({0: RankHandshake(meta.model_dump_json(), b"agent")})
    yield scheduler
    scheduler.connector.shutdown()


def request(request_id: str, tokens: int, params: dict[str, Any], max_tokens: int = 3) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)  # as vLLM's engine core does: prefix caching hashes every full block
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args={"kv_transfer_params": params})
    return Request(
        request_id, list(range(1, tokens + 1)), sampling, None, block_hasher=get_request_block_hasher(BLOCK, hash_fn)
    )


def step(scheduler: Any, sampled: int | None = 7, **connector: set[str]) -> Any:
    """One engine step: schedule, then report what the model runner and the connector's workers did."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    output = scheduler.schedule()
    ids = list(output.num_scheduled_tokens)
    runner = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[sampled] if sampled is not None else [] for _ in ids],
        kv_connector_output=KVConnectorOutput(**connector) if connector else None,
    )
    scheduler.update_from_output(output, runner)
    return output


def free_blocks(scheduler: Any) -> int:
    return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def remote_params(tokens: int) -> dict[str, Any]:
    blocks = list(range(10, 10 + -(-tokens // BLOCK)))
    params = KVTransferParams(
        remote_engine_id="prefill-0",
        remote_incarnation="inc",
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_request_id="p-1",
        remote_block_ids=blocks,
        num_tokens=tokens,
        remote_tp_size=1,
        fingerprint="fp",
        expires_at=time.time() + 120,
    )
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvbridge": params.model_dump(mode="json", by_alias=True),
    }


def test_decode_loads_asynchronously_then_computes_only_the_last_token_and_frees_every_block(decode: Any) -> None:
    initial = free_blocks(decode)
    decode.add_request(request("d-1", 3 * BLOCK + 5, remote_params(3 * BLOCK + 5)))
    first = step(decode, sampled=None)
    order = first.kv_connector_metadata.to_read["d-1"]
    assert len(order.local_block_ids) == 4  # 3 full blocks and a partial one, all from prefill
    assert first.num_scheduled_tokens == {}  # nothing computed while the KV is on its way
    assert free_blocks(decode) == initial - 4
    step(decode, sampled=None, finished_recving={"d-1"})
    running = step(decode)
    assert running.num_scheduled_tokens == {"d-1": 1}  # only the last prompt token is computed
    while decode.requests:
        step(decode)
    assert free_blocks(decode) == initial
    assert step(decode).kv_connector_metadata.to_read == {}  # read once


def test_an_aborted_decode_request_frees_its_blocks_once(decode: Any) -> None:
    from vllm.v1.request import RequestStatus

    initial = free_blocks(decode)
    decode.add_request(request("d-2", 2 * BLOCK, remote_params(2 * BLOCK)))
    step(decode, sampled=None)
    decode.finish_requests("d-2", RequestStatus.FINISHED_ABORTED)
    step(decode, sampled=None, finished_recving={"d-2"})  # the read that was in flight completes afterwards
    for _ in range(3):
        step(decode, sampled=None)
    assert free_blocks(decode) == initial
    assert not decode.requests


def test_a_finished_prefill_holds_its_blocks_until_read_then_frees_them_once(prefill: Any) -> None:
    initial = free_blocks(prefill)
    prefill.add_request(request("p-1", 2 * BLOCK + 3, {"do_remote_decode": True}, max_tokens=1))
    step(prefill)  # prefill computes the prompt and samples its one token: finished
    published = step(prefill, sampled=None).kv_connector_metadata
    assert set(published.to_offer) == {"p-1"}
    assert len(published.to_offer["p-1"].block_ids) == 3
    assert free_blocks(prefill) == initial - 3  # held for decode
    step(prefill, sampled=None, finished_sending={"p-1"})
    assert free_blocks(prefill) == initial
    assert not prefill.requests
    assert step(prefill, sampled=None).kv_connector_metadata.leases == {}


def test_a_local_prefix_hit_reads_only_the_blocks_decode_lacks(decode: Any) -> None:
    tokens = 3 * BLOCK + 5
    decode.add_request(request("warm", tokens, {}, max_tokens=1))  # the same prompt, computed on decode alone
    while decode.requests:
        step(decode)
    initial = free_blocks(decode)
    decode.add_request(request("d-3", tokens, remote_params(tokens)))
    first = step(decode, sampled=None)
    assert len(first.kv_connector_metadata.to_read["d-3"].local_block_ids) == 1  # 3 full blocks were cached
    step(decode, sampled=None, finished_recving={"d-3"})
    while decode.requests:
        step(decode)
    assert free_blocks(decode) == initial


def test_a_preempted_decode_request_is_recomputed_not_read_again(decode: Any) -> None:
    tokens = 2 * BLOCK + 9
    initial = free_blocks(decode)
    decode.add_request(request("d-4", tokens, remote_params(tokens), max_tokens=4))
    step(decode, sampled=None)
    step(decode, sampled=None, finished_recving={"d-4"})
    step(decode)  # running: the last prompt token computed, one token sampled
    running = decode.requests["d-4"]
    decode.running.remove(running)
    decode._preempt_request(running, time.monotonic())  # as under memory pressure: blocks go back to the pool
    assert free_blocks(decode) == initial
    again = step(decode)
    assert "d-4" not in again.kv_connector_metadata.to_read  # the prefill's blocks are not read a second time
    assert again.num_scheduled_tokens["d-4"] > 1  # decode recomputes what it had
    while decode.requests:
        step(decode)
    assert free_blocks(decode) == initial
