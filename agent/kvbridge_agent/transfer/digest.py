"""The transfer digest (``core.digest``, protocol ``kvbridge-digest/1``) computed with torch on the cache's own
device: the values of the numpy reference, for the blocks of one request on one rank.

The row sums — one multiply-add per 32-bit word, the whole cost — are taken on each region's blocks as they lie
in memory (a row is contiguous in every layout), so the only copy is the gather of the request's blocks; the
per-row values (1/64 of the words for a 128-dim bf16 head) are then put in logical order and combined in 64 bits.
An engine whose block interior the cache's geometry does not describe (vLLM's CPU attention stores keys
dimension-major) passes a logical view instead, which costs a copy into token-major order. int32 and int64
arithmetic wrap modulo 2**32 and 2**64 exactly as the reference's unsigned types.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvbridge_agent.core import KVLayout
from kvbridge_agent.core.arithmetic import ceil_div
from kvbridge_agent.core.digest import Words, coefficients, row_words
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.kv_view import global_heads, logical_layer

#: ``(cache, block ids, layer) -> [blocks, kv, tokens, heads, row bytes]`` uint8: how a cache is read logically
LogicalView = Callable[[KVCache, torch.Tensor, int], torch.Tensor]


def _signed(values: Words, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Unsigned coefficients as the signed integers of the same bits (torch multiplies signed types)."""
    if dtype is torch.int32:
        return torch.from_numpy(values.astype(np.uint32).view(np.int32)).to(device)
    return torch.from_numpy(values.view(np.int64)).to(device)


class Digester:
    """Digests of one rank's cache; the coefficients live on the cache's device, computed once (positions grow)."""

    def __init__(self, cache: KVCache, view: LogicalView | None = None, heads: list[int] | None = None) -> None:
        """``view`` and ``heads`` (the global KV heads of the view's head axis) default to the cache's own
        geometry; an engine whose block interior the geometry does not describe passes its own."""
        self.cache = cache
        self.view = view
        self.device = cache.tensors[0].device
        self.heads = global_heads(cache) if heads is None else heads
        model = cache.model
        self._a = _signed(coefficients("word", row_words(cache.row_bytes)), torch.int32, self.device)
        self._kv = 1 if model.is_mla else 2
        layer_kv = coefficients("layer_kv", model.num_layers * self._kv)
        self._b = _signed(layer_kv, torch.int64, self.device).view(model.num_layers, self._kv)
        self._p = torch.empty(0, dtype=torch.int64, device=self.device)

    def _positions(self, count: int, num_tokens: int) -> torch.Tensor:
        if self._p.numel() < count:
            self._p = _signed(coefficients("position", max(count, 2 * self._p.numel())), torch.int64, self.device)
        p = self._p[:count].clone()
        p[num_tokens:] = 0
        return p

    def request(self, block_ids: list[int], num_tokens: int, wire_block_size: int) -> Words:
        """``D[local head, wire block]`` of a request whose block ``i`` holds tokens ``i*bs .. i*bs+bs-1``: the
        first ``ceil(num_tokens / wire_block_size)`` wire blocks (what every side of any plan agrees on)."""
        cache = self.cache
        wire_blocks = ceil_div(num_tokens, wire_block_size)
        positions = len(block_ids) * cache.block_size
        if positions < num_tokens or cache.block_size % wire_block_size:
            raise ValueError(
                f"{len(block_ids)} blocks of {cache.block_size} tokens cannot hold {num_tokens} tokens in "
                f"{wire_block_size}-token wire blocks"
            )
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        if self.view is not None or cache.cross_layer or not cache.per_layer_tensors:
            total = self._logical_total(ids)
        else:
            total = self._physical_total(ids)  # [positions, heads]
        total *= self._positions(positions, num_tokens)[:, None]
        per_block = total.view(-1, wire_block_size, len(self.heads)).sum(dim=1)[:wire_blocks]
        return np.ascontiguousarray(per_block.T.cpu().numpy().view(np.uint64))

    def _physical_total(self, ids: torch.Tensor) -> torch.Tensor:
        """Sum over layers and K/V of ``r * B``, accumulated in the blocks' own order (heads and tokens as they lie)
        and put in logical order once: per region a gather, a multiply-add per word and one per row."""
        cache = self.cache
        n, hl, bs, row = ids.numel(), len(self.heads), cache.block_size, cache.row_bytes
        hnd = cache.kv_layout is KVLayout.HND and not cache.model.is_mla
        shape = (n, hl, bs, row) if hnd else (n, bs, hl, row)
        split = cache.layout.num_regions == cache.layout.num_tensors
        total = torch.zeros(shape[:-1], dtype=torch.int64, device=self.device)
        for layer in range(cache.model.num_layers):
            if split:  # a tensor per layer and K/V (MLA: per layer)
                for kv in range(self._kv):
                    sums = self._row_sums(self._gather(self._kv * layer + kv, ids).view(shape))
                    total += sums * self._b[layer, kv : kv + 1]  # a 1-d factor: int32 * int64 widens
            else:  # blocks-first: K and V inside each block
                sums = self._row_sums(self._gather(layer, ids).view(n, 2, *shape[1:]))
                total += (sums * self._b[layer, :, None, None]).sum(dim=1)
        if hnd:
            total = total.transpose(1, 2)
        return total.reshape(n * bs, hl)

    def _logical_total(self, ids: torch.Tensor) -> torch.Tensor:
        """The same through a logical view (a copy into token-major order per layer)."""
        cache = self.cache
        view = self.view or logical_layer
        total = torch.zeros(ids.numel() * cache.block_size, len(self.heads), dtype=torch.int64, device=self.device)
        for layer in range(cache.model.num_layers):
            sums = self._row_sums(view(cache, ids, layer).contiguous())  # [n, kv, bs, heads]
            weighted = sums * self._b[layer, : sums.shape[1], None, None]
            total += weighted.sum(dim=1).reshape(total.shape)
        return total

    def _gather(self, tensor: int, ids: torch.Tensor) -> torch.Tensor:
        """The request's blocks of one tensor, as bytes (``index_select`` on 32-bit words: many times faster than
        indexing a byte tensor)."""
        words = self.cache.bytes_view(tensor).view(torch.int32)
        return torch.index_select(words, 0, ids).view(torch.uint8)

    def _row_sums(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s last axis holds rows of bytes: their 32-bit sums (signed; widened where they are multiplied)."""
        words = x.view(torch.int32).view(*x.shape[:-1], -1)
        return (words * self._a).sum(dim=-1, dtype=torch.int32)
