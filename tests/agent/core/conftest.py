from __future__ import annotations

from kvbridge_agent.core import Attention, KVCacheDtype, KVLayout, ModelGeometry, RoleSettings


def dense(heads: int = 8, layers: int = 32, head_dim: int = 128, **kw: object) -> ModelGeometry:
    return ModelGeometry.model_validate(
        {"name": "m", "numLayers": layers, "numKVHeads": heads, "headDim": head_dim, "kvCacheDtype": "float16", **kw}
    )


def mla(head_dim: int = 576, layers: int = 32) -> ModelGeometry:
    return ModelGeometry(
        name="m",
        num_layers=layers,
        num_kv_heads=1,
        head_dim=head_dim,
        kv_cache_dtype=KVCacheDtype.FLOAT16,
        attention=Attention.MLA,
    )


def role(tp: int, bs: int = 16, layout: str = "HND") -> RoleSettings:
    return RoleSettings(tensor_parallel_size=tp, block_size=bs, kv_layout=KVLayout(layout))
