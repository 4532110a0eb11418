"""The transfer digest (``core.digest``, protocol ``kvbridge-digest/2``) computed on the cache's own device: the
values of the numpy reference, for the blocks of one request on one rank, under the request's key.

The row sums — two multiply-adds per 16-bit unit, the whole cost — are taken on each region's blocks as they lie
in memory (a row is contiguous in every layout), with the coefficients ``A_k[j] * B_k[l, c] mod p`` of the
region's layer and K/V half (``core.digest.row_coefficients``), exactly in float64 over segments of at most
``SEGMENT_UNITS`` units and reduced mod ``p``; the per-row totals (1/128 of the units for a 128-dim bf16 head) are
then weighted by position and summed per wire block (``core.digest.finish``). With numba, the coefficients and
that last step are two compiled loops over the key's SHAKE stream and the totals where they lie
(``transfer.digest_kernel.row_coefficients_of``, ``finish_sums``): for a short request (400 tokens of a 2-layer
model) they were more than half of the digest as numpy's small array operations (140 -> 90 us per digest).

- CPU caches: one compiled pass (``transfer.digest_kernel``, numba) reads every unit once from the request's
  blocks where they lie — no gather copy, no widened copy.
- Other devices (and CPUs without numba): torch — per region a gather of the request's blocks, a widening to
  float64 and a batched matmul against the coefficients (exact: integers below ``2**53``, any summation order), in
  chunks of blocks.

An engine whose block interior the cache's geometry does not describe passes a logical view instead, which costs
a copy into token-major order per layer. One such interior is read where it lies: keys dimension-major and values
token-major per block and head (vLLM's CPU attention, ``vec`` kernels, 16-bit elements), summed by
``transfer.digest_kernel.add_keys_across`` with no copy.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvbridge_agent.core import KVLayout
from kvbridge_agent.core.arithmetic import ceil_div
from kvbridge_agent.core.digest import (
    LANES,
    PRIME,
    Lanes,
    Words,
    finish,
    key_stream,
    row_coefficients,
    row_units,
    segments,
)
from kvbridge_agent.transfer.digest_kernel import RowKernel, compiled, compiled_finish, compiled_keys_across
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.kv_view import global_heads, logical_layer

#: ``(cache, block ids, layer) -> [blocks, kv, tokens, heads, row bytes]`` uint8: how a cache is read logically
LogicalView = Callable[[KVCache, torch.Tensor, int], torch.Tensor]
#: the torch path's widened chunk, in units (float64: 8 bytes each)
CHUNK_UNITS = 1 << 24
#: the durations kept until an engine takes them (an engine that never does keeps the latest)
KEPT_DURATIONS = 4096
_INVERSE = 1.0 / PRIME


#: rows to digest: ``units[blocks, outer, groups, rows, width]`` (int16) whose group ``g`` is the layer and K/V
#: group ``first group + g``
_Region = tuple[torch.Tensor, int]


class Digester:
    """Digests of one rank's cache on the cache's device, for any key (one per request)."""

    def __init__(
        self,
        cache: KVCache,
        view: LogicalView | None = None,
        heads: list[int] | None = None,
        compiled_cpu: bool = True,
        keys_across: bool = False,
    ) -> None:
        """``view`` and ``heads`` (the global KV heads of the view's head axis) default to the cache's own
        geometry; an engine whose block interior the geometry does not describe passes its own. ``keys_across``:
        each tensor is one layer whose block holds, per head of ``heads``, its keys dimension-major then its values
        token-major, units of 16 bits (the view's interior, read where it lies when compiled). ``compiled_cpu``
        False takes the torch path on a CPU cache too (tests compare both)."""
        self.cache = cache
        self.view = view
        self.device = cache.tensors[0].device
        self.heads = global_heads(cache) if heads is None else heads
        self.width = row_units(cache.row_bytes)
        self._segments = segments(self.width)
        self._kv = 1 if cache.model.is_mla else 2
        self._kernel: RowKernel | None = compiled() if compiled_cpu and self.device.type == "cpu" else None
        #: the key's coefficients and the totals' last steps, compiled beside the pass (a GPU rank never imports numba)
        self._finish = compiled_finish() if self._kernel is not None else None
        self._logical = view is not None or not cache.per_layer_tensors
        #: the cache's own tensors as regions, read where they lie (made once: the views cost more than small
        #: requests' rows)
        self._regions = [] if self._logical else list(self._physical())
        self._arrays = [(units.numpy(), group) for units, group in self._regions] if self._kernel else []
        across = compiled_keys_across() if keys_across and self._kernel is not None else None
        self._across: tuple[RowKernel, list[npt.NDArray[np.int16]]] | None = None
        if across is not None:
            shape = (cache.num_blocks, len(self.heads), 2, cache.block_size * self.width)
            if cache.layout.block_stride != 2 * int(np.prod(shape[1:])) or len(cache.tensors) != cache.model.num_layers:
                raise ValueError(f"a cache of {cache.layout} is not one tensor per layer of {shape[1:]} blocks")
            layers = [self._units(layer).view(shape).numpy() for layer in range(cache.model.num_layers)]
            if all(units.flags.c_contiguous for units in layers):  # else through the view (the kernel's signature)
                self._across = across, layers
        self._seconds: deque[float] = deque(maxlen=KEPT_DURATIONS)

    def take_seconds(self) -> list[float]:
        """How long each request's digest took (seconds) since the last call, oldest first."""
        taken = list(self._seconds)
        self._seconds.clear()
        return taken

    def request(
        self,
        key: bytes,
        block_ids: list[int],
        num_tokens: int,
        wire_block_size: int,
        block_layers: Sequence[int] | None = None,
    ) -> Words:
        """``D[local head, wire block]`` under ``key`` of a request whose block ``i`` holds tokens
        ``i*bs .. i*bs+bs-1``: the first ``ceil(num_tokens / wire_block_size)`` wire blocks (what every side of
        any plan agrees on). ``block_layers``: per block, the layers that hold its KV (a padded cache group's
        blocks hold fewer than the cache, core.cache_groups; the rest is not digested)."""
        started = time.perf_counter()
        cache = self.cache
        wire_blocks = ceil_div(num_tokens, wire_block_size)
        if len(block_ids) * cache.block_size < num_tokens or cache.block_size % wire_block_size:
            raise ValueError(
                f"{len(block_ids)} blocks of {cache.block_size} tokens cannot hold {num_tokens} tokens in "
                f"{wire_block_size}-token wire blocks"
            )
        if any(not 0 <= b < cache.num_blocks for b in block_ids):
            raise ValueError(f"block ids {block_ids} are not all blocks of a cache of {cache.num_blocks}")
        groups = cache.model.num_layers * self._kv
        count, units = self._segments
        if block_layers is not None and len(block_layers) != len(block_ids):
            raise ValueError(f"layers of {len(block_layers)} blocks for {len(block_ids)} blocks")
        depths = None if block_layers is None else np.asarray(block_layers, dtype=np.int64)
        if depths is not None and bool((depths >= cache.model.num_layers).all()):
            depths = None  # every block holds every layer
        if self._finish is None:
            coef = row_coefficients(key, self.width, groups)
        else:
            coef = np.empty((groups, LANES, self.width))
            self._finish.coefficients(key_stream(key, "row", self.width), key_stream(key, "layer_kv", groups), coef)
        total, head_major = self._totals(block_ids, coef.reshape(groups, LANES, count, units), depths)
        if self._finish is not None:
            digests = np.zeros((len(self.heads), wire_blocks), dtype=np.uint64)
            position = key_stream(key, "position", num_tokens)
            self._finish.finish(total, head_major, position, num_tokens, wire_block_size, digests)
        else:
            digests = finish(by_position(total, head_major), key, num_tokens, wire_block_size)[:, :wire_blocks]
        self._seconds.append(time.perf_counter() - started)
        return digests

    # -- the rows, in the blocks' own order ----------------------------------------------------------------------
    def _totals(
        self, block_ids: list[int], coef: npt.NDArray[np.float64], depths: npt.NDArray[np.int64] | None = None
    ) -> tuple[npt.NDArray[np.float64], bool]:
        """``[blocks, heads, positions, lanes]`` when head-major (the bool), else ``[blocks, positions, heads,
        lanes]``: per position and head, the sum over layers and K/V of ``r * B`` (congruent mod ``p``; float64 from
        the passes, exact integers of either sign); with ``depths``, layer ``l`` of block ``i`` only where
        ``l < depths[i]``."""
        cache = self.cache
        n, hl, bs = len(block_ids), len(self.heads), cache.block_size
        hnd = cache.kv_layout is KVLayout.HND and not cache.model.is_mla
        logical = self._logical or depths is not None
        if self._across is not None and depths is None:  # head-major rows, read where they lie
            return self._run_across(self._across, np.asarray(block_ids, np.int64), (n, hl, bs), coef), True
        if logical:
            shape, head_major = (n, 1, bs * hl), False
        elif cache.cross_layer:
            shape, head_major = (n, hl, bs), True
        else:
            shape, head_major = (n, 1, hl * bs), hnd
        if logical:
            ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
            every = torch.arange(n, dtype=torch.int64, device=self.device)
            if self._kernel is not None:
                arrays = ((units.numpy(), group) for units, group in self._logical_regions(ids, depths))
                total = self._run_kernel(self._kernel, arrays, every.numpy(), shape, coef)
            else:
                total = self._run_torch(self._logical_regions(ids, depths), every, shape, coef)
        elif self._kernel is not None:
            total = self._run_kernel(self._kernel, iter(self._arrays), np.asarray(block_ids, np.int64), shape, coef)
        else:
            ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
            total = self._run_torch(iter(self._regions), ids, shape, coef)
        return total.reshape((n, hl, bs, LANES) if head_major else (n, bs, hl, LANES)), head_major

    def _physical(self) -> Iterator[_Region]:
        """The cache's own tensors as regions of every block."""
        cache = self.cache
        nb, hl, bs, width = cache.num_blocks, len(self.heads), cache.block_size, self.width
        layers = cache.model.num_layers
        if cache.cross_layer:  # one tensor: in a block, heads, then layers and K/V, then tokens
            yield self._units(0).view(nb, hl, layers * 2, bs, width), 0
            return
        rows = hl * bs
        if cache.layout.num_regions == cache.layout.num_tensors:  # a tensor per layer and K/V (MLA: per layer)
            for tensor in range(layers * self._kv):
                yield self._units(tensor).view(nb, 1, 1, rows, width), tensor
        else:  # blocks-first: K and V inside each block
            for layer in range(layers):
                yield self._units(layer).view(nb, 1, 2, rows, width), 2 * layer

    def _logical_regions(self, ids: torch.Tensor, depths: npt.NDArray[np.int64] | None = None) -> Iterator[_Region]:
        """Per layer, the request's blocks copied into token-major order by the logical view (``ids`` in order);
        with ``depths``, a block's layers from its depth on are zeros (they add nothing to a digest)."""
        view = self.view or logical_layer
        for layer in range(self.cache.model.num_layers):
            x = view(self.cache, ids, layer).contiguous()  # [n, kv, bs, heads, row bytes]
            if depths is not None and bool((depths <= layer).any()):
                padding = torch.from_numpy(depths <= layer).to(x.device)
                x = torch.where(padding.view(-1, *([1] * (x.dim() - 1))), x.new_zeros(()), x)
            n, kv = x.shape[0], x.shape[1]
            yield x.view(torch.int16).view(n, 1, kv, -1, self.width), layer * self._kv

    def _units(self, tensor: int) -> torch.Tensor:
        return self.cache.bytes_view(tensor).view(torch.int16)

    # -- the two ways of summing rows ----------------------------------------------------------------------------
    @staticmethod
    def _run_kernel(
        kernel: RowKernel,
        arrays: Iterator[tuple[npt.NDArray[np.int16], int]],
        ids: npt.NDArray[np.int64],
        shape: tuple[int, int, int],
        coef: npt.NDArray[np.float64],
    ) -> npt.NDArray[np.float64]:
        total = np.zeros((*shape, LANES), dtype=np.float64)
        for units, group in arrays:
            kernel(total, units, ids, coef[group : group + units.shape[2]])
        return total

    @staticmethod
    def _run_across(
        across: tuple[RowKernel, list[npt.NDArray[np.int16]]],
        ids: npt.NDArray[np.int64],
        shape: tuple[int, int, int],
        coef: npt.NDArray[np.float64],
    ) -> npt.NDArray[np.float64]:
        kernel, layers = across
        total = np.zeros((*shape, LANES), dtype=np.float64)
        for layer, units in enumerate(layers):
            kernel(total, units, ids, coef[2 * layer : 2 * layer + 2])
        return total

    def _run_torch(
        self, regions: Iterator[_Region], ids: torch.Tensor, shape: tuple[int, int, int], coef: npt.NDArray[np.float64]
    ) -> npt.NDArray[np.float64]:
        total = torch.zeros((*shape, LANES), dtype=torch.float64, device=self.device)
        count, units = self._segments
        c = torch.from_numpy(coef).to(self.device)  # [groups, lanes, segments, units]
        for region, first_group in regions:
            groups = region.shape[2]
            step = max(1, CHUNK_UNITS // (region[0].numel() // groups))  # blocks per widened chunk of one group
            for start in range(0, ids.numel(), step):
                x = torch.index_select(region, 0, ids[start : start + step])
                for g in range(groups):
                    rows = x[:, :, g].reshape(-1, count, units).to(torch.float64)
                    sums = torch.einsum("mqs,kqs->mqk", rows, c[first_group + g])  # exact: < 2**52
                    reduced = (sums - torch.floor(sums * _INVERSE) * PRIME).sum(dim=1)
                    total[start : start + step] += reduced.view(-1, *shape[1:], LANES)
        return total.cpu().numpy()


def by_position(total: npt.NDArray[np.float64], head_major: bool) -> Lanes:
    """:meth:`Digester._totals`'s sums as ``core.digest.finish`` takes them: ``[positions, heads, lanes]`` in
    ``[0, p)``."""
    lanes = np.remainder(total, PRIME).astype(np.int64)
    if head_major:
        lanes = lanes.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(lanes, dtype=np.int64).reshape(-1, lanes.shape[2], LANES)
