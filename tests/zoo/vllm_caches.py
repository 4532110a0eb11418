"""One TP rank's KV cache of a zoo model as vLLM 0.32 builds it, and kvbridge's connector started on it.

- the cache: the model's per-layer ``KVCacheSpec`` (``FullAttentionSpec``, ``SlidingWindowSpec``,
  ``ChunkedLocalAttentionSpec``, ``MLAAttentionSpec`` from ``spec.model.layerTypes``) -> vLLM's
  ``get_kv_cache_groups`` (its grouping and padding) -> ``get_kv_cache_config_from_groups`` -> ``allocate_kv_cache``
  on host memory in the ``KVCacheLayout`` kvbridge renders for the role (``rendered_order``);
- the start: what ``KVBridgeConnector.__init__`` and ``register_kv_caches`` do in a vLLM worker of that role and
  rank — the settings from kvbridge's rendered environment checked against vLLM's, the cache groups, the resolved
  layout, both halves (scheduler, worker), the registration with real NIXL.

Scaled down: every layer's head size is :data:`HEAD_SIZE` (the model's layers, KV heads and windows are its own), in
vLLM's cache and in the model the connector is told alike, and the allocation holds :data:`NUM_BLOCKS` blocks:
what registration looks at (layers, heads per rank, groups, block size, layout) is the model's. Every start
registers with one NIXL agent (:class:`SharedAgent`, real NIXL): starting an agent is most of a start's time.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings
from kvbridge_agent.core.contract import EngineEnvironment, render_environment
from kvbridge_agent.core.layout import rendered_order
from kvbridge_agent.core.model import LayerType
from kvbridge_agent.transfer.transport import Transport
from kvbridge_agent.vllm_connector.connector import cache_groups, require_checked_layout
from kvbridge_agent.vllm_connector.scheduler import ConnectorScheduler
from kvbridge_agent.vllm_connector.settings import ConnectorSettings
from kvbridge_agent.vllm_connector.worker import ConnectorWorker

HEAD_SIZE = 16
NUM_BLOCKS = 4
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def scaled(model: ModelGeometry) -> ModelGeometry:
    """The model with every head :data:`HEAD_SIZE` wide (the geometry the connector is told)."""
    return ModelGeometry.model_validate(
        {**model.model_dump(include=set(ModelGeometry.model_fields)), "head_dim": HEAD_SIZE}
    )


def layer_specs(model: ModelGeometry, block: int, tp: int) -> dict[str, KVCacheSpec]:
    """Each attention layer's cache spec on one rank of ``tp`` (state-space and cache-less layers have none here)."""
    heads = 1 if model.is_mla else max(1, model.num_kv_heads // tp)
    shape: dict[str, Any] = {
        "block_size": block,
        "num_kv_heads": heads,
        "head_size": model.head_dim,
        "dtype": _DTYPES[model.kv_cache_dtype.value],
    }
    specs: dict[str, KVCacheSpec] = {}
    for index, kind in enumerate(model.layer_kinds):
        name = f"model.layers.{index}.self_attn.attn"
        if model.is_mla:
            specs[name] = MLAAttentionSpec(**shape)
        elif kind is LayerType.FULL:
            specs[name] = FullAttentionSpec(**shape)
        elif kind is LayerType.SLIDING:
            specs[name] = SlidingWindowSpec(**shape, sliding_window=model.sliding_window)
        elif kind is LayerType.CHUNKED_LOCAL:
            specs[name] = ChunkedLocalAttentionSpec(**shape, attention_chunk_size=model.attention_chunk_size)
    return specs


def vllm_config(layout: KVCacheLayout, blocks: int = NUM_BLOCKS) -> Any:
    """What ``get_kv_cache_groups`` and ``get_kv_cache_config_from_groups`` read of vLLM's config (the hybrid
    allocator on, as vLLM runs kvbridge's connector on GPUs)."""
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        attention_config=SimpleNamespace(hisparse_config=None),
        speculative_config=None,
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            prefix_cache_retention_interval=None,
            num_gpu_blocks_override=blocks,
        ),
    )


def kv_cache_config(model: ModelGeometry, block: int, tp: int, layout: KVCacheLayout) -> KVCacheConfig:
    """vLLM's KV cache configuration of one rank: its groups (padded where vLLM pads) and tensors."""
    specs = layer_specs(model, block, tp)
    config = vllm_config(layout)
    groups = get_kv_cache_groups(config, specs)
    page = max(spec.page_size_bytes for spec in specs.values())
    return get_kv_cache_config_from_groups(config, groups, page * len(specs) * NUM_BLOCKS)


class SharedAgent(Transport):
    """kvbridge's Transport on one NIXL agent for every start of this process (each start registers and, closed,
    deregisters its own memory on it)."""

    _agent_of_all: Any = None

    def __init__(self, name: str, backends: Any = ("UCX",), **options: Any) -> None:
        if SharedAgent._agent_of_all is None:
            super().__init__("zoo-shared-agent", backends, **options)
            SharedAgent._agent_of_all = self._agent
        self.name, self.backends, self._agent = name, list(backends), SharedAgent._agent_of_all
        self._registrations, self._dlists, self._peers, self._closed = [], [], set(), False


@dataclasses.dataclass
class Started:
    """One rank of one role, started as vLLM starts kvbridge's connector."""

    scheduler: ConnectorScheduler
    worker: ConnectorWorker
    config: KVCacheConfig

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def start(model: ModelGeometry, role: Role, prefill: RoleSettings, decode: RoleSettings, rank: int = 0) -> Started:
    """Start kvbridge's connector on one rank of ``role`` over vLLM's own cache; raises what the start refuses."""
    own = prefill if role is Role.PREFILL else decode
    layout = KVCacheLayout[rendered_order(own.kv_layout, model.cache_kind).name]
    small = scaled(model)
    config = kv_cache_config(small, own.block_size, own.tensor_parallel_size, layout)
    views = allocate_kv_cache(config, torch.device("cpu"), layout)
    environment = EngineEnvironment(
        role=role,
        engine_id=f"{role.value}-zoo",
        model=small,
        prefill=prefill,
        decode=decode,
        transfer={"verification": "All"},
        side_channel_host="127.0.0.1",
        side_channel_listen_port=0,
    )
    vllm = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role="kv_producer" if role is Role.PREFILL else "kv_consumer"),
        cache_config=SimpleNamespace(block_size=own.block_size),
        parallel_config=SimpleNamespace(tensor_parallel_size=own.tensor_parallel_size),
    )
    settings = ConnectorSettings.from_vllm(vllm, render_environment(environment), cpu_build=False)
    groups = cache_groups(config)  # KVBridgeConnector.__init__
    if groups is not None:
        layers = [list(group.layer_names) for group in config.kv_cache_groups]
        settings = dataclasses.replace(settings, groups=groups, group_layers=layers)
    scheduler = ConnectorScheduler(settings)
    worker = ConnectorWorker(settings, rank, f"zoo-{role.value}-{rank}")
    started = Started(scheduler, worker, config)
    try:
        require_checked_layout(layout.name, settings)  # register_kv_caches
        worker.register_kv_caches(views, layout.name)
    except BaseException:
        started.shutdown()
        raise
    return started
