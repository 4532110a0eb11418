"""Tensor-parallel mapping between prefill and decode ranks (docs/protocol.md §3).

All functions take validated TP sizes (one divides the other); they raise a
typed error instead of returning a wrong rank when given anything else.
"""

from __future__ import annotations

from .arithmetic import divides_either_way, exact_div
from .errors import SpecError
from .model import ModelGeometry


def _check(tp_prefill: int, tp_decode: int, decode_rank: int | None = None) -> None:
    if tp_prefill < 1 or tp_decode < 1 or not divides_either_way(tp_prefill, tp_decode):
        raise SpecError(
            f"prefill TP {tp_prefill} and decode TP {tp_decode} do not divide one another",
            field="spec.decode.tensorParallelSize",
            code="TP_NOT_DIVISIBLE",
        )
    if decode_rank is not None and not 0 <= decode_rank < tp_decode:
        raise SpecError(
            f"decode rank {decode_rank} is outside 0..{tp_decode - 1}",
            field="decodeRank",
            code="DECODE_RANK_OUT_OF_RANGE",
        )


def tp_ratio(tp_prefill: int, tp_decode: int) -> int:
    """vLLM's sign convention: ``tp_D // tp_P`` when ``tp_D >= tp_P``, else ``-(tp_P // tp_D)``."""
    _check(tp_prefill, tp_decode)
    if tp_decode >= tp_prefill:
        return exact_div(tp_decode, tp_prefill, what="decode TP / prefill TP")
    return -exact_div(tp_prefill, tp_decode, what="prefill TP / decode TP")


def handshake_ranks(tp_prefill: int, tp_decode: int, decode_rank: int) -> list[int]:
    """Prefill ranks whose metadata decode rank ``d`` needs."""
    _check(tp_prefill, tp_decode, decode_rank)
    ratio = tp_ratio(tp_prefill, tp_decode)
    if ratio > 0:
        return [decode_rank // ratio]
    fan_in = -ratio
    return [decode_rank * fan_in + i for i in range(fan_in)]


def prefill_head(model: ModelGeometry, tp_prefill: int, prefill_rank: int) -> int:
    """First KV head held by a prefill rank: ``p * K // tp_P``."""
    return prefill_rank * model.num_kv_heads // tp_prefill


def read_ranks(model: ModelGeometry, tp_prefill: int, tp_decode: int, decode_rank: int) -> list[int]:
    """Prefill ranks that decode rank ``d`` READs from; list position is the read's slot.

    MLA, or ``tp_D >= tp_P``: one rank, ``d * tp_P // tp_D``.  Dense with
    ``tp_P > tp_D``: the handshake ranks, keeping only the first rank per
    distinct head.
    """
    ranks = handshake_ranks(tp_prefill, tp_decode, decode_rank)
    if model.is_mla or tp_decode >= tp_prefill:
        # one rank: [d * tp_P // tp_D] when tp_D >= tp_P; the first of the fan-in for MLA
        return ranks[:1]
    seen: set[int] = set()
    kept: list[int] = []
    for rank in ranks:
        head = prefill_head(model, tp_prefill, rank)
        if head not in seen:
            seen.add(head)
            kept.append(rank)
    return kept


def notify_only_ranks(model: ModelGeometry, tp_prefill: int, tp_decode: int, decode_rank: int) -> list[int]:
    """Handshake ranks that get the completion notification without a READ (MLA with ``tp_P > tp_D``)."""
    readers = set(read_ranks(model, tp_prefill, tp_decode, decode_rank))
    return [r for r in handshake_ranks(tp_prefill, tp_decode, decode_rank) if r not in readers]


def head_offset_factor(model: ModelGeometry, tp_prefill: int, tp_decode: int, decode_rank: int) -> int:
    """How many read lengths into the remote block decode rank ``d`` starts (``tp_D >= tp_P``).

    0 for MLA; ``d % (tp_D // tp_P)`` when ``tp_D <= K``; when ``tp_D > K``
    the difference of head indices ``d*K//tp_D - src*K//tp_P`` (``d % ratio``
    would read past the end of the remote block).
    """
    _check(tp_prefill, tp_decode, decode_rank)
    if model.is_mla or tp_prefill > tp_decode:
        return 0
    k = model.num_kv_heads
    if tp_decode <= k:
        return decode_rank % exact_div(tp_decode, tp_prefill, what="decode TP / prefill TP")
    source = decode_rank * tp_prefill // tp_decode
    return decode_rank * k // tp_decode - source * k // tp_prefill


def notifications_per_prefill_rank(tp_prefill: int, tp_decode: int) -> int:
    """Notifications each prefill rank waits for per request: ``max(1, tp_D // tp_P)``."""
    _check(tp_prefill, tp_decode)
    return max(1, tp_decode // tp_prefill)
