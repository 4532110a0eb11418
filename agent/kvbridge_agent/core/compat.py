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


def check_pair(
    model: ModelGeometry,
    prefill: RoleSettings,
    decode: RoleSettings,
    transfer: TransferSettings | None = None,
    *,
    suggestions: bool = True,
) -> list[Problem]:
    """Every problem that keeps this prefill/decode pair from exchanging KV caches."""
    transfer = transfer or TransferSettings()
    conversion = transfer.conversion
    problems = check_model(model)
    for role, settings in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
        problems += check_parallelism(model, role, settings)
    problems += check_side_channel_ports(prefill, decode, transfer)
    tp_p, tp_d = prefill.tensor_parallel_size, decode.tensor_parallel_size
    bs_p, bs_d = prefill.block_size, decode.block_size
    k = model.num_kv_heads

    def decode_works(name: str) -> Callable[[int], bool]:
        """Would the pair be compatible with decode's ``name`` set to a value (everything else as is)?"""

        def works(value: int) -> bool:
            candidate = decode.model_copy(update={name: value})
            return not check_pair(model, prefill, candidate, transfer, suggestions=False)

        return works

    def hint(candidates: Iterable[int], name: str, rule: Callable[[int], bool]) -> str:
        """Decode values that make the whole pair compatible, else those that at least satisfy this rule."""
        if not suggestions:
            return ""
        path = field_path(Role.DECODE, "tensorParallelSize" if name == "tensor_parallel_size" else "blockSize")
        near = getattr(decode, name)
        found = _closest(candidates, decode_works(name), near)
        if found:
            return "; " + _advice(path, found)
        partial = _closest(candidates, rule, near)
        return f"; {_advice(path, partial)} for this rule, but other problems remain (see them)" if partial else ""

    # Rule 6: heads divide evenly on each side.
    for role, settings in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
        tp = settings.tensor_parallel_size
        if not heads_divide(model, tp):
            path = field_path(role, "tensorParallelSize")
            options = _closest(_TP_CANDIDATES, lambda c: heads_divide(model, c), near=tp)
            problems.append(
                Problem(
                    HEADS_NOT_DIVISIBLE,
                    path,
                    f"{k} KV heads cannot be spread evenly over {role.value} TP {tp}: the TP size must divide "
                    f"{k} or be a multiple of it; {_advice(path, options)}",
                )
            )
    tp_ok = divides_either_way(tp_p, tp_d)
    # Rule 1: TP sizes divide one another.
    if not tp_ok:
        problems.append(
            Problem(
                TP_NOT_DIVISIBLE,
                field_path(Role.DECODE, "tensorParallelSize"),
                f"prefill TP {tp_p} and decode TP {tp_d} do not divide one another"
                + hint(
                    _TP_CANDIDATES,
                    "tensor_parallel_size",
                    lambda c: divides_either_way(tp_p, c) and heads_divide(model, c),
                ),
            )
        )
    # Rule 2: block sizes divide one another.
    bs_ok = divides_either_way(bs_p, bs_d)
    if not bs_ok:
        problems.append(
            Problem(
                BLOCK_SIZE_NOT_DIVISIBLE,
                field_path(Role.DECODE, "blockSize"),
                f"prefill block size {bs_p} and decode block size {bs_d} do not divide one another"
                + hint(_BLOCK_SIZE_CANDIDATES, "block_size", lambda c: divides_either_way(bs_p, c)),
            )
        )
    # Rule 3: dense prefill with replicated heads feeding fewer decode ranks.
    if not model.is_mla and tp_p > tp_d and tp_p > k:
        problems.append(
            Problem(
                PREFILL_HEADS_REPLICATED,
                field_path(Role.PREFILL, "tensorParallelSize"),
                f"prefill TP {tp_p} exceeds the {k} KV heads, so prefill ranks replicate heads, and decode "
                f"TP {tp_d} would have to deduplicate them into one block: set spec.prefill.tensorParallelSize: "
                f"{k}, or spec.decode.tensorParallelSize: {tp_p}",
            )
        )
    # Rule 4: no decode-side merge while reading from several prefill ranks.
    if tp_p > tp_d and bs_p < bs_d and bs_ok:
        # equal TP sizes end the fan-in; offered only where the heads spread evenly over it (else the advice
        # would lead to HEADS_NOT_DIVISIBLE, whose advice leads back here)
        equal_tp = [f"spec.decode.tensorParallelSize: {tp_p}"] if heads_divide(model, tp_p) else []
        equal_tp += [f"spec.prefill.tensorParallelSize: {tp_d}"] if heads_divide(model, tp_d) else []
        problems.append(
            Problem(
                MERGE_WITH_TP_FAN_IN,
                field_path(Role.DECODE, "blockSize"),
                f"decode would merge {bs_d // bs_p} prefill blocks into each block while reading from several "
                f"prefill ranks (prefill TP {tp_p} > decode TP {tp_d}), which is not supported: set "
                f"spec.decode.blockSize: {bs_p} (or smaller: prefill then splits its blocks)"
                + "".join(f"{', or' if i == len(equal_tp) - 1 else ','} {o}" for i, o in enumerate(equal_tp)),
            )
        )
    # Rule 8: cross-layer needs HND on both sides and equal block sizes.
    cross_layer = model.cache_kind is CacheKind.CROSS_LAYER and not model.is_mla
    if cross_layer:
        for role, settings in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
            if settings.kv_layout is not KVLayout.HND:
                problems.append(
                    Problem(
                        CROSS_LAYER_NEEDS_HND,
                        field_path(role, "kvLayout"),
                        "cacheKind CrossLayer keeps heads outermost across all layers and needs kvLayout HND "
                        f"on both sides; set {field_path(role, 'kvLayout')}: HND",
                    )
                )
        if bs_p != bs_d:
            problems.append(
                Problem(
                    CROSS_LAYER_BLOCK_SIZE,
                    field_path(Role.DECODE, "blockSize"),
                    f"cacheKind CrossLayer defines no block conversion: decode blockSize must equal prefill "
                    f"blockSize {bs_p} (got {bs_d}); set spec.decode.blockSize: {bs_p}",
                )
            )
    # Rule 7: with conversion Off, every needed conversion is a problem.
    if conversion is Conversion.OFF and wire_format_defined(model, prefill, decode):
        for step in wire_format(model, prefill, decode).conversions:
            if step.kind is ConversionKind.PERMUTE:
                at = field_path(step.side, "kvLayout")
                what = f"{step.side.value} would permute its blocks from {step.source} to {step.target}"
                fix = f"set {at}: {step.target}"
            else:
                at = field_path(Role.DECODE, "blockSize")
                verb = "split" if step.kind is ConversionKind.SPLIT_BLOCKS else "merge"
                what = f"{step.side.value} would {verb} {step.source}-token blocks into {step.target}-token blocks"
                fix = f"set {at}: {bs_p}"
            problems.append(
                Problem(
                    CONVERSION_OFF,
                    at,
                    f"spec.transfer.conversion is Off but {what}: {fix}, or spec.transfer.conversion: Auto",
                )
            )
    return problems


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
