"""The wire format and the conversions each side performs (docs/protocol.md §2 rule 5, §4b).

The plan fixes one wire block size (the smaller block size) and one wire
layout; a side whose native format differs re-lays its blocks in place:
prefill before it offers a request, decode after it received one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from .arithmetic import divides_either_way
from .geometry import heads_local
from .model import CacheKind, KVLayout, ModelGeometry, Role, RoleSettings


class ConversionKind(StrEnum):
    SPLIT_BLOCKS = "SplitBlocks"  # prefill: one bs_P block -> bs_P // bs_D wire blocks in the same bytes
    MERGE_BLOCKS = "MergeBlocks"  # decode: bs_D // bs_P received wire blocks -> one local block
    PERMUTE = "Permute"  # NHD <-> HND inside each block


@dataclass(frozen=True, slots=True)
class ConversionStep:
    side: Role
    kind: ConversionKind
    source: int | str
    target: int | str

    def to_dict(self) -> dict[str, object]:
        return {"side": self.side.value, "kind": self.kind.value, "from": self.source, "to": self.target}


@dataclass(frozen=True, slots=True)
class WireFormat:
    block_size: int
    layout: KVLayout
    conversions: tuple[ConversionStep, ...]

    def steps(self, side: Role) -> tuple[ConversionStep, ...]:
        return tuple(step for step in self.conversions if step.side is side)

    @property
    def prefill_prefix_caching_allowed(self) -> bool:
        """A block converted on prefill no longer matches its prefix-cache hash."""
        return not self.steps(Role.PREFILL)


def heads_split(model: ModelGeometry, prefill: RoleSettings, decode: RoleSettings) -> bool:
    """True when a rank's heads are spread over several ranks of the other side."""
    if model.is_mla:
        return False
    return heads_local(model, prefill.tensor_parallel_size) != heads_local(model, decode.tensor_parallel_size)


def heads_divide(model: ModelGeometry, tensor_parallel_size: int) -> bool:
    """Whether one side's KV heads spread evenly over its ranks (always, for MLA's single latent)."""
    return model.is_mla or divides_either_way(model.num_kv_heads, tensor_parallel_size)


def wire_format_defined(model: ModelGeometry, prefill: RoleSettings, decode: RoleSettings) -> bool:
    """Whether :func:`wire_format` has a meaning for these settings: block sizes and TP sizes divide one another,
    each side's heads spread evenly, and a cross-layer cache keeps one block size. Otherwise the settings are
    incompatible for another reason, and the conversions they would need are undefined."""
    tp_p, tp_d = prefill.tensor_parallel_size, decode.tensor_parallel_size
    return (
        divides_either_way(prefill.block_size, decode.block_size)
        and divides_either_way(tp_p, tp_d)
        and heads_divide(model, tp_p)
        and heads_divide(model, tp_d)
        and not (
            model.cache_kind is CacheKind.CROSS_LAYER and not model.is_mla and prefill.block_size != decode.block_size
        )
    )


def wire_format(model: ModelGeometry, prefill: RoleSettings, decode: RoleSettings) -> WireFormat:
    """Wire block size and layout, and the conversion steps of both sides.

    A layout permute is listed only where it moves bytes: a block holding a
    single head (MLA, or replicated heads) is byte-identical in HND and NHD.
    """
    block_size = min(prefill.block_size, decode.block_size)
    if heads_split(model, prefill, decode) or model.cache_kind is CacheKind.CROSS_LAYER:
        layout = KVLayout.HND
    else:
        layout = prefill.kv_layout
    steps: list[ConversionStep] = []
    if prefill.block_size > decode.block_size:
        steps.append(ConversionStep(Role.PREFILL, ConversionKind.SPLIT_BLOCKS, prefill.block_size, block_size))
    if prefill.kv_layout is not layout and heads_local(model, prefill.tensor_parallel_size) > 1:
        steps.append(ConversionStep(Role.PREFILL, ConversionKind.PERMUTE, prefill.kv_layout.value, layout.value))
    if prefill.block_size < decode.block_size:
        steps.append(ConversionStep(Role.DECODE, ConversionKind.MERGE_BLOCKS, prefill.block_size, decode.block_size))
    if decode.kv_layout is not layout and heads_local(model, decode.tensor_parallel_size) > 1:
        steps.append(ConversionStep(Role.DECODE, ConversionKind.PERMUTE, layout.value, decode.kv_layout.value))
    return WireFormat(block_size, layout, tuple(steps))
