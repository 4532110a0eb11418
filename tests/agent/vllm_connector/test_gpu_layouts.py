"""vLLM's physical KV layouts on host memory: the caches vLLM's own allocator builds for each ``KVCacheLayout``,
moved byte-exact between a prefill and a decode connector (both halves: scheduler and worker), with real NIXL on
DRAM, kvbridge's side channel and verification ``All``; every byte checked where decode's vLLM reads it.

The KV cache configuration comes from vLLM's ``get_kv_cache_config_from_groups`` for a small model (3 layers, 2 KV
heads, head size 64, bf16, 16-token blocks) and the views from ``allocate_kv_cache(..., device=cpu, layout)``: the
strided per-layer views of one allocation a GPU worker hands ``register_kv_caches``.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.core.kv_cache_utils import create_kv_cache_group_specs, get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings, SpecError
from kvbridge_agent.core.contract import EngineEnvironment, render_environment
from kvbridge_agent.core.handshake import RankMetadata
from kvbridge_agent.core.layout import PhysicalOrder
from kvbridge_agent.transfer.host_buffer import HostBuffer
from kvbridge_agent.transfer.reads import ReadResult
from kvbridge_agent.vllm_connector.messages import RankHandshake
from kvbridge_agent.vllm_connector.scheduler import ConnectorScheduler
from kvbridge_agent.vllm_connector.settings import ConnectorSettings
from kvbridge_agent.vllm_connector.worker import ConnectorWorker
from tests.physical_kv import BLOCK, HEAD_SIZE, HEADS, LAYERS, NAMES, NUM_BLOCKS, fill, lying, own_views
from tests.physical_kv import check_bytes as check_moved

MODEL = ModelGeometry(name="layouts", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_SIZE)
#: an MLA model: one latent of ``HEAD_SIZE`` per token and layer, which every rank holds whole
MLA_MODEL = ModelGeometry(name="layouts-mla", num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_SIZE, attention="MLA")
TOKENS = 70  # five 16-token blocks, the last one partly filled
PREFILL_BLOCKS = [3, 7, 1, 12, 5]
DECODE_BLOCKS = [9, 2, 14, 6, 11]
TIMEOUT = 30.0


@dataclass(frozen=True)
class Side:
    """One role as vLLM would run it: its ``KVCacheLayout``, block size, kernel block size (``None``: the block's)
    and TP size (one connector worker per rank)."""

    layout: KVCacheLayout
    block: int = BLOCK
    kernel: int | None = None
    tp: int = 1
    mla: bool = False
    #: vLLM's kv_buffer_device cpu: NIXL moves a host mirror, the engine's cache is copied in and out
    host_buffer: bool = False

    @property
    def ratio(self) -> int:
        return 1 if self.kernel is None else self.block // self.kernel

    @property
    def model_heads(self) -> int:
        return 1 if self.mla else HEADS

    @property
    def heads(self) -> int:
        """KV heads on one rank."""
        return max(1, self.model_heads // self.tp)

    def first_head(self, rank: int) -> int:
        return rank * self.model_heads // self.tp


def settings(role: Role, prefill: Side, decode: Side) -> ConnectorSettings:
    """One role's connector settings, both roles' settings in its environment (what the operator renders)."""
    env = EngineEnvironment(
        role=role,
        engine_id=f"{role.value}-layouts",
        model=MLA_MODEL if prefill.mla else MODEL,
        prefill=RoleSettings(block_size=prefill.block, tensor_parallel_size=prefill.tp),
        decode=RoleSettings(block_size=decode.block, tensor_parallel_size=decode.tp),
        transfer={"verification": "All"},
        side_channel_host="127.0.0.1",
        side_channel_listen_port=0,
    )
    mine = prefill if role is Role.PREFILL else decode
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role="kv_producer" if role is Role.PREFILL else "kv_consumer",
            kv_buffer_device="cpu" if mine.host_buffer else "cuda",
        ),
        cache_config=SimpleNamespace(block_size=mine.block),
        parallel_config=SimpleNamespace(tensor_parallel_size=mine.tp),
    )
    # off vLLM's CPU build (a GPU engine's views, here on host memory)
    return ConnectorSettings.from_vllm(config, render_environment(env), cpu_build=False)


def kv_cache_config(layout: KVCacheLayout, groups: Any, memory_bytes: int) -> Any:
    """vLLM's ``KVCacheConfig`` for ``groups`` in ``memory_bytes`` of cache, ``NUM_BLOCKS`` blocks, ``layout``
    resolved (what the engine core decides, from the few settings it reads)."""
    vllm_config = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            prefix_cache_retention_interval=None,
            num_gpu_blocks_override=NUM_BLOCKS,
        ),
    )
    return get_kv_cache_config_from_groups(vllm_config, groups, memory_bytes)


def allocate(
    layout: KVCacheLayout, block: int = BLOCK, kernel: int | None = None, heads: int = HEADS, mla: bool = False
) -> dict[str, torch.Tensor]:
    """The views vLLM's GPU worker would hand the connector of one rank (``heads`` KV heads), built by vLLM's own
    allocator on host memory (with ``kernel``: each block split into kernel blocks of that many tokens, as attention
    backends ask for)."""
    kind = MLAAttentionSpec if mla else FullAttentionSpec
    spec = kind(block_size=block, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    groups = create_kv_cache_group_specs(dict.fromkeys(NAMES, spec), [NAMES])
    config = kv_cache_config(layout, groups, spec.page_size_bytes * LAYERS * NUM_BLOCKS)
    kernels = None if kernel is None else [kernel]
    views: dict[str, torch.Tensor] = allocate_kv_cache(config, torch.device("cpu"), layout, kernels)
    assert list(views) == NAMES
    return views


#: every layout with whole blocks, as an MLA latent too, and kernel blocks where vLLM allows them (blocks stored as
#: dense pages: LBHNC, LBNHC; it refuses the others with a ValueError naming the fix)
OWN_VIEWS = [
    *[(layout, 16, None, 2, False) for layout in KVCacheLayout],
    *[(layout, 16, None, 1, True) for layout in KVCacheLayout],
    *[(KVCacheLayout[name], block, 16, 2, False) for name in ("LBHNC", "LBNHC") for block in (32, 64)],
]


@pytest.mark.parametrize(("layout", "block", "kernel", "heads", "mla"), OWN_VIEWS)
def test_kvbridges_own_views_are_vllms(
    layout: KVCacheLayout, block: int, kernel: int | None, heads: int, mla: bool
) -> None:
    """``layout_views`` (what the CUDA suite builds, on a GPU machine without vLLM) gives exactly the views vLLM's
    ``allocate_kv_cache`` gives: shape, strides, offset into the allocation, dtype and the allocation's size."""
    theirs = allocate(layout, block, kernel, heads, mla)
    ours = own_views(layout.name, block, kernel, heads, mla, "cpu")
    assert list(ours) == list(theirs)
    for name, view in theirs.items():
        mine = ours[name]
        assert (mine.shape, mine.stride(), mine.dtype) == (view.shape, view.stride(), view.dtype), name
        assert mine.storage_offset() == view.storage_offset(), name
        assert mine.untyped_storage().nbytes() == view.untyped_storage().nbytes(), name


def request(request_id: str, params: dict[str, Any] | None) -> Any:
    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=list(range(TOKENS)),
        kv_transfer_params=params,
        status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
        num_computed_tokens=TOKENS,
    )


def blocks_of(ids: list[int]) -> Any:
    return SimpleNamespace(get_unhashed_block_ids=lambda: ids, get_block_ids=lambda: (ids,))


@dataclass
class Moved:
    prefill: Side
    decode: Side
    results: list[ReadResult]  # every decode rank's
    load_errors: set[int]  # any decode rank's
    prefill_views: list[dict[str, torch.Tensor]]  # per rank
    decode_views: list[dict[str, torch.Tensor]]  # per rank
    runs_per_block: int  # paired runs of one chunk, decode rank 0's first read
    prefill_blocks: list[int]
    decode_blocks: list[int]
    failures: list[str]  # codes of the reads that failed, as the connector's metrics count them

    @property
    def ratio(self) -> int:
        return self.decode.ratio


def wrong_strides(handshake: RankHandshake) -> RankHandshake:
    """Prefill's metadata with its heads' and tokens' strides exchanged (tests.physical_kv.lying)."""
    meta = lying(RankMetadata.model_validate_json(handshake.rank_metadata_json))
    return RankHandshake(meta.model_dump_json(exclude_none=True), handshake.agent_metadata)


def move(
    prefill: Side,
    decode: Side,
    opened: list[Any],
    lie: bool = False,
    decode_per_layer: bool = False,
    blocks: tuple[list[int], list[int]] = (PREFILL_BLOCKS, DECODE_BLOCKS),
) -> Moved:
    """One prompt of ``TOKENS`` tokens computed by a prefill engine (a scheduler, a worker per rank) and loaded by a
    decode engine, through vLLM's connector API, real NIXL and kvbridge's side channel, verification ``All``; the
    request's blocks the first of ``blocks`` (prefill's, decode's)."""
    prefill_blocks = blocks[0][: -(-TOKENS // prefill.block)]
    decode_blocks = blocks[1][: -(-TOKENS // decode.block)]
    prefill_scheduler = ConnectorScheduler(settings(Role.PREFILL, prefill, decode))
    opened.append(prefill_scheduler)
    prefill_workers, prefill_views, handshakes = [], [], {}
    for rank in range(prefill.tp):
        worker = ConnectorWorker(prefill_scheduler.settings, rank, "inc-prefill")
        opened.append(worker)
        views = allocate(prefill.layout, prefill.block, prefill.kernel, prefill.heads, prefill.mla)
        fill(views, prefill, rank)
        worker.register_kv_caches(views, prefill.layout.name)
        handshake = worker.get_handshake_metadata()
        assert handshake is not None
        handshakes[rank] = wrong_strides(handshake) if lie else handshake
        prefill_workers.append(worker)
        prefill_views.append(views)
    prefill_scheduler.set_xfer_handshake_metadata(handshakes)

    decode_scheduler = ConnectorScheduler(settings(Role.DECODE, prefill, decode))
    opened.append(decode_scheduler)
    decode_workers, decode_views = [], []
    results: list[ReadResult] = []
    for rank in range(decode.tp):
        worker = ConnectorWorker(decode_scheduler.settings, rank, "inc-decode")
        opened.append(worker)
        views = allocate(decode.layout, decode.block, decode.kernel, decode.heads, decode.mla)
        worker.register_kv_caches(views, None if decode_per_layer else decode.layout.name)
        assert worker.decode is not None
        polled = worker.decode.poll

        def poll(polled: Any = polled) -> list[ReadResult]:
            found: list[ReadResult] = polled()
            results.extend(found)
            return found

        worker.decode.poll = poll  # type: ignore[method-assign]
        decode_workers.append(worker)
        decode_views.append(views)

    # prefill finishes the prompt and offers it (digested on every rank: verification All)
    delay, params = prefill_scheduler.request_finished(request("p1", {"do_remote_decode": True}), (prefill_blocks,))
    assert delay is True
    assert params is not None
    assert params["kvbridge"]["verify"] is True
    metadata = prefill_scheduler.build_connector_meta()
    stats: Any = None
    for worker in prefill_workers:
        worker.start_load_kv(metadata)
        taken = worker.stats.take()
        stats = taken if stats is None else stats.aggregate(taken)
    prefill_scheduler.take_digests(stats)

    # decode loads it into its own blocks, every rank its heads
    wanted = request("d1", params)
    assert decode_scheduler.get_num_new_matched_tokens(wanted, 0) == (TOKENS, True)
    decode_scheduler.update_state_after_alloc(wanted, blocks_of(decode_blocks), TOKENS)
    metadata = decode_scheduler.build_connector_meta()
    for worker in decode_workers:
        worker.start_load_kv(metadata)
    deadline = time.monotonic() + TIMEOUT
    done = [False] * decode.tp
    while not all(done):
        assert time.monotonic() < deadline, "the transfer did not finish"
        for worker in prefill_workers:
            worker.get_finished(set())
        for rank, worker in enumerate(decode_workers):
            _sending, received = worker.get_finished(set())
            done[rank] = done[rank] or "d1" in (received or set())
        time.sleep(0.002)

    # every prefill rank is released by its readers' notifications (MLA: a notify-only rank too)
    def holding() -> bool:
        return any(worker.prefill is not None and worker.prefill.pending for worker in prefill_workers)

    while results and all(r.ok for r in results) and holding():
        assert time.monotonic() < deadline, "a prefill rank was never notified"
        for worker in prefill_workers:
            worker.get_finished(set())
        time.sleep(0.002)
    failures = [code for worker in decode_workers for code in worker.stats.data.get("failed_reads", [])]
    assert decode_workers[0].decode is not None
    peer = decode_workers[0].decode.peers.get("prefill-layouts")
    errors = set().union(*(worker.get_block_ids_with_load_errors() for worker in decode_workers))
    return Moved(
        prefill,
        decode,
        results,
        errors,
        prefill_views,
        decode_views,
        0 if peer is None else peer.regions,
        prefill_blocks,
        decode_blocks,
        failures,
    )


def transfer(
    prefill_layout: KVCacheLayout,
    decode_layout: KVCacheLayout,
    opened: list[Any],
    lie: bool = False,
    block: int = BLOCK,
    kernel: int | None = None,
    decode_kernel: int | None = None,
    decode_per_layer: bool = False,
) -> Moved:
    """:func:`move` between two TP 1 engines of one block size."""
    prefill = Side(prefill_layout, block, kernel)
    decode = Side(decode_layout, block, decode_kernel or kernel)
    return move(prefill, decode, opened, lie, decode_per_layer)


def check_bytes(outcome: Moved) -> None:
    """Every byte where decode's vLLM reads it is prefill's (tests.physical_kv.check_bytes)."""
    o = outcome
    check_moved(o.prefill, o.decode, o.prefill_views, o.decode_views, o.prefill_blocks, o.decode_blocks)


#: descriptors per block for the model above (3 layers, 2 heads, 16 tokens), docs/protocol.md §1b
RUNS = {
    ("LBHNC", "LBHNC"): LAYERS,
    ("LBNHC", "LBNHC"): LAYERS,
    ("LHBNC", "LHBNC"): LAYERS * HEADS,
    ("BLHNC", "BLHNC"): 1,
    ("BLNHC", "BLNHC"): 1,
    ("BHLNC", "BHLNC"): 1,
    ("LBHNC", "BLHNC"): LAYERS,
    ("BLHNC", "LBNHC"): LAYERS * HEADS * BLOCK,
    ("LHBNC", "BHLNC"): LAYERS * HEADS,
}


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_every_layout_moves_byte_exact_to_the_same_layout(layout: KVCacheLayout, closing: list[Any]) -> None:
    outcome = transfer(layout, layout, closing)
    assert outcome.load_errors == set()
    assert [(r.ok, r.code) for r in outcome.results] == [(True, "")]
    check_bytes(outcome)
    assert outcome.runs_per_block == RUNS[layout.name, layout.name]
    assert outcome.results[0].descriptors == RUNS[layout.name, layout.name] * len(DECODE_BLOCKS)


PAIRS = [
    (KVCacheLayout[a], KVCacheLayout[b])
    for a, b in itertools.product([m.name for m in KVCacheLayout], repeat=2)
    if a != b
]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda pair: f"{pair[0].name}-{pair[1].name}")
def test_prefill_one_layout_decode_another(pair: tuple[KVCacheLayout, KVCacheLayout], closing: list[Any]) -> None:
    prefill_layout, decode_layout = pair
    outcome = transfer(prefill_layout, decode_layout, closing)
    assert outcome.load_errors == set()
    assert [(r.ok, r.code) for r in outcome.results] == [(True, "")]
    check_bytes(outcome)
    expected = RUNS.get((prefill_layout.name, decode_layout.name))
    if expected is not None:
        assert outcome.runs_per_block == expected
    assert outcome.results[0].descriptors == outcome.runs_per_block * len(DECODE_BLOCKS)


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC], ids=lambda layout: layout.name)
def test_a_wrong_stride_is_caught_by_the_digest(layout: KVCacheLayout, closing: list[Any]) -> None:
    """Negative control: prefill publishes its heads' and tokens' strides exchanged. Decode's READs follow the
    description exactly, so the bytes land in the wrong places — and verification fails the request (its blocks
    reported invalid: vLLM recomputes or fails it), never wrong tokens."""
    outcome = transfer(layout, layout, closing, lie=True)
    assert [(r.ok, r.code) for r in outcome.results] == [(True, "")]  # the READs themselves completed
    assert outcome.load_errors == set(outcome.decode_blocks)
    with pytest.raises(AssertionError, match="differs"):
        check_bytes(outcome)


def test_a_view_against_the_declared_layout_is_refused_at_registration(closing: list[Any]) -> None:
    worker = ConnectorWorker(settings(Role.DECODE, Side(KVCacheLayout.LBHNC), Side(KVCacheLayout.LBHNC)), 0, "inc")
    closing.append(worker)
    with pytest.raises(SpecError) as caught:
        worker.register_kv_caches(allocate(KVCacheLayout.LBHNC), "BHLNC")
    assert (caught.value.code, caught.value.field) == ("KV_VIEW_LAYOUT_MISMATCH", "kv_cache_layout")
    with pytest.raises(SpecError) as caught:
        worker.register_kv_caches(allocate(KVCacheLayout.LBHNC), "HND")
    assert (caught.value.code, caught.value.field) == ("LAYOUT_UNSUPPORTED", "kv_cache_layout")


KERNEL_CASES = [
    (KVCacheLayout.LBHNC, KVCacheLayout.LBHNC, 32, 16),
    (KVCacheLayout.LBNHC, KVCacheLayout.LBNHC, 64, 16),
    (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, 64, 16),
    (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, 32, 16),
]


@pytest.mark.parametrize(
    "case", KERNEL_CASES, ids=lambda case: f"{case[0].name}-{case[1].name}-block{case[2]}-kernel{case[3]}"
)
def test_kernel_blocks_smaller_than_the_block(
    case: tuple[KVCacheLayout, KVCacheLayout, int, int], closing: list[Any]
) -> None:
    """vLLM splits each block into kernel blocks (allocate_kv_cache's kernel_block_sizes; only the layer-compact,
    block-contiguous layouts LBHNC and LBNHC allow it): the views hold kernel blocks, kvbridge reads the kernel
    blocks of each block, verified, byte-exact."""
    prefill_layout, decode_layout, block, kernel = case
    outcome = transfer(prefill_layout, decode_layout, closing, block=block, kernel=kernel)
    assert outcome.load_errors == set()
    assert [(r.ok, r.code) for r in outcome.results] == [(True, "")]
    check_bytes(outcome)
    kernels = len(outcome.decode_blocks) * (block // kernel)
    # one layout on both sides: a block's kernel blocks lie end to end on both, and NIXL merges them into one
    # descriptor per run and block (docs/protocol.md §4c); across orders the runs are smaller than a kernel block
    per_run = len(outcome.decode_blocks) if prefill_layout == decode_layout else kernels
    assert outcome.results[0].descriptors == outcome.runs_per_block * per_run


#: contiguous block ids on both sides: five blocks of each, one run
CONTIGUOUS = (list(range(4, 9)), list(range(11, 16)))


@pytest.mark.parametrize(
    ("prefill", "decode", "merged"),
    [
        *[(Side(layout), Side(layout), True) for layout in KVCacheLayout],
        (Side(KVCacheLayout.LBHNC, 32, 16), Side(KVCacheLayout.LBHNC, 32, 16), True),
        (Side(KVCacheLayout.BHLNC, mla=True, tp=2), Side(KVCacheLayout.BHLNC, mla=True), True),
        (Side(KVCacheLayout.LBHNC, tp=2), Side(KVCacheLayout.LBHNC), False),
        (Side(KVCacheLayout.LBHNC), Side(KVCacheLayout.BLHNC), False),
    ],
    ids=lambda value: value.layout.name + (f"-tp{value.tp}" if value.tp > 1 else "") if isinstance(value, Side) else "",
)
def test_contiguous_block_ids_go_as_one_run_per_region_and_read(
    prefill: Side, decode: Side, merged: bool, closing: list[Any]
) -> None:
    """Block ids that run on in both caches: where both sides' blocks lie end to end (same layout, whole blocks),
    NIXL posts the request as one descriptor per region (paired run) and read — its telemetry, docs/protocol.md §4c
    — not one per block; byte-exact and verified."""
    outcome = move(prefill, decode, closing, blocks=CONTIGUOUS)
    assert [(r.ok, r.code) for r in outcome.results] == [(True, "")] * decode.tp
    assert outcome.load_errors == set()
    check_bytes(outcome)
    reads = max(1, prefill.tp // decode.tp) if not prefill.mla else 1
    units = len(outcome.decode_blocks) * decode.ratio
    assert outcome.results[0].indices == outcome.runs_per_block * units * reads
    assert outcome.results[0].descriptors == outcome.runs_per_block * (1 if merged else units) * reads


def test_kernel_block_sizes_that_differ_pair_by_chunks(closing: list[Any]) -> None:
    """Prefill splits its 64-token blocks into 16-token kernel blocks, decode into 32: the runs pair chunk by chunk
    of 16 tokens (before chunking, this was refused as runs that do not pair)."""
    outcome = transfer(KVCacheLayout.LBHNC, KVCacheLayout.LBHNC, closing, block=64, kernel=16, decode_kernel=32)
    assert [(r.ok, r.code) for r in outcome.results] == [(True, "")]
    assert outcome.load_errors == set()
    check_bytes(outcome)
    assert outcome.results[0].descriptors == outcome.runs_per_block * 2 * 64 // 16


def test_the_connector_hands_the_worker_the_resolved_layout_off_vllms_cpu_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.platforms import current_platform

    from kvbridge_agent.vllm_connector.connector import resolved_layout

    config = SimpleNamespace(cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout.BHLNC))
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    assert resolved_layout(config) is None  # the CPU build: per-layer tensors, its own block interior
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert resolved_layout(config) == "BHLNC"


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_overlaid_cache_groups_are_one_registration_with_a_layout_each(layout: KVCacheLayout) -> None:
    """A hybrid model (full attention on layers 0 and 2, sliding window on 1 and 3): vLLM overlays the two groups in
    one allocation, so layer 0 and layer 1 share a data_ptr. kvbridge registers the allocation once and keeps each
    group's own layout over it (the transfer of several groups is not done yet: the connector refuses them)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from kvbridge_agent.transfer.allocations import describe_groups

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    window = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16, sliding_window=32
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    specs = {names[0]: full, names[2]: full, names[1]: window, names[3]: window}
    groups = create_kv_cache_group_specs(specs, [[names[0], names[2]], [names[1], names[3]]])
    config = kv_cache_config(layout, groups, full.page_size_bytes * 2 * NUM_BLOCKS)
    views = allocate_kv_cache(config, torch.device("cpu"), layout)
    assert views[names[0]].data_ptr() == views[names[1]].data_ptr()  # the groups overlay
    by_group = [{name: views[name] for name in group.layer_names} for group in config.kv_cache_groups]
    described = describe_groups(by_group, PhysicalOrder(layout.name))
    assert len(described.allocations) == 1
    assert described.homes == (0, 0)
    shape = (2, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE * 2)
    for group in described.groups:
        assert group.physical.shape == shape
        assert group.physical.order.value == layout.name
        assert group.origin == 0


def test_a_physical_layout_prefill_and_a_per_layer_decode_fail_the_request_typed(closing: list[Any]) -> None:
    """Decode attaches its cache the CPU build's way (per layer, no layout) while prefill publishes a physical
    layout: the handshake says the two block interiors differ (CPU attention's against the layout's), so decode
    refuses the peer and the request fails, typed, before any READ."""
    outcome = transfer(KVCacheLayout.LBHNC, KVCacheLayout.LBHNC, closing, decode_per_layer=True)
    assert outcome.results == []
    assert outcome.failures == ["BLOCK_INTERIOR_MISMATCH"]
    assert outcome.load_errors == set(outcome.decode_blocks)


CONVERSIONS = [
    # block-size conversion both ways, decode merging (16 -> 32, 64) and prefill's blocks split (64 -> 16)
    (Side(KVCacheLayout.LBHNC, 16), Side(KVCacheLayout.LBHNC, 32)),
    (Side(KVCacheLayout.LBNHC, 16), Side(KVCacheLayout.LBNHC, 64)),
    (Side(KVCacheLayout.BLHNC, 64), Side(KVCacheLayout.BLHNC, 16)),
    (Side(KVCacheLayout.BHLNC, 32), Side(KVCacheLayout.LBHNC, 16)),
    # with kernel blocks on one or both sides
    (Side(KVCacheLayout.LBHNC, 16), Side(KVCacheLayout.LBHNC, 64, kernel=16)),
    (Side(KVCacheLayout.LBNHC, 64, kernel=32), Side(KVCacheLayout.LBHNC, 16)),
    (Side(KVCacheLayout.LBHNC, 32, kernel=16), Side(KVCacheLayout.LBNHC, 64, kernel=32)),
    # TP 2 -> 1 (each decode block read from both prefill ranks) and TP 1 -> 2 (each decode rank its head)
    (Side(KVCacheLayout.LBHNC, tp=2), Side(KVCacheLayout.LBHNC)),
    (Side(KVCacheLayout.BLHNC, tp=2), Side(KVCacheLayout.BHLNC)),
    (Side(KVCacheLayout.LBNHC), Side(KVCacheLayout.LBNHC, tp=2)),
    (Side(KVCacheLayout.BHLNC), Side(KVCacheLayout.LHBNC, tp=2)),
    # MLA: one latent every rank holds; TP 2 -> 1 reads it from one rank and notifies the other, TP 1 -> 2 reads
    # it whole on both decode ranks
    (Side(KVCacheLayout.LBHNC, tp=2, mla=True), Side(KVCacheLayout.LBHNC, mla=True)),
    (Side(KVCacheLayout.BLHNC, 32, mla=True), Side(KVCacheLayout.LBNHC, 16, tp=2, mla=True)),
    # both at once
    (Side(KVCacheLayout.LBHNC, 32, tp=2), Side(KVCacheLayout.BLHNC, 16)),
    (Side(KVCacheLayout.LBNHC, 64, kernel=16), Side(KVCacheLayout.LBHNC, 16, tp=2)),
]


def describe(side: Side) -> str:
    kernel = f"k{side.kernel}" if side.kernel else ""
    return f"{side.layout.name}-{side.block}{kernel}-tp{side.tp}"


@pytest.mark.parametrize("pair", CONVERSIONS, ids=lambda pair: f"{describe(pair[0])}-to-{describe(pair[1])}")
def test_tp_mappings_and_block_conversions_are_descriptors(pair: tuple[Side, Side], closing: list[Any]) -> None:
    """Different block sizes (kernel blocks included) and TP sizes on vLLM's physical layouts: decode pairs each
    prefill rank's runs of the heads both hold, chunk by chunk of the smaller block, with its own (nothing is
    re-laid on either side); verified on every decode rank, byte-exact where decode's vLLM reads it."""
    prefill, decode = pair
    outcome = move(prefill, decode, closing)
    assert outcome.failures == []
    assert outcome.load_errors == set()
    assert [(r.ok, r.code) for r in outcome.results] == [(True, "")] * decode.tp
    check_bytes(outcome)
    chunk = min(prefill.kernel or prefill.block, decode.kernel or decode.block)
    tokens = min(len(outcome.prefill_blocks) * prefill.block, len(outcome.decode_blocks) * decode.block)
    reads = 1 if prefill.mla else max(1, prefill.tp // decode.tp)  # prefill ranks each decode rank reads from
    assert outcome.results[0].descriptors == outcome.runs_per_block * (tokens // chunk) * reads


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC], ids=lambda layout: layout.name)
def test_a_wrong_stride_is_caught_across_a_tp_mapping(layout: KVCacheLayout, closing: list[Any]) -> None:
    """The negative control across TP 1 -> 2 and a block conversion (32 -> 16): prefill lies about its strides;
    both decode ranks' READs complete, and the digest fails the request on each."""
    outcome = move(Side(layout, 32), Side(layout, 16, tp=2), closing, lie=True)
    assert [(r.ok, r.code) for r in outcome.results] == [(True, "")] * 2
    assert outcome.load_errors == set(outcome.decode_blocks)
    with pytest.raises(AssertionError, match="differs"):
        check_bytes(outcome)


HOST_BUFFERS = [
    (Side(KVCacheLayout.LBHNC, host_buffer=True), Side(KVCacheLayout.LBHNC)),
    (Side(KVCacheLayout.BLHNC), Side(KVCacheLayout.BLHNC, host_buffer=True)),
    (Side(KVCacheLayout.LBHNC, 32, tp=2, host_buffer=True), Side(KVCacheLayout.LBNHC, 16, host_buffer=True)),
    (Side(KVCacheLayout.LBHNC, 16, kernel=8, host_buffer=True), Side(KVCacheLayout.BHLNC, 16, tp=2, host_buffer=True)),
]


@pytest.mark.parametrize("pair", HOST_BUFFERS, ids=lambda pair: f"{describe(pair[0])}-to-{describe(pair[1])}")
def test_a_host_buffer_on_either_side(pair: tuple[Side, Side], closing: list[Any]) -> None:
    """vLLM's kv_buffer_device cpu (nodes without GPUDirect RDMA): NIXL registers and moves a host mirror of the
    engine's cache; prefill copies the request's blocks into it before offering them, decode copies what it read out
    of it before verifying — the bytes are checked in the engine's own views, and the digest read them there."""
    prefill, decode = pair
    outcome = move(prefill, decode, closing)
    assert outcome.failures == []
    assert outcome.load_errors == set()
    assert [(r.ok, r.code) for r in outcome.results] == [(True, "")] * decode.tp
    check_bytes(outcome)
    for worker in closing:
        rank = getattr(worker, "prefill", None) or getattr(worker, "decode", None)
        if rank is not None:
            buffered = rank.convert if isinstance(rank.convert, HostBuffer) else None
            side = prefill if rank is getattr(worker, "prefill", None) else decode
            assert (buffered is not None) is side.host_buffer
            if buffered is not None:
                assert buffered.copies == 1  # the request's blocks, once
                assert rank.cache is buffered.mirror  # NIXL's descriptors are the mirror's


def test_a_wrong_stride_through_host_buffers_is_caught(closing: list[Any]) -> None:
    """The negative control with host buffers on both sides: the digest reads the engines' caches, after decode's
    copy out of its mirror, and fails the request."""
    prefill = Side(KVCacheLayout.LBHNC, 32, host_buffer=True)
    decode = Side(KVCacheLayout.LBHNC, 16, tp=2, host_buffer=True)
    outcome = move(prefill, decode, closing, lie=True)
    assert [(r.ok, r.code) for r in outcome.results] == [(True, "")] * 2
    assert outcome.load_errors == set(outcome.decode_blocks)
    with pytest.raises(AssertionError, match="differs"):
        check_bytes(outcome)
