"""Compatibility rules: can these prefill and decode settings exchange KV caches?

Every rule of docs/protocol.md §2 is checked and *every* violation is
returned at once, each as a :class:`Problem` with a stable code, the CRD
field at fault and a message that says what would work.  The operator runs
these before anything is scheduled; the agent runs them again at handshake
with the settings the remote engine actually reports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .arithmetic import divides_either_way
from .errors import IncompatibleError, Problem
from .fingerprint import fingerprint_fields
from .model import CacheKind, Conversion, KVLayout, ModelGeometry, Role, RoleSettings, TransferSettings
from .wire import ConversionKind, heads_divide, wire_format, wire_format_defined

# Stable problem codes (documented in docs/troubleshooting.md).
MLA_KV_HEADS = "MLA_KV_HEADS"
MLA_CACHE_KIND = "MLA_CACHE_KIND"
HEADS_NOT_DIVISIBLE = "HEADS_NOT_DIVISIBLE"
TP_NOT_DIVISIBLE = "TP_NOT_DIVISIBLE"
BLOCK_SIZE_NOT_DIVISIBLE = "BLOCK_SIZE_NOT_DIVISIBLE"
PREFILL_HEADS_REPLICATED = "PREFILL_HEADS_REPLICATED"
MERGE_WITH_TP_FAN_IN = "MERGE_WITH_TP_FAN_IN"
CROSS_LAYER_NEEDS_HND = "CROSS_LAYER_NEEDS_HND"
CROSS_LAYER_BLOCK_SIZE = "CROSS_LAYER_BLOCK_SIZE"
CONVERSION_OFF = "CONVERSION_OFF"
MODEL_MISMATCH = "MODEL_MISMATCH"
EXPERT_PARALLEL_NEEDS_MOE = "EXPERT_PARALLEL_NEEDS_MOE"
EXPERTS_FEWER_THAN_RANKS = "EXPERTS_FEWER_THAN_RANKS"
SIDE_CHANNEL_PORTS_OUT_OF_RANGE = "SIDE_CHANNEL_PORTS_OUT_OF_RANGE"

PROBLEM_CODES = (
    MLA_KV_HEADS,
    MLA_CACHE_KIND,
    HEADS_NOT_DIVISIBLE,
    TP_NOT_DIVISIBLE,
    BLOCK_SIZE_NOT_DIVISIBLE,
    PREFILL_HEADS_REPLICATED,
    MERGE_WITH_TP_FAN_IN,
    CROSS_LAYER_NEEDS_HND,
    CROSS_LAYER_BLOCK_SIZE,
    CONVERSION_OFF,
    MODEL_MISMATCH,
    EXPERT_PARALLEL_NEEDS_MOE,
    EXPERTS_FEWER_THAN_RANKS,
    SIDE_CHANNEL_PORTS_OUT_OF_RANGE,
)

#: the highest TCP port
_MAX_PORT = 65535


def field_path(role: Role, name: str) -> str:
    return f"spec.{role.value}.{name}"


_TP_CANDIDATES = tuple(range(1, 129))
_BLOCK_SIZE_CANDIDATES = tuple(sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024} | set(range(1, 65))))


def _join(values: list[int]) -> str:
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _closest(candidates: Iterable[int], works: Callable[[int], bool], near: int, limit: int = 4) -> list[int]:
    """The ``limit`` working values closest to ``near`` (by ratio), closest first."""
    good = [c for c in candidates if works(c)]
    return sorted(good, key=lambda c: (abs(math.log2(c / near)), c))[:limit]


def _advice(path: str, values: list[int]) -> str:
    """``set spec.x.y: 4`` (the closest value), with the other working values in brackets."""
    others = f" (or {_join(sorted(values[1:]))})" if len(values) > 1 else ""
    return f"set {path}: {values[0]}{others}"


def check_model(model: ModelGeometry) -> list[Problem]:
    """Rules about the model description itself."""
    problems: list[Problem] = []
    if model.is_mla and model.num_kv_heads != 1:
        problems.append(
            Problem(
                MLA_KV_HEADS,
                "spec.model.numKVHeads",
                f"MLA keeps one latent per token, so numKVHeads must be 1 (got {model.num_kv_heads}); "
                "set spec.model.numKVHeads: 1 and put the latent width in spec.model.headDim",
            )
        )
    if model.is_mla and model.cache_kind is not CacheKind.SPLIT:
        problems.append(
            Problem(
                MLA_CACHE_KIND,
                "spec.model.cacheKind",
                f"MLA uses one latent region per layer; cacheKind {model.cache_kind.value} is not defined "
                "for it: set spec.model.cacheKind: Split",
            )
        )
    return problems


def check_side_channel_ports(prefill: RoleSettings, decode: RoleSettings, transfer: TransferSettings) -> list[Problem]:
    """Every data-parallel rank listens on base port + rank: the widest role's last rank must get a TCP port."""
    dp = max(prefill.data_parallel_size, decode.data_parallel_size)
    last = transfer.side_channel_port + dp - 1
    if last <= _MAX_PORT:
        return []
    return [
        Problem(
            SIDE_CHANNEL_PORTS_OUT_OF_RANGE,
            "spec.transfer.sideChannelPort",
            f"{dp} data-parallel ranks listen on side-channel ports {transfer.side_channel_port} to {last} (base + "
            f"rank), past {_MAX_PORT}: set spec.transfer.sideChannelPort: {_MAX_PORT + 1 - dp}",
        )
    ]


def check_parallelism(model: ModelGeometry, role: Role, settings: RoleSettings) -> list[Problem]:
    """Rules about one role's data and expert parallelism. Neither changes the KV geometry of a rank: a
    data-parallel rank is an engine of its own to the other side (its own KV cache, engine id and side-channel
    port, TP inside it under the pair rules), and experts hold no KV. What can be wrong is the role alone."""
    problems: list[Problem] = []
    dp, world = settings.data_parallel_size, settings.world_size
    if settings.expert_parallel and not model.is_moe:
        problems.append(
            Problem(
                EXPERT_PARALLEL_NEEDS_MOE,
                field_path(role, "expertParallel"),
                f"{role.value} asks for expert parallelism, but spec.model.numExperts is 0 (a dense model has no "
                f"experts to shard): set {field_path(role, 'expertParallel')}: false, or give spec.model.numExperts "
                "the model's routed experts (config.json's n_routed_experts or num_experts)",
            )
        )
    elif settings.expert_parallel and model.num_experts < world:
        fits = model.num_experts // settings.tensor_parallel_size
        fix = (
            f"set {field_path(role, 'dataParallelSize')}: {fits}"
            if fits >= 1
            else f"set {field_path(role, 'expertParallel')}: false"
        )
        problems.append(
            Problem(
                EXPERTS_FEWER_THAN_RANKS,
                field_path(role, "dataParallelSize"),
                f"{role.value} shards {model.num_experts} experts over DP {dp} x TP {settings.tensor_parallel_size} "
                f"= {world} ranks, so some ranks would hold no expert at all: {fix}",
            )
        )
    return problems


@dataclass(frozen=True)
class Pair:
    """What every pair rule looks at: the model, both roles' settings, the transfer's, and whether a problem's
    message may search for decode values that would work (that search runs the rules again, without it)."""

    model: ModelGeometry
    prefill: RoleSettings
    decode: RoleSettings
    transfer: TransferSettings
    suggestions: bool = True

    @property
    def roles(self) -> tuple[tuple[Role, RoleSettings], tuple[Role, RoleSettings]]:
        return (Role.PREFILL, self.prefill), (Role.DECODE, self.decode)

    def hint(self, candidates: Iterable[int], name: str, rule: Callable[[int], bool]) -> str:
        """Decode values of ``name`` that make the whole pair compatible, else those that at least satisfy
        ``rule``; empty without suggestions."""
        if not self.suggestions:
            return ""
        path = field_path(Role.DECODE, "tensorParallelSize" if name == "tensor_parallel_size" else "blockSize")
        near = getattr(self.decode, name)

        def works(value: int) -> bool:
            candidate = self.decode.model_copy(update={name: value})
            return not check_pair(self.model, self.prefill, candidate, self.transfer, suggestions=False)

        found = _closest(candidates, works, near)
        if found:
            return "; " + _advice(path, found)
        partial = _closest(candidates, rule, near)
        return f"; {_advice(path, partial)} for this rule, but other problems remain (see them)" if partial else ""


def heads_spread_evenly(pair: Pair) -> list[Problem]:
    """Rule 6: the KV heads divide evenly over each side's TP (or the TP is a multiple of them)."""
    problems = []
    for role, settings in pair.roles:
        tp, k = settings.tensor_parallel_size, pair.model.num_kv_heads
        if not heads_divide(pair.model, tp):
            path = field_path(role, "tensorParallelSize")
            options = _closest(_TP_CANDIDATES, lambda c: heads_divide(pair.model, c), near=tp)
            problems.append(
                Problem(
                    HEADS_NOT_DIVISIBLE,
                    path,
                    f"{k} KV heads cannot be spread evenly over {role.value} TP {tp}: the TP size must divide "
                    f"{k} or be a multiple of it; {_advice(path, options)}",
                )
            )
    return problems


def tp_sizes_divide(pair: Pair) -> list[Problem]:
    """Rule 1: the TP sizes divide one another."""
    tp_p, tp_d = pair.prefill.tensor_parallel_size, pair.decode.tensor_parallel_size
    if divides_either_way(tp_p, tp_d):
        return []

    def works(c: int) -> bool:
        return divides_either_way(tp_p, c) and heads_divide(pair.model, c)

    return [
        Problem(
            TP_NOT_DIVISIBLE,
            field_path(Role.DECODE, "tensorParallelSize"),
            f"prefill TP {tp_p} and decode TP {tp_d} do not divide one another"
            + pair.hint(_TP_CANDIDATES, "tensor_parallel_size", works),
        )
    ]


def block_sizes_divide(pair: Pair) -> list[Problem]:
    """Rule 2: the block sizes divide one another."""
    bs_p, bs_d = pair.prefill.block_size, pair.decode.block_size
    if divides_either_way(bs_p, bs_d):
        return []
    return [
        Problem(
            BLOCK_SIZE_NOT_DIVISIBLE,
            field_path(Role.DECODE, "blockSize"),
            f"prefill block size {bs_p} and decode block size {bs_d} do not divide one another"
            + pair.hint(_BLOCK_SIZE_CANDIDATES, "block_size", lambda c: divides_either_way(bs_p, c)),
        )
    ]


def prefill_heads_not_replicated(pair: Pair) -> list[Problem]:
    """Rule 3: a dense prefill whose ranks replicate heads cannot feed fewer decode ranks."""
    tp_p, tp_d, k = pair.prefill.tensor_parallel_size, pair.decode.tensor_parallel_size, pair.model.num_kv_heads
    if pair.model.is_mla or not (tp_p > tp_d and tp_p > k):
        return []
    return [
        Problem(
            PREFILL_HEADS_REPLICATED,
            field_path(Role.PREFILL, "tensorParallelSize"),
            f"prefill TP {tp_p} exceeds the {k} KV heads, so prefill ranks replicate heads, and decode "
            f"TP {tp_d} would have to deduplicate them into one block: set spec.prefill.tensorParallelSize: "
            f"{k}, or spec.decode.tensorParallelSize: {tp_p}",
        )
    ]


def no_merge_with_fan_in(pair: Pair) -> list[Problem]:
    """Rule 4: no decode-side merge while reading from several prefill ranks."""
    tp_p, tp_d = pair.prefill.tensor_parallel_size, pair.decode.tensor_parallel_size
    bs_p, bs_d = pair.prefill.block_size, pair.decode.block_size
    if not (tp_p > tp_d and bs_p < bs_d and divides_either_way(bs_p, bs_d)):
        return []
    # equal TP sizes end the fan-in; offered only where the heads spread evenly over it (else the advice would lead
    # to HEADS_NOT_DIVISIBLE, whose advice leads back here)
    equal_tp = [f"spec.decode.tensorParallelSize: {tp_p}"] if heads_divide(pair.model, tp_p) else []
    equal_tp += [f"spec.prefill.tensorParallelSize: {tp_d}"] if heads_divide(pair.model, tp_d) else []
    return [
        Problem(
            MERGE_WITH_TP_FAN_IN,
            field_path(Role.DECODE, "blockSize"),
            f"decode would merge {bs_d // bs_p} prefill blocks into each block while reading from several "
            f"prefill ranks (prefill TP {tp_p} > decode TP {tp_d}), which is not supported: set "
            f"spec.decode.blockSize: {bs_p} (or smaller: prefill then splits its blocks)"
            + "".join(f"{', or' if i == len(equal_tp) - 1 else ','} {o}" for i, o in enumerate(equal_tp)),
        )
    ]


def cross_layer_hnd_equal_blocks(pair: Pair) -> list[Problem]:
    """Rule 8: a cross-layer cache needs HND on both sides and equal block sizes."""
    if pair.model.cache_kind is not CacheKind.CROSS_LAYER or pair.model.is_mla:
        return []
    problems = [
        Problem(
            CROSS_LAYER_NEEDS_HND,
            field_path(role, "kvLayout"),
            "cacheKind CrossLayer keeps heads outermost across all layers and needs kvLayout HND "
            f"on both sides; set {field_path(role, 'kvLayout')}: HND",
        )
        for role, settings in pair.roles
        if settings.kv_layout is not KVLayout.HND
    ]
    bs_p, bs_d = pair.prefill.block_size, pair.decode.block_size
    if bs_p != bs_d:
        problems.append(
            Problem(
                CROSS_LAYER_BLOCK_SIZE,
                field_path(Role.DECODE, "blockSize"),
                f"cacheKind CrossLayer defines no block conversion: decode blockSize must equal prefill "
                f"blockSize {bs_p} (got {bs_d}); set spec.decode.blockSize: {bs_p}",
            )
        )
    return problems


def conversions_allowed(pair: Pair) -> list[Problem]:
    """Rule 7: with ``conversion: Off``, every conversion the wire format needs is a problem."""
    model, prefill, decode = pair.model, pair.prefill, pair.decode
    if pair.transfer.conversion is not Conversion.OFF or not wire_format_defined(model, prefill, decode):
        return []
    problems = []
    for step in wire_format(model, prefill, decode).conversions:
        if step.kind is ConversionKind.PERMUTE:
            at = field_path(step.side, "kvLayout")
            what = f"{step.side.value} would permute its blocks from {step.source} to {step.target}"
            fix = f"set {at}: {step.target}"
        else:
            at = field_path(Role.DECODE, "blockSize")
            verb = "split" if step.kind is ConversionKind.SPLIT_BLOCKS else "merge"
            what = f"{step.side.value} would {verb} {step.source}-token blocks into {step.target}-token blocks"
            fix = f"set {at}: {prefill.block_size}"
        problems.append(
            Problem(
                CONVERSION_OFF,
                at,
                f"spec.transfer.conversion is Off but {what}: {fix}, or spec.transfer.conversion: Auto",
            )
        )
    return problems


#: every rule of a pair, in the order its problems are listed (each a function of the pair, with its codes)
PAIR_RULES: tuple[Callable[[Pair], list[Problem]], ...] = (
    lambda pair: check_model(pair.model),
    lambda pair: [p for role, settings in pair.roles for p in check_parallelism(pair.model, role, settings)],
    lambda pair: check_side_channel_ports(pair.prefill, pair.decode, pair.transfer),
    heads_spread_evenly,
    tp_sizes_divide,
    block_sizes_divide,
    prefill_heads_not_replicated,
    no_merge_with_fan_in,
    cross_layer_hnd_equal_blocks,
    conversions_allowed,
)


def check_pair(
    model: ModelGeometry,
    prefill: RoleSettings,
    decode: RoleSettings,
    transfer: TransferSettings | None = None,
    *,
    suggestions: bool = True,
) -> list[Problem]:
    """Every problem that keeps this prefill/decode pair from exchanging KV caches: :data:`PAIR_RULES` in turn."""
    pair = Pair(model, prefill, decode, transfer or TransferSettings(), suggestions)
    return [problem for rule in PAIR_RULES for problem in rule(pair)]


def check_same_model(prefill: ModelGeometry, decode: ModelGeometry) -> list[Problem]:
    """Must-match fields that differ between two engines' own descriptions (used at handshake)."""
    ours, theirs = fingerprint_fields(decode), fingerprint_fields(prefill)
    return [
        Problem(
            MODEL_MISMATCH,
            f"spec.model.{name}",
            f"prefill has {name} {theirs[name]!r} but decode has {ours[name]!r}; both sides must be equal",
        )
        for name in ours
        if ours[name] != theirs[name]
    ]


def require_compatible(
    model: ModelGeometry, prefill: RoleSettings, decode: RoleSettings, transfer: TransferSettings | None = None
) -> None:
    """Raise :class:`IncompatibleError` listing every problem, or return."""
    problems = check_pair(model, prefill, decode, transfer)
    if problems:
        raise IncompatibleError(problems)
