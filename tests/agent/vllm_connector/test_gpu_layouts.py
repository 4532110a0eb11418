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
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.core.kv_cache_utils import create_kv_cache_group_specs, get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings, SpecError
from kvbridge_agent.core.contract import EngineEnvironment, render_environment
from kvbridge_agent.core.handshake import RankMetadata
from kvbridge_agent.core.layout import PhysicalLayout, PhysicalOrder, dense_strides
from kvbridge_agent.transfer.decode_rank import ReadResult
from kvbridge_agent.vllm_connector.messages import RankHandshake
from kvbridge_agent.vllm_connector.scheduler import ConnectorScheduler
from kvbridge_agent.vllm_connector.settings import ConnectorSettings
from kvbridge_agent.vllm_connector.worker import ConnectorWorker

LAYERS, HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS = 3, 2, 64, 16, 24
MODEL = ModelGeometry(name="layouts", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_SIZE)
TOKENS = 70  # five 16-token blocks, the last one partly filled
PREFILL_BLOCKS = [3, 7, 1, 12, 5]
DECODE_BLOCKS = [9, 2, 14, 6, 11]
TIMEOUT = 30.0


def environ(role: Role, decode_block: int = BLOCK, block: int = BLOCK) -> dict[str, str]:
    env = EngineEnvironment(
        role=role,
        engine_id=f"{role.value}-layouts",
        model=MODEL,
        prefill=RoleSettings(block_size=block),
        decode=RoleSettings(block_size=decode_block),
        transfer={"verification": "All"},
        side_channel_host="127.0.0.1",
        side_channel_listen_port=0,
    )
    return render_environment(env)


def settings(role: Role, decode_block: int = BLOCK, block: int = BLOCK) -> ConnectorSettings:
    """One role's connector settings; ``block`` is this engine's (and by default both roles') block size."""
    kv_role = "kv_producer" if role is Role.PREFILL else "kv_consumer"
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=kv_role),
        cache_config=SimpleNamespace(block_size=block if role is Role.PREFILL else decode_block),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    return ConnectorSettings.from_vllm(config, environ(role, decode_block, block))


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


def allocate(layout: KVCacheLayout, block: int = BLOCK, kernel: int | None = None) -> dict[str, torch.Tensor]:
    """The views vLLM's GPU worker would hand the connector, built by vLLM's own allocator on host memory (with
    ``kernel``: each block split into kernel blocks of that many tokens, as attention backends ask for)."""
    spec = FullAttentionSpec(block_size=block, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    groups = create_kv_cache_group_specs(dict.fromkeys(names, spec), [names])
    config = kv_cache_config(layout, groups, spec.page_size_bytes * LAYERS * NUM_BLOCKS)
    kernels = None if kernel is None else [kernel]
    views: dict[str, torch.Tensor] = allocate_kv_cache(config, torch.device("cpu"), layout, kernels)
    assert list(views) == names
    return views


def tag(layer: int, kernel_blocks: torch.Tensor, ratio: int = 1, tokens: int = BLOCK) -> torch.Tensor:
    """Position-tagged content ``[len(kernel_blocks), H, N, C]`` (int16 bit patterns): a function of the logical
    layer, block, head, token and content index, so any byte in a wrong place shows. Kernel block ``k`` of
    ``tokens`` tokens is part ``k % ratio`` of block ``k // ratio``."""
    k = kernel_blocks.view(-1, 1, 1, 1).to(torch.int64)
    b = k // ratio
    h = torch.arange(HEADS).view(1, -1, 1, 1)
    n = (k % ratio) * tokens + torch.arange(tokens).view(1, 1, -1, 1)
    c = torch.arange(2 * HEAD_SIZE).view(1, 1, 1, -1)
    value = (layer * 7919 + b * 104729 + h * 1299709 + n * 15485863 + c * 32452843 + 12345) % 65521
    return (value - 32768).to(torch.int16)


def fill(views: dict[str, torch.Tensor], ratio: int = 1) -> None:
    for layer, view in enumerate(views.values()):
        view.view(torch.int16).copy_(tag(layer, torch.arange(view.shape[0]), ratio, view.shape[2]))


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
class Outcome:
    results: list[ReadResult]
    load_errors: set[int]
    decode_views: dict[str, torch.Tensor]
    runs_per_block: int
    prefill_blocks: list[int]
    decode_blocks: list[int]
    ratio: int  # kernel blocks per block
    failures: list[str]  # codes of the reads that failed, as the connector's metrics count them


def wrong_strides(handshake: RankHandshake) -> RankHandshake:
    """Prefill's metadata with its heads' and tokens' strides exchanged: decode then reads each byte as if it lay
    elsewhere (the negative control: only the digest can tell)."""
    meta = RankMetadata.model_validate_json(handshake.rank_metadata_json)
    layout = meta.physical_layout
    assert layout is not None
    order = {"LBHNC": "LBNHC", "LBNHC": "LBHNC", "BLHNC": "BLNHC", "BLNHC": "BLHNC"}[layout.order.value]
    strides = list(layout.strides)
    strides[2], strides[3] = dense_strides(PhysicalOrder(order), layout.shape)[2:4]
    lying = PhysicalLayout(order=PhysicalOrder(order), shape=layout.shape, strides=tuple(strides))
    meta = meta.model_copy(update={"physical_layout": lying})
    return RankHandshake(meta.model_dump_json(exclude_none=True), handshake.agent_metadata)


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Everything a test starts (schedulers with side channels and heartbeat threads, workers with NIXL agents),
    closed however the test ends."""
    opened: list[Any] = []
    yield opened
    for thing in reversed(opened):
        thing.close()


def transfer(
    prefill_layout: KVCacheLayout,
    decode_layout: KVCacheLayout,
    opened: list[Any],
    lie: bool = False,
    block: int = BLOCK,
    kernel: int | None = None,
    decode_kernel: int | None = None,
    decode_per_layer: bool = False,
) -> Outcome:
    ratio = 1 if kernel is None else block // kernel
    count = -(-TOKENS // block)
    prefill_blocks, decode_blocks = PREFILL_BLOCKS[:count], DECODE_BLOCKS[:count]
    prefill_scheduler = ConnectorScheduler(settings(Role.PREFILL, block, block))
    opened.append(prefill_scheduler)
    prefill = ConnectorWorker(prefill_scheduler.settings, 0, "inc-prefill")
    opened.append(prefill)
    prefill_views = allocate(prefill_layout, block, kernel)
    fill(prefill_views, ratio)
    prefill.register(prefill_views, prefill_layout.name)
    handshake = prefill.handshake_metadata()
    assert handshake is not None
    prefill_scheduler.set_handshake({0: wrong_strides(handshake) if lie else handshake})

    decode_scheduler = ConnectorScheduler(settings(Role.DECODE, block, block))
    opened.append(decode_scheduler)
    decode = ConnectorWorker(decode_scheduler.settings, 0, "inc-decode")
    opened.append(decode)
    decode_views = allocate(decode_layout, block, decode_kernel or kernel)
    decode.register(decode_views, None if decode_per_layer else decode_layout.name)
    assert decode.decode is not None
    results: list[ReadResult] = []
    polled = decode.decode.poll

    def poll() -> list[ReadResult]:
        found = polled()
        results.extend(found)
        return found

    decode.decode.poll = poll  # type: ignore[method-assign]

    # prefill finishes the prompt and offers it (digested: verification All)
    delay, params = prefill_scheduler.request_finished(request("p1", {"do_remote_decode": True}), (prefill_blocks,))
    assert delay is True
    assert params is not None
    assert params["kvbridge"]["verify"] is True
    prefill.start(prefill_scheduler.build_metadata())
    prefill_scheduler.take_digests(prefill.stats.take())

    # decode loads it into its own blocks
    wanted = request("d1", params)
    assert decode_scheduler.matched_tokens(wanted, 0) == (TOKENS, True)
    decode_scheduler.after_alloc(wanted, blocks_of(decode_blocks), TOKENS)
    decode.start(decode_scheduler.build_metadata())
    deadline = time.monotonic() + TIMEOUT
    done: set[str] = set()
    while "d1" not in done:
        assert time.monotonic() < deadline, "the transfer did not finish"
        prefill.finished(set())
        _sending, received = decode.finished(set())
        done |= received or set()
        time.sleep(0.002)
    failures = list(decode.stats.data.get("failed_reads", []))
    peer = decode.decode.peers.get("prefill-layouts")
    regions = 0 if peer is None else peer.regions
    return Outcome(results, decode.load_errors(), decode_views, regions, prefill_blocks, decode_blocks, ratio, failures)


def check_bytes(outcome: Outcome) -> None:
    """Every byte where decode's vLLM reads it — through decode's own views — is prefill's byte of the same
    logical position; no other decode block was written."""
    r = outcome.ratio

    def kernel(blocks: list[int]) -> torch.Tensor:
        return (torch.tensor(blocks).view(-1, 1) * r + torch.arange(r).view(1, -1)).view(-1)

    read = kernel(outcome.decode_blocks)
    untouched = torch.tensor(sorted(set(range(NUM_BLOCKS * r)) - set(read.tolist())))
    for layer, view in enumerate(outcome.decode_views.values()):
        got = view.view(torch.int16)
        expected = tag(layer, kernel(outcome.prefill_blocks), r, view.shape[2])
        assert torch.equal(got[read], expected), f"layer {layer} differs"
        assert not got[untouched].any(), f"layer {layer}: a block outside the request was written"


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
    worker = ConnectorWorker(settings(Role.DECODE), 0, "inc")
    closing.append(worker)
    with pytest.raises(SpecError) as caught:
        worker.register(allocate(KVCacheLayout.LBHNC), "BHLNC")
    assert (caught.value.code, caught.value.field) == ("KV_VIEW_LAYOUT_MISMATCH", "kv_cache_layout")
    with pytest.raises(SpecError) as caught:
        worker.register(allocate(KVCacheLayout.LBHNC), "HND")
    assert (caught.value.code, caught.value.field) == ("LAYOUT_UNSUPPORTED", "kv_cache_layout")


def test_a_block_conversion_on_a_physical_layout_is_refused_at_registration(closing: list[Any]) -> None:
    """Prefill 16-token blocks for a decode of 32: the plan merges blocks on decode, which kvbridge does not do on a
    physical layout yet — refused before any request, naming the field."""
    worker = ConnectorWorker(settings(Role.PREFILL, decode_block=32), 0, "inc")
    closing.append(worker)
    with pytest.raises(SpecError) as caught:
        worker.register(allocate(KVCacheLayout.BLHNC), "BLHNC")
    assert (caught.value.code, caught.value.field) == ("LAYOUT_UNSUPPORTED", "spec.decode.blockSize")


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
    assert outcome.results[0].descriptors == outcome.runs_per_block * kernels


def test_kernel_block_sizes_that_differ_fail_the_request_typed(closing: list[Any]) -> None:
    """Prefill splits its 64-token blocks into 16-token kernel blocks, decode into 32: the runs do not pair, so the
    handshake refuses the peer and the request fails (its blocks reported invalid), before any READ."""
    outcome = transfer(KVCacheLayout.LBHNC, KVCacheLayout.LBHNC, closing, block=64, kernel=16, decode_kernel=32)
    assert outcome.results == []
    assert outcome.failures == ["PEER_INCOMPATIBLE"]
    assert outcome.load_errors == set(outcome.decode_blocks)


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
