"""Hybrid models whose KV cache groups vLLM pads: registered and moved byte-exact.

vLLM 0.32's ``get_kv_cache_groups`` splits a hybrid model's layers into groups of one size, the last group of a
kind of layer padded: five layers, two full attention and three sliding window, become groups of 2, 2 and 1 layers;
a Gemma-3-1B shape (26 layers, full attention every sixth, a 512-token window) becomes 4, 4, 4, 4, 3, 3, 4. Every
group has the deepest one's layout; a shallower group's blocks leave its last layer slots unused. The caches here
are vLLM's own (``get_kv_cache_groups`` -> ``get_kv_cache_config_from_groups`` -> ``allocate_kv_cache`` on host
memory), the block tables from vLLM's ``KVCacheManager``, moved by both connector halves with real NIXL and
verification ``All`` (vllm_engines.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvbridge_agent.core import Role, SpecError

from .vllm_engines import Engine, Model, check_bytes, compute_prompt, move, window_gaps

FIVE = Model((None, None, 32, 32, 32), num_blocks=64)
#: Gemma-3-1B's layer pattern and window (1 KV head; head size shrunk from 256)
GEMMA = Model(tuple(None if i % 6 == 5 else 512 for i in range(26)), heads=1, head_size=64, num_blocks=1024)
#: the same pattern with 2 KV heads: BHLNC's head stride then differs between a group of 4 layers and one of 3
GEMMA_TWO_HEADS = Model(GEMMA.windows, heads=2, head_size=64, num_blocks=64)


def pair(model: Model, prefill_layout: KVCacheLayout, decode_layout: KVCacheLayout) -> tuple[Engine, Engine]:
    prefill = Engine(model, Role.PREFILL, prefill_layout)
    decode = Engine(model, Role.DECODE, decode_layout)
    for engine in (prefill, decode):
        engine.register()
    handshake = prefill.worker.get_handshake_metadata()
    assert handshake is not None
    prefill.scheduler.set_xfer_handshake_metadata({0: handshake})
    return prefill, decode


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    opened: list[Engine] = []
    yield opened
    for engine in reversed(opened):
        engine.shutdown()


def test_vllm_pads_these_groups() -> None:
    assert [len(g.layer_names) for g in FIVE.kv_cache_config(KVCacheLayout.LBHNC).kv_cache_groups] == [2, 2, 1]
    gemma = GEMMA.kv_cache_config(KVCacheLayout.LBHNC).kv_cache_groups
    assert [len(g.layer_names) for g in gemma] == [4, 4, 4, 4, 3, 3, 4]


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
@pytest.mark.parametrize("model", [FIVE, GEMMA, GEMMA_TWO_HEADS], ids=["five", "gemma3-1b", "gemma3-2heads"])
def test_padded_groups_register_where_they_overlay(model: Model, layout: KVCacheLayout, engines: list[Engine]) -> None:
    """Every layout registers as one cache of the deepest group's layers, but BHLNC with several KV heads: there a
    group's head stride is its own layers' bytes, so a padded group is another layout (refused, with the fix)."""
    engine = Engine(model, Role.DECODE, layout)
    engines.append(engine)
    if layout is KVCacheLayout.BHLNC and model.heads > 1:
        with pytest.raises(SpecError) as caught:
            engine.register()
        assert caught.value.code == "LAYOUT_UNSUPPORTED"
        assert "BHLNC" in caught.value.message
        assert "layer-outer" in caught.value.message
        return
    engine.register()
    rank = engine.worker.decode
    assert rank is not None
    depth = max(len(group.layer_names) for group in engine.config.kv_cache_groups)
    assert rank.cache.model.num_layers == depth
    assert len(rank.cache.tensors) == 1  # one allocation, one registration


LAYOUT_PAIRS = [
    (KVCacheLayout.LBHNC, KVCacheLayout.LBHNC),
    (KVCacheLayout.BLHNC, KVCacheLayout.LBNHC),
    (KVCacheLayout.LHBNC, KVCacheLayout.BLNHC),
]


@pytest.mark.parametrize(("prefill_layout", "decode_layout"), LAYOUT_PAIRS, ids=lambda layout: layout.name)
def test_five_layers_in_padded_groups_move_byte_exact(
    prefill_layout: KVCacheLayout, decode_layout: KVCacheLayout, engines: list[Engine]
) -> None:
    """Groups [2, 2, 1]: a prompt, then a longer one sharing its prefix (a prefix hit on both sides, in the
    padded sliding-window group too), each verified and byte-exact where decode's vLLM reads it."""
    prefill, decode = pair(FIVE, prefill_layout, decode_layout)
    engines += [prefill, decode]
    tokens = list(range(5000, 5100))
    for index, length in enumerate((70, 75, 100)):
        moved = move(prefill, decode, f"r{index}", tokens[:length])
        assert moved.ok, (moved.failures, moved.load_errors)
        check_bytes(decode, moved)
    assert moved.local_hit > 0


def test_gemma3_1b_groups_move_byte_exact_at_the_window_edges(engines: list[Engine]) -> None:
    """Gemma-3-1B's 7 groups (two padded) with its 512-token window, prompts one block edge around one and two
    windows and at the window's edge (527, 1023: ``n - 511`` a multiple of the block): every group's kept blocks
    byte-exact, the padded groups' unused layer slots never digested, the first computed token's window held."""
    prefill, decode = pair(GEMMA, KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)
    engines += [prefill, decode]
    for length in (511, 512, 513, 527, 1023, 1024, 1025):
        moved = move(prefill, decode, f"g{length}", [7 + (i * 31) % 1000 for i in range(length)])
        assert moved.ok, (length, moved.failures, moved.load_errors)
        check_bytes(decode, moved)
        sizes = moved.params["remoteGroupSizes"]
        offered = len(moved.tokens)  # at an edge (527, 1023) prefill left the last token to decode (window_backoff)
        assert offered == (length - 1 if length in (527, 1023) else length)
        blocks = -(-offered // GEMMA.block)
        window = blocks - max(0, offered - 512 + 1) // GEMMA.block
        assert sizes == [window] * 6 + [blocks]  # vLLM's sliding-window groups come first here
        assert not window_gaps(decode, moved)


def test_a_hit_in_a_padded_group_verifies(engines: list[Engine]) -> None:
    """Decode computed a prompt's prefix itself (vLLM's forward writes a group's own layer slots only), then reads
    the rest of a longer prompt: the padded group's hit blocks hold other bytes than prefill's in their unused
    slot, which the digest leaves out (before: KV_DIGEST_MISMATCH on those blocks)."""
    prefill, decode = pair(FIVE, KVCacheLayout.LBHNC, KVCacheLayout.LBHNC)
    engines += [prefill, decode]
    noise = torch.Generator().manual_seed(58)
    for engine in (prefill, decode):  # caches that served other requests: every slot holds something
        for view in engine.slots().values():
            view.view(torch.int16).copy_(torch.randint(-32768, 32767, view.shape, dtype=torch.int16, generator=noise))
    tokens = list(range(9000, 9075))
    local, _table = compute_prompt(decode, "local", tokens[:70])
    decode.manager.cache_blocks(local, 70)
    decode.manager.free(local)
    moved = move(prefill, decode, "turn2", tokens)
    assert moved.local_hit == 64
    assert moved.ok, (moved.failures, moved.load_errors)
    check_bytes(decode, moved)
