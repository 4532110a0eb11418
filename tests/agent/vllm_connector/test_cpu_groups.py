"""Several KV cache groups on vLLM's CPU build: each group's blocks in the layer slots its layers use.

vLLM's CPU build keeps its hybrid allocator for kvbridge's connector (it declares ``SupportsHMA``), and its
``allocate_kv_cache`` views one allocation per group at the same origin in ``LBHNC``, the CPU attention's layout:
group ``g``'s layer ``i`` is the tensor of slot ``i`` — every group's ``i``-th layer — ``[blocks, heads, block_size,
2 * head_dim]`` with the CPU attention kernel's block interior, and a block id is one group's at a time. The
connector takes the slots as its per-layer tensors (``cache_geometry.group_slots``): the cache is one group's layers
deep, a padded group's blocks leave their last slots unused (moved, never digested). The caches here are vLLM's own
(``allocate_kv_cache`` on host memory, ``LBHNC``), registered as the CPU build registers them (no resolved layout),
the block tables from vLLM's ``KVCacheManager``, both halves with real NIXL and verification ``All``
(vllm_engines.py). Gemma-3's pattern (5 sliding : 1 global) and the padded [2, 2, 1] five-layer model, window 32,
blocks 32 (the CPU attention's smallest), prompts at the window's and the block's edges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvbridge_agent.core import BlockMappingError, Role, SpecError
from kvbridge_agent.core.cache_groups import pair_groups
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.transfer import reads
from kvbridge_agent.transfer.reads import _map_group_blocks
from kvbridge_agent.vllm_connector.cache_geometry import group_slots
from kvbridge_agent.vllm_connector.cpu_blocks import CPUAttentionBlocks

from .vllm_engines import Engine, Model, check_bytes, move, window_gaps

#: Gemma-3's layer pattern with a 32-token window, 1 KV head of 64 (tiny_model.GEMMA3's cache): vLLM makes one
#: group per layer here (group size: the one global layer), all in one layer slot
GEMMA3 = Model((32, 32, 32, 32, 32, None), block=32, heads=1, head_size=64, num_blocks=64)
#: two full and three sliding layers: groups [2, 2, 1], the last padded (its blocks leave slot 1 unused)
FIVE = Model((None, None, 32, 32, 32), block=32, heads=2, head_size=64, num_blocks=64)
#: window 32, blocks 32: ``(n - 31) % 32 == 0``, where prefill leaves the last token to decode (window_backoff)
EDGES = (63, 95, 127)
LENGTHS = (31, 32, 33, *EDGES, 64, 65)
#: a prompt away from the window's edge: prefill offers all of it
PROMPT = 100


class CPUEngine(Engine):
    """An engine whose cache vLLM's CPU build allocated (``LBHNC``) and hands over without a resolved layout."""

    def __init__(self, model: Model, role: Role) -> None:
        super().__init__(model, role, KVCacheLayout.LBHNC)

    def register(self) -> None:
        self.worker.register_kv_caches(self.views, None)


@pytest.fixture
def pair() -> Iterator[Callable[[Model], tuple[CPUEngine, CPUEngine]]]:
    opened: list[CPUEngine] = []

    def make(model: Model) -> tuple[CPUEngine, CPUEngine]:
        prefill, decode = CPUEngine(model, Role.PREFILL), CPUEngine(model, Role.DECODE)
        opened.extend((prefill, decode))
        for engine in (prefill, decode):
            engine.register()
        handshake = prefill.worker.get_handshake_metadata()
        assert handshake is not None
        prefill.scheduler.set_xfer_handshake_metadata({0: handshake})
        return prefill, decode

    yield make
    for engine in reversed(opened):
        engine.shutdown()


def test_vllm_overlays_the_groups_in_layer_slots() -> None:
    gemma = GEMMA3.kv_cache_config(KVCacheLayout.LBHNC)
    assert [len(g.layer_names) for g in gemma.kv_cache_groups] == [1] * 6
    five = FIVE.kv_cache_config(KVCacheLayout.LBHNC)
    assert [len(g.layer_names) for g in five.kv_cache_groups] == [2, 2, 1]


@pytest.mark.parametrize("model", [GEMMA3, FIVE], ids=["gemma3", "five"])
def test_the_cache_is_the_groups_layer_slots(
    model: Model, pair: Callable[[Model], tuple[CPUEngine, CPUEngine]]
) -> None:
    """One tensor per slot, slot ``i`` the tensor of every group's ``i``-th layer; the cache one group deep, with
    the CPU attention's pseudo-heads (keys and values of a head) and its block interior for the digest."""
    prefill, decode = pair(model)
    for engine in (prefill, decode):
        rank = engine.worker.prefill or engine.worker.decode
        assert rank is not None
        groups = engine.config.kv_cache_groups
        depth = max(len(g.layer_names) for g in groups)
        assert rank.cache.model.num_layers == depth == len(rank.cache.tensors)
        assert rank.cache.model.num_kv_heads == 2 * model.heads
        for slot, tensor in enumerate(rank.cache.tensors):
            names = [g.layer_names[slot] for g in groups if slot < len(g.layer_names)]
            assert {engine.views[name].data_ptr() for name in names} == {tensor.data_ptr()}
        assert engine.worker.block_interior.startswith("vllm-cpu-attention/")
    rank = prefill.worker.prefill
    assert rank is not None
    assert rank.digester is not None
    assert isinstance(getattr(rank.digester.view, "__self__", None), CPUAttentionBlocks)


@pytest.mark.parametrize("model", [GEMMA3, FIVE], ids=["gemma3", "five"])
def test_groups_move_byte_exact_at_the_window_edges(
    model: Model, pair: Callable[[Model], tuple[CPUEngine, CPUEngine]]
) -> None:
    """Every group's kept blocks byte-exact in the slots its layers use, verified; at the window's edge prefill
    offers ``n - 1`` tokens and every token decode's first forward attends to lies in a block it holds. The
    prompts share a prefix: later ones hit decode's prefix cache in every group."""
    prefill, decode = pair(model)
    tokens = [11 + (i * 37) % 1000 for i in range(max(LENGTHS))]
    windows = sum(w is not None for w in model.windows)
    for length in LENGTHS:
        moved = move(prefill, decode, f"r{length}", tokens[:length])
        assert moved.ok, (length, moved.failures, moved.load_errors)
        check_bytes(decode, moved)
        assert moved.params["numTokens"] == (length - 1 if length in EDGES else length)
        assert not window_gaps(decode, moved), length
        sizes = moved.params.get("remoteGroupSizes")
        assert sizes is not None
        assert len(sizes) == len(decode.config.kv_cache_groups)
        if length > 64 and windows:  # the sliding groups keep fewer blocks than the full ones
            assert min(sizes) < max(sizes), (length, sizes)
    assert moved.local_hit > 0


def flip_after_offer(engine: Engine, slot: int, group: int) -> None:
    """Once prefill has offered (and digested) a request, flip one byte of its cache in layer slot ``slot`` of the
    first block ``group`` keeps of it; decode then reads it."""
    offer = engine.worker.start_load_kv
    groups = engine.scheduler.settings.groups
    assert groups is not None

    def flipped(meta: Any) -> None:
        offer(meta)
        for order in meta.to_offer.values():
            sizes = groups.sizes(PROMPT)
            assert sum(sizes) == len(order.block_ids)
            block = order.block_ids[sum(sizes[:group])]
            rank = engine.worker.prefill
            assert rank is not None
            rank.cache.tensors[slot].view(torch.uint8).view(rank.cache.num_blocks, -1)[block, 5] ^= 0x40

    engine.worker.start_load_kv = flipped  # type: ignore[method-assign]


@pytest.mark.parametrize(("group", "slot", "caught"), [(0, 0, True), (2, 0, True), (1, 1, True), (2, 1, False)])
def test_a_byte_in_a_groups_block_fails_the_digest(
    group: int, slot: int, caught: bool, pair: Callable[[Model], tuple[CPUEngine, CPUEngine]]
) -> None:
    """Groups [2, 2, 1]: a byte flipped after prefill's digest in a block of ``group``, in a slot its layers use,
    fails the read (``KV_DIGEST_MISMATCH``) — for the full group, a sliding one and the padded one; in the padded
    group's unused slot it is moved but never digested (vLLM reads nothing there)."""
    prefill, decode = pair(FIVE)
    flip_after_offer(prefill, slot, group)
    moved = move(prefill, decode, "flipped", [3 + i for i in range(PROMPT)])
    if caught:
        assert moved.failures == ["KV_DIGEST_MISMATCH"], moved.failures
        assert moved.load_errors
    else:
        assert moved.ok, (moved.failures, moved.load_errors)


def test_groups_that_do_not_share_their_slots_are_refused() -> None:
    """A group's layer in a tensor of its own (not the slot the other groups' layer of that index uses), or
    groups that do not hold the model's layers: refused at registration, typed."""
    config = FIVE.kv_cache_config(KVCacheLayout.LBHNC)
    engine = CPUEngine(FIVE, Role.DECODE)
    try:
        layers = [list(g.layer_names) for g in config.kv_cache_groups]
        apart = dict(engine.views)
        apart[layers[2][0]] = apart[layers[2][0]].clone()
        with pytest.raises(SpecError) as caught:
            group_slots(apart, layers, 5)
        assert caught.value.code == "LAYOUT_UNSUPPORTED"
        with pytest.raises(SpecError) as caught:
            group_slots(engine.views, layers, 6)
        assert caught.value.code == "INVALID_KV_TENSOR"
        with pytest.raises(SpecError) as caught:
            group_slots({}, layers, 5)
        assert caught.value.code == "INVALID_KV_TENSOR"
        empties: list[list[list[str]]] = [[], [[]], [layers[0], []]]
        for empty in empties:  # no groups, or a group of no layers: typed, not a bare error
            with pytest.raises(SpecError) as caught:
                group_slots(engine.views, empty, sum(len(group) for group in empty))
            assert caught.value.code == "INVALID_KV_TENSOR"
        assert [t.data_ptr() for t in group_slots(engine.views, layers, 5)] == [
            engine.views[layers[0][0]].data_ptr(),
            engine.views[layers[0][1]].data_ptr(),
        ]
    finally:
        engine.shutdown()


def test_a_group_read_into_another_groups_blocks_fails_the_digest(
    pair: Callable[[Model], tuple[CPUEngine, CPUEngine]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups [2, 2, 1], the two sliding-window groups equally long: decode's reads pair each one's blocks with the
    other's on prefill (every byte moved intact, but into the wrong group's blocks): the digest, taken per block in
    each group's own layer slots, fails the read."""
    prefill, decode = pair(FIVE)

    def crossed(*args: Any) -> list[tuple[list[int], list[int]]]:
        pairs = pair_groups(*args)
        (mine1, theirs1), (mine2, theirs2) = pairs[1], pairs[2]
        assert len(theirs1) == len(theirs2)
        return [pairs[0], (mine1, theirs2), (mine2, theirs1)]

    monkeypatch.setattr(reads, "pair_groups", crossed)
    moved = move(prefill, decode, "crossed", [5 + i for i in range(PROMPT)])
    assert moved.failures == ["KV_DIGEST_MISMATCH"], moved.failures


def params(remote: list[int], sizes: list[int]) -> KVTransferParams:
    return KVTransferParams(
        remote_engine_id="p-0",
        remote_incarnation="i",
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_request_id="r",
        remote_block_ids=remote,
        remote_group_sizes=sizes,
        num_tokens=32 * max(sizes),
        remote_tp_size=1,
        fingerprint="f",
    )


def test_per_layer_reads_pair_each_groups_blocks() -> None:
    """On per-layer-slot tensors each group's blocks pair with the last of prefill's blocks of that group (a prefix
    hit leaves out a group's first ones), the groups one after the other; other block sizes are refused."""
    offered = params([10, 11, 12, 20, 21], [3, 2])
    mapped = _map_group_blocks([7, 8, 9, 5, 6], [3, 2], offered, 1)
    assert mapped.local.tolist() == [7, 8, 9, 5, 6]
    assert mapped.remote.tolist() == [10, 11, 12, 20, 21]
    hit = _map_group_blocks([9, 6], [1, 1], offered, 1)  # decode's prefix cache holds two and one of them
    assert hit.remote.tolist() == [12, 21]
    with pytest.raises(BlockMappingError) as caught:
        _map_group_blocks([7, 8, 9, 5, 6], [3, 2], offered, 2)
    assert caught.value.code == "CACHE_GROUPS_MISMATCH"
