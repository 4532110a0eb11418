"""One checked fix for an incompatible spec: a few field changes that make the whole verdict compatible.

Each problem's message says what would fix *it* with everything else as is; two problems can then advise
different values for one field (a compatibility rule asks decode for 16-token blocks, vLLM's CPU attention
for 32). :func:`suggested_fix` searches for one set of changes that clears every problem at once, and
returns it only when the verdict with those changes is compatible, so the advice is never a guess.

The search is a small beam search: each step changes one more field (to values near its current one) and
keeps the states with the fewest problems left, then the fewest fields changed, then the smallest change (a
role's node count weighs half: spreading a role keeps its TP size). It looks one step past the first fix found,
so a fix made of two single changes competes with a move that sets both roles at once.
Only settings are searched: both roles' TP size, block size and layout, the KV cache dtype and cache kind,
the conversion policy, and offending ``extraArgs`` (dropped); the model's geometry is a fact about the
model, not a setting, and is never changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from kvbridge_agent.core import Problem
from kvbridge_agent.core.compat import CONVERSION_OFF, MLA_KV_HEADS, check_pair
from kvbridge_agent.core.model import CacheKind, Conversion, KVCacheDtype, KVLayout
from kvbridge_operator.api.objects import with_fields
from kvbridge_operator.api.spec import DisaggregatedDeployment, DisaggregatedDeploymentSpec
from kvbridge_operator.api.transfer import KVBufferDevice
from kvbridge_operator.children import network
from kvbridge_operator.children.engines import engine_of
from kvbridge_operator.children.engines.vllm_problems import VLLM_KV_BUFFER_DEVICE
from kvbridge_operator.children.verdict import spec_problems, verdict_for

#: at most this many fields change (more is a different deployment, not a fix)
MAX_CHANGES = 6
_TP_VALUES = tuple(range(1, 129))
_NODE_VALUES = tuple(range(1, 65))
#: DP sizes tried: every size a node of up to 8 GPUs holds, then the usual wide ones
_DP_VALUES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 64)
_BLOCK_VALUES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256, 512, 1024)

#: bfloat16 first: the dtype to fall back to when the one asked for cannot run
_DTYPES = (KVCacheDtype.BFLOAT16, *(d for d in KVCacheDtype if d is not KVCacheDtype.BFLOAT16))

#: states kept per step of the search (tried in turn: the wider beam only when the narrower finds nothing), and
#: values tried per field (the nearest to the current one)
BEAM_WIDTHS = (8, 48)
VALUES_PER_FIELD = 12

Fix = dict[str, Any]


def _role_field(role: str, name: str) -> tuple[str, Setter]:
    attribute = {
        "tensorParallelSize": "tensor_parallel_size",
        "blockSize": "block_size",
        "kvLayout": "kv_layout",
        "nodes": "nodes",
        "dataParallelSize": "data_parallel_size",
        "expertParallel": "expert_parallel",
    }

    def apply(spec: DisaggregatedDeploymentSpec, value: Any) -> DisaggregatedDeploymentSpec:
        current = getattr(spec, role)
        return spec.model_copy(update={role: current.model_copy(update={attribute[name]: value})})

    return f"spec.{role}.{name}", apply


def _model_field(name: str, attribute: str) -> tuple[str, Setter]:
    def apply(spec: DisaggregatedDeploymentSpec, value: Any) -> DisaggregatedDeploymentSpec:
        return spec.model_copy(update={"model": spec.model.model_copy(update={attribute: value})})

    return f"spec.model.{name}", apply


def _conversion(spec: DisaggregatedDeploymentSpec, value: Any) -> DisaggregatedDeploymentSpec:
    return spec.model_copy(update={"transfer": spec.transfer.model_copy(update={"conversion": value})})


Setter = Callable[[DisaggregatedDeploymentSpec, Any], DisaggregatedDeploymentSpec]


def _fields() -> dict[str, tuple[Setter, Sequence[Any]]]:
    """Every searched field: its path, how to set it on a spec, its candidate values."""
    fields: dict[str, tuple[Setter, Sequence[Any]]] = {}
    role_values: tuple[tuple[str, Sequence[Any]], ...] = (
        ("tensorParallelSize", _TP_VALUES),
        ("blockSize", _BLOCK_VALUES),
        ("kvLayout", tuple(KVLayout)),
        ("nodes", _NODE_VALUES),
    )
    for role in ("prefill", "decode"):
        for name, values in role_values:
            path, apply = _role_field(role, name)
            fields[path] = (apply, values)
    model_values: tuple[tuple[str, str, Sequence[Any]], ...] = (
        ("kvCacheDtype", "kv_cache_dtype", _DTYPES),
        ("cacheKind", "cache_kind", tuple(CacheKind)),
    )
    for name, attribute, values in model_values:
        path, apply = _model_field(name, attribute)
        fields[path] = (apply, values)
    fields["spec.transfer.conversion"] = (_conversion, (Conversion.AUTO,))
    # only where a problem names them (see _relevant): the one value MLA allows, the buffer vLLM's CPU build has
    # and the one kvbridge's connector reads on GPUs
    fields[MLA_HEADS_FIELD] = (_model_field("numKVHeads", "num_kv_heads")[1], (1,))
    fields[KV_BUFFER_FIELD] = (_kv_buffer_device, (KVBufferDevice.CPU, KVBufferDevice.CUDA))
    # data and expert parallelism: only where a problem names them (they are a choice of scale, not of geometry)
    for role in ("prefill", "decode"):
        for name, values in (("dataParallelSize", _DP_VALUES), ("expertParallel", (False, True))):
            path, apply = _role_field(role, name)
            fields[path] = (apply, values)
    return fields


MLA_HEADS_FIELD = "spec.model.numKVHeads"
KV_BUFFER_FIELD = "spec.transfer.network.kvBufferDevice"
#: fields searched only for these problems (a model's geometry is a fact, not a setting to search, except this)
_ONLY_FOR = {
    MLA_HEADS_FIELD: frozenset({MLA_KV_HEADS}),
    KV_BUFFER_FIELD: frozenset({VLLM_KV_BUFFER_DEVICE}),
}


def _kv_buffer_device(spec: DisaggregatedDeploymentSpec, value: Any) -> DisaggregatedDeploymentSpec:
    network = spec.transfer.network.model_copy(update={"kv_buffer_device": value})
    return spec.model_copy(update={"transfer": spec.transfer.model_copy(update={"network": network})})


_FIELDS = _fields()


def _problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """The verdict's problems without the per-problem suggestions (cheap: no plan is built)."""
    found = check_pair(spec.model, spec.prefill.settings(), spec.decode.settings(), spec.transfer, suggestions=False)
    return found + spec_problems(spec)


#: problems that no setting the search changes can clear (a template overlay's, an RDMA resource's name): with one
#: of them no fix exists, and the search would try every candidate (seconds) to find none
_UNSEARCHABLE_CODES = frozenset({network.RDMA_RESOURCE_INVALID, network.RDMA_RESOURCE_GPU})


def _unsearchable(problem: Problem) -> bool:
    return problem.code in _UNSEARCHABLE_CODES or problem.code.startswith("TEMPLATE_")


def _distance(old: Any, new: Any) -> float:
    if isinstance(old, int) and isinstance(new, int) and old > 0 and new > 0:
        return abs(math.log2(new / old))
    return 0.0 if old == new else 1.0


#: a change of where an engine runs (its node count) weighs half a change of what it runs (its TP size, blocks,
#: layout): a role that does not fit a node keeps the TP size its user chose when spreading it suffices — the
#: advice its own problem gives
_PLACEMENT_WEIGHT = 0.5


def _cost(path: str, old: Any, new: Any) -> float:
    weight = _PLACEMENT_WEIGHT if path.endswith(".nodes") else 1.0
    return weight * _distance(old, new)


def _nearest(values: Sequence[Any], near: Any) -> list[Any]:
    """The :data:`VALUES_PER_FIELD` candidate values nearest ``near``, nearest first (stable among equals)."""
    return sorted(values, key=lambda value: _distance(near, value))[:VALUES_PER_FIELD]


#: role fields searched only where a problem is at them (see _fields)
_PARALLEL_NAMES = ("dataParallelSize", "expertParallel")
_ROLE_FIELDS = tuple(
    path
    for path in _FIELDS
    if path.split(".")[1] in ("prefill", "decode") and path.split(".")[2] not in _PARALLEL_NAMES
)


def _relevant(problems: Sequence[Problem]) -> list[str]:
    """The fields worth changing: every role setting (the rules tie TP sizes and block sizes of both roles), and
    a model field or the conversion policy only when a problem is about it."""
    at_fault = {problem.field for problem in problems}
    if any(problem.code == CONVERSION_OFF for problem in problems):
        at_fault.add("spec.transfer.conversion")
    codes = {problem.code for problem in problems}
    at_fault = {path for path in at_fault if path not in _ONLY_FOR or _ONLY_FOR[path] & codes}
    return [*_ROLE_FIELDS, *(path for path in _FIELDS if path in at_fault and path not in _ROLE_FIELDS)]


def _moves(paths: Sequence[str], candidates: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """One step of the search: one field to a candidate value, or one role setting to the same value on both
    roles (many rules want them equal: CPU block sizes, cross-layer blocks, layouts without conversions)."""
    moves: list[dict[str, Any]] = [{path: value} for path in paths for value in candidates[path]]
    for name in ("tensorParallelSize", "blockSize", "kvLayout"):
        prefill, decode = f"spec.prefill.{name}", f"spec.decode.{name}"
        for value in dict.fromkeys([*candidates[prefill], *candidates[decode]]):
            moves.append({prefill: value, decode: value})
    return moves


def _settings_of(spec: DisaggregatedDeploymentSpec) -> dict[str, Any]:
    """The searched fields' current values, by path."""
    dumped = spec.model_dump(by_alias=True)
    found: dict[str, Any] = {}
    for path in _FIELDS:
        value: Any = dumped
        for step in path.split(".")[1:]:
            value = value[step]
        found[path] = value
    return found


State = tuple[int, int, float, dict[str, Any], DisaggregatedDeploymentSpec, list[Problem]]


def _search(
    spec: DisaggregatedDeploymentSpec,
    problems: list[Problem],
    original: dict[str, Any],
    candidates: dict[str, list[Any]],
    width: int,
) -> dict[str, Any] | None:
    """Beam search; a state is (problems left, fields changed, distance, changes, spec, its problems). The fewest
    fields changed, then the smallest change, among the states without problems found by the first step that has
    any and the step after it (a move that sets both roles changes two fields in one step: the step after finds
    the two-field fixes made of single moves, such as spreading each role over more nodes)."""
    beam: list[State] = [(len(problems), 0, 0.0, {}, spec, problems)]
    seen: set[tuple[tuple[str, Any], ...]] = {()}
    done: list[State] = []
    first: int | None = None
    for step in range(MAX_CHANGES + 1):
        done += [state for state in beam if state[0] == 0]
        if done and first is None:
            first = step
        if step == MAX_CHANGES or (first is not None and step > first):
            break
        expanded: list[State] = []
        for *_, changes, state, found in beam:
            if not found:  # solved: more changes only make it a worse fix
                continue
            for move in _moves(_relevant(found), candidates):
                new = {**changes, **move}
                key = tuple(sorted((p, v) for p, v in new.items() if v != original[p]))
                if key in seen or len(key) > MAX_CHANGES:
                    continue
                seen.add(key)
                moved = state
                for path, value in move.items():
                    moved = _FIELDS[path][0](moved, value)
                cost = sum(_cost(p, original[p], v) for p, v in key)
                left = _problems(moved)
                expanded.append((len(left), len(key), cost, dict(key), moved, left))
        if not expanded:
            break
        expanded.sort(key=lambda state: state[:3])
        beam = expanded[:width]
    return min(done, key=lambda state: state[1:3])[3] if done else None


def suggested_fix(dd: DisaggregatedDeployment) -> Fix | None:
    """``{"spec.decode.blockSize": 32, ...}`` whose application makes ``dd`` compatible; ``None`` when ``dd`` is
    compatible already or no fix within :data:`MAX_CHANGES` settings was found."""
    spec = dd.spec
    problems = _problems(spec)
    if not problems or any(_unsearchable(problem) for problem in problems):
        return None
    fix: Fix = {}
    dropped = engine_of(spec).refused_extra_args(spec)
    if dropped:
        kept = [a for a in spec.engine.extra_args if a not in dropped]
        fix["spec.engine.extraArgs"] = kept
        spec = spec.model_copy(update={"engine": spec.engine.model_copy(update={"extra_args": kept})})
        problems = _problems(spec)
    transports = network.fixed_transports(spec)
    if transports is not None:
        fix[network.TRANSPORTS_FIELD] = transports
        changed = spec.transfer.network.model_copy(update={"ucx_transports": transports})
        spec = spec.model_copy(update={"transfer": spec.transfer.model_copy(update={"network": changed})})
        problems = _problems(spec)
    original = _settings_of(dd.spec)
    candidates = {path: _nearest(values, original[path]) for path, (_, values) in _FIELDS.items()}
    for width in BEAM_WIDTHS:  # a wider beam only when the narrow one finds nothing (rare, and slower)
        found = _search(spec, problems, original, candidates, width)
        if found is not None:
            break
    else:
        return None
    for path, value in found.items():
        fix[path] = value.value if hasattr(value, "value") else value
    fixed = DisaggregatedDeployment.model_validate(apply_fix(dd.model_dump(by_alias=True, mode="json"), fix))
    return fix if not isinstance(verdict_for(fixed), list) else None


def apply_fix(manifest: dict[str, Any], fix: Fix) -> dict[str, Any]:
    """The manifest with the fix's fields set (a copy; the input is left alone)."""
    return with_fields(manifest, fix)


def merge_patch(fix: Fix) -> dict[str, Any]:
    """The fix as a JSON merge patch (``kubectl patch --type merge -p``)."""
    return apply_fix({}, fix)


def describe(fix: Fix) -> str:
    return ", ".join(f"{path}: {value}" for path, value in fix.items())


#: spec JSON -> the fix in words; bounded, oldest first out
_ADVICE: dict[str, str] = {}
_ADVICE_SIZE = 256


def advice(dd: DisaggregatedDeployment) -> str:
    """The checked fix in words, for conditions and events; the search runs once per distinct spec."""
    key = dd.spec.model_dump_json(by_alias=True)
    if key not in _ADVICE:
        if len(_ADVICE) >= _ADVICE_SIZE:
            del _ADVICE[next(iter(_ADVICE))]
        fix = suggested_fix(dd)
        _ADVICE[key] = describe(fix) if fix else ""
    return _ADVICE[key]
