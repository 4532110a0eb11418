"""Prefill and decode ranks with staging buffers, in one process, with real NIXL agents (DRAM) between them: a
cache kind's regions (``harness.InProcessPair``'s caches) or vLLM's physical layouts (kvbridge's ``layout_views``,
checked equal to vLLM's allocator elsewhere), every cache filled with random bytes, the stage requests handed to
the prefill ranks directly (the side channel carries them in an engine)."""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from kvbridge_agent.core import ModelGeometry, RoleSettings, TransferSettings, build_plan
from kvbridge_agent.core.digest import RequestDigests
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.core.layout import PhysicalLayout, PhysicalOrder
from kvbridge_agent.core.stage_requests import StageReply, StageRequest
from kvbridge_agent.core.tp import handshake_ranks
from kvbridge_agent.transfer.allocations import layout_views
from kvbridge_agent.transfer.decode_rank import DecodeRank
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.prefill_rank import PrefillRank
from kvbridge_agent.transfer.reads import ReadResult, Verify
from kvbridge_agent.transfer.transport import Transport
from kvbridge_sim.support import wait_until

from .harness import offer_on_ranks

#: each side's staging buffer in these pairs
STAGING = 8 << 20
_ids = itertools.count()


@dataclass(frozen=True)
class Side:
    """One role: vLLM's ``KVCacheLayout`` (or ``None``: the cache kind's own regions), block size, TP size, kernel
    block size (``None``: the block size)."""

    order: str | None
    block: int = 16
    tp: int = 1
    kernel: int | None = None


def physical_cache(model: ModelGeometry, side: Side, rank: int, blocks: int) -> KVCache:
    heads = max(1, model.num_kv_heads // side.tp)
    tokens = side.kernel or side.block
    order = PhysicalOrder(side.order or "LBHNC")
    content = model.token_bytes_per_head
    layout = PhysicalLayout.dense(order, model.num_layers, blocks * side.block // tokens, heads, tokens, content)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(model.num_layers)]
    views = layout_views(layout, names, torch.bfloat16, "cpu")
    return KVCache.attach_views(model, side.block, side.tp, rank, views, order)


def randomize(cache: KVCache, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for tensor in cache.tensors:
        flat = tensor.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=generator))


class StagedPair:
    """Prefill ranks and decode ranks of one pair, every rank with a staging buffer."""

    def __init__(self, model: ModelGeometry, prefill: Side, decode: Side, blocks: int = 24, staging: int = STAGING):
        self.model, self.prefill_side, self.decode_side, self.blocks = model, prefill, decode, blocks
        settings = [RoleSettings(tensor_parallel_size=s.tp, block_size=s.block) for s in (prefill, decode)]
        self.plan = build_plan(model, settings[0], settings[1], TransferSettings(verification="Off"))
        tag = uuid.uuid4().hex[:8]
        self.engine_id, self.incarnation = f"prefill-{tag}", f"inc-{tag}"
        self.prefill: list[PrefillRank] = []
        self.decode: list[DecodeRank] = []
        for p in range(prefill.tp):
            cache = self._cache(prefill, p)
            transport = Transport(f"{self.engine_id}.{p}")
            transport.register(cache.tensors)
            rank = PrefillRank(cache, transport, self.plan, self.engine_id, self.incarnation, staging_bytes=staging)
            self.prefill.append(rank)
        for d in range(decode.tp):
            cache = self._cache(decode, d)
            transport = Transport(f"decode-{tag}.{d}")
            transport.register(cache.tensors)
            self.decode.append(
                DecodeRank(cache, transport, settings[1], self.plan.transfer, staging_bytes=staging, stager=self.stage)
            )
        metas = {p: (prank.metadata(), prank.transport.metadata()) for p, prank in enumerate(self.prefill)}
        for d, drank in enumerate(self.decode):
            drank.add_peer(
                self.engine_id, self.incarnation, {p: metas[p] for p in handshake_ranks(prefill.tp, decode.tp, d)}
            )
        self.stage_requests: list[StageRequest] = []
        self.digests: dict[str, RequestDigests] = {}

    def _cache(self, side: Side, rank: int) -> KVCache:
        if side.order is None:
            model = self.model
            return KVCache.allocate(
                model, side.block, RoleSettings(tensor_parallel_size=side.tp).kv_layout, side.tp, rank, self.blocks
            )
        return physical_cache(self.model, side, rank, self.blocks)

    def stage(self, params: KVTransferParams, request: StageRequest) -> StageReply:
        self.stage_requests.append(request)
        return self.prefill[request.rank].stage(params.remote_request_id, request)

    def offer(self, tokens: int, blocks: list[int], seed: int, digest: bool = False) -> KVTransferParams:
        """Offer a request (its prefill caches filled from ``seed``); with ``digest`` its digests are kept in
        :attr:`digests` for decode to verify."""

        def fill(p: int, rank: PrefillRank) -> None:
            randomize(rank.cache, seed * 31 + p)

        request_id = f"staged-{next(_ids)}"
        return offer_on_ranks(self.prefill, self.plan, request_id, tokens, blocks, self.digests, digest, fill)

    def run(
        self, tokens: int, remote: list[int], local: list[int], seed: int, mode: str, into: str = "auto"
    ) -> dict[int, Any]:
        """Offer a request of ``tokens`` tokens on ``remote`` (its content drawn from ``seed``), every decode rank
        reads it into ``local`` (``mode``: direct or staged, ``into`` where); each rank's result and its cache's
        bytes afterwards (every decode cache starts from the same random bytes)."""
        return self.read(self.offer(tokens, remote, seed), local, mode, into)

    def read(
        self, params: KVTransferParams, blocks: list[int], mode: str, into: str = "auto", verify: Verify | None = None
    ) -> dict[int, Any]:
        """Every decode rank reads ``blocks`` of an offered request."""
        results: dict[int, ReadResult] = {}
        for d, rank in enumerate(self.decode):
            randomize(rank.cache, 1000 + d)
            assert rank.staging is not None
            rank.staging.mode, rank.staging.into = mode, into
            done = rank.start(f"{params.remote_request_id}-{mode}-{into}", params, blocks, 20.0, verify)
            if done is not None:
                results[d] = done

        def finished() -> bool:
            for d, rank in enumerate(self.decode):
                for result in rank.poll():
                    results[d] = result
            for prank in self.prefill:
                prank.poll()
            return len(results) == len(self.decode)

        wait_until(finished, 25, "every decode rank's read", interval=0)
        return {d: (results[d], [t.clone() for t in self.decode[d].cache.tensors]) for d in results}

    def close(self) -> None:
        for rank in self.decode:
            rank.close()
            rank.transport.close()
        for prank in self.prefill:
            prank.transport.close()
