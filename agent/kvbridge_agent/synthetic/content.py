"""Deterministic synthetic KV content for the agent worker, and its verification.

A prefill "computes" a request by writing, for every layer, K/V, head, token
and byte, a value derived from the prefill request id; a decode rank verifies
what it received against the same derivation in its own layout.  Nothing
here is on the transfer path: it stands in for the model.
"""

from __future__ import annotations

import hashlib

import torch

from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.kv_view import check_per_layer, global_heads, logical_layer, tokens_major

MASK = 0xFFFFFFFF


def request_seed(prefill_request_id: str) -> int:
    return int.from_bytes(hashlib.sha256(prefill_request_id.encode()).digest()[:4], "little")


def layer_content(cache: KVCache, seed: int, layer: int, blocks: int, first_token: int) -> torch.Tensor:
    """Expected bytes of ``blocks`` consecutive blocks from ``first_token``: ``[n, kv, tokens, heads, row]``."""
    device = cache.tensors[0].device
    bs = cache.block_size

    def axis(values: torch.Tensor, dim: int) -> torch.Tensor:
        shape = [1] * 5
        shape[dim] = -1
        return values.view(shape)

    token = axis(torch.arange(blocks * bs, device=device, dtype=torch.int64), 0).view(blocks, 1, bs, 1, 1)
    kv = axis(torch.arange(cache.kv_count, device=device, dtype=torch.int64), 1)
    head = axis(torch.tensor(global_heads(cache), device=device, dtype=torch.int64), 3)
    byte = axis(torch.arange(cache.row_bytes, device=device, dtype=torch.int64), 4)
    value = ((seed * 131 + layer) * 7 + kv) * 1031 + head
    value = (value * 65599 + first_token + token) * 4099 + byte
    value = value & MASK
    value = ((value ^ (value >> 15)) * 0x2C1B3C6D) & MASK
    value = ((value ^ (value >> 12)) * 0x297A2D39) & MASK
    return ((value ^ (value >> 15)) & 0xFF).to(torch.uint8)


def write_layer(cache: KVCache, block_ids: torch.Tensor, layer: int, data: torch.Tensor) -> None:
    """Write ``[n, kv, tokens, heads, row]`` bytes into the native layout of ``block_ids``."""
    check_per_layer(cache)
    n, hl, bs, row = block_ids.numel(), cache.heads_local, cache.block_size, cache.row_bytes
    layout = cache.kv_layout
    if cache.cross_layer:
        view = cache.bytes_view(0).view(cache.num_blocks, hl, cache.model.num_layers, 2, bs, row)
        view[block_ids, :, layer] = data.permute(0, 3, 1, 2, 4)
        return
    native = tokens_major(data, layout)  # the same transpose maps back
    if cache.model.is_mla:
        cache.bytes_view(layer).view(cache.num_blocks, bs, row)[block_ids] = data[:, 0, :, 0, :]
    elif cache.layout.num_regions == cache.layout.num_tensors:  # split: K and V tensors
        for kv in range(2):
            cache.bytes_view(2 * layer + kv).view(cache.num_blocks, -1)[block_ids] = native[:, kv].reshape(n, -1)
    else:  # blocks-first
        cache.bytes_view(layer).view(cache.num_blocks, -1)[block_ids] = native.reshape(n, -1)


def fill_request(cache: KVCache, prefill_request_id: str, block_ids: list[int], first_token: int = 0) -> None:
    """Write a request's content into ``block_ids`` (block ``i`` holds tokens from ``first_token + i*bs``)."""
    if not block_ids:
        return
    ids = torch.tensor(block_ids, dtype=torch.int64, device=cache.tensors[0].device)
    seed = request_seed(prefill_request_id)
    for layer in range(cache.model.num_layers):
        write_layer(cache, ids, layer, layer_content(cache, seed, layer, len(block_ids), first_token))


def scribble(cache: KVCache, block_ids: list[int]) -> None:
    """Overwrite blocks with a fixed pattern, so a missing write cannot pass verification."""
    if not block_ids:
        return
    ids = torch.tensor(block_ids, dtype=torch.int64, device=cache.tensors[0].device)
    for index in range(len(cache.tensors)):
        cache.bytes_view(index)[ids] = 0xA5


def invalid_blocks(cache: KVCache, prefill_request_id: str, block_ids: list[int], num_tokens: int) -> list[int]:
    """Local blocks whose prompt bytes differ from the derivation (empty when all verify)."""
    if not block_ids:
        return []
    device = cache.tensors[0].device
    ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
    seed = request_seed(prefill_request_id)
    bs = cache.block_size
    real = (torch.arange(len(block_ids) * bs, device=device) < num_tokens).view(len(block_ids), 1, bs, 1, 1)
    bad = torch.zeros(len(block_ids), dtype=torch.bool, device=device)
    for layer in range(cache.model.num_layers):
        differs = (logical_layer(cache, ids, layer) != layer_content(cache, seed, layer, len(block_ids), 0)) & real
        bad |= differs.flatten(1).any(dim=1)
    return [block_ids[i] for i in torch.nonzero(bad).flatten().tolist()]
