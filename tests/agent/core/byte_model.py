"""A brute-force byte model of prefill and decode KV caches, independent of the core's geometry code.

Memory is simulated per rank as one int64 per *byte*; every byte of real KV
content holds a unique id of (layer, K/V, global head, token, dim, byte), so
a copy that lands anywhere but the right place is detected.  Addresses are
computed here from first principles (cache kind, layout, heads per rank) —
the core's ``RegionLayout`` is only used to produce descriptors, never to
decide what is right.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbridge_agent.core import CacheKind, KVLayout, ModelGeometry

Ints = npt.NDArray[np.int64]


def heads_of_rank(model: ModelGeometry, tp: int, rank: int) -> list[int]:
    """Global heads held by one rank, in local order."""
    if model.is_mla:
        return [0]
    k = model.num_kv_heads
    if tp <= k:
        per = k // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * k // tp]


@dataclass(frozen=True)
class RankMemory:
    """Flat simulated memory of one rank: tensors laid one after another."""

    model: ModelGeometry
    tp: int
    rank: int
    block_size: int
    layout: KVLayout
    num_blocks: int

    @property
    def heads(self) -> list[int]:
        return heads_of_rank(self.model, self.tp, self.rank)

    @property
    def kvs(self) -> int:
        return 1 if self.model.is_mla else 2

    @property
    def elem(self) -> int:
        return self.model.element_bytes

    @property
    def unit(self) -> int:
        """Bytes of one block of one region (K or V, a half, the latent, or the whole cross-layer block)."""
        m = self.model
        per = self.block_size * m.head_dim * self.elem * len(self.heads)
        if m.cache_kind is CacheKind.CROSS_LAYER and not m.is_mla:
            return per * 2 * m.num_layers
        return per

    @property
    def num_tensors(self) -> int:
        m = self.model
        if m.is_mla:
            return m.num_layers
        return {CacheKind.SPLIT: 2 * m.num_layers, CacheKind.BLOCKS_FIRST: m.num_layers, CacheKind.CROSS_LAYER: 1}[
            m.cache_kind
        ]

    @property
    def stride(self) -> int:
        if self.model.cache_kind is CacheKind.BLOCKS_FIRST and not self.model.is_mla:
            return 2 * self.unit
        return self.unit

    @property
    def tensor_bytes(self) -> int:
        return self.stride * self.num_blocks

    @property
    def bases(self) -> list[int]:
        return [t * self.tensor_bytes for t in range(self.num_tensors)]

    @property
    def size(self) -> int:
        return self.tensor_bytes * self.num_tensors

    def address(
        self,
        layer: Ints,
        kv: Ints,
        local_head: Ints,
        token: Ints,
        dim: Ints,
        byte: Ints,
        block: Ints,
        *,
        tokens_per_unit: int,
        layout: KVLayout,
    ) -> Ints:
        """Byte address of an element when each block is viewed as units of ``tokens_per_unit`` tokens
        in ``layout`` (the native view: ``tokens_per_unit == block_size``, native layout)."""
        m, elem, hl = self.model, self.elem, len(self.heads)
        sub, tok = token // tokens_per_unit, token % tokens_per_unit
        if m.cache_kind is CacheKind.CROSS_LAYER and not m.is_mla:
            inner = (((local_head * m.num_layers + layer) * 2 + kv) * tokens_per_unit + tok) * m.head_dim + dim
            return block * self.stride + inner * elem + byte
        if m.is_mla:
            tensor, region_offset = layer, 0 * layer
            inner = tok * m.head_dim + dim
        else:
            if m.cache_kind is CacheKind.SPLIT:
                tensor, region_offset = 2 * layer + kv, 0 * layer
            else:  # blocks-first: K half then V half inside each block
                tensor, region_offset = layer, kv * self.unit
            if layout is KVLayout.HND:
                inner = (local_head * tokens_per_unit + tok) * m.head_dim + dim
            else:
                inner = (tok * hl + local_head) * m.head_dim + dim
        sub_bytes = tokens_per_unit * m.head_dim * elem * hl
        return tensor * self.tensor_bytes + region_offset + block * self.stride + sub * sub_bytes + inner * elem + byte

    def elements(self, blocks: list[int], first_token: int) -> dict[str, Ints]:
        """Index arrays of every element of the given blocks (block ``i`` holds tokens from
        ``first_token + i * block_size``), flattened."""
        m = self.model
        grids = np.meshgrid(
            np.arange(len(blocks)),
            np.arange(m.num_layers),
            np.arange(self.kvs),
            np.arange(len(self.heads)),
            np.arange(self.block_size),
            np.arange(m.head_dim),
            np.arange(self.elem),
            indexing="ij",
        )
        position, layer, kv, local_head, token, dim, byte = (g.ravel().astype(np.int64) for g in grids)
        return {
            "block": np.asarray(blocks, dtype=np.int64)[position],
            "layer": layer,
            "kv": kv,
            "local_head": local_head,
            "global_head": np.asarray(self.heads, dtype=np.int64)[local_head],
            "token": token,
            "global_token": first_token + position * self.block_size + token,
            "dim": dim,
            "byte": byte,
        }


def content_id(model: ModelGeometry, e: dict[str, Ints], num_tokens: int) -> Ints:
    """Unique positive id of every real element byte; tokens past the prompt get -1 (never checked)."""
    m = model
    ident = (
        (
            (((e["layer"] * 2 + e["kv"]) * max(1, m.num_kv_heads) + e["global_head"]) * 4096 + e["global_token"])
            * m.head_dim
            + e["dim"]
        )
        * 8
        + e["byte"]
        + 1
    )
    return np.where(e["global_token"] < num_tokens, ident, -1)


def expand(addresses: Ints, length: int) -> Ints:
    """Every byte address of descriptors ``[addr, addr + length)``."""
    return (addresses[:, None] + np.arange(length, dtype=np.int64)[None, :]).ravel()
