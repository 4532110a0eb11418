"""Staged reads (docs/protocol.md §4d) with real NIXL agents on host memory: prefill packs a request's segments in
wire order, decode READs them in a few descriptors — straight into its blocks or into its staging buffer and
scattered — and every byte lands where the direct read puts it, for cache kinds' regions and vLLM's physical
layouts, TP changes, block-size conversions and any block ids. A full staging buffer on either side reads directly;
the staged bytes go back when the readers are done or the lease ends; a stage request that names anything prefill
does not hold is refused with a code."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import CacheKind, KVBridgeError, ModelGeometry
from kvbridge_agent.core.arithmetic import ceil_div
from kvbridge_agent.core.digest import KV_DIGEST_MISMATCH
from kvbridge_agent.core.stage_requests import (
    STAGE_NOT_OFFERED,
    STAGE_OUT_OF_RANGE,
    STAGE_PLAN_INVALID,
    STAGE_PLAN_MISMATCH,
    STAGING_OFF,
    StageRequest,
)
from kvbridge_agent.transfer import staged_reads
from kvbridge_agent.transfer.prefill_rank import PrefillRank
from kvbridge_agent.transfer.reads import TRANSFER_FAILED, Verify

from .harness import model as region_model
from .staged_harness import Side, StagedPair

PHYSICAL = ModelGeometry(name="tiny-physical", num_layers=3, num_kv_heads=4, head_dim=64)
BLOCKS = 24
#: layout pairs: a cache kind's regions (``None``) or vLLM's physical layouts; TP changes, block-size conversions
#: (decode merging, prefill splitting, kernel blocks), orders whose runs are single tokens of single heads
CONFIGS: dict[str, tuple[ModelGeometry, Side, Side]] = {
    "regions-2to1": (region_model(), Side(None, tp=2), Side(None)),
    "regions-blocks-first-1to2": (region_model(CacheKind.BLOCKS_FIRST), Side(None), Side(None, tp=2)),
    "regions-8to16": (region_model(), Side(None, 8), Side(None, 16)),
    "LBHNC-tp2to1": (PHYSICAL, Side("LBHNC", tp=2), Side("LBHNC")),
    "LHBNC": (PHYSICAL, Side("LHBNC"), Side("LHBNC")),
    "LBHNC-16to32": (PHYSICAL, Side("LBHNC", 16), Side("LBHNC", 32)),
    "BLHNC-32to16": (PHYSICAL, Side("BLHNC", 32), Side("BLHNC", 16)),
    "LBHNC-to-LBNHC": (PHYSICAL, Side("LBHNC"), Side("LBNHC")),
    "LBHNC-kernel16-to-BHLNC-tp1to2": (PHYSICAL, Side("LBHNC", 32, kernel=16), Side("BHLNC", 32, tp=2)),
    "BHLNC-tp2to1": (PHYSICAL, Side("BHLNC", tp=2), Side("BHLNC")),
}


@pytest.fixture(scope="module")
def pairs() -> Iterator[dict[str, StagedPair]]:
    built: dict[str, StagedPair] = {}
    try:
        yield built
    finally:
        for pair in built.values():
            pair.close()


def pair_of(pairs: dict[str, StagedPair], name: str) -> StagedPair:
    if name not in pairs:
        pairs[name] = StagedPair(*CONFIGS[name], blocks=BLOCKS)
    return pairs[name]


def block_ids(rng: random.Random, count: int, contiguous: bool) -> list[int]:
    if contiguous:
        start = rng.randrange(0, BLOCKS - count + 1)
        return list(range(start, start + count))
    return rng.sample(range(BLOCKS), count)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(sorted(CONFIGS)),
    contiguous=st.booleans(),
    seed=st.integers(0, 1 << 16),
    data=st.data(),
)
def test_pack_read_scatter_is_byte_exact_against_the_direct_read(
    pairs: dict[str, StagedPair], name: str, contiguous: bool, seed: int, data: st.DataObject
) -> None:
    pair = pair_of(pairs, name)
    prefill, decode = pair.prefill_side, pair.decode_side
    tokens = data.draw(st.integers(1, (BLOCKS - 2) * min(prefill.block, decode.block)), label="tokens")
    rng = random.Random(seed)
    remote = block_ids(rng, ceil_div(tokens, prefill.block), contiguous)
    local = block_ids(rng, ceil_div(tokens, decode.block), contiguous)
    hit = data.draw(st.integers(0, len(local)), label="prefix hit")
    direct = pair.run(tokens, remote, local[hit:], seed, "direct")
    for into in ("blocks", "buffer"):
        staged = pair.run(tokens, remote, local[hit:], seed, "staged", into)
        for d, (result, tensors) in staged.items():
            assert result.ok, (name, into, result.code, result.message)
            if hit < len(local):
                assert result.mode == "staged", (name, into)
            assert result.bytes == direct[d][0].bytes
            for got, want in zip(tensors, direct[d][1], strict=True):
                assert torch.equal(got, want), f"{name}: decode rank {d} read {into} differs from the direct read"
    for rank in pair.prefill:  # every staged byte went back once the readers were done
        assert rank.staging is not None
        assert rank.staging.held == []
    for drank in pair.decode:
        assert drank.staging is not None
        assert drank.staging.pool.free_bytes == drank.staging.pool.bytes


def test_the_cost_model_is_measured_when_a_rank_starts(pairs: dict[str, StagedPair]) -> None:
    staging = pair_of(pairs, "LBHNC-tp2to1").decode[0].staging
    assert staging is not None
    cost = staging.cost
    assert cost.descriptor_us > 0
    assert cost.transfer_gbps > 0
    assert cost.gather_gbps > 0
    assert cost.scatter_gbps > 0


def test_a_full_staging_buffer_reads_directly_and_still_exactly(pairs: dict[str, StagedPair]) -> None:
    """Back-pressure: no room in decode's buffer, or prefill's answers ``busy``: the request reads directly."""
    pair = pair_of(pairs, "LBHNC-tp2to1")
    remote, local = [3, 8, 1, 20], [5, 6, 7, 2]
    direct = pair.run(60, remote, local, 7, "direct")
    staging = pair.decode[0].staging
    assert staging is not None
    hog = staging.pool.take(staging.pool.bytes, "hog")
    assert hog is not None
    try:
        busy = staging.busy
        got = pair.run(60, remote, local, 7, "staged", "buffer")
        assert got[0][0].mode == "direct"
        assert staging.busy == busy + 1
        assert all(torch.equal(a, b) for a, b in zip(got[0][1], direct[0][1], strict=True))
    finally:
        staging.pool.release("hog")
    prefill_pool = pair.prefill[1].staging
    assert prefill_pool is not None
    assert prefill_pool.pool.take(prefill_pool.pool.bytes, "hog") is not None
    try:
        got = pair.run(60, remote, local, 7, "staged", "blocks")
        assert got[0][0].mode == "direct"
        assert all(torch.equal(a, b) for a, b in zip(got[0][1], direct[0][1], strict=True))
    finally:
        prefill_pool.pool.release("hog")
    assert staging.pool.free_bytes == staging.pool.bytes


def test_a_lease_that_ends_frees_the_staged_bytes(pairs: dict[str, StagedPair]) -> None:
    pair = pair_of(pairs, "LHBNC")
    params = pair.offer(80, [1, 2, 3, 9, 10], 11)
    rank = pair.prefill[0]
    assert rank.staging is not None
    read = pair.decode[0].peers[pair.engine_id].staged[0]
    request = StageRequest(rank=0, plan=read.segments.plan, first=0, count=5)
    reply = rank.stage(params.remote_request_id, request)
    assert reply.bytes == 5 * PHYSICAL.kv_bytes_per_token * 16
    assert rank.staging.held == [params.remote_request_id]
    assert rank.staging.pool.free_bytes < rank.staging.pool.bytes
    assert rank.forget(params.remote_request_id)  # the lease ended
    assert rank.staging.held == []
    assert rank.staging.pool.free_bytes == rank.staging.pool.bytes
    with pytest.raises(KVBridgeError) as caught:
        rank.stage(params.remote_request_id, request)
    assert caught.value.code == STAGE_NOT_OFFERED


def test_hostile_stage_requests_are_refused_typed(pairs: dict[str, StagedPair]) -> None:
    pair = pair_of(pairs, "LBHNC-tp2to1")
    params = pair.offer(40, [4, 5, 6], 3)
    plan = pair.decode[0].peers[pair.engine_id].staged[1].segments.plan
    rank = pair.prefill[1]
    refusals = [
        ("never-offered", StageRequest(rank=1, plan=plan, first=0, count=3), STAGE_NOT_OFFERED),
        (params.remote_request_id, StageRequest(rank=0, plan=plan, first=0, count=3), STAGE_PLAN_INVALID),
        (params.remote_request_id, StageRequest(rank=1, plan=plan, first=2, count=2), STAGE_OUT_OF_RANGE),
        (params.remote_request_id, StageRequest(rank=1, plan=plan, first=0, count=1 << 20), STAGE_OUT_OF_RANGE),
        (
            params.remote_request_id,
            StageRequest(rank=1, plan=plan.model_copy(update={"digest": "a" * 32}), first=0, count=3),
            STAGE_PLAN_MISMATCH,
        ),
        (
            params.remote_request_id,
            StageRequest(rank=1, plan=plan.model_copy(update={"heads": ((0, 3), (0, 3))}), first=0, count=3),
            STAGE_PLAN_INVALID,
        ),
    ]
    assert rank.staging is not None
    free = rank.staging.pool.free_bytes  # (prefill packed the request when offered: it has met the plan)
    for request_id, request, code in refusals:
        with pytest.raises(KVBridgeError) as caught:
            rank.stage(request_id, request)
        assert caught.value.code == code, request
    assert rank.staging.pool.free_bytes == free  # nothing more was packed
    bare = PrefillRank(rank.cache, rank.transport, pair.plan, "bare", "inc")  # no staging buffer
    with pytest.raises(KVBridgeError) as caught:
        bare.stage(params.remote_request_id, refusals[0][1])
    assert caught.value.code == STAGING_OFF
    for prank in pair.prefill:
        prank.forget(params.remote_request_id)


def test_decode_verifies_its_own_blocks_after_the_scatter(pairs: dict[str, StagedPair]) -> None:
    """The digest covers each engine's own cache: decode digests its blocks once the staged bytes are in place."""
    pair = pair_of(pairs, "regions-2to1")
    local = [9, 2, 14, 7]
    for into in ("buffer", "blocks"):
        params = pair.offer(60, [1, 5, 6, 11], 5, digest=True)
        got = pair.read(params, local, "staged", into, Verify(pair.digests[params.remote_request_id], local, 60))
        assert (got[0][0].ok, got[0][0].mode) == (True, "staged"), got[0][0]


def test_bytes_that_changed_in_a_staging_buffer_fail_the_digest(pairs: dict[str, StagedPair]) -> None:
    """A fault in the staged bytes (prefill's buffer overwritten after the pack) reaches decode's blocks, and
    decode's digest of them catches it: the request fails, naming the blocks, never used."""
    pair = pair_of(pairs, "regions-2to1")
    local = [3, 4, 12, 8]
    pair.run(60, [2, 3, 4, 5], local, 9, "staged")  # prefill meets the plan: it packs later requests when offered
    params = pair.offer(60, [2, 3, 4, 5], 9, digest=True)
    for rank in pair.prefill:
        assert rank.staging is not None
        assert rank.staging.held == [params.remote_request_id]
        rank.staging.pool.tensor.bitwise_not_()  # every staged byte flipped
    got = pair.read(params, local, "staged", "buffer", Verify(pair.digests[params.remote_request_id], local, 60))
    result = got[0][0]
    assert (result.ok, result.code, result.mode, result.prestaged) == (False, KV_DIGEST_MISMATCH, "staged", True)
    assert result.invalid_blocks == sorted(local)
    for rank in pair.prefill:
        rank.forget(params.remote_request_id)


def test_a_scatter_that_fails_fails_its_request_not_the_rank(
    pairs: dict[str, StagedPair], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scatter that raises on the rank's own thread (host memory: the READ is done when posted, so the rank
    scatters it itself) fails that request with ``TRANSFER_FAILED``; it never escapes the rank's start or poll
    (in an engine, that ended the rank's loop and process). The extent goes back; the next request reads."""
    pair = pair_of(pairs, "LBHNC-tp2to1")
    remote, local = [3, 8, 1, 20], [5, 6, 7, 2]
    direct = pair.run(60, remote, local, 7, "direct")

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("a scatter that failed")

    monkeypatch.setattr(staged_reads, "scatter", broken)
    params = pair.offer(60, remote, 7)
    result = pair.read(params, local, "staged", "buffer")[0][0]
    assert (result.ok, result.code) == (False, TRANSFER_FAILED), result
    staging = pair.decode[0].staging
    assert staging is not None
    assert staging.pool.free_bytes == staging.pool.bytes
    for rank in pair.prefill:  # no notification came: prefill's lease ends
        rank.forget(params.remote_request_id)
    monkeypatch.undo()
    got = pair.run(60, remote, local, 7, "staged", "buffer")
    assert (got[0][0].ok, got[0][0].mode) == (True, "staged")
    assert all(torch.equal(a, b) for a, b in zip(got[0][1], direct[0][1], strict=True))


def test_an_evicted_peer_keeps_its_lists_while_nixl_holds_a_read_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A READ NIXL would not release (a failed staged read in quarantine, or a direct one) must not outlive the
    descriptor lists and remote agents it names: evicting its peer releases them only once NIXL let go of it."""
    pair = StagedPair(*CONFIGS["LBHNC-tp2to1"], blocks=BLOCKS)
    try:
        rank = pair.decode[0]
        transport, staging = rank.transport, rank.staging
        assert staging is not None
        staging.mode, staging.into = "staged", "buffer"
        params = pair.offer(60, [3, 8, 1, 20], 7)
        assert rank.start("held", params, [5, 6, 7, 2], 20.0) is None
        monkeypatch.setattr(transport, "state", lambda _handle: "ERR")
        monkeypatch.setattr(transport, "release", lambda _handle: False)
        [failed] = rank.poll()
        assert failed.code == TRANSFER_FAILED
        assert staging.quarantine
        peer = rank.peers[pair.engine_id]
        lists = [read.pieces for read in peer.staged] + [remote for remote, _local in peer.lists]
        agents = set(peer.agents.values())
        assert rank.evict_peer(pair.engine_id)
        rank.poll()
        assert all(handle in transport._dlists for handle in lists)  # still named by the READ NIXL holds
        assert agents <= transport._peers
        monkeypatch.undo()
        rank.poll()  # NIXL let go: the extent, the lists and the agents go
        assert not staging.quarantine
        assert staging.pool.free_bytes == staging.pool.bytes
        assert not any(handle in transport._dlists for handle in lists)
        assert not agents & transport._peers
    finally:
        pair.close()


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_reads_in_flight_when_their_peer_is_evicted_fail_with_the_next_poll(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill engine that restarts is evicted when its new incarnation is met: its READs still in flight must
    end with a result, or the engine waiting on them (vLLM: a request waiting for remote KV) waits for ever."""
    pair = StagedPair(*CONFIGS["LBHNC-tp2to1"], blocks=BLOCKS)
    try:
        rank = pair.decode[0]
        assert rank.staging is not None
        rank.staging.mode, rank.staging.into = mode, "buffer"
        params = pair.offer(60, [3, 8, 1, 20], 7)
        monkeypatch.setattr(rank.transport, "state", lambda _handle: "PROC")  # never done
        assert rank.start("held", params, [5, 6, 7, 2], 20.0) is None
        assert rank.poll() == []
        assert rank.evict_peer(pair.engine_id)
        monkeypatch.undo()
        [failed] = rank.poll()
        assert (failed.request_id, failed.ok, failed.code) == ("held", False, TRANSFER_FAILED)
        assert failed.invalid_blocks == [5, 6, 7, 2]
        assert not failed.peer_failed  # the engine already forgot it: nothing more to evict
        assert rank.poll() == []
        assert rank.in_flight == 0
    finally:
        pair.close()
