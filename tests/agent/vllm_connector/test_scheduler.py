"""The connector's scheduler half without a model: settings checks, publishing, leases, heartbeats, mismatches."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings, SpecError
from kvbridge_agent.core.contract import EngineEnvironment, render_environment
from kvbridge_agent.core.handshake import RankMetadata
from kvbridge_agent.transfer.keys import generate_keys
from kvbridge_agent.transfer.side_channel import SideChannelServer
from kvbridge_agent.vllm_connector.scheduler import ConnectorScheduler
from kvbridge_agent.vllm_connector.settings import ConnectorSettings
from kvbridge_sim.support import wait_until

MODEL = ModelGeometry(name="m", num_layers=2, num_kv_heads=2, head_dim=64)


def environ(role: Role, lease: int = 120, keys: Path | None = None) -> dict[str, str]:
    env = EngineEnvironment(
        role=role,
        engine_id=f"{role.value}-0",
        model=MODEL,
        prefill=RoleSettings(block_size=32),
        decode=RoleSettings(block_size=32),
        transfer={"lease_seconds": lease},
        side_channel_host="127.0.0.1",
        side_channel_listen_port=0,
        keys_dir=str(keys or ""),
    )
    return render_environment(env)


def vllm_config(kv_role: str, block_size: int = 32, tp: int = 1) -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=kv_role),
        cache_config=SimpleNamespace(block_size=block_size),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
    )


def request(request_id: str, tokens: int, params: dict[str, Any] | None, status: str = "FINISHED_LENGTH_CAPPED") -> Any:
    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=list(range(tokens)),
        kv_transfer_params=params,
        status=SimpleNamespace(name=status),
        num_computed_tokens=tokens,
    )


def prefill_scheduler(keys: Path | None = None, lease: int = 120) -> ConnectorScheduler:
    settings = ConnectorSettings.from_vllm(vllm_config("kv_producer"), environ(Role.PREFILL, lease, keys))
    scheduler = ConnectorScheduler(settings)
    meta = RankMetadata(
        engine_id="prefill-0",
        incarnation="inc1",
        agent_name="a",
        tp_rank=0,
        tp_size=1,
        block_size=32,
        kv_layout="HND",
        cache_kind="Split",
        num_blocks=64,
        tensor_bases=[4096],
        region_block_bytes=16384,
        wire_block_size=32,
        wire_layout="HND",
        memory_type="DRAM",
        device_id=0,
    )
    from kvbridge_agent.vllm_connector.messages import RankHandshake

    scheduler.set_xfer_handshake_metadata({0: RankHandshake(meta.model_dump_json(), b"agent")})
    return scheduler


@pytest.mark.parametrize(
    ("config", "code"),
    [
        (vllm_config("kv_both"), "CONNECTOR_ROLE"),
        (vllm_config("kv_producer", block_size=16), "CONNECTOR_MISMATCH"),
        (vllm_config("kv_producer", tp=2), "CONNECTOR_MISMATCH"),
    ],
)
def test_vllm_flags_that_disagree_with_the_contract_stop_the_engine(config: Any, code: str) -> None:
    with pytest.raises(SpecError) as caught:
        ConnectorSettings.from_vllm(config, environ(Role.PREFILL))
    assert caught.value.code == code


def test_each_data_parallel_rank_is_an_engine_of_its_own_as_vllm_names_it() -> None:
    """vLLM runs one engine core per DP rank, ``data_parallel_index`` set (dense models too, as DP 1 engines):
    kvbridge's connector names it ``<pod>_dp<index>`` and listens on base port + index, as NixlConnector does."""
    env = EngineEnvironment(
        role=Role.PREFILL,
        engine_id="p-0",
        model=MODEL.model_copy(update={"num_experts": 8}),
        prefill=RoleSettings(block_size=32, data_parallel_size=4, expert_parallel=True),
        decode=RoleSettings(block_size=32),
    )
    config = vllm_config("kv_producer")
    config.parallel_config.data_parallel_index = 2
    settings = ConnectorSettings.from_vllm(config, render_environment(env))
    assert settings.environment.engine_id == "p-0_dp2"
    assert settings.environment.side_channel_port == 5602
    config.parallel_config.data_parallel_index = 4
    with pytest.raises(SpecError) as caught:
        ConnectorSettings.from_vllm(config, render_environment(env))
    assert (caught.value.code, caught.value.field) == ("CONNECTOR_MISMATCH", "spec.prefill.dataParallelSize")
    single = ConnectorSettings.from_vllm(vllm_config("kv_producer"), environ(Role.PREFILL))
    assert single.environment.engine_id == "prefill-0"  # one DP rank: the pod's name, as before


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
        meta = scheduler.build_connector_meta()
        assert meta.to_offer["r1"].block_ids == [3, 4, 5]
        assert meta.leases == {"r1": ours["expiresAt"]}
        assert scheduler.build_connector_meta().to_offer == {}  # offered once
        scheduler.transfers_done({"r1"}, None)
        assert scheduler.build_connector_meta().leases == {}
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize(
    ("params", "status"),
    [(None, "FINISHED_LENGTH_CAPPED"), ({"do_remote_decode": True}, "FINISHED_ABORTED"), ({}, "FINISHED_STOPPED")],
)
def test_aborted_or_plain_requests_free_their_blocks_at_once(params: dict[str, Any] | None, status: str) -> None:
    scheduler = prefill_scheduler()
    try:
        assert scheduler.request_finished(request("r", 40, params, status), ([1, 2],)) == (False, None)
        assert scheduler.build_connector_meta().to_offer == {}
    finally:
        scheduler.shutdown()


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
        assert decode.get_num_new_matched_tokens(req, 32) == (38, True)  # one block already in decode's prefix cache
        blocks = SimpleNamespace(get_unhashed_block_ids=lambda: [11, 12], get_block_ids=lambda: ([5, 11, 12],))
        decode.update_state_after_alloc(req, blocks, 38)
        order = decode.build_connector_meta().to_read["d1"]
        assert (order.local_block_ids, order.refused) == ([11, 12], "")
        assert order.all_block_ids == [5, 11, 12]  # a verification digests the prefix hit too
        assert req.kv_transfer_params["do_remote_prefill"] is False  # a preempted request is not read twice
        assert decode.get_num_new_matched_tokens(req, 0) == (0, False)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_decode_prompt_of_another_length_is_refused_for_that_request() -> None:
    prefill = prefill_scheduler()
    decode = ConnectorScheduler(ConnectorSettings.from_vllm(vllm_config("kv_consumer"), environ(Role.DECODE)))
    try:
        req = request("d2", 102, published(prefill, tokens=70))
        decode.get_num_new_matched_tokens(req, 0)
        decode.update_state_after_alloc(req, blocks_of([1, 2, 3, 4]), 102)
        assert decode.build_connector_meta().to_read["d2"].refused.startswith("PROMPT_MISMATCH")
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_decode_heartbeats_renew_the_prefill_lease_until_the_kv_arrived(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path / "keys")
    seen: list[list[str]] = []
    decode = ConnectorScheduler(
        ConnectorSettings.from_vllm(vllm_config("kv_consumer"), environ(Role.DECODE, lease=1, keys=tmp_path / "keys"))
    )
    prefill = prefill_scheduler()
    params = published(prefill)
    assert prefill._server is not None
    secret = prefill._server.secret  # the stand-in listener checks the lease tokens prefill's listener handed out
    prefill.shutdown()

    def renew(request_ids: list[str]) -> list[str]:
        seen.append(request_ids)
        return request_ids

    server = SideChannelServer("127.0.0.1", 0, decode.settings.fingerprint, {}, keys, on_heartbeat=renew, secret=secret)
    server.start()
    try:
        params["kvbridge"]["remotePort"] = server.port
        params["kvbridge"]["expiresAt"] = time.time() + 1  # the lease as published, 1 s
        req = request("d3", 70, params)
        decode.get_num_new_matched_tokens(req, 0)
        with contextlib.suppress(TimeoutError):  # three at most; one is enough for what follows
            wait_until(lambda: len(seen) >= 3, 5, "three heartbeats", interval=0.05)
        assert seen
        assert seen[0] == ["p1"]
        # the request waited longer than the published lease; the renewals that got through count
        time.sleep(0.1)
        decode.update_state_after_alloc(req, blocks_of([1, 2, 3]), 70)
        order = decode.build_connector_meta().to_read["d3"]
        assert order.expires_at is not None
        assert order.expires_at > params["kvbridge"]["expiresAt"]
        assert order.expires_at > time.time() + 0.2
        decode.transfers_done(None, {"d3"})
        time.sleep(0.8)
        count = len(seen)
        time.sleep(1.2)
        assert len(seen) == count  # the KV arrived: no more heartbeats for it
    finally:
        decode.shutdown()
        server.close()


class UnreadRank:
    """Stands in for a PrefillRank whose offers no reader ever notifies."""

    digester = None

    def offer(
        self,
        request_id: str,
        block_ids: list[int],
        digest_tokens: int = 0,
        key: bytes = b"",
        block_layers: list[int] | None = None,
    ) -> dict[int, Any]:
        return {}

    def poll(self) -> Any:
        return SimpleNamespace(completed=[])

    def forget(self, request_id: str) -> bool:
        return True


def test_a_prefill_worker_remembers_only_the_requests_it_holds() -> None:
    """vLLM reports every finished request to every worker; a long-running prefill must not keep them all."""
    from kvbridge_agent.vllm_connector.messages import OfferOrder, StepMetadata
    from kvbridge_agent.vllm_connector.worker import ConnectorWorker

    settings = ConnectorSettings.from_vllm(vllm_config("kv_producer"), environ(Role.PREFILL, lease=1))
    worker = ConnectorWorker(settings, 0, "inc")
    worker.prefill = UnreadRank()  # type: ignore[assignment]
    worker.start_load_kv(StepMetadata(to_offer={"held": OfferOrder([1], time.time() + 0.3)}))
    for step in range(1000):
        worker.get_finished({f"plain-{step}"} | ({"held"} if step == 0 else set()))
    assert worker._finished_seen == {"held"}
    time.sleep(0.4)
    assert worker.get_finished(set()) == ({"held"}, None)  # the lease ended unread: its blocks are freed
    assert worker._finished_seen == set()


@pytest.mark.parametrize(
    "request_id",
    ["a:b", "cmpl-" + "x" * 300, "with space", "tab\there", "nul\x00", "é-not-ascii", ""],
)
def test_a_request_id_kvbridge_cannot_carry_fails_that_request_and_records_nothing(request_id: str) -> None:
    """vLLM derives request ids from the client's X-Request-Id; an exception out of request_finished is fatal to
    vLLM's engine core, so a bad id must fail its own request, typed, with no lease or offer left behind."""
    scheduler = prefill_scheduler()
    try:
        delay, params = scheduler.request_finished(request(request_id, 70, {"do_remote_decode": True}), ([3, 4],))
        assert delay is False  # vLLM frees the blocks now
        assert params is not None
        assert params["kvbridge_error"]["code"] == "INVALID_REQUEST_ID"
        assert params["do_remote_prefill"] is False
        meta = scheduler.build_connector_meta()
        assert (meta.to_offer, meta.leases) == ({}, {})
        # the engine keeps serving: the next request is offered as usual
        assert scheduler.request_finished(request("next", 40, {"do_remote_decode": True}), ([5, 6],))[0] is True
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize(
    "mutation",
    [
        {"remoteRequestId": "a:b"},
        {"remoteRequestId": "x" * 300},
        {"remotePort": 0},
        {"remoteBlockIds": "not a list"},
        {"numTokens": -1},
        {"fingerprint": None},
        # bounds: a claimed TP decides how many ranks decode asks for (10^9 grew decode by GiBs on its handshake
        # thread, then a MemoryError ended the engine); block ids and token counts are bounded alike
        {"remoteTpSize": 1_000_000_000},
        {"remoteTpSize": 1025},
        {"numTokens": 1 << 40},
        {"remoteBlockIds": [-1]},
        {"remoteBlockIds": [1 << 70]},
        {"remoteGroupSizes": [-1, 1]},
        # within the schema's bounds but refused by the deployment's verdict (2 KV heads): TP 3 does not divide
        # them, TP 4 would replicate prefill's heads into a smaller decode
        {"remoteTpSize": 3},
        {"remoteTpSize": 4},
    ],
)
def test_decode_parameters_that_do_not_validate_fail_that_request_without_raising(mutation: dict[str, Any]) -> None:
    """A client that calls decode directly with forged kvbridge parameters: the request's blocks are reported
    invalid (vLLM fails it by its kv_load_failure_policy), nothing is read, no heartbeat is sent for it."""
    from kvbridge_agent.vllm_connector.worker import ConnectorWorker

    prefill = prefill_scheduler()
    decode = ConnectorScheduler(ConnectorSettings.from_vllm(vllm_config("kv_consumer"), environ(Role.DECODE)))
    try:
        params = published(prefill)
        params["kvbridge"].update(mutation)
        req = request("d9", 70, params)
        assert decode.get_num_new_matched_tokens(req, 0) == (70, True)
        assert decode._waiting == {}
        decode.update_state_after_alloc(req, blocks_of([1, 2, 3]), 70)
        order = decode.build_connector_meta().to_read["d9"]
        assert order.params is None
        assert order.refused.startswith("INVALID_TRANSFER_PARAMS: kv_transfer_params.kvbridge")
        worker = ConnectorWorker(decode.settings, 0, "inc")
        result = worker._start_read(None, "d9", order)  # type: ignore[arg-type]
        assert result is not None
        assert (result.ok, result.code, result.invalid_blocks) == (False, "INVALID_TRANSFER_PARAMS", [1, 2, 3])
        worker.shutdown()
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_prefill_tp_the_deployment_allows_is_read_though_not_the_planned_one() -> None:
    """A rollout's mixed pair (prefill TP 2 beside this decode, planned against TP 1; the verdict allows it) is not
    refused: the bound is the deployment's verdict, not equality with the plan."""
    prefill = prefill_scheduler()
    decode = ConnectorScheduler(ConnectorSettings.from_vllm(vllm_config("kv_consumer"), environ(Role.DECODE)))
    try:
        params = published(prefill)
        params["kvbridge"]["remoteTpSize"] = 2
        req = request("d11", 70, params)
        assert decode.get_num_new_matched_tokens(req, 0) == (70, True)
        decode.update_state_after_alloc(req, blocks_of([1, 2, 3]), 70)
        order = decode.build_connector_meta().to_read["d11"]
        assert (order.refused, order.params is not None) == ("", True)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_whatever_a_handshake_or_a_read_raises_fails_its_requests_not_vllm_s_step() -> None:
    """get_finished and start_load_kv are vLLM hooks whose exceptions end the engine: a handshake thread that died of
    a MemoryError (the 10^9-rank list), or a read that raised something unforeseen, fails the requests it hit, typed
    INTERNAL_ERROR and logged, and the hook returns."""
    from concurrent.futures import Future

    from kvbridge_agent.vllm_connector.messages import ReadOrder
    from kvbridge_agent.vllm_connector.worker import ConnectorWorker

    prefill = prefill_scheduler()
    decode = ConnectorScheduler(ConnectorSettings.from_vllm(vllm_config("kv_consumer"), environ(Role.DECODE)))
    worker = ConnectorWorker(decode.settings, 0, "inc")
    try:
        from kvbridge_agent.vllm_connector.messages import transfer_params

        params = transfer_params(published(prefill))
        assert params is not None
        died: Future[Any] = Future()
        died.set_exception(MemoryError("a list of 10^9 ranks"))
        key = (params.remote_engine_id, params.remote_incarnation)
        worker._fetching[key] = (died, time.perf_counter(), ("127.0.0.1", 1))
        worker._parked[key] = [("d12", ReadOrder([4, 5], params))]
        worker._finish_handshakes(None)  # type: ignore[arg-type]
        (result,) = worker._results
        assert (result.request_id, result.ok, result.code, result.invalid_blocks) == (
            "d12",
            False,
            "INTERNAL_ERROR",
            [4, 5],
        )
        assert "MemoryError" in result.message
        worker._results = []

        def broken(*_: Any) -> None:
            raise IndexError("an id past the cache")

        worker._start_read = broken  # type: ignore[method-assign,assignment]
        worker._start_or_fail(None, "d13", ReadOrder([6], params))  # type: ignore[arg-type]
        (result,) = worker._results
        assert (result.request_id, result.ok, result.code, result.invalid_blocks) == (
            "d13",
            False,
            "INTERNAL_ERROR",
            [6],
        )
    finally:
        worker.shutdown()
        prefill.shutdown()
        decode.shutdown()


def test_decode_parameters_that_are_not_an_object_fail_that_request() -> None:
    decode = ConnectorScheduler(ConnectorSettings.from_vllm(vllm_config("kv_consumer"), environ(Role.DECODE)))
    try:
        req = request("d10", 40, {"do_remote_prefill": True, "kvbridge": ["not", "an", "object"]})
        assert decode.get_num_new_matched_tokens(req, 0) == (40, True)
        decode.update_state_after_alloc(req, blocks_of([4, 5]), 40)
        assert decode.build_connector_meta().to_read["d10"].refused.startswith("INVALID_TRANSFER_PARAMS")
    finally:
        decode.shutdown()


# decode behind a signing router (spec.router.signTransfers): test_signed_reads.py


def test_a_verified_request_is_offered_with_its_own_key_and_published_with_it() -> None:
    """A request whose prompt the scheduler did not see completed (no scheduler output here): it decides at the
    finish (a secret draw; Sampled's warm-up here: every request), draws the request's digest key, hands it to the
    ranks with the offer and serves it with their digests on the side channel — the parameters, already sent, carry
    neither."""
    from kvbridge_agent.core.digest import KEY_BYTES
    from kvbridge_agent.core.handshake import DigestState
    from kvbridge_agent.vllm_connector.stats import DIGESTS

    scheduler = prefill_scheduler()
    try:
        params = published(scheduler)
        assert params["kvbridge"]["verify"] is True
        order = scheduler.build_connector_meta().to_offer["p1"]
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
        assert scheduler.build_connector_meta().to_offer["p2"].digest_key != order.digest_key  # one key per request
    finally:
        scheduler.shutdown()


def scheduler_output(new: list[tuple[str, list[int]]], scheduled: dict[str, int]) -> SimpleNamespace:
    """vLLM's SchedulerOutput as far as the connector reads it."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,)) for r, b in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens=scheduled,
    )


def test_a_verified_prompt_is_digested_after_its_last_step_and_its_answer_carries_the_digests() -> None:
    """Issue 34, item 3: the digests travel with the transfer parameters, so decode checks what it read in the
    step its READs complete, with no side-channel exchange. vLLM calls request_finished for the step's finished
    requests, then update_connector_output with the same step's worker output, then sends the answers: the
    answer's dict is completed in between."""
    from kvbridge_agent.core.handshake import KVTransferParams
    from kvbridge_agent.vllm_connector.stats import DIGESTS

    scheduler = prefill_scheduler()
    try:
        req = request("p5", 70, {"do_remote_decode": True})
        req.num_prompt_tokens, req.num_computed_tokens = 70, 0
        scheduler.update_state_after_alloc(req, blocks_of([7, 8, 9]), 0)
        first = scheduler.build_connector_meta(scheduler_output([("p5", [7, 8])], {"p5": 64}))
        assert first.to_digest == {}  # the prompt is not complete after this step (chunked prefill)
        req.num_computed_tokens = 64
        cached = SimpleNamespace(req_ids=["p5"], new_block_ids=[([9],)], resumed_req_ids=set())
        last = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={"p5": 6})
        meta = scheduler.build_connector_meta(last)
        order = meta.to_digest["p5"]
        assert (order.block_ids, order.num_tokens) == ([7, 8, 9], 70)
        req.num_computed_tokens = 70
        delay, params = scheduler.request_finished(req, ([7, 8, 9],))
        assert delay is True
        assert params is not None
        assert "digests" not in params["kvbridge"]  # this step's digests are still to come
        rows = (np.arange(6, dtype="<u8") + 1).tobytes()  # 2 heads x 3 wire blocks of 32
        scheduler.take_digests(SimpleNamespace(data={DIGESTS: [("p5", [0, 1], rows)]}))
        carried = KVTransferParams.model_validate(params["kvbridge"])
        assert carried.verify is True
        assert carried.digests is not None
        found = carried.digests.request_digests()
        assert found.key == order.key
        assert found.heads[1].tolist() == [4, 5, 6]
        assert scheduler.build_connector_meta().to_offer["p5"].digest_tokens == 0  # not digested twice
    finally:
        scheduler.shutdown()


def test_a_prompt_digested_but_finished_later_is_digested_again_at_the_offer() -> None:
    """max_tokens > 1 straight to prefill: the request finishes steps after its prompt, with more tokens computed,
    so the early digests do not describe what is offered; the offer digests it again, the side channel serves it."""
    scheduler = prefill_scheduler()
    try:
        req = request("p6", 40, {"do_remote_decode": True})
        req.num_prompt_tokens, req.num_computed_tokens = 40, 0
        scheduler.update_state_after_alloc(req, blocks_of([3, 4]), 0)
        assert "p6" in scheduler.build_connector_meta(scheduler_output([("p6", [3, 4])], {"p6": 40})).to_digest
        req.num_computed_tokens = 43  # three tokens generated since
        _, params = scheduler.request_finished(req, ([3, 4],))
        assert params is not None
        scheduler.take_digests(SimpleNamespace(data={}))
        assert "digests" not in params["kvbridge"]
        assert params["kvbridge"]["verify"] is True
        assert scheduler.build_connector_meta().to_offer["p6"].digest_tokens == 43
    finally:
        scheduler.shutdown()


def test_prefill_renews_only_leases_still_running_past_the_clock_margin() -> None:
    """The worker frees an expired request from its copy of the leases (a step old at most): a heartbeat that comes
    when the lease has ended, or is about to, is neither applied nor acknowledged."""
    prefill = prefill_scheduler(lease=120)
    try:
        published(prefill)
        assert prefill._renew(["p1", "unknown"]) == ["p1"]
        prefill._leases["p1"] = time.time() + 0.5  # within the margin: the worker may free it before it sees more
        assert prefill._renew(["p1"]) == []
        prefill._leases["p1"] = time.time() - 1  # ended
        assert prefill._renew(["p1"]) == []
        assert prefill._leases["p1"] < time.time()
    finally:
        prefill.shutdown()
