"""What vLLM's KV tensors are to kvbridge: the geometry it moves bytes by, the layer slots several KV cache groups
share on vLLM's CPU build, the name of vLLM's resolved layout, the CPU attention kernel (which decides a block's
interior) and the conversions refused on that cache."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

from kvbridge_agent.core import CacheKind, ModelGeometry, SpecError, TransferPlan
from kvbridge_agent.core.handshake import HandshakeError
from kvbridge_agent.core.layout import PhysicalOrder
from kvbridge_agent.core.wire import ConversionKind
from kvbridge_agent.transfer.kv_cache import LAYOUT_UNSUPPORTED
from kvbridge_agent.transfer.peers import PrefillRanks

from .cpu_blocks import KNOWN_KERNELS

BLOCK_INTERIOR_MISMATCH = "BLOCK_INTERIOR_MISMATCH"


def transfer_geometry(model: ModelGeometry, tensors: list[Any], tp_size: int) -> ModelGeometry:
    """The geometry kvbridge moves bytes by.

    vLLM's CPU attention keeps one tensor per layer, ``[blocks, heads, block_size, 2 * head_dim]``: inside a block,
    each head's keys, then its values, each ``block_size * head_dim`` elements, in the kernel's order inside
    (:mod:`.cpu_blocks`; tests/vllm/test_cpu_attention_layout.py pins it). For moving whole heads that is a Split
    cache of one region per layer with twice the heads — head ``h``'s keys are pseudo-head ``2h``, its values
    ``2h + 1`` — exact for every TP mapping that keeps heads whole (TP size <= KV heads; replicated heads are
    refused). Other engines' tensors are taken as the model's cache kind describes them."""
    if model.cache_kind is CacheKind.SPLIT and not model.is_mla and len(tensors) == model.num_layers:
        if tp_size > model.num_kv_heads:
            raise SpecError(
                f"TP {tp_size} replicates the model's {model.num_kv_heads} KV heads; KVBridgeConnector moves vLLM's "
                "CPU attention cache by whole heads only",
                field="spec.prefill.tensorParallelSize",
                code="CONNECTOR_UNSUPPORTED",
            )
        return model.model_copy(update={"num_kv_heads": 2 * model.num_kv_heads})
    return model


def group_slots(kv_caches: Mapping[str, Any], group_layers: Sequence[Sequence[str]], num_layers: int) -> list[Any]:
    """vLLM's CPU build with several KV cache groups (its hybrid allocator): the tensors of the layer slots the groups
    overlay, slot ``i`` being every group's ``i``-th layer.

    ``allocate_kv_cache`` views one allocation per group at the same origin (``LBHNC``, the CPU attention's only
    layout), so group ``g``'s layer ``i`` and group ``h``'s layer ``i`` are one tensor, ``[blocks, heads, block_size,
    2 * head_dim]``, and a block id is one group's at a time: block ``b`` of a group is block ``b`` of the first
    ``len(group)`` slots (a group vLLM padded leaves the slots past its layers unused; core.cache_groups). Groups
    that do not share their slots so are refused."""
    names = sum(len(group) for group in group_layers)
    if names != num_layers or not all(group_layers) or not group_layers:
        raise SpecError(
            f"vLLM's {len(group_layers)} KV cache groups hold {names} layers, the model geometry says {num_layers}",
            field="spec.model.numLayers",
            code="INVALID_KV_TENSOR",
        )
    slots: list[Any] = []
    for index in range(max(len(group) for group in group_layers)):
        try:
            tensors = [kv_caches[group[index]] for group in group_layers if index < len(group)]
        except KeyError as exc:
            raise SpecError(
                f"cache group layer {exc} has no KV tensor", field="kv_cache_config", code="INVALID_KV_TENSOR"
            ) from exc
        first = tensors[0]
        if any((t.data_ptr(), t.shape, t.stride()) != (first.data_ptr(), first.shape, first.stride()) for t in tensors):
            raise SpecError(
                f"vLLM's KV cache groups do not share layer slot {index}: kvbridge moves groups on the CPU build "
                "that overlay one another, each group's i-th layer in one tensor (as vLLM's allocate_kv_cache lays "
                "them out)",
                field="kv_cache_config",
                code=LAYOUT_UNSUPPORTED,
            )
        slots.append(first)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in slots)
    if any(end > start for (_, end), (start, _) in pairwise(spans)):
        raise SpecError(
            f"vLLM's {len(slots)} layer slots of its KV cache groups overlap one another",
            field="kv_cache_config",
            code=LAYOUT_UNSUPPORTED,
        )
    return slots


def physical_order(layout: str) -> PhysicalOrder:
    """kvbridge's name of vLLM's resolved ``KVCacheLayout`` (its member name, e.g. ``"BLHNC"``)."""
    try:
        return PhysicalOrder(layout)
    except ValueError as exc:
        raise SpecError(
            f"vLLM resolved the KV cache layout {layout!r}; kvbridge knows {', '.join(o.value for o in PhysicalOrder)}",
            field="kv_cache_layout",
            code=LAYOUT_UNSUPPORTED,
        ) from exc


def refuse_conversions(geometry: ModelGeometry, model: ModelGeometry, plan: TransferPlan, kernel: str) -> None:
    """On vLLM's CPU attention layout (the pseudo-head geometry) kvbridge converts between block sizes for the
    kernels whose block interior it knows (:mod:`.cpu_blocks`); a layout permute (CPU attention runs HND only) or
    a conversion for another kernel is refused."""
    if geometry == model or not plan.wire.conversions:
        return
    permute = any(s.kind is ConversionKind.PERMUTE for s in plan.wire.conversions)
    if permute or kernel not in KNOWN_KERNELS:
        steps = ", ".join(f"{s.side.value} {s.kind.value} {s.source}->{s.target}" for s in plan.wire.conversions)
        raise SpecError(
            f"the plan needs {steps} on vLLM's CPU attention cache (kernel {kernel}); kvbridge converts it only "
            f"between block sizes and for the {', '.join(KNOWN_KERNELS)} kernels: use kvLayout HND on both sides",
            field="spec.decode.blockSize",
            code="CONNECTOR_UNSUPPORTED",
        )


def cpu_kernel(model_dtype: Any, block_size: int, head_dim: int, kv_cache_dtype: str = "auto") -> str:
    """The CPU attention kernel vLLM runs for this cache (its block interior depends on it), asked as vLLM's CPU
    backend asks: by the *model's* dtype and the cache's (an fp8 cache of a bfloat16 model runs ``amx`` on an AMX CPU,
    though the cache tensor is uint8)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(model_dtype, block_size, head_dim, kv_cache_dtype))
    except Exception:  # another vLLM: unknown, so no conversion is attempted
        return "unknown"


def check_block_interior(mine: str, engine_id: str, ranks: PrefillRanks) -> None:
    """Both engines' kernels must lay a block's bytes out alike: a prefill on another CPU kernel (an AMX node beside
    a plain AVX-512 one) would hand decode bytes it reads as other tokens."""
    theirs = {meta.block_interior for meta, _ in ranks.values()}
    if theirs != {mine}:
        raise HandshakeError(
            f"{engine_id} stores KV blocks as {' and '.join(sorted(t or 'its layout says' for t in theirs))}, this "
            f"decode as {mine or 'its layout says'}: run both roles on nodes whose CPUs give vLLM the same attention "
            "kernel (a node selector on the CPU feature), or the same engine build",
            code=BLOCK_INTERIOR_MISMATCH,
        )
