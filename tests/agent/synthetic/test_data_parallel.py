"""The synthetic engine with data parallelism: DP ranks on both roles, each a transfer peer of its own, every
prefill DP rank read by every decode DP rank at different DP sizes, every byte verified."""

from __future__ import annotations

import itertools
import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings, SpecError, TransferSettings, Verification
from kvbridge_agent.core.contract import EngineEnvironment
from kvbridge_agent.core.handshake import HandshakeError, KVTransferParams
from kvbridge_agent.synthetic.data_parallel import DP_RANK_HEADER
from kvbridge_agent.synthetic.processes import EngineProcess, start_engine
from kvbridge_agent.synthetic.rank_worker import rank_device
from kvbridge_agent.transfer.keys import generate_keys, load_keys
from kvbridge_agent.transfer.peers import WRONG_PEER, fetch_prefill_ranks

MODEL = ModelGeometry(name="tiny", num_layers=2, num_kv_heads=4, head_dim=32)
PREFILL = RoleSettings(tensor_parallel_size=2, data_parallel_size=2)
DECODE = RoleSettings(tensor_parallel_size=1, data_parallel_size=3)


def environment(role: Role, engine_id: str, keys: Path) -> EngineEnvironment:
    return EngineEnvironment(
        role=role,
        engine_id=engine_id,
        model=MODEL,
        prefill=PREFILL,
        decode=DECODE,
        transfer=TransferSettings(lease_seconds=20, handshake_timeout_seconds=5, verification=Verification.ALL),
        keys_dir=str(keys),
        num_blocks=32,
        http_port=0,
        side_channel_listen_port=0,
        transfer_timeout_seconds=10,
    )


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    keys = tmp_path_factory.mktemp("dp") / "keys"
    generate_keys(keys)
    started: list[EngineProcess] = []
    try:
        for role, name in ((Role.PREFILL, "p"), (Role.DECODE, "d")):
            started.append(start_engine(environment(role, name, keys)))
        yield started[0], started[1]
    finally:
        for engine in started:
            engine.stop()


def on_rank(rank: int) -> dict[str, str]:
    return {DP_RANK_HEADER: str(rank)}


def prefill(engine: EngineProcess, request_id: str, tokens: int, rank: int | None = None) -> dict[str, Any]:
    headers = on_rank(rank) if rank is not None else None
    status, body = engine.post("/v1/prefill", {"requestId": request_id, "numTokens": tokens}, headers=headers)
    assert status == 200, body
    params: dict[str, Any] = body["kvTransferParams"]
    return params


def decode(
    engine: EngineProcess, request_id: str, params: dict[str, Any], rank: int | None = None
) -> tuple[int, dict[str, Any]]:
    headers = on_rank(rank) if rank is not None else None
    return engine.post("/v1/decode", {"requestId": request_id, "kvTransferParams": params}, headers=headers)


def test_each_dp_rank_is_a_peer_of_its_own(engines: tuple[EngineProcess, EngineProcess]) -> None:
    p, d = engines
    ranks = p.ready["dataParallelRanks"]
    assert [r["engineId"] for r in ranks] == ["p_dp0", "p_dp1"]
    assert len({r["sideChannelPort"] for r in ranks}) == 2  # a side channel each
    assert len({r["incarnation"] for r in ranks}) == 2
    assert [r["engineId"] for r in d.ready["dataParallelRanks"]] == ["d_dp0", "d_dp1", "d_dp2"]
    assert len(p.ready["rankPids"]) == 4
    assert len(d.ready["rankPids"]) == 3
    health = p.get("/healthz")
    assert health["ok"]
    assert health["dataParallelRanks"] == ranks


def test_every_decode_dp_rank_reads_every_prefill_dp_rank_byte_verified(
    engines: tuple[EngineProcess, EngineProcess],
) -> None:
    p, d = engines
    ports = {r["engineId"]: r["sideChannelPort"] for r in p.ready["dataParallelRanks"]}
    verified = [d.metric("kvbridge_requests_total", engine=f"d_dp{rank}", outcome="verified") for rank in range(3)]
    for prefill_rank, decode_rank in itertools.product(range(2), range(3)):
        request = f"pair-{prefill_rank}-{decode_rank}"
        params = prefill(p, request, 37 + 8 * prefill_rank + decode_rank, rank=prefill_rank)
        assert params["remoteEngineId"] == f"p_dp{prefill_rank}"  # the rank that computed it, and its side channel
        assert params["remotePort"] == ports[params["remoteEngineId"]]
        status, result = decode(d, f"d-{request}", params, rank=decode_rank)
        assert status == 200, result
        assert result["verified"]
        assert result["dataParallelRank"] == decode_rank
        assert result["bytes"] > 0
    assert p.get("/v1/held")["held"] == {}  # every offer was released by its reader
    for rank in range(3):  # each decode rank read two, and handshook with both prefill ranks, once each
        assert d.metric("kvbridge_requests_total", engine=f"d_dp{rank}", outcome="verified") == verified[rank] + 2
        assert d.metric("kvbridge_handshake_seconds_count", engine=f"d_dp{rank}") == 2


def test_requests_without_a_rank_spread_over_the_ranks(engines: tuple[EngineProcess, EngineProcess]) -> None:
    p, d = engines
    with ThreadPoolExecutor(8) as pool:
        offered = list(pool.map(lambda i: prefill(p, f"spread-{i}", 64), range(8)))
        read = list(pool.map(lambda item: decode(d, f"d-spread-{item[0]}", item[1]), enumerate(offered)))
    assert {o["remoteEngineId"] for o in offered} == {"p_dp0", "p_dp1"}
    assert all(status == 200 and result["verified"] for status, result in read), read
    assert {result["dataParallelRank"] for _, result in read} >= {0, 1}


def test_a_bad_rank_header_is_refused_naming_the_ranks(engines: tuple[EngineProcess, EngineProcess]) -> None:
    p, _ = engines
    for bad in ("2", "-1", "one"):
        headers = {DP_RANK_HEADER: bad}
        status, body = p.post("/v1/prefill", {"requestId": f"bad-{bad}", "numTokens": 8}, headers=headers)
        assert status == 400
        assert body["error"]["field"] == DP_RANK_HEADER
        assert "0..1" in body["error"]["message"]
    assert p.get("/v1/held")["held"] == {}


def test_a_request_id_is_held_once_per_pod_whichever_rank(engines: tuple[EngineProcess, EngineProcess]) -> None:
    p, d = engines
    params = prefill(p, "twice", 16, rank=0)
    status, body = p.post("/v1/prefill", {"requestId": "twice", "numTokens": 16}, headers=on_rank(1))
    assert status == 409
    assert body["error"]["code"] == "DUPLICATE_REQUEST"
    status, result = decode(d, "d-twice", params)
    assert status == 200
    assert result["verified"]


def test_parameters_naming_another_ranks_side_channel_fail_loudly(
    engines: tuple[EngineProcess, EngineProcess],
) -> None:
    p, d = engines
    params = prefill(p, "crossed", 24, rank=0)
    dp1_port = p.ready["dataParallelRanks"][1]["sideChannelPort"]
    crossed = KVTransferParams.model_validate(dict(params, remotePort=dp1_port))  # dp0's id at dp1's side channel
    with pytest.raises(HandshakeError) as caught:
        fetch_prefill_ranks(crossed, [0], crossed.fingerprint, load_keys(d.env.keys_dir), 5)
    assert caught.value.code == WRONG_PEER
    assert "serves p_dp1, not p_dp0" in caught.value.message
    # through decode: an engine id no rank has met, at a rank's port: refused, nothing read, nothing retired
    status, body = decode(d, "d-crossed", dict(params, remoteEngineId="p_dp7", remotePort=dp1_port), rank=1)
    assert status == 502, body
    assert body["error"]["code"] == WRONG_PEER
    known = prefill(p, "known", 24, rank=0)
    status, result = decode(d, "d-known", known, rank=1)  # decode rank 1 now knows p_dp0's incarnation
    assert status == 200, result
    # and a known incarnation named at another rank's side channel: refused too (the heartbeats and digests
    # would go to the wrong rank), before a byte is read
    status, body = decode(d, "d-crossed-known", dict(params, remotePort=dp1_port), rank=1)
    assert status == 502, body
    assert body["error"]["code"] == WRONG_PEER
    status, result = decode(d, "d-crossed-right", params, rank=1)  # the right parameters still read
    assert status == 200
    assert result["verified"]


def test_metrics_name_every_rank_in_one_family(engines: tuple[EngineProcess, EngineProcess]) -> None:
    p, _ = engines
    with urllib.request.urlopen(p.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    assert text.count("# TYPE kvbridge_free_blocks gauge") == 1
    assert 'kvbridge_free_blocks{engine="p_dp0",role="prefill"}' in text
    assert 'kvbridge_free_blocks{engine="p_dp1",role="prefill"}' in text
    assert json.loads(json.dumps(p.get("/v1/held")))["freeBlocks"] == 64  # both ranks' caches, all free again


@pytest.mark.parametrize(
    ("device", "dp_index", "rank", "visible", "expected"),
    [
        ("cpu", 1, 1, 0, "cpu"),
        ("cuda", 0, 0, 4, "cuda:0"),
        ("cuda", 0, 1, 4, "cuda:1"),
        ("cuda", 1, 0, 4, "cuda:2"),  # DP rank 1's first TP rank: the pod's third GPU
        ("cuda", 1, 1, 4, "cuda:3"),
        ("cuda", 1, 1, 1, "cuda:0"),  # one GPU visible (a test): the ranks share it
    ],
)
def test_each_rank_of_a_gpu_pod_gets_its_own_gpu(
    device: str, dp_index: int, rank: int, visible: int, expected: str
) -> None:
    assert rank_device(device, dp_index, 2, rank, visible) == expected


def test_a_dp_rank_past_the_last_port_is_refused() -> None:
    env = environment(Role.PREFILL, "p", Path("/nonexistent")).model_copy(update={"side_channel_listen_port": 65535})
    assert env.of_data_parallel_rank(0).side_channel_port == 65535
    with pytest.raises(SpecError) as caught:
        env.of_data_parallel_rank(1)
    assert caught.value.code == "SIDE_CHANNEL_PORTS_OUT_OF_RANGE"
