"""The KV cache a vLLM GPU worker hands its KV connector, built by vLLM's own allocator (on host memory by default).

``allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes)`` lays one allocation out as the resolved
``KVCacheLayout`` says and returns a strided view per layer: off a GPU (``device=cpu``) it gives the same views and
strides a GPU worker would register, which is what ``kvbridge-agent bench --layouts`` moves. It lives here because
this package is the only one in the agent that imports vllm.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvbridge_agent.core import ModelGeometry


def allocate_host_views(
    model: ModelGeometry, layout: str, block_size: int, heads: int, num_blocks: int, device: str = "cpu"
) -> dict[str, Any]:
    """Per-layer views (``model.layers.<i>.self_attn.attn``) of ``num_blocks`` blocks of ``block_size`` tokens and
    ``heads`` KV heads of ``model.head_dim`` in bf16 on ``device`` (an MLA model: its one latent), laid out as the
    ``KVCacheLayout`` named ``layout``."""
    import torch
    from vllm.v1.core.kv_cache_utils import create_kv_cache_group_specs, get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    resolved = KVCacheLayout[layout]
    kind = MLAAttentionSpec if model.is_mla else FullAttentionSpec
    spec = kind(block_size=block_size, num_kv_heads=heads, head_size=model.head_dim, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(model.num_layers)]
    groups = create_kv_cache_group_specs(dict.fromkeys(names, spec), [names])
    vllm_config = SimpleNamespace(  # the few settings the engine core reads to size the cache
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: resolved,
            prefix_cache_retention_interval=None,
            num_gpu_blocks_override=num_blocks,
        ),
    )
    config = get_kv_cache_config_from_groups(vllm_config, groups, spec.page_size_bytes * len(names) * num_blocks)
    views: dict[str, Any] = allocate_kv_cache(config, torch.device(device), resolved, None)
    return views
