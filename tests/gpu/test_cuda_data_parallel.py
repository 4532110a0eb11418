"""Data-parallel engines on a GPU: each decode DP rank reads its request from the prefill DP rank that computed it.

vLLM runs one engine core per data-parallel rank, each with its own KV cache, and kvbridge makes each DP rank a
transfer peer of its own (engine id ``<engine>_dp<rank>``: ``core.parallel``). Here a prefill engine of DP 2 and a
decode engine of DP 3 share one GPU: five caches in GPU memory, registered with NIXL as VRAM, each prefill DP rank
holding different content and offering one request per reader. Every decode DP rank knows both prefill DP ranks;
the transfer parameters name the one to read from (d0 and d2 from p0, d1 from p1), verification ``All`` (digest
and check on the GPU). Reading from the wrong peer would give other bytes, so the byte check and the digest both
tell which rank was read.

The host-memory proof through vLLM's connector API (scheduler and worker per DP rank, side channel on base port +
rank) is tests/agent/vllm_connector/test_data_parallel.py; this one needs a CUDA device and NIXL only (conftest.py).
"""

from __future__ import annotations

import uuid

import torch

from kvbridge_agent.core import build_plan, wire_block_ids
from kvbridge_agent.core.digest import RequestDigests, new_key
from kvbridge_agent.core.handshake import KVTransferParams, RankMetadata
from kvbridge_agent.core.parallel import engine_id_of_rank
from kvbridge_agent.transfer.decode_rank import DecodeRank
from kvbridge_agent.transfer.digest import Digester
from kvbridge_agent.transfer.prefill_rank import PrefillRank
from kvbridge_agent.transfer.reads import ReadResult, Verify
from tests.physical_kv import check_bytes

from .test_cuda_transfer import (
    DECODE_BLOCKS,
    MODEL,
    PREFILL_BLOCKS,
    TIMEOUT,
    TOKENS,
    TRANSFER,
    Opened,
    Side,
    attach,
    read,
    released,
)

NEEDS_VLLM = False  # conftest.py: this module needs a CUDA device and NIXL only

PREFILL_DP, DECODE_DP = 2, 3
#: the prefill DP rank each decode DP rank reads from
SOURCES = [0, 1, 0]
SIDE = Side("BLHNC")


def test_each_decode_dp_rank_reads_the_prefill_dp_rank_its_parameters_name(opened: Opened) -> None:
    plan = build_plan(MODEL, SIDE.settings(), SIDE.settings(), TRANSFER)
    tag = uuid.uuid4().hex[:8]
    prefill_blocks = PREFILL_BLOCKS[: -(-TOKENS // SIDE.block)]
    decode_blocks = DECODE_BLOCKS[: -(-TOKENS // SIDE.block)]
    prefills: list[PrefillRank] = []
    views: list[dict[str, torch.Tensor]] = []
    expected: dict[str, RequestDigests] = {}
    peers: dict[str, dict[int, tuple[RankMetadata, bytes]]] = {}
    for dp in range(PREFILL_DP):
        engine_id = engine_id_of_rank(f"prefill-{tag}", dp, PREFILL_DP)
        held = attach(SIDE, 0, engine_id, opened, fill_it=True)
        for view in held.views.values():  # each DP rank's own content: a read from the wrong one differs
            view.view(torch.int16).add_(911 * (dp + 1))
        rank = PrefillRank(held.cache, held.transport, plan, engine_id, f"inc-{tag}", held.convert)
        rank.digester = Digester(held.engine)
        for request in [f"r{d}" for d, source in enumerate(SOURCES) if source == dp]:  # one request per reader
            key = new_key()
            expected[request] = RequestDigests(key, rank.offer(request, prefill_blocks, TOKENS, key))
        peers[engine_id] = {0: (rank.metadata(), held.transport.metadata())}
        prefills.append(rank)
        views.append(held.views)
    first, second = (next(iter(v.values())).view(torch.int16) for v in views)  # bit patterns: bf16 has NaNs
    assert not torch.equal(first, second)

    results: list[ReadResult] = []
    for dp, source in enumerate(SOURCES[:DECODE_DP]):
        held = attach(SIDE, 0, engine_id_of_rank(f"decode-{tag}", dp, DECODE_DP), opened, fill_it=False)
        reader = DecodeRank(held.cache, held.transport, SIDE.settings(), TRANSFER, held.convert)
        reader.digester = Digester(held.engine)
        opened.decodes.append(reader)
        for engine_id, ranks in peers.items():  # both prefill DP ranks known: the parameters pick one
            reader.add_peer(engine_id, f"inc-{tag}", ranks)
        params = KVTransferParams(
            remote_engine_id=engine_id_of_rank(f"prefill-{tag}", source, PREFILL_DP),
            remote_incarnation=f"inc-{tag}",
            remote_host="127.0.0.1",
            remote_port=1,
            remote_request_id=f"r{dp}",
            remote_block_ids=wire_block_ids(prefill_blocks, TOKENS, plan.split_ratio, plan.wire.block_size).tolist(),
            num_tokens=TOKENS,
            remote_tp_size=1,
            fingerprint=plan.fingerprint,
        )
        verify = Verify(expected[f"r{dp}"], decode_blocks, TOKENS)
        started = reader.start(f"d{dp}", params, decode_blocks, TIMEOUT, verify)
        results.append(read(reader, prefills, started, f"decode DP rank {dp}"))
        torch.cuda.synchronize()
        check_bytes(SIDE, SIDE, [views[source]], [held.views], prefill_blocks, decode_blocks)
        assert held.cache.memory_type.value == "VRAM"
    assert [(r.ok, r.code) for r in results] == [(True, "")] * DECODE_DP
    assert all(r.descriptors > 0 for r in results)
    released(prefills, "a prefill DP rank")
