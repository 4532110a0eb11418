"""Registration from views (transfer.allocations): allocations deduplicated by base and extent, strides checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge_agent.core import SpecError
from kvbridge_agent.core.layout import PhysicalLayout, PhysicalOrder, dense_strides
from kvbridge_agent.transfer.allocations import describe_views, distinct_allocations

SHAPE = (3, 5, 2, 4, 16)  # L, B, H, N, C bytes
ELEMENT = 2


def views_of(order: PhysicalOrder, offset: int = 0, raw: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-layer ``[B, H, N, C]`` bf16 views of one int8 allocation, as vLLM's allocator makes them."""
    strides = dense_strides(order, SHAPE)
    extent = sum((s - 1) * st for s, st in zip(SHAPE, strides, strict=True)) + 1
    raw = torch.zeros(offset + extent, dtype=torch.int8) if raw is None else raw
    blocks, heads, tokens, content = SHAPE[1:]
    views = {}
    for layer in range(SHAPE[0]):
        view = torch.as_strided(raw, (blocks, heads, tokens, content), strides[1:], offset + layer * strides[0]).view(
            torch.bfloat16
        )
        views[f"layer.{layer}"] = view
    return views


@pytest.mark.parametrize("order", list(PhysicalOrder))
def test_views_of_one_allocation_are_one_registration_with_their_layout(order: PhysicalOrder) -> None:
    views = views_of(order, offset=64)
    described = describe_views(views, order)
    assert len(described.allocations) == 1
    allocation = described.allocations[0]
    first = next(iter(views.values()))
    assert (allocation.base, allocation.nbytes) == (
        first.untyped_storage().data_ptr(),
        first.untyped_storage().nbytes(),
    )
    assert allocation.tensor.data_ptr() == allocation.base
    assert allocation.tensor.numel() == allocation.nbytes
    assert described.origin == 64
    assert described.physical == PhysicalLayout(order=order, shape=SHAPE, strides=dense_strides(order, SHAPE))


def test_storages_at_one_address_with_different_extents_stay_two() -> None:
    buffer = np.zeros(4096, dtype=np.uint8)
    whole, head = torch.from_numpy(buffer), torch.from_numpy(buffer[:1024])
    assert whole.data_ptr() == head.data_ptr()
    found = distinct_allocations({"a": whole, "b": head, "c": whole[8:]})
    assert [(a.base, a.nbytes) for a in found] == [(whole.data_ptr(), 4096), (whole.data_ptr(), 1024)]


def test_views_that_contradict_the_declared_layout_are_refused() -> None:
    with pytest.raises(SpecError) as caught:
        describe_views(views_of(PhysicalOrder.LBHNC), PhysicalOrder.BLHNC)
    assert caught.value.code == "KV_VIEW_LAYOUT_MISMATCH"
    assert caught.value.field == "kv_cache_layout"
    assert "BLHNC" in caught.value.message


def test_layers_not_a_constant_stride_apart_are_refused() -> None:
    views = views_of(PhysicalOrder.LBHNC)
    names = list(views)
    shuffled = {names[0]: views[names[0]], names[2]: views[names[2]], names[1]: views[names[1]]}
    with pytest.raises(SpecError) as caught:
        describe_views(shuffled, PhysicalOrder.LBHNC)
    assert caught.value.code == "KV_VIEW_LAYOUT_MISMATCH"
    assert caught.value.field == f"kv_caches[{names[1]}]"


def test_views_in_two_allocations_are_refused() -> None:
    views = views_of(PhysicalOrder.LBHNC)
    other = views_of(PhysicalOrder.LBHNC)
    views["layer.2"] = other["layer.2"]
    with pytest.raises(SpecError) as caught:
        describe_views(views, PhysicalOrder.LBHNC)
    assert caught.value.code == "KV_VIEW_LAYOUT_MISMATCH"
    assert caught.value.field == "kv_caches[layer.2]"


def test_views_of_another_shape_or_a_strided_content_axis_are_refused() -> None:
    views = views_of(PhysicalOrder.LBHNC)
    views["layer.1"] = views["layer.1"][:, :1]
    with pytest.raises(SpecError) as caught:
        describe_views(views, PhysicalOrder.LBHNC)
    assert (caught.value.code, caught.value.field) == ("KV_VIEW_INVALID", "kv_caches[layer.1]")
    strided = {"layer.0": torch.zeros(4, 2, 4, 16, dtype=torch.bfloat16)[..., ::2]}
    with pytest.raises(SpecError, match="contiguous"):
        describe_views(strided, PhysicalOrder.LBHNC)
    with pytest.raises(SpecError) as caught:
        describe_views({}, PhysicalOrder.LBHNC)
    assert caught.value.field == "kv_caches"
