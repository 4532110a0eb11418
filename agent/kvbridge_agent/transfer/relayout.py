"""In-place conversions between a side's native block format and the wire format (docs/protocol.md §4b).

A block of one region is viewed as ``units`` units of ``tokens_per_unit``
tokens, each in HND (``[heads, tokens, row]``) or NHD (``[tokens, heads,
row]``).  Prefill converts ``(1, bs_P, native) -> (bs_P/bs_D, bs_D, wire)``
before it offers a request; decode converts ``(bsr, bs_P, wire) -> (1, bs_D,
native)`` after it received one.  Each conversion is an exact permutation of
the bytes inside each block, done with torch on the cache's device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbridge_agent.core import KVLayout, Role, TransferPlan
from kvbridge_agent.transfer.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class Arrangement:
    units: int
    tokens_per_unit: int
    layout: KVLayout


def is_identity(src: Arrangement, dst: Arrangement, heads: int) -> bool:
    """True when both arrangements put every byte in the same place."""
    if src == dst or heads == 1:
        return True
    return src.layout is KVLayout.NHD and dst.layout is KVLayout.NHD


def _to_tokens(x: torch.Tensor, arrangement: Arrangement, heads: int, row: int) -> torch.Tensor:
    n, halves = x.shape[0], x.shape[1]
    a = arrangement
    if a.layout is KVLayout.HND:
        x = x.view(n, halves, a.units, heads, a.tokens_per_unit, row).transpose(-3, -2)
    else:
        x = x.view(n, halves, a.units, a.tokens_per_unit, heads, row)
    return x.reshape(n, halves, a.units * a.tokens_per_unit, heads, row)


def _from_tokens(x: torch.Tensor, arrangement: Arrangement, heads: int, row: int) -> torch.Tensor:
    n, halves = x.shape[0], x.shape[1]
    a = arrangement
    x = x.reshape(n, halves, a.units, a.tokens_per_unit, heads, row)
    if a.layout is KVLayout.HND:
        x = x.transpose(-3, -2)
    return x.reshape(n, halves, -1)


def relayout(cache: KVCache, block_ids: list[int], src: Arrangement, dst: Arrangement) -> bool:
    """Re-lay ``block_ids`` of every region from ``src`` to ``dst``; False when nothing had to move."""
    heads, row = cache.heads_local, cache.row_bytes
    if not block_ids or cache.cross_layer or is_identity(src, dst, heads):
        return False
    ids = torch.tensor(block_ids, dtype=torch.int64, device=cache.tensors[0].device)
    halves = cache.layout.num_regions // cache.layout.num_tensors
    for index in range(len(cache.tensors)):
        view = cache.bytes_view(index).view(cache.num_blocks, halves, cache.layout.unit_bytes)
        blocks = view[ids]
        view[ids] = _from_tokens(_to_tokens(blocks, src, heads, row), dst, heads, row)
    return True


def prefill_arrangements(plan: TransferPlan) -> tuple[Arrangement, Arrangement]:
    """Native prefill blocks -> wire blocks."""
    wire = plan.wire
    return (
        Arrangement(1, plan.prefill.block_size, plan.prefill.kv_layout),
        Arrangement(plan.split_ratio, wire.block_size, wire.layout),
    )


def decode_arrangements(plan: TransferPlan) -> tuple[Arrangement, Arrangement]:
    """Received wire sub-blocks -> native decode blocks."""
    wire = plan.wire
    return (
        Arrangement(plan.block_size_ratio, wire.block_size, wire.layout),
        Arrangement(1, plan.decode.block_size, plan.decode.kv_layout),
    )


#: how a rank re-lays blocks between its native format and the wire format; engines whose block interior is not
#: the plain HND/NHD one (vLLM's CPU attention) bring their own
Converter = Callable[[KVCache, TransferPlan, Role, list[int]], bool]


def convert_for_side(cache: KVCache, plan: TransferPlan, side: Role, block_ids: list[int]) -> bool:
    """Apply the conversions the plan names for ``side`` to ``block_ids``. A cache with a physical layout (vLLM's
    ``KVCacheLayout``) is never re-laid: decode's READs pair each run of prefill's native blocks with its own
    (core.physical_reads), which is every conversion the plan names."""
    if not plan.wire.steps(side) or cache.physical is not None:
        return False
    src, dst = prefill_arrangements(plan) if side is Role.PREFILL else decode_arrangements(plan)
    return relayout(cache, block_ids, src, dst)
