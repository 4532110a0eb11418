"""A hybrid model's KV cache groups on host memory: vLLM's own allocator overlays a full-attention group and a
sliding-window group in one allocation; kvbridge's connector (both halves, real NIXL, side channel, verification
``All``) moves, per group, only the blocks that group keeps — every prompt block of the full-attention layers, those
of the sliding-window layers vLLM has not freed (core.cache_groups) — and never touches vLLM's null block.

Model: 4 layers (0 and 2 full attention, 1 and 3 a 32-token sliding window), 2 KV heads, head size 64, bf16,
16-token blocks; a 70-token prompt is 5 blocks, of which the window keeps the last 3.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.core.kv_cache_utils import create_kv_cache_group_specs
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings
from kvbridge_agent.core.contract import EngineEnvironment, render_environment
from kvbridge_agent.transfer.reads import ReadResult
from kvbridge_agent.vllm_connector.connector import cache_groups
from kvbridge_agent.vllm_connector.scheduler import ConnectorScheduler
from kvbridge_agent.vllm_connector.settings import ConnectorSettings
from kvbridge_agent.vllm_connector.worker import ConnectorWorker
from tests.physical_kv import NUM_BLOCKS

from .test_gpu_layouts import kv_cache_config, request, wrong_strides

HEADS, HEAD_SIZE, BLOCK, WINDOW, TOKENS = 2, 64, 16, 32, 70
MODEL = ModelGeometry(name="hybrid", num_layers=4, num_kv_heads=HEADS, head_dim=HEAD_SIZE)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
FULL, WINDOWED = [NAMES[0], NAMES[2]], [NAMES[1], NAMES[3]]
#: vLLM's block tables of the request, per group: the sliding-window group's first blocks are its null block
PREFILL_TABLE = ([3, 7, 1, 12, 5], [0, 0, 20, 21, 22])
DECODE_TABLE = ([9, 2, 14, 6, 11], [0, 0, 15, 16, 17])
TIMEOUT = 30.0


def allocate(layout: KVCacheLayout) -> tuple[dict[str, torch.Tensor], Any]:
    """The overlaid views of both groups and vLLM's KVCacheConfig (as a hybrid model's GPU worker gets them)."""
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    window = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16, sliding_window=WINDOW
    )
    specs = {NAMES[0]: full, NAMES[2]: full, NAMES[1]: window, NAMES[3]: window}
    groups = create_kv_cache_group_specs(specs, [FULL, WINDOWED])
    config = kv_cache_config(layout, groups, full.page_size_bytes * 2 * NUM_BLOCKS)
    views: dict[str, torch.Tensor] = allocate_kv_cache(config, torch.device("cpu"), layout)
    assert views[NAMES[0]].data_ptr() == views[NAMES[1]].data_ptr()  # the groups overlay
    return views, config


def settings(role: Role, config: Any) -> ConnectorSettings:
    env = EngineEnvironment(
        role=role,
        engine_id=f"{role.value}-hybrid",
        model=MODEL,
        prefill=RoleSettings(block_size=BLOCK),
        decode=RoleSettings(block_size=BLOCK),
        transfer={"verification": "All"},
        side_channel_host="127.0.0.1",
        side_channel_listen_port=0,
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role="kv_producer" if role is Role.PREFILL else "kv_consumer"),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    base = ConnectorSettings.from_vllm(vllm_config, render_environment(env), cpu_build=False)
    groups = cache_groups(config)  # what the connector derives from vLLM's KVCacheConfig
    layers = [list(group.layer_names) for group in config.kv_cache_groups]
    return dataclasses.replace(base, groups=groups, group_layers=layers)


def tag(layer: int, block: int) -> torch.Tensor:
    """``[H, N, C]`` int16 content of one block of one layer, a function of both (any misplaced byte shows)."""
    h = torch.arange(HEADS).view(-1, 1, 1)
    n = torch.arange(BLOCK).view(1, -1, 1)
    c = torch.arange(2 * HEAD_SIZE).view(1, 1, -1)
    value = (layer * 7919 + block * 104729 + h * 1299709 + n * 15485863 + c * 32452843 + 777) % 65521
    return (value - 32768).to(torch.int16)


def fill(views: dict[str, torch.Tensor], table: tuple[list[int], list[int]]) -> None:
    """Each group's layers hold content in that group's blocks only (a block id belongs to one group)."""
    for names, blocks in ((FULL, table[0]), (WINDOWED, table[1])):
        for name in names:
            for block in blocks:
                if block:  # never the null block
                    views[name].view(torch.int16)[block] = tag(NAMES.index(name), block)


@dataclass
class Blocks:
    """vLLM's KVCacheBlocks of a request, as the scheduler half reads them."""

    table: tuple[list[int], list[int]]
    hashed: int = 0  # the first blocks of the full-attention group hit the local prefix cache

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(list(group) for group in self.table)

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        full, window = self.table
        return [full[self.hashed :], [b for b in window if b]]


@dataclass
class Moved:
    results: list[ReadResult]
    load_errors: set[int]
    prefill_views: dict[str, torch.Tensor]
    decode_views: dict[str, torch.Tensor]
    descriptors: int
    params: dict[str, Any]


def move(
    prefill_layout: KVCacheLayout, decode_layout: KVCacheLayout, opened: list[Any], lie: bool = False, hit: int = 0
) -> Moved:
    prefill_views, prefill_config = allocate(prefill_layout)
    fill(prefill_views, PREFILL_TABLE)
    prefill_scheduler = ConnectorScheduler(settings(Role.PREFILL, prefill_config))
    opened.append(prefill_scheduler)
    prefill = ConnectorWorker(prefill_scheduler.settings, 0, "inc-prefill")
    opened.append(prefill)
    prefill.register_kv_caches(prefill_views, prefill_layout.name)
    handshake = prefill.get_handshake_metadata()
    assert handshake is not None
    prefill_scheduler.set_xfer_handshake_metadata({0: wrong_strides(handshake) if lie else handshake})

    decode_views, decode_config = allocate(decode_layout)
    for block_p, block_d in zip(PREFILL_TABLE[0][:hit], DECODE_TABLE[0][:hit], strict=True):
        for name in FULL:  # the local prefix cache holds the first blocks already
            decode_views[name].view(torch.int16)[block_d] = prefill_views[name].view(torch.int16)[block_p]
    decode_scheduler = ConnectorScheduler(settings(Role.DECODE, decode_config))
    opened.append(decode_scheduler)
    decode = ConnectorWorker(decode_scheduler.settings, 0, "inc-decode")
    opened.append(decode)
    decode.register_kv_caches(decode_views, decode_layout.name)
    assert decode.decode is not None
    results: list[ReadResult] = []
    polled = decode.decode.poll

    def poll() -> list[ReadResult]:
        found = polled()
        results.extend(found)
        return found

    decode.decode.poll = poll  # type: ignore[method-assign]

    delay, params = prefill_scheduler.request_finished(request("p1", {"do_remote_decode": True}), PREFILL_TABLE)
    assert delay is True
    assert params is not None
    prefill.start_load_kv(prefill_scheduler.build_connector_meta())
    prefill_scheduler.take_digests(prefill.stats.take())

    wanted = request("d1", params)
    assert decode_scheduler.get_num_new_matched_tokens(wanted, hit * BLOCK) == (TOKENS - hit * BLOCK, True)
    decode_scheduler.update_state_after_alloc(wanted, Blocks(DECODE_TABLE, hit), TOKENS - hit * BLOCK)
    decode.start_load_kv(decode_scheduler.build_connector_meta())
    deadline = time.monotonic() + TIMEOUT
    done: set[str] = set()
    while "d1" not in done:
        assert time.monotonic() < deadline, "the transfer did not finish"
        prefill.get_finished(set())
        _sending, received = decode.get_finished(set())
        done |= received or set()
        time.sleep(0.002)
    while results and results[0].ok and prefill.prefill is not None and prefill.prefill.pending:
        assert time.monotonic() < deadline, "prefill was never notified"
        prefill.get_finished(set())
        time.sleep(0.002)
    descriptors = results[0].descriptors if results else 0
    return Moved(
        results, decode.get_block_ids_with_load_errors(), prefill_views, decode_views, descriptors, params["kvbridge"]
    )


def check_bytes(outcome: Moved, hit: int = 0) -> None:
    """Each group's kept blocks hold, in each of its layers, prefill's bytes of the same position; nothing else
    was written (the null block, the window's dropped blocks, every block outside the request)."""
    full = list(zip(PREFILL_TABLE[0], DECODE_TABLE[0], strict=True))
    window = list(zip(PREFILL_TABLE[1], DECODE_TABLE[1], strict=True))[-3:]  # (70 - 32 + 1) // 16 = 2 skipped
    kept = (full, window)
    written: dict[str, set[int]] = {}
    for names, pairs in ((FULL, kept[0]), (WINDOWED, kept[1])):
        for name in names:
            got, want = outcome.decode_views[name].view(torch.int16), outcome.prefill_views[name].view(torch.int16)
            for block_p, block_d in pairs:
                assert torch.equal(got[block_d], want[block_p]), f"{name} block {block_d} differs"
            written[name] = {d for _, d in pairs}
    for name in NAMES:  # a block belongs to one group: the other group's blocks of this layer are its own
        others = set(range(NUM_BLOCKS)) - written[FULL[0]] - written[WINDOWED[0]]
        view = outcome.decode_views[name].view(torch.int16)
        assert not view[sorted(others)].any(), f"{name}: a block outside the request was written"
    assert 0 in others  # vLLM's null block among them


@pytest.mark.parametrize(
    ("prefill_layout", "decode_layout"),
    [
        (KVCacheLayout.LBHNC, KVCacheLayout.LBHNC),
        (KVCacheLayout.BLHNC, KVCacheLayout.BLHNC),
        (KVCacheLayout.LBHNC, KVCacheLayout.BHLNC),
    ],
    ids=lambda layout: layout.name,
)
def test_each_group_moves_the_blocks_it_keeps(
    prefill_layout: KVCacheLayout, decode_layout: KVCacheLayout, closing: list[Any]
) -> None:
    outcome = move(prefill_layout, decode_layout, closing)
    assert outcome.load_errors == set()
    assert [(r.ok, r.code) for r in outcome.results] == [(True, "")]
    check_bytes(outcome)
    # the parameters list the full group's 5 blocks, then the window's last 3
    assert outcome.params["remoteBlockIds"] == [3, 7, 1, 12, 5, 20, 21, 22]
    assert outcome.params["remoteGroupSizes"] == [5, 3]
    assert outcome.params["verify"] is True


def test_a_prefix_hit_leaves_out_the_first_blocks_of_a_group(closing: list[Any]) -> None:
    """Decode's prefix cache holds the full group's first 2 blocks: 3 + 3 blocks are read, and the digest (over
    every kept block, the hit ones too) still matches."""
    outcome = move(KVCacheLayout.LBHNC, KVCacheLayout.LBHNC, closing, hit=2)
    assert outcome.load_errors == set()
    assert [(r.ok, r.code) for r in outcome.results] == [(True, "")]
    check_bytes(outcome)
    single = move(KVCacheLayout.LBHNC, KVCacheLayout.LBHNC, closing)
    # 6 of the 8 kept blocks read (counted in bytes: NIXL merges adjacent blocks into fewer descriptors)
    assert outcome.results[0].bytes * 8 == single.results[0].bytes * 6


def test_a_wrong_stride_fails_the_request_in_every_group(closing: list[Any]) -> None:
    outcome = move(KVCacheLayout.LBHNC, KVCacheLayout.LBHNC, closing, lie=True)
    assert [(r.ok, r.code) for r in outcome.results] == [(True, "")]
    read = set(DECODE_TABLE[0]) | set(DECODE_TABLE[1][-3:])
    assert outcome.load_errors
    assert outcome.load_errors <= read
    with pytest.raises(AssertionError, match="differs"):
        check_bytes(outcome)


def test_groups_that_do_not_overlay_are_refused_at_registration(closing: list[Any]) -> None:
    from kvbridge_agent.core import SpecError

    views, config = allocate(KVCacheLayout.LBHNC)
    worker = ConnectorWorker(settings(Role.DECODE, config), 0, "inc")
    closing.append(worker)
    moved = dict(views)
    moved[NAMES[1]] = moved[NAMES[1]].clone()  # the window group in another allocation
    moved[NAMES[3]] = moved[NAMES[3]].clone()
    with pytest.raises(SpecError) as caught:
        worker.register_kv_caches(moved, "LBHNC")
    assert caught.value.code in {"LAYOUT_UNSUPPORTED", "KV_VIEW_LAYOUT_MISMATCH"}


def test_a_refused_hybrid_order_fails_every_block_vllm_loads(closing: list[Any]) -> None:
    """Parameters whose token count is not decode's prompt (PROMPT_MISMATCH; clipped by them, the window would even
    hold the null block): the order is refused and every unhashed block of every group is reported, so vLLM
    recomputes them instead of using blocks nothing was read into."""
    from kvbridge_agent.core.handshake import KVTransferParams

    _views, config = allocate(KVCacheLayout.LBHNC)
    scheduler = ConnectorScheduler(settings(Role.DECODE, config))
    closing.append(scheduler)
    params = KVTransferParams(
        remote_engine_id="prefill-hybrid",
        remote_incarnation="i",
        remote_host="127.0.0.1",
        remote_port=1,
        remote_request_id="p1",
        remote_block_ids=[3, 7, 20],
        remote_group_sizes=[2, 1],
        num_tokens=40,
        remote_tp_size=1,
        fingerprint=scheduler.settings.fingerprint,
    )
    raw = {"do_remote_prefill": True, "kvbridge": params.model_dump(mode="json", by_alias=True, exclude_none=True)}
    wanted = request("d1", raw)
    assert scheduler.get_num_new_matched_tokens(wanted, 0) == (TOKENS, True)
    scheduler.update_state_after_alloc(wanted, Blocks(DECODE_TABLE), TOKENS)
    order = scheduler.build_connector_meta().to_read["d1"]
    assert order.refused.startswith("PROMPT_MISMATCH")
    assert order.local_block_ids == [9, 2, 14, 6, 11, 15, 16, 17]
