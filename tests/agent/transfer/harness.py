"""Prefill and decode ranks of one pair in one process, with real NIXL agents (DRAM) between them.

Fast enough to run the whole TP / layout / block-size matrix; the process-level
tests run the same classes behind ``kvbridge-agent serve``.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Sequence

from kvbridge_agent.core import (
    Attention,
    CacheKind,
    KVLayout,
    ModelGeometry,
    RoleSettings,
    TransferPlan,
    TransferSettings,
    build_plan,
)
from kvbridge_agent.core.blocks import blocks_for_tokens, wire_block_ids
from kvbridge_agent.core.digest import RequestDigests, new_key
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.core.tp import handshake_ranks
from kvbridge_agent.synthetic.content import fill_request, invalid_blocks, scribble
from kvbridge_agent.transfer.decode_rank import DecodeRank
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.prefill_rank import PrefillRank
from kvbridge_agent.transfer.reads import ReadResult, Verify
from kvbridge_agent.transfer.transport import Transport
from kvbridge_sim.support import wait_until


def scattered(num_blocks: int, seed: int) -> list[int]:
    """All block ids in a deterministic scattered order (runs of adjacent ids are rare)."""
    return sorted(range(num_blocks), key=lambda b: ((b + seed) * 7919) % num_blocks)


def offer_on_ranks(
    prefill: Sequence[PrefillRank],
    plan: TransferPlan,
    request_id: str,
    num_tokens: int,
    blocks: list[int],
    digests: dict[str, RequestDigests],
    digest: bool,
    fill: Callable[[int, PrefillRank], None],
) -> KVTransferParams:
    """Offer a request on every prefill rank of a pair, each rank's cache filled first by ``fill(p, rank)``; with
    ``digest`` its digests (one key for all ranks) are kept in ``digests`` for decode to verify. The parameters
    decode reads it with (shared by ``InProcessPair`` and ``staged_harness.StagedPair``)."""
    key = new_key()  # one per request, the same on every prefill rank
    for p, rank in enumerate(prefill):
        fill(p, rank)
        published = rank.offer(request_id, blocks, num_tokens if digest else 0, key)
        digests.setdefault(request_id, RequestDigests(key, {})).heads.update(published)
    wire = wire_block_ids(blocks, num_tokens, plan.split_ratio, plan.wire.block_size)
    return KVTransferParams(
        remote_engine_id=prefill[0].engine_id,
        remote_incarnation=prefill[0].incarnation,
        remote_host="127.0.0.1",
        remote_port=1,
        remote_request_id=request_id,
        remote_block_ids=wire.tolist(),
        num_tokens=num_tokens,
        remote_tp_size=len(prefill),
        fingerprint=plan.fingerprint,
    )


class InProcessPair:
    def __init__(
        self,
        model: ModelGeometry,
        prefill: RoleSettings,
        decode: RoleSettings,
        transfer: TransferSettings | None = None,
        num_blocks: int = 48,
        device: str = "cpu",
    ) -> None:
        self.transfer = transfer or TransferSettings()
        self.plan: TransferPlan = build_plan(model, prefill, decode, self.transfer)
        self.model, self.prefill_settings, self.decode_settings = model, prefill, decode
        self.num_blocks = num_blocks
        self.tag = uuid.uuid4().hex[:8]
        self.incarnation = "inc-" + self.tag
        self.engine_id = "prefill-" + self.tag
        self.prefill: list[PrefillRank] = []
        self.decode: list[DecodeRank] = []
        self.completed: dict[int, list[str]] = {}
        self.unknown = 0
        #: per offered request: prefill's key and digests by global head (when offered with ``digest=True``)
        self.digests: dict[str, RequestDigests] = {}
        for p in range(prefill.tensor_parallel_size):
            cache = KVCache.allocate(
                model, prefill.block_size, prefill.kv_layout, prefill.tensor_parallel_size, p, num_blocks, device
            )
            transport = Transport(f"{self.engine_id}.{p}")
            transport.register(cache.tensors)
            self.prefill.append(PrefillRank(cache, transport, self.plan, self.engine_id, self.incarnation))
        for d in range(decode.tensor_parallel_size):
            cache = KVCache.allocate(
                model, decode.block_size, decode.kv_layout, decode.tensor_parallel_size, d, num_blocks, device
            )
            transport = Transport(f"decode-{self.tag}.{d}")
            transport.register(cache.tensors)
            self.decode.append(DecodeRank(cache, transport, decode, self.transfer))
        self.connect()

    def metadata(self) -> dict[int, tuple]:  # type: ignore[type-arg]
        return {p: (rank.metadata(), rank.transport.metadata()) for p, rank in enumerate(self.prefill)}

    def connect(self) -> None:
        metas = self.metadata()
        tp_p, tp_d = self.prefill_settings.tensor_parallel_size, self.decode_settings.tensor_parallel_size
        for d, rank in enumerate(self.decode):
            rank.add_peer(self.engine_id, self.incarnation, {p: metas[p] for p in handshake_ranks(tp_p, tp_d, d)})

    def offer(
        self, request_id: str, num_tokens: int, prefill_blocks: list[int], digest: bool = False
    ) -> KVTransferParams:
        def fill(_p: int, rank: PrefillRank) -> None:
            fill_request(rank.cache, request_id, prefill_blocks)

        blocks, digests = prefill_blocks, self.digests
        return offer_on_ranks(self.prefill, self.plan, request_id, num_tokens, blocks, digests, digest, fill)

    def read(
        self,
        params: KVTransferParams,
        decode_blocks: list[int],
        hit: int,
        ranks: list[int] | None = None,
        timeout: float = 20.0,
        verify: bool = False,
    ) -> dict[int, ReadResult]:
        """Every (or the given) decode rank reads; polls both sides until all results are in."""
        ranks = list(range(len(self.decode))) if ranks is None else ranks
        results: dict[int, ReadResult] = {}
        for d in ranks:
            cache = self.decode[d].cache
            fill_request(cache, params.remote_request_id, decode_blocks[:hit])
            scribble(cache, decode_blocks[hit:])
            check = Verify(self.digests[params.remote_request_id], decode_blocks, params.num_tokens) if verify else None
            immediate = self.decode[d].start(
                f"d-{params.remote_request_id}", params, decode_blocks[hit:], timeout, check
            )
            if immediate is not None:
                results[d] = immediate

        def all_done() -> bool:
            for d in ranks:
                for result in self.decode[d].poll():
                    results[d] = result
            self.poll_prefill()
            return len(results) == len(ranks)

        with contextlib.suppress(TimeoutError):  # the caller's assertions say which ranks never finished
            wait_until(all_done, timeout + 5, "every decode rank's read", interval=0)
        return results

    def poll_prefill(self) -> dict[int, list[str]]:
        """Poll every prefill rank; completions are also kept in ``self.completed``."""
        done: dict[int, list[str]] = {}
        for p, rank in enumerate(self.prefill):
            events = rank.poll()
            done[p] = events.completed
            self.completed.setdefault(p, []).extend(events.completed)
            self.unknown += events.unknown
        return done

    def verify(self, d: int, request_id: str, decode_blocks: list[int], num_tokens: int) -> list[int]:
        return invalid_blocks(self.decode[d].cache, request_id, decode_blocks, num_tokens)

    def roundtrip(self, request_id: str, num_tokens: int, hit: int, *, offset: int = 0) -> dict[int, ReadResult]:
        """Offer, read on every decode rank, verify every byte; returns the results."""
        bs_p, bs_d = self.prefill_settings.block_size, self.decode_settings.block_size
        prefill_blocks = scattered(self.num_blocks, offset)[: blocks_for_tokens(num_tokens, bs_p)]
        decode_blocks = scattered(self.num_blocks, offset + 1)[: blocks_for_tokens(num_tokens, bs_d)]
        params = self.offer(request_id, num_tokens, prefill_blocks)
        results = self.read(params, decode_blocks, hit)
        for d, result in results.items():
            assert result.ok, (d, result)
            assert self.verify(d, request_id, decode_blocks, num_tokens) == [], f"decode rank {d} bytes differ"
        return results

    def close(self) -> None:
        for rank in self.decode:
            rank.close()
            rank.transport.close()
        for prank in self.prefill:
            prank.transport.close()


def model(kind: CacheKind = CacheKind.SPLIT, heads: int = 8, mla: bool = False) -> ModelGeometry:
    return ModelGeometry(
        name="tiny",
        num_layers=2,
        num_kv_heads=1 if mla else heads,
        head_dim=32 if mla else 16,
        kv_cache_dtype="bfloat16",
        attention=Attention.MLA if mla else Attention.DENSE,
        cache_kind=kind,
    )


def role(tp: int, bs: int = 16, layout: str = "HND") -> RoleSettings:
    return RoleSettings(tensor_parallel_size=tp, block_size=bs, kv_layout=KVLayout(layout))


CASES = {
    # (model, prefill, decode)
    "dense-1to1": (model(), role(1), role(1)),
    "dense-2to1": (model(), role(2), role(1)),
    "dense-1to2": (model(), role(1), role(2)),
    "dense-4to2": (model(), role(4), role(2)),
    "dense-2to4": (model(), role(2), role(4)),
    "dense-4to1": (model(), role(4), role(1)),
    "dense-2to8-replicated-decode": (model(heads=4), role(2), role(8)),
    "mla-1to1": (model(mla=True), role(1), role(1)),
    "mla-2to1": (model(mla=True), role(2), role(1)),
    "mla-1to2": (model(mla=True), role(1), role(2)),
    "mla-4to2": (model(mla=True), role(4), role(2)),
    "mla-2to4": (model(mla=True), role(2), role(4)),
    "mla-4to1": (model(mla=True), role(4), role(1)),
    "bsr2-decode-merges": (model(), role(1, 8), role(1, 16)),
    "bsr2-decode-merges-tp1to2": (model(), role(1, 8), role(2, 16)),
    "bsr2-decode-merges-nhd": (model(), role(1, 8, "NHD"), role(1, 16, "NHD")),
    "prefill-splits-32nhd-tp2-to-16hnd-tp1": (model(), role(2, 32, "NHD"), role(1, 16, "HND")),
    "prefill-splits-128nhd-tp4-to-16hnd-tp1": (model(), role(4, 128, "NHD"), role(1, 16, "HND")),
    "decode-permutes-to-nhd": (model(), role(2), role(1, 16, "NHD")),
    "equal-tp-nhd-to-hnd": (model(), role(2, 16, "NHD"), role(2, 16, "HND")),
    "blocks-first-2to1": (model(CacheKind.BLOCKS_FIRST), role(2), role(1)),
    "blocks-first-1to2-nhd": (model(CacheKind.BLOCKS_FIRST), role(1, 16, "NHD"), role(2, 16, "NHD")),
    "blocks-first-bsr2": (model(CacheKind.BLOCKS_FIRST), role(1, 8), role(1, 16)),
    "cross-layer-2to1": (model(CacheKind.CROSS_LAYER), role(2), role(1)),
    "cross-layer-1to4": (model(CacheKind.CROSS_LAYER), role(1), role(4)),
}
