"""The transfer plan: everything that depends only on the two engines' shapes.

Built once per (prefill engine, decode engine) pair — by the operator from
the spec, by a decode agent at handshake from what the remote engine
reports — and then reused for every request, which only maps block ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from .arithmetic import exact_div
from .compat import check_pair
from .errors import IncompatibleError, Problem, SpecError
from .fingerprint import fingerprint
from .geometry import RegionLayout, region_layout
from .model import ModelGeometry, RoleSettings, TransferSettings
from .parallel import parallelism
from .tp import (
    handshake_ranks,
    head_offset_factor,
    notifications_per_prefill_rank,
    notify_only_ranks,
    read_ranks,
    tp_ratio,
)
from .wire import WireFormat, wire_format


@dataclass(frozen=True, slots=True)
class Read:
    """One READ per region block: bytes ``[remote_offset, +length)`` of a prefill wire block
    land at ``local_offset`` of the decode descriptor unit (a block, or a sub-block when merging)."""

    prefill_rank: int
    slot: int
    remote_offset: int
    local_offset: int
    length: int

    def to_dict(self) -> dict[str, int]:
        return {
            "prefillRank": self.prefill_rank,
            "remoteOffsetBytes": self.remote_offset,
            "localOffsetBytes": self.local_offset,
            "lengthBytes": self.length,
        }


@dataclass(frozen=True)
class DecodeRankPlan:
    """What one decode rank does for every request from one prefill engine."""

    pair: TransferPlan
    decode_rank: int
    handshake_ranks: tuple[int, ...]
    reads: tuple[Read, ...]
    notify_only_ranks: tuple[int, ...]

    @property
    def descriptors_per_block(self) -> int:
        """Descriptors posted per local block: regions x reads x sub-blocks."""
        return self.pair.decode_layout.num_regions * len(self.reads) * self.pair.block_size_ratio

    def to_dict(self) -> dict[str, object]:
        pair = self.pair
        return {
            "decodeRank": self.decode_rank,
            "compatible": True,
            "problems": [],
            "tpRatio": pair.tp_ratio,
            "blockSizeRatio": pair.block_size_ratio,
            "handshakeRanks": list(self.handshake_ranks),
            "reads": [read.to_dict() for read in self.reads],
            "notifyOnlyRanks": list(self.notify_only_ranks),
            "notificationsPerPrefillRank": pair.notifications_per_prefill_rank,
            "localBlockBytes": pair.local_block_bytes,
            "remoteBlockBytes": pair.remote_block_bytes,
            "wireBlockSize": pair.wire.block_size,
            "wireLayout": pair.wire.layout.value,
            "conversions": [step.to_dict() for step in pair.wire.conversions],
            "fingerprint": pair.fingerprint,
            "descriptorsPerBlock": self.descriptors_per_block,
            "prefillPrefixCachingAllowed": pair.wire.prefill_prefix_caching_allowed,
            "parallelism": pair.parallelism,
        }


@dataclass(frozen=True)
class TransferPlan:
    """The pair-level plan; :meth:`for_decode_rank` gives each decode rank's reads."""

    model: ModelGeometry
    prefill: RoleSettings
    decode: RoleSettings
    transfer: TransferSettings
    fingerprint: str
    tp_ratio: int
    wire: WireFormat
    #: decode-side sub-blocks per local block (``bs_D // wire``; 1 unless decode merges)
    block_size_ratio: int
    #: prefill-side wire blocks per prefill block (``bs_P // wire``; 1 unless prefill splits)
    split_ratio: int
    prefill_layout: RegionLayout
    decode_layout: RegionLayout
    notifications_per_prefill_rank: int
    _ranks: dict[int, DecodeRankPlan] = field(default_factory=dict, repr=False, compare=False)

    @property
    def local_block_bytes(self) -> int:
        """Bytes of one decode block of one region."""
        return self.decode_layout.unit_bytes

    @property
    def remote_block_bytes(self) -> int:
        """Bytes of one *wire* block of one region on a prefill rank."""
        return exact_div(self.prefill_layout.unit_bytes, self.split_ratio, what="prefill block bytes per wire block")

    @property
    def local_unit_bytes(self) -> int:
        """Bytes of one decode descriptor unit: a block, or a sub-block when merging."""
        return exact_div(self.decode_layout.unit_bytes, self.block_size_ratio, what="decode block bytes per sub-block")

    @cached_property
    def parallelism(self) -> dict[str, object]:
        """Both roles' data and expert parallelism and what they change for KV (core/parallel.py)."""
        return parallelism(self.model, self.prefill, self.decode, self.transfer)

    def for_decode_rank(self, decode_rank: int) -> DecodeRankPlan:
        cached = self._ranks.get(decode_rank)
        if cached is None:
            cached = self._build_rank(decode_rank)
            self._ranks[decode_rank] = cached
        return cached

    @cached_property
    def all_ranks(self) -> tuple[DecodeRankPlan, ...]:
        return tuple(self.for_decode_rank(d) for d in range(self.decode.tensor_parallel_size))

    def _build_rank(self, d: int) -> DecodeRankPlan:
        model, tp_p, tp_d = self.model, self.prefill.tensor_parallel_size, self.decode.tensor_parallel_size
        ranks = read_ranks(model, tp_p, tp_d, d)
        unit = self.local_unit_bytes
        reads: tuple[Read, ...]
        if model.is_mla or tp_d >= tp_p:
            offset = head_offset_factor(model, tp_p, tp_d, d) * unit
            reads = (Read(ranks[0], 0, offset, 0, unit),)
        else:
            length = exact_div(unit, len(ranks), what="local block bytes per read slot")
            reads = tuple(Read(rank, slot, 0, slot * length, length) for slot, rank in enumerate(ranks))
        for read in reads:
            if read.remote_offset + read.length > self.remote_block_bytes or read.local_offset + read.length > unit:
                raise SpecError(
                    f"read {read} does not fit a {self.remote_block_bytes}-byte remote block "
                    f"and a {unit}-byte local unit",
                    field="spec",
                    code="PLAN_OUT_OF_BOUNDS",
                )
        return DecodeRankPlan(
            pair=self,
            decode_rank=d,
            handshake_ranks=tuple(handshake_ranks(tp_p, tp_d, d)),
            reads=reads,
            notify_only_ranks=tuple(notify_only_ranks(model, tp_p, tp_d, d)),
        )

    def summary(self) -> dict[str, object]:
        """The plan as the operator publishes it in ``status.plan``."""
        first = self.for_decode_rank(0)
        return {
            "tpRatio": self.tp_ratio,
            "blockSizeRatio": self.block_size_ratio,
            "readsPerDecodeRank": len(first.reads),
            "notificationsPerPrefillRank": self.notifications_per_prefill_rank,
            "wireBlockSize": self.wire.block_size,
            "wireLayout": self.wire.layout.value,
            "conversions": [step.to_dict() for step in self.wire.conversions],
            "descriptorsPerBlock": first.descriptors_per_block,
            "prefillPrefixCachingAllowed": self.wire.prefill_prefix_caching_allowed,
        }


def plan_or_problems(
    model: ModelGeometry,
    prefill: RoleSettings,
    decode: RoleSettings,
    transfer: TransferSettings | None = None,
) -> TransferPlan | list[Problem]:
    """The plan when the pair is compatible, else every problem."""
    transfer = transfer or TransferSettings()
    problems = check_pair(model, prefill, decode, transfer)
    if problems:
        return problems
    wire = wire_format(model, prefill, decode)
    return TransferPlan(
        model=model,
        prefill=prefill,
        decode=decode,
        transfer=transfer,
        fingerprint=fingerprint(model),
        tp_ratio=tp_ratio(prefill.tensor_parallel_size, decode.tensor_parallel_size),
        wire=wire,
        block_size_ratio=exact_div(decode.block_size, wire.block_size, what="decode block size / wire block size"),
        split_ratio=exact_div(prefill.block_size, wire.block_size, what="prefill block size / wire block size"),
        prefill_layout=region_layout(model, prefill.block_size, prefill.tensor_parallel_size),
        decode_layout=region_layout(model, decode.block_size, decode.tensor_parallel_size),
        notifications_per_prefill_rank=notifications_per_prefill_rank(
            prefill.tensor_parallel_size, decode.tensor_parallel_size
        ),
    )


def build_plan(
    model: ModelGeometry,
    prefill: RoleSettings,
    decode: RoleSettings,
    transfer: TransferSettings | None = None,
) -> TransferPlan:
    """The plan, or :class:`IncompatibleError` listing every problem."""
    result = plan_or_problems(model, prefill, decode, transfer)
    if isinstance(result, list):
        raise IncompatibleError(result)
    return result


class PeerTensorParallel:
    """Whether a decode engine planned against ``prefill`` may pair with a prefill engine that says it runs another
    TP: the deployment's own verdict with the TP the peer claims (a rollout's mixed pairs pass; anything the verdict
    refuses is never handshaken with, whatever the transfer parameters say). A claimed TP decides how many prefill
    ranks decode asks for, so it is bounded by the deployment, not by the sender. Verdicts are kept per claimed TP
    (at most :data:`~.model.MAX_TENSOR_PARALLEL` of them: the parameters' schema bounds it)."""

    def __init__(
        self, model: ModelGeometry, prefill: RoleSettings, decode: RoleSettings, transfer: TransferSettings | None
    ) -> None:
        self._pair = (model, prefill, decode, transfer or TransferSettings())
        self._verdicts: dict[int, Problem | None] = {prefill.tensor_parallel_size: None}

    def problem(self, remote_tp: int) -> Problem | None:
        """The first problem of pairing with a prefill of TP ``remote_tp`` (``None``: it may pair)."""
        if remote_tp not in self._verdicts:
            model, prefill, decode, transfer = self._pair
            claimed = prefill.model_copy(update={"tensor_parallel_size": remote_tp})
            problems = check_pair(model, claimed, decode, transfer)
            self._verdicts[remote_tp] = problems[0] if problems else None
        return self._verdicts[remote_tp]

    def refusal(self, remote_tp: int) -> str:
        """Why parameters naming a prefill of TP ``remote_tp`` are refused (empty: they are not)."""
        problem = self.problem(remote_tp)
        if problem is None:
            return ""
        planned = self._pair[1].tensor_parallel_size
        return (
            f"remoteTpSize {remote_tp} cannot pair with this decode engine (planned against prefill TP {planned}): "
            f"{problem.code}: {problem.message}"
        )
