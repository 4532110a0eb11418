"""The connector's scheduler half without a model: settings checks, publishing, leases, heartbeats, mismatches."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings, SpecError
from kvbridge_agent.core.contract import EngineEnvironment, render_environment
from kvbridge_agent.core.handshake import RankMetadata
from kvbridge_agent.transfer.keys import generate_keys
from kvbridge_agent.transfer.side_channel import SideChannelServer
from kvbridge_agent.vllm_connector.scheduler import ConnectorScheduler
from kvbridge_agent.vllm_connector.settings import ConnectorSettings

MODEL = ModelGeometry(name="m", num_layers=2, num_kv_heads=2, head_dim=64)


def environ(role: Role, lease: int = 120, keys: Path | None = None) -> dict[str, str]:
    env = EngineEnvironment(
        role=role, engine_id=f"{role.value}-0", model=MODEL, prefill=RoleSettings(block_size=32),
        decode=RoleSettings(block_size=32), transfer={"lease_seconds": lease}, side_channel_host="127.0.0.1",
        side_channel_listen_port=0, keys_dir=str(keys or ""),
    )  # fmt: skip
    return render_environment(env)


def vllm_config(kv_role: str, block_size: int = 32, tp: int = 1) -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=kv_role),
        cache_config=SimpleNamespace(block_size=block_size),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
    )


def request(request_id: str, tokens: int, params: dict[str, Any] | None, status: str = "FINISHED_LENGTH_CAPPED") -> Any:
    return SimpleNamespace(request_id=request_id, prompt_token_ids=list(range(tokens)), kv_transfer_params=params,
                           status=SimpleNamespace(name=status), num_computed_tokens=tokens)  # fmt: skip


def prefill_scheduler(keys: Path | None = None, lease: int = 120) -> ConnectorScheduler:
    settings = ConnectorSettings.from_vllm(vllm_config("kv_producer"), environ(Role.PREFILL, lease, keys))
    scheduler = ConnectorScheduler(settings)
    meta = RankMetadata(
        engine_id="prefill-0", incarnation="inc1", agent_name="a", tp_rank=0, tp_size=1, block_size=32,
        kv_layout="HND", cache_kind="Split", num_blocks=64, tensor_bases=[4096], region_block_bytes=16384,
        wire_block_size=32, wire_layout="HND", memory_type="DRAM", device_id=0,
    )  # fmt: skip
    from kvbridge_agent.vllm_connector.messages import RankHandshake

    scheduler.set_handshake({0: RankHandshake(meta.model_dump_json(), b"agent")})
    return scheduler


@pytest.mark.parametrize(
    ("config", "code"),
    [(vllm_config("kv_both"), "CONNECTOR_ROLE"), (vllm_config("kv_producer", block_size=16), "CONNECTOR_MISMATCH"),
     (vllm_config("kv_producer", tp=2), "CONNECTOR_MISMATCH")],
)  # fmt: skip
def test_vllm_flags_that_disagree_with_the_contract_stop_the_engine(config: Any, code: str) -> None:
    with pytest.raises(SpecError) as caught:
        ConnectorSettings.from_vllm(config, environ(Role.PREFILL))
    assert caught.value.code == code


def test_a_finished_prefill_keeps_its_blocks_and_publishes_the_lease() -> None:
    scheduler = prefill_scheduler()
    try:
        before = time.time()
        delay, params = scheduler.request_finished(request("r1", 70, {"do_remote_decode": True}), ([3, 4, 5],))
        assert delay is True
        assert params is not None
        ours = params["kvbridge"]
        assert params["do_remote_prefill"] is True
        assert ours["remoteBlockIds"] == [3, 4, 5]
        assert ours["numTokens"] == 70
        assert ours["remoteIncarnation"] == "inc1"
        assert before + 119 < ours["expiresAt"] <= time.time() + 120
        meta = scheduler.build_metadata()
        assert meta.to_offer["r1"].block_ids == [3, 4, 5]
        assert meta.leases == {"r1": ours["expiresAt"]}
        assert scheduler.build_metadata().to_offer == {}  # offered once
        scheduler.transfers_done({"r1"}, None)
        assert scheduler.build_metadata().leases == {}
    finally:
        scheduler.close()


@pytest.mark.parametrize(
    ("params", "status"),
    [(None, "FINISHED_LENGTH_CAPPED"), ({"do_remote_decode": True}, "FINISHED_ABORTED"), ({}, "FINISHED_STOPPED")],
)
def test_aborted_or_plain_requests_free_their_blocks_at_once(params: dict[str, Any] | None, status: str) -> None:
    scheduler = prefill_scheduler()
    try:
        assert scheduler.request_finished(request("r", 40, params, status), ([1, 2],)) == (False, None)
        assert scheduler.build_metadata().to_offer == {}
    finally:
        scheduler.close()


def published(scheduler: ConnectorScheduler, tokens: int = 70) -> dict[str, Any]:
    _, params = scheduler.request_finished(request("p1", tokens, {"do_remote_decode": True}), ([7, 8, 9],))
    assert params is not None
    return params


def blocks_of(ids: list[int]) -> SimpleNamespace:
    """vLLM's KVCacheBlocks of a request with no prefix hit (one KV cache group)."""
    return SimpleNamespace(get_unhashed_block_ids=lambda: ids, get_block_ids=lambda: (ids,))


def test_decode_loads_the_prompt_less_its_prefix_hit_once() -> None:
    prefill = prefill_scheduler()
    decode = ConnectorScheduler(ConnectorSettings.from_vllm(vllm_config("kv_consumer"), environ(Role.DECODE)))
    try:
        params = published(prefill)
        req = request("d1", 70, params)
        assert decode.matched_tokens(req, 32) == (38, True)  # one block already in decode's prefix cache
        blocks = SimpleNamespace(get_unhashed_block_ids=lambda: [11, 12], get_block_ids=lambda: ([5, 11, 12],))
        decode.after_alloc(req, blocks, 38)
        order = decode.build_metadata().to_read["d1"]
        assert (order.local_block_ids, order.refused) == ([11, 12], "")
        assert order.all_block_ids == [5, 11, 12]  # a verification digests the prefix hit too
        assert req.kv_transfer_params["do_remote_prefill"] is False  # a preempted request is not read twice
        assert decode.matched_tokens(req, 0) == (0, False)
    finally:
        prefill.close()
        decode.close()


def test_a_decode_prompt_of_another_length_is_refused_for_that_request() -> None:
    prefill = prefill_scheduler()
    decode = ConnectorScheduler(ConnectorSettings.from_vllm(vllm_config("kv_consumer"), environ(Role.DECODE)))
    try:
        req = request("d2", 102, published(prefill, tokens=70))
        decode.matched_tokens(req, 0)
        decode.after_alloc(req, blocks_of([1, 2, 3, 4]), 102)
        assert decode.build_metadata().to_read["d2"].refused.startswith("PROMPT_MISMATCH")
    finally:
        prefill.close()
        decode.close()


def test_decode_heartbeats_renew_the_prefill_lease_until_the_kv_arrived(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path / "keys")
    seen: list[list[str]] = []
    decode = ConnectorScheduler(
        ConnectorSettings.from_vllm(vllm_config("kv_consumer"), environ(Role.DECODE, lease=1, keys=tmp_path / "keys"))
    )  # fmt: skip
    server = SideChannelServer("127.0.0.1", 0, decode.settings.fingerprint, {}, keys, on_heartbeat=seen.append)
    server.start()
    try:
        prefill = prefill_scheduler()
        params = published(prefill)
        prefill.close()
        params["kvbridge"]["remotePort"] = server.port
        params["kvbridge"]["expiresAt"] = time.time() + 1  # the lease as published, 1 s
        req = request("d3", 70, params)
        decode.matched_tokens(req, 0)
        deadline = time.monotonic() + 5
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen
        assert seen[0] == ["p1"]
        # the request waited longer than the published lease; the renewals that got through count
        time.sleep(0.1)
        decode.after_alloc(req, blocks_of([1, 2, 3]), 70)
        order = decode.build_metadata().to_read["d3"]
        assert order.expires_at is not None
        assert order.expires_at > params["kvbridge"]["expiresAt"]
        assert order.expires_at > time.time() + 0.2
        decode.transfers_done(None, {"d3"})
        time.sleep(0.8)
        count = len(seen)
        time.sleep(1.2)
        assert len(seen) == count  # the KV arrived: no more heartbeats for it
    finally:
        decode.close()
        server.close()


def test_a_prefill_worker_remembers_only_the_requests_it_holds() -> None:
    """vLLM reports every finished request to every worker; a long-running prefill must not keep them all."""
    from kvbridge_agent.vllm_connector.messages import OfferOrder, StepMetadata
    from kvbridge_agent.vllm_connector.worker import ConnectorWorker

    settings = ConnectorSettings.from_vllm(vllm_config("kv_producer"), environ(Role.PREFILL, lease=1))
    worker = ConnectorWorker(settings, 0, "inc")

    class Rank:  # stands in for PrefillRank: no reader ever notifies
        def offer(
            self, request_id: str, block_ids: list[int], digest_tokens: int = 0, key: bytes = b""
        ) -> dict[int, Any]:
            return {}

        def poll(self) -> Any:
            return SimpleNamespace(completed=[])

        def forget(self, request_id: str) -> bool:
            return True

    worker.prefill = Rank()  # type: ignore[assignment]
    worker.start(StepMetadata(to_offer={"held": OfferOrder([1], time.time() + 0.3)}))
    for step in range(1000):
        worker.finished({f"plain-{step}"} | ({"held"} if step == 0 else set()))
    assert worker._finished_seen == {"held"}
    time.sleep(0.4)
    assert worker.finished(set()) == ({"held"}, None)  # the lease ended unread: its blocks are freed
    assert worker._finished_seen == set()


def test_a_verified_request_is_offered_with_its_own_key_and_published_with_it() -> None:
    """The scheduler decides (a secret draw; Sampled's warm-up here: every request), draws the request's digest key,
    hands it to the ranks with the offer and serves it with their digests on the side channel — never in the
    transfer parameters, which pass through routers and clients."""
    from kvbridge_agent.core.digest import KEY_BYTES
    from kvbridge_agent.core.handshake import DigestState
    from kvbridge_agent.vllm_connector.stats import DIGESTS

    scheduler = prefill_scheduler()
    try:
        params = published(scheduler)
        assert params["kvbridge"]["verify"] is True
        order = scheduler.build_metadata().to_offer["p1"]
        assert order.digest_tokens == 70
        assert len(order.digest_key) == KEY_BYTES
        assert order.digest_key.hex() not in str(params)
        assert scheduler._published_digests("p1") == (DigestState.PENDING, None)
        rows = b"\1" * 8 * 3  # 70 tokens: 3 wire blocks of 32
        scheduler.take_digests(SimpleNamespace(data={DIGESTS: [("p1", [0], rows)]}))
        assert scheduler._published_digests("p1")[0] is DigestState.PENDING  # one head of two
        scheduler.take_digests(SimpleNamespace(data={DIGESTS: [("p1", [1], rows)]}))
        state, found = scheduler._published_digests("p1")
        assert state is DigestState.READY
        assert found is not None
        assert found.key == order.digest_key
        assert sorted(found.heads) == [0, 1]
        scheduler.request_finished(request("p2", 70, {"do_remote_decode": True}), ([1, 2, 3],))
        assert scheduler.build_metadata().to_offer["p2"].digest_key != order.digest_key  # one key per request
    finally:
        scheduler.close()
