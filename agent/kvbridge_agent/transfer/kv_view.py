"""A rank's KV cache read logically — ``[blocks, kv, tokens, heads, row bytes]`` — whatever its cache kind and
layout: what the synthetic engine writes and checks, and what the transfer digest (``transfer.digest``) reads."""

from __future__ import annotations

import torch

from kvbridge_agent.core import KVLayout, SpecError
from kvbridge_agent.transfer.kv_cache import KVCache


def global_heads(cache: KVCache) -> list[int]:
    """Global KV heads of this rank, in local order."""
    model = cache.model
    if model.is_mla:
        return [0]
    k, tp = model.num_kv_heads, cache.tp_size
    if tp <= k:
        per = k // tp
        return list(range(cache.tp_rank * per, (cache.tp_rank + 1) * per))
    return [cache.tp_rank * k // tp]


def tokens_major(x: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """``[..., heads, tokens, row]`` (HND) or ``[..., tokens, heads, row]`` (NHD) -> tokens first."""
    return x.transpose(-3, -2) if layout is KVLayout.HND else x


def check_per_layer(cache: KVCache) -> None:
    if not cache.per_layer_tensors:
        raise SpecError("synthetic content needs one tensor per layer (no shared tensors)", code="INVALID_KV_TENSOR")


def physical_view(cache: KVCache, layer: int) -> torch.Tensor:
    """One layer of a cache attached from views (a physical layout) as its ``[kernel blocks, heads, tokens,
    content bytes]`` strided view of the allocation."""
    physical = cache.physical
    if physical is None:
        raise SpecError("the cache was not attached from views", code="INVALID_KV_TENSOR")
    _, stride_b, stride_h, stride_n, _ = physical.strides
    offset = cache.origin + layer * physical.strides[0]
    shape = (physical.num_blocks, physical.num_heads, physical.block_size, physical.content_bytes)
    return torch.as_strided(cache.tensors[0], shape, (stride_b, stride_h, stride_n, 1), offset)


def physical_layer(cache: KVCache, block_ids: torch.Tensor, layer: int) -> torch.Tensor:
    """The bytes of ``block_ids`` of a cache attached from views (a physical layout) as ``[n, kv, tokens, heads,
    row]``: the layer's strided view (:func:`physical_view`), its content split into keys then values (MLA: ``kv``
    is 1)."""
    view = physical_view(cache, layer)
    _, heads, tokens, _ = view.shape
    n, ratio = block_ids.numel(), cache.kernel_ratio
    kernel = (block_ids.view(-1, 1) * ratio + torch.arange(ratio, device=block_ids.device).view(1, -1)).view(-1)
    kv = 1 if cache.model.is_mla else 2  # keys then values; MLA's single latent
    x = view[kernel].view(n, ratio, heads, tokens, kv, cache.row_bytes)  # a block's kernel blocks in token order
    return x.permute(0, 4, 1, 3, 2, 5).reshape(n, kv, ratio * tokens, heads, cache.row_bytes)


def logical_layer(cache: KVCache, block_ids: torch.Tensor, layer: int) -> torch.Tensor:
    """The bytes of ``block_ids`` as ``[n, kv, tokens, heads, row]``."""
    if cache.physical is not None:
        return physical_layer(cache, block_ids, layer)
    check_per_layer(cache)
    n, hl, bs, row = block_ids.numel(), cache.heads_local, cache.block_size, cache.row_bytes
    layout = cache.kv_layout
    physical = (hl, bs, row) if layout is KVLayout.HND else (bs, hl, row)
    if cache.cross_layer:
        view = cache.bytes_view(0).view(cache.num_blocks, hl, cache.model.num_layers, 2, bs, row)
        return view[block_ids, :, layer].permute(0, 2, 3, 1, 4)
    if cache.model.is_mla:
        return cache.bytes_view(layer).view(cache.num_blocks, bs, row)[block_ids].view(n, 1, bs, 1, row)
    if cache.layout.num_regions == cache.layout.num_tensors:
        parts = [cache.bytes_view(2 * layer + kv)[block_ids].view(n, *physical) for kv in range(2)]
        return tokens_major(torch.stack(parts, dim=1), layout)
    return tokens_major(cache.bytes_view(layer)[block_ids].view(n, 2, *physical), layout)
