"""kvbridge's transfer path on a GPU: vLLM's physical KV layouts in GPU memory, moved by NIXL from VRAM to VRAM.

What kvbridge's connector worker runs for vLLM's GPU views (``register_kv_caches`` with a ``KVCacheLayout``), without
vLLM itself, which a GPU machine may lack: the views come from kvbridge's ``layout_views`` on ``cuda`` — the views
vLLM's ``allocate_kv_cache`` builds, shape, strides and offsets (tests/agent/vllm_connector/test_gpu_layouts.py checks
them equal) — attached with ``KVCache.attach_views``, registered with NIXL as VRAM, offered by a ``PrefillRank`` and
read by a ``DecodeRank`` per rank, verification ``All`` (prefill's digest and decode's check computed on the GPU).
The host buffer (vLLM's ``kv_buffer_device: cpu``) moves a pinned host mirror, with the engine's cache copied in and
out on the GPU's stream. Every byte is checked where decode's vLLM would read it, and a wrong stride must be caught by
the digest (negative control).

Needs a CUDA device and NIXL (no vLLM); skipped, naming what is missing, elsewhere (conftest.py).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import pytest
import torch

from kvbridge_agent.core import ModelGeometry, RoleSettings, TransferSettings, build_plan, wire_block_ids
from kvbridge_agent.core.digest import RequestDigests, new_key
from kvbridge_agent.core.handshake import KVTransferParams, RankMetadata
from kvbridge_agent.core.layout import PhysicalOrder
from kvbridge_agent.core.tp import handshake_ranks
from kvbridge_agent.transfer.decode_rank import DecodeRank
from kvbridge_agent.transfer.digest import Digester
from kvbridge_agent.transfer.host_buffer import HostBuffer
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.prefill_rank import PrefillRank
from kvbridge_agent.transfer.reads import ReadResult, Verify
from kvbridge_agent.transfer.relayout import Converter, convert_for_side
from kvbridge_agent.transfer.transport import Transport
from tests.physical_kv import HEAD_SIZE, HEADS, LAYERS, check_bytes, fill, lying, own_views

NEEDS_VLLM = False  # conftest.py: this module needs a CUDA device and NIXL only

MODEL = ModelGeometry(name="cuda-layouts", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_SIZE)
MLA_MODEL = ModelGeometry(
    name="cuda-layouts-mla", num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_SIZE, attention="MLA"
)
TOKENS = 70  # five 16-token blocks, the last one partly filled
PREFILL_BLOCKS = [3, 7, 1, 12, 5]
DECODE_BLOCKS = [9, 2, 14, 6, 11]
TIMEOUT = 30.0
TRANSFER = TransferSettings(verification="All")


@dataclass(frozen=True)
class Side:
    """One role as vLLM runs it on a GPU: its layout, block size, kernel block size (``None``: the block's), TP
    size (one rank's cache each), MLA, and whether NIXL moves a host mirror (``kv_buffer_device: cpu``)."""

    layout: str
    block: int = 16
    kernel: int | None = None
    tp: int = 1
    mla: bool = False
    host_buffer: bool = False

    @property
    def ratio(self) -> int:
        return 1 if self.kernel is None else self.block // self.kernel

    @property
    def model_heads(self) -> int:
        return 1 if self.mla else HEADS

    @property
    def heads(self) -> int:
        return max(1, self.model_heads // self.tp)

    def first_head(self, rank: int) -> int:
        return rank * self.model_heads // self.tp

    def settings(self) -> RoleSettings:
        return RoleSettings(block_size=self.block, tensor_parallel_size=self.tp)

    def __str__(self) -> str:
        kernel = f"/{self.kernel}" if self.kernel else ""
        extras = " MLA" * self.mla + " host-buffer" * self.host_buffer
        return f"{self.layout}-{self.block}{kernel}-tp{self.tp}{extras}"


@dataclass
class Rank:
    """One rank's engine views, the cache NIXL registered (the views', or the host mirror's) and its transport."""

    views: dict[str, torch.Tensor]
    cache: KVCache
    transport: Transport
    engine: KVCache  # the cache vLLM's kernels use (the digest reads it)
    convert: Converter


@dataclass
class Opened:
    transports: list[Transport] = field(default_factory=list)
    decodes: list[DecodeRank] = field(default_factory=list)


def attach(side: Side, rank: int, name: str, opened: Opened, fill_it: bool) -> Rank:
    """One rank's cache as the connector's worker attaches vLLM's views (``register_kv_caches`` with a layout)."""
    views = own_views(side.layout, side.block, side.kernel, side.heads, side.mla, "cuda")
    if fill_it:
        fill(views, side, rank)
    model = MLA_MODEL if side.mla else MODEL
    cache = engine = KVCache.attach_views(model, side.block, side.tp, rank, views, PhysicalOrder(side.layout))
    convert: Converter = convert_for_side
    if side.host_buffer:
        buffer = HostBuffer(engine)
        cache, convert = buffer.mirror, buffer
    transport = Transport(name)
    opened.transports.append(transport)
    transport.register(cache.tensors)
    return Rank(views, cache, transport, engine, convert)


@dataclass
class Moved:
    results: list[ReadResult]
    prefill_views: list[dict[str, torch.Tensor]]
    decode_views: list[dict[str, torch.Tensor]]
    memory_types: set[str]
    descriptors: int


def read(reader: DecodeRank, prefills: list[PrefillRank], result: ReadResult | None, what: str) -> ReadResult:
    """Poll the prefill ranks and ``reader`` until its read ends (``result``: what ``reader.start`` returned)."""
    deadline = time.monotonic() + TIMEOUT + 5
    while result is None:
        assert time.monotonic() < deadline, f"{what}: the read did not finish"
        for rank in prefills:
            rank.poll()
        done = reader.poll()
        result = done[0] if done else None
    return result


def released(prefills: list[PrefillRank], what: str) -> None:
    """Poll the prefill ranks until each reader's notification released every offer."""
    deadline = time.monotonic() + TIMEOUT
    while any(rank.pending for rank in prefills):
        assert time.monotonic() < deadline, f"{what} was never notified"
        for rank in prefills:
            rank.poll()
        time.sleep(0.001)


def move(prefill: Side, decode: Side, opened: Opened, lie: bool = False) -> Moved:
    """One prompt of ``TOKENS`` tokens offered by every prefill rank and read by every decode rank, verified."""
    model = MLA_MODEL if prefill.mla else MODEL
    plan = build_plan(model, prefill.settings(), decode.settings(), TRANSFER)
    tag = uuid.uuid4().hex[:8]
    engine_id, incarnation = f"prefill-{tag}", f"inc-{tag}"
    prefill_blocks = PREFILL_BLOCKS[: -(-TOKENS // prefill.block)]
    decode_blocks = DECODE_BLOCKS[: -(-TOKENS // decode.block)]
    key = new_key()
    expected = RequestDigests(key, {})
    prefills: list[PrefillRank] = []
    metadata: dict[int, tuple[RankMetadata, bytes]] = {}
    prefill_views = []
    for p in range(prefill.tp):
        held = attach(prefill, p, f"{engine_id}.{p}", opened, fill_it=True)
        rank = PrefillRank(held.cache, held.transport, plan, engine_id, incarnation, held.convert)
        rank.digester = Digester(held.engine)
        expected.heads.update(rank.offer("r1", prefill_blocks, TOKENS, key))
        meta = rank.metadata()
        metadata[p] = (lying(meta) if lie else meta, held.transport.metadata())
        prefills.append(rank)
        prefill_views.append(held.views)
    params = KVTransferParams(
        remote_engine_id=engine_id,
        remote_incarnation=incarnation,
        remote_host="127.0.0.1",
        remote_port=1,
        remote_request_id="r1",
        remote_block_ids=wire_block_ids(prefill_blocks, TOKENS, plan.split_ratio, plan.wire.block_size).tolist(),
        num_tokens=TOKENS,
        remote_tp_size=prefill.tp,
        fingerprint=plan.fingerprint,
    )
    results: list[ReadResult] = []
    decode_views = []
    descriptors = 0
    memory_types = {meta.memory_type.value for meta, _ in metadata.values()}
    for d in range(decode.tp):
        held = attach(decode, d, f"decode-{tag}.{d}", opened, fill_it=False)
        reader = DecodeRank(held.cache, held.transport, decode.settings(), TRANSFER, held.convert)
        reader.digester = Digester(held.engine)
        opened.decodes.append(reader)
        memory_types.add(held.cache.memory_type.value)
        reader.add_peer(engine_id, incarnation, {p: metadata[p] for p in handshake_ranks(prefill.tp, decode.tp, d)})
        verify = Verify(expected, decode_blocks, TOKENS)
        result = read(reader, prefills, reader.start("d1", params, decode_blocks, TIMEOUT, verify), f"decode rank {d}")
        results.append(result)
        descriptors += result.descriptors
        decode_views.append(held.views)
    if all(r.ok for r in results):
        released(prefills, "a prefill rank")
    torch.cuda.synchronize()
    return Moved(results, prefill_views, decode_views, memory_types, descriptors)


CASES = [
    *[(Side(layout), Side(layout)) for layout in [order.value for order in PhysicalOrder]],
    (Side("LBHNC"), Side("BLHNC")),
    (Side("BHLNC"), Side("LBNHC")),
    (Side("LBHNC"), Side("LBHNC", 32, 16)),  # decode merges two 16-token blocks into each 32-token block
    (Side("LBNHC", 32, 16), Side("LBNHC")),  # prefill's 32-token blocks split into 16
    (Side("LBHNC", tp=2), Side("LBHNC")),  # multi-source: every block from both prefill ranks
    (Side("BLHNC"), Side("BLHNC", tp=2)),
    (Side("LBHNC", tp=2, mla=True), Side("LBHNC", mla=True)),  # one read, the other rank notified
    (Side("LBHNC", host_buffer=True), Side("LBHNC")),
    (Side("BLHNC"), Side("BLHNC", host_buffer=True)),
    (Side("LBHNC", tp=2, host_buffer=True), Side("LBHNC", host_buffer=True)),
    (Side("LBHNC", host_buffer=True), Side("LBHNC", 32, 16, host_buffer=True)),
]


@pytest.mark.parametrize(("prefill", "decode"), CASES, ids=lambda side: str(side))
def test_vllm_layouts_move_byte_exact_between_gpu_caches(prefill: Side, decode: Side, opened: Opened) -> None:
    outcome = move(prefill, decode, opened)
    assert [(r.ok, r.code) for r in outcome.results] == [(True, "")] * decode.tp
    expected_memory = {"DRAM" if side.host_buffer else "VRAM" for side in (prefill, decode)}
    assert outcome.memory_types == expected_memory
    prefill_blocks = PREFILL_BLOCKS[: -(-TOKENS // prefill.block)]
    decode_blocks = DECODE_BLOCKS[: -(-TOKENS // decode.block)]
    check_bytes(prefill, decode, outcome.prefill_views, outcome.decode_views, prefill_blocks, decode_blocks)
    assert outcome.descriptors > 0


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
@pytest.mark.parametrize("host_buffer", [False, True], ids=["vram", "host-buffer"])
def test_a_wrong_stride_on_the_gpu_is_caught_by_the_digest(layout: str, host_buffer: bool, opened: Opened) -> None:
    """Negative control: prefill publishes its heads' and tokens' strides exchanged; the READs complete, the bytes
    land in the wrong places, and decode's digest on the GPU fails the request."""
    side = Side(layout, host_buffer=host_buffer)
    outcome = move(side, side, opened, lie=True)
    assert [(r.ok, r.code) for r in outcome.results] == [(False, "KV_DIGEST_MISMATCH")]
    blocks = DECODE_BLOCKS[: -(-TOKENS // side.block)]
    with pytest.raises(AssertionError, match="differs"):
        check_bytes(side, side, outcome.prefill_views, outcome.decode_views, PREFILL_BLOCKS, blocks)
