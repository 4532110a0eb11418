"""VRAM variants of the transfer tests (docs/protocol.md on GPUs): run on a CUDA machine, skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from kvbridge_agent.core import CacheKind, KVLayout, ModelGeometry, RoleSettings
from kvbridge_agent.core.digest import new_key
from kvbridge_agent.core.handshake import MemoryType

from .harness import InProcessPair

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def role(tp: int, bs: int = 16, layout: str = "HND") -> RoleSettings:
    return RoleSettings(tensor_parallel_size=tp, block_size=bs, kv_layout=KVLayout(layout))


@pytest.mark.parametrize(
    ("kind", "prefill", "decode"),
    [
        (CacheKind.SPLIT, role(2), role(1)),
        (CacheKind.SPLIT, role(1, 8), role(2, 16)),
        (CacheKind.SPLIT, role(2, 32, "NHD"), role(1, 16, "HND")),
        (CacheKind.BLOCKS_FIRST, role(1), role(2, 16, "NHD")),
        (CacheKind.CROSS_LAYER, role(2), role(1)),
    ],
)
def test_vram_transfers_verify(kind: CacheKind, prefill: RoleSettings, decode: RoleSettings) -> None:
    model = ModelGeometry(name="gpu", num_layers=2, num_kv_heads=8, head_dim=64, cache_kind=kind)
    pair = InProcessPair(model, prefill, decode, device="cuda")
    try:
        assert pair.decode[0].cache.memory_type is MemoryType.VRAM
        pair.roundtrip("gpu-partial", 3 * 32 + 5, 0)
        pair.roundtrip("gpu-hit", 3 * 32 + 5, 2, offset=3)
    finally:
        pair.close()


@pytest.mark.parametrize("kind", [CacheKind.SPLIT, CacheKind.BLOCKS_FIRST, CacheKind.CROSS_LAYER])
def test_the_digest_runs_on_the_device_and_equals_the_cpu_one(kind: CacheKind) -> None:
    """Transfer verification's torch form on VRAM (docs/protocol.md §8): computed where the cache lives, the same
    values as on the CPU (the compiled pass and torch's), and a verified transfer between two GPU caches passes."""
    from kvbridge_agent.transfer.digest import Digester
    from kvbridge_agent.transfer.kv_cache import KVCache

    model = ModelGeometry(name="gpu", num_layers=2, num_kv_heads=8, head_dim=64, cache_kind=kind)
    gpu = KVCache.allocate(model, 16, KVLayout.HND, 1, 0, 16, device="cuda")
    for tensor in gpu.tensors:
        tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8, device="cuda"))
    cpu = KVCache(gpu.model, 16, KVLayout.HND, 1, 0, 16, [t.cpu() for t in gpu.tensors], gpu.layout)
    ids, key = [3, 9, 4], new_key()
    on_gpu = Digester(gpu).request(key, ids, 40, 16)
    assert (on_gpu == Digester(cpu).request(key, ids, 40, 16)).all()
    assert (on_gpu == Digester(cpu, compiled_cpu=False).request(key, ids, 40, 16)).all()
    pair = InProcessPair(model, role(2), role(1), device="cuda")
    try:
        params = pair.offer("gpu-verified", 45, [1, 5, 7], digest=True)
        result = pair.read(params, [2, 6, 8], 0, verify=True)[0]
        assert result.ok, result
    finally:
        pair.close()
