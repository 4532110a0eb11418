"""NIXL transport: registration with shared tensors, handles released idempotently, merged descriptors."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from kvbridge_agent.core import KVLayout, ModelGeometry, SpecError
from kvbridge_agent.transfer.descriptors import descriptor_rows
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.transport import Transport
from kvbridge_sim.support import wait_until

MODEL = ModelGeometry(name="m", num_layers=2, num_kv_heads=2, head_dim=8, kv_cache_dtype="float16")


def test_attach_deduplicates_shared_base_addresses() -> None:
    layout_bytes = 4 * 2 * 16 * 8 * 2  # num_blocks * heads * tokens * dim * elem
    k0, v0 = torch.zeros(layout_bytes // 2, dtype=torch.float16), torch.zeros(layout_bytes // 2, dtype=torch.float16)
    shared = [k0, v0, k0, v0]  # a hybrid allocator handing the same tensors to both layers
    cache = KVCache.attach(MODEL, 16, KVLayout.HND, 1, 0, 4, shared)
    assert cache.bases == [k0.data_ptr(), v0.data_ptr()]
    assert cache.layout.num_regions == 2


def test_attach_rejects_tensors_of_the_wrong_size() -> None:
    with pytest.raises(SpecError) as caught:
        KVCache.attach(MODEL, 16, KVLayout.HND, 1, 0, 4, [torch.zeros(10, dtype=torch.uint8)] * 4)
    assert caught.value.code == "INVALID_KV_TENSOR"


def _pair() -> tuple[Transport, Transport, KVCache, KVCache]:
    tag = uuid.uuid4().hex[:6]
    src, dst = Transport(f"src-{tag}"), Transport(f"dst-{tag}")
    a = KVCache.allocate(MODEL, 16, KVLayout.HND, 1, 0, 64)
    b = KVCache.allocate(MODEL, 16, KVLayout.HND, 1, 0, 64)
    for tensor in a.tensors:
        tensor.copy_(torch.randint(0, 255, tensor.shape, dtype=torch.uint8))
    src.register(a.tensors)
    dst.register(b.tensors)
    return src, dst, a, b


def test_read_with_notification_and_clean_close() -> None:
    src, dst, a, b = _pair()
    name = dst.add_peer(src.metadata())
    rows_remote = descriptor_rows(
        a.bases, a.layout, 64, units_per_block=1, offset=0, length=a.layout.unit_bytes, device_id=0
    )
    rows_local = descriptor_rows(
        b.bases, b.layout, 64, units_per_block=1, offset=0, length=b.layout.unit_bytes, device_id=0
    )
    assert rows_remote.shape == (4, 5)  # strided: one row per region
    remote, local = dst.prep(name, rows_remote, "DRAM"), dst.prep("", rows_local, "DRAM")
    ids = np.arange(4 * 64, dtype=np.int32)  # every block of every region, adjacent: NIXL merges them
    handle = dst.read(local, ids, remote, ids, b"req-1:1")
    notes: list[bytes] = []

    def finished() -> bool:
        for messages in src.notifications().values():
            notes.extend(messages)
        return dst.state(handle) != "PROC" and bool(notes)

    wait_until(finished, 10, "the READ to end and its notification to arrive", interval=0)
    assert dst.state(handle) == "DONE"
    assert notes == [b"req-1:1"]
    assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors, strict=True))
    assert dst.release(handle)
    assert dst.open_handles == 4  # one registration, two lists, one peer
    dst.close()
    dst.close()  # idempotent
    assert dst.open_handles == 0
    src.close()
    assert src.open_handles == 0


def test_blocks_first_sub_blocks_fall_back_to_explicit_rows() -> None:
    model = ModelGeometry(name="m", num_layers=2, num_kv_heads=2, head_dim=8, cache_kind="BlocksFirst")
    cache = KVCache.allocate(model, 16, KVLayout.HND, 1, 0, 4)
    rows = descriptor_rows(cache.bases, cache.layout, 4, units_per_block=2, offset=0, length=256, device_id=0)
    assert rows.shape == (2 * 2 * 4 * 2, 3)  # regions x blocks x sub-blocks, one row each
