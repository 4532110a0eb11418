"""The layouts bench's cases: which pairs of vLLM's ``KVCacheLayout`` it moves, on which geometries, and how big each
side's cache and a request's block ids are."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge_agent.core import ModelGeometry
from kvbridge_agent.core.arithmetic import ceil_div

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
CROSS_LAYER = ("BLHNC", "BLNHC", "BHLNC")

LLAMA_8B = ModelGeometry(name="llama3-8b-geometry", num_layers=32, num_kv_heads=8, head_dim=128)
LLAMA_70B = ModelGeometry(name="llama3-70b-geometry", num_layers=80, num_kv_heads=8, head_dim=128)


@dataclass(frozen=True)
class Side:
    """One role: vLLM's ``KVCacheLayout`` (its member name), block size in tokens, TP size."""

    layout: str
    block: int = 16
    tp: int = 1

    def heads(self, model: ModelGeometry) -> int:
        """KV heads on one rank."""
        return max(1, model.num_kv_heads // self.tp)


@dataclass(frozen=True)
class Case:
    """A layout pair: ``kind`` is ``same`` (both sides one layout), ``tp`` (a TP mapping), ``block`` (a block-size
    conversion) or ``order`` (two layouts)."""

    name: str
    kind: str
    prefill: Side
    decode: Side
    #: the block allocations it runs
    allocations: tuple[str, ...] = ("contiguous", "scattered")


def cases(quick: bool = False, names: Sequence[str] = ()) -> list[Case]:
    """The layout pairs of a run: every layout to itself, then the heterogeneous pairs (``quick``: one per-layer
    and one cross-layer layout, and TP 2 -> 1; ``names``: those cases only)."""
    same = [Case(layout, "same", Side(layout), Side(layout)) for layout in LAYOUTS]
    mixed = [
        Case("LBHNC-tp2to1", "tp", Side("LBHNC", tp=2), Side("LBHNC")),
        # heads outermost in the block: each prefill rank's heads are one run of decode's block
        Case("BHLNC-tp2to1", "tp", Side("BHLNC", tp=2), Side("BHLNC")),
        Case("LBHNC-block16to32", "block", Side("LBHNC", 16), Side("LBHNC", 32)),
        Case("LBHNC-to-BLHNC", "order", Side("LBHNC"), Side("BLHNC")),
        # 512-byte descriptors, a million per request: contiguous ids only (they cannot merge either way)
        Case("LBHNC-to-LBNHC", "order", Side("LBHNC"), Side("LBNHC"), ("contiguous",)),
    ]
    every = [*same, *mixed]
    if names:
        unknown = sorted(set(names) - {c.name for c in every})
        if unknown:
            raise ValueError(f"no layout case {', '.join(unknown)}; the cases: {', '.join(c.name for c in every)}")
        return [c for c in every if c.name in names]
    if quick:
        return [same[0], same[3], mixed[0]]
    return every


def cache_blocks(tokens: int, block: int) -> int:
    """Blocks of one side's cache: room for two requests, so scattered ids spread over twice a request."""
    return 2 * ceil_div(tokens, block) + 2


def cache_bytes(model: ModelGeometry, case: Case, tokens: int) -> int:
    """Bytes of both sides' caches of a case (every rank)."""
    total = 0
    for side in (case.prefill, case.decode):
        per_token = model.kv_bytes_per_token * side.heads(model) // model.num_kv_heads
        total += side.tp * cache_blocks(tokens, side.block) * side.block * per_token
    return total


def block_ids(count: int, num_blocks: int, allocation: str, rng: np.random.Generator) -> list[int]:
    """A request's block ids: ``contiguous`` (a fresh allocator's) or ``scattered`` (random free blocks in random
    order, as after long uptime)."""
    if allocation == "contiguous":
        return list(range(count))
    return [int(b) for b in rng.choice(num_blocks, size=count, replace=False)]


def staging_bytes(model: ModelGeometry, tokens: int, ranks: int) -> int:
    """A staging buffer for one rank of a side of ``ranks`` ranks holding ``tokens`` tokens (prefill: its cache's,
    room for two requests — one packed when offered, the one before it whose readers' notification is on its way;
    decode: a request's), and the pieces their ranges round up to."""
    return model.kv_bytes_per_token * tokens // ranks + (16 << 20)
