"""A host buffer for nodes without GPUDirect RDMA (vLLM's ``kv_buffer_device: cpu``).

NIXL registers a host mirror of the engine's cache — the same physical layout at the same strides, in host memory
(pinned when the cache is on a GPU) — and kvbridge moves blocks between the engine's cache and the mirror around each
transfer: prefill copies a request's blocks in before it offers them, decode copies the blocks it read out before it
verifies them. The plan, the descriptors and the side channel are those of the mirror; the digest reads the engine's
cache (prefill's before the copy, decode's after it), so verification covers both copies.

On CUDA the copies run on the current stream and :class:`HostBuffer` returns only after that stream finished them,
so no block is offered before its bytes are in the mirror, and none is used before they are in the engine's cache.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvbridge_agent.core import Role, SpecError, TransferPlan
from kvbridge_agent.core.layout import kernel_blocks
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.kv_view import physical_view


class HostBuffer:
    """The engine's cache and its host mirror; called as the ranks' converter (:data:`.relayout.Converter`) with the
    mirror and a request's blocks: prefill copies engine -> mirror, decode mirror -> engine."""

    def __init__(self, engine: KVCache) -> None:
        physical = engine.physical
        if physical is None:
            raise SpecError(
                "a host buffer mirrors a cache attached from views", field="kv_caches", code="KV_VIEW_INVALID"
            )
        pinned = engine.tensors[0].is_cuda
        host = torch.zeros(physical.extent, dtype=torch.uint8, pin_memory=pinned)
        self.engine = engine
        self.mirror = dataclasses.replace(engine, tensors=[host], origin=0)
        self._engine_layers = [physical_view(engine, layer) for layer in range(physical.num_layers)]
        self._mirror_layers = [physical_view(self.mirror, layer) for layer in range(physical.num_layers)]
        self.copies = 0  # requests copied, both ways

    def __call__(self, cache: KVCache, plan: TransferPlan, side: Role, block_ids: list[int]) -> bool:
        if cache is not self.mirror:
            raise SpecError("the host buffer was handed another cache", field="kv_caches", code="KV_VIEW_INVALID")
        if not block_ids:
            return False
        kernels = kernel_blocks(np.asarray(block_ids, dtype=np.int64), self.engine.kernel_ratio)
        on_host = torch.from_numpy(kernels)
        on_engine = on_host.to(self.engine.tensors[0].device)
        pairs = zip(self._engine_layers, self._mirror_layers, strict=True)
        if side is Role.PREFILL:
            for engine, mirror in pairs:
                mirror[on_host] = engine[on_engine].to("cpu")  # waits for the gather: the bytes are read here
        else:
            for engine, mirror in pairs:
                engine[on_engine] = mirror[on_host].to(engine.device, non_blocking=True)
        finish(self.engine.tensors[0])
        self.copies += 1
        return True


def finish(tensor: torch.Tensor) -> None:
    """Wait for the copies queued on the current stream of ``tensor``'s device (nothing to wait for on the host)."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
