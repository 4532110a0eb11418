"""What kvbridge's connector cannot move of a model's KV cache as vLLM 0.32 groups it: refused before scheduling,
each with the field at fault and a fix that the remedy search checks.

vLLM gives each kind of layer (``spec.model.layerTypes``: full attention, a sliding window, chunked local attention,
a state-space mixer) a cache spec, and its ``get_kv_cache_groups`` makes one group per kind when every layer has
the same kind, else splits every kind into groups of one size (the fewest layers of a kind, or the most where that
is under 1.5 times the fewest) and pads the last group of a kind whose count that size does not divide
(:func:`vllm_groups`). kvbridge's connector moves full-attention and sliding-window groups, padded ones included;
what it cannot move fails the engine's start (``CONNECTOR_UNSUPPORTED``, ``LAYOUT_UNSUPPORTED``) or, for one
sliding-window group, every prompt longer than the window: each is refused here instead.
"""

from __future__ import annotations

from collections import Counter

from kvbridge_agent.core import CacheKind, Problem, Role
from kvbridge_agent.core.model import LayerType, ModelGeometry
from kvbridge_operator.api.spec import DisaggregatedDeploymentSpec
from kvbridge_operator.children.engines.vllm_cpu import cpu_build
from kvbridge_operator.children.engines.vllm_serve import uses_kvbridge

#: a model with state-space or linear-attention layers (spec.model.stateSpace), whose state kvbridge does not move
VLLM_KVBRIDGE_STATE_SPACE = "VLLM_KVBRIDGE_STATE_SPACE"
#: chunked local attention (Llama 4) on GPUs, where vLLM keeps its own group of it
VLLM_KVBRIDGE_CHUNKED_ATTENTION = "VLLM_KVBRIDGE_CHUNKED_ATTENTION"
#: every layer slides: one sliding-window group, which kvbridge's transfer parameters do not carry
VLLM_KVBRIDGE_SLIDING_ONLY = "VLLM_KVBRIDGE_SLIDING_ONLY"
#: a padded hybrid in one block-major allocation with several KV heads on a rank (the connector's own code)
LAYOUT_UNSUPPORTED = "LAYOUT_UNSUPPORTED"

#: the groups' kinds with what makes two layers of one kind differ (a window, a chunk size)
Kind = tuple[LayerType, int]

STATE_SPACE = (
    "{model} has {layers} {kind} layers, whose state (not a KV cache) kvbridge's connector does not move: vLLM "
    "would fail its start (CONNECTOR_UNSUPPORTED); vLLM 0.32's NixlConnector moves it with the KV cache "
    "(ssm_conv_transfer_utils); set spec.engine.connector: Nixl"
)
CHUNKED_ATTENTION = (
    "{model} has {layers} chunked local attention layers ({chunk}-token chunks), which vLLM 0.32 keeps in KV cache "
    "groups of their own on GPUs, and kvbridge's connector moves full-attention and sliding-window groups only: vLLM "
    "would fail its start (CONNECTOR_UNSUPPORTED); set spec.engine.connector: Nixl"
)
SLIDING_ONLY = (
    "every layer of {model} slides ({window}-token window): vLLM keeps them in one sliding-window group and frees "
    "its blocks below the window, and kvbridge's transfer parameters carry such groups only beside a full-attention "
    "one, so every prompt longer than the window would fail (INVALID_BLOCK_IDS); set spec.engine.connector: Nixl"
)
PADDED_CROSS_LAYER = (
    "vLLM pads {model}'s KV cache groups (layers per group {groups}), and cacheKind CrossLayer keeps them in one "
    "block-major allocation (BHLNC) whose head stride is a group's own layers' bytes, so with {heads} KV heads on a "
    "{role} rank a padded group is another layout, which kvbridge's connector refuses at start; set "
    "spec.model.cacheKind: Split"
)


def attention_kinds(model: ModelGeometry) -> Counter[Kind]:
    """How many layers of each kind hold KV (state-space and cache-less layers hold none)."""
    sizes = {LayerType.SLIDING: model.sliding_window, LayerType.CHUNKED_LOCAL: model.attention_chunk_size}
    return Counter(
        (kind, sizes.get(kind, 0))
        for kind in model.layer_kinds
        if kind not in (LayerType.STATE_SPACE, LayerType.NO_CACHE)
    )


def vllm_groups(model: ModelGeometry) -> list[tuple[Kind, int]]:
    """vLLM 0.32's KV cache groups of the model's attention layers (``get_kv_cache_groups`` with the hybrid
    allocator on), each as its kind and its layers, in the order of the kinds' first layers: one group when every
    layer has one kind; else groups of one size, the last group of a kind padded (fewer layers)."""
    kinds = attention_kinds(model)
    if len(kinds) < 2:
        return [(kind, count) for kind, count in kinds.items()]
    counts = list(kinds.values())
    size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    groups: list[tuple[Kind, int]] = []
    for kind, count in kinds.items():
        parts = -(-count // size)
        groups += [(kind, len(range(i, count, parts))) for i in range(parts)]  # vLLM: layers[i::parts]
    return groups


def padded(model: ModelGeometry) -> bool:
    """Whether vLLM pads some group of the model (a group of fewer layers than the deepest)."""
    return len({layers for _kind, layers in vllm_groups(model)}) > 1


def problems(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """What kvbridge's connector cannot move of the model as vLLM groups it (connector KVBridge only)."""
    if not uses_kvbridge(spec):
        return []
    model = spec.model
    name = model.name
    found: list[Problem] = []
    if model.state_space is not None:
        state = model.state_space
        found.append(
            Problem(
                VLLM_KVBRIDGE_STATE_SPACE,
                "spec.model.stateSpace",
                STATE_SPACE.format(model=name, layers=state.num_layers, kind=state.kind.value),
            )
        )
    kinds = attention_kinds(model)
    chunked = sum(count for (kind, _size), count in kinds.items() if kind is LayerType.CHUNKED_LOCAL)
    if chunked and not cpu_build(spec):  # the CPU build runs them without the hybrid allocator (one_cache_group)
        found.append(
            Problem(
                VLLM_KVBRIDGE_CHUNKED_ATTENTION,
                "spec.model.layerTypes",
                CHUNKED_ATTENTION.format(model=name, layers=chunked, chunk=model.attention_chunk_size),
            )
        )
    if list(kinds) == [(LayerType.SLIDING, model.sliding_window)]:
        found.append(
            Problem(
                VLLM_KVBRIDGE_SLIDING_ONLY,
                "spec.model.layerTypes",
                SLIDING_ONLY.format(model=name, window=model.sliding_window),
            )
        )
    found += _padded_cross_layer(spec)
    return found


def _padded_cross_layer(spec: DisaggregatedDeploymentSpec) -> list[Problem]:
    """A padded hybrid in cacheKind CrossLayer with more than one KV head on some rank (GPUs: the CPU build runs
    its attention's per-layer caches only, whose groups share layer slots)."""
    model = spec.model
    if model.cache_kind is not CacheKind.CROSS_LAYER or cpu_build(spec) or not padded(model):
        return []
    for role in Role:
        heads = max(1, model.num_kv_heads // spec.role(role).tensor_parallel_size)
        if heads > 1:
            groups = ", ".join(str(layers) for _kind, layers in vllm_groups(model))
            return [
                Problem(
                    LAYOUT_UNSUPPORTED,
                    "spec.model.cacheKind",
                    PADDED_CROSS_LAYER.format(model=model.name, groups=groups, heads=heads, role=role.value),
                )
            ]
    return []
