"""The allocations behind an engine's KV views, and the physical layout those views declare.

vLLM (0.32) allocates a cache group as one backing allocation and hands the connector one strided ``[B, H, N, C]``
view per layer (``C`` in the cache's dtype, keys then values): layer ``l`` of block ``b`` starts at
``origin + l * layer_stride + b * block_stride``. :func:`describe_views` derives from the views alone — their
``data_ptr()``, strides, shape and storage (``untyped_storage().data_ptr()`` and ``nbytes()``) — what kvbridge
registers with NIXL and how it addresses the bytes:

- the distinct allocations, deduplicated by base address *and* extent: views of one allocation are one
  registration, while two storages that start at the same address but end elsewhere stay two;
- the :class:`~kvbridge_agent.core.layout.PhysicalLayout` (byte strides over ``[L, B, H, N, C]``) and its origin in
  the allocation, checked against the layout the engine declares;
- for a hybrid model, whose cache groups overlay each other in one allocation (their layers' views may share a
  ``data_ptr()``: layer 0 of one group and layer 0 of the next), one layout per group over the allocations of all
  groups, each registered once (:func:`describe_groups`).

A view that contradicts the declared layout, or a set of views kvbridge cannot address as one layout, is a
:class:`~kvbridge_agent.core.SpecError` with a stable code, the view at fault and what to change.

:func:`layout_views` goes the other way: a new allocation viewed per layer as a layout lays it out — the views vLLM's
``allocate_kv_cache`` builds for one cache group (the tests check them equal, stride for stride), for a machine
without vLLM (a GPU benchmark or test host) and for benchmarks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvbridge_agent.core import SpecError
from kvbridge_agent.core.layout import PhysicalLayout, PhysicalOrder

# Stable error codes of view registration (documented in docs/troubleshooting.md).
KV_VIEW_INVALID = "KV_VIEW_INVALID"
KV_VIEW_LAYOUT_MISMATCH = "KV_VIEW_LAYOUT_MISMATCH"
KV_VIEW_OUT_OF_BOUNDS = "KV_VIEW_OUT_OF_BOUNDS"


@dataclass(frozen=True, slots=True)
class Allocation:
    """One backing allocation: its base address and size in bytes, and a byte tensor over all of it."""

    base: int
    nbytes: int
    tensor: torch.Tensor


@dataclass(frozen=True, slots=True)
class ViewedCache:
    """What a set of views describes: the allocations to register and the layout of the bytes in the first."""

    allocations: tuple[Allocation, ...]
    physical: PhysicalLayout
    #: byte offset of logical ``(0, 0, 0, 0, 0)`` from the base of ``allocations[0]``
    origin: int
    dtype: torch.dtype

    @property
    def address(self) -> int:
        """The address of logical ``(0, 0, 0, 0, 0)``."""
        return self.allocations[0].base + self.origin


def storage_tensor(view: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage behind ``view`` (what NIXL registers)."""
    storage = view.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8, device=view.device)
    return whole.set_(storage, 0, (storage.nbytes(),), (1,))


def distinct_allocations(views: Mapping[str, torch.Tensor]) -> tuple[Allocation, ...]:
    """The storages behind ``views`` in first-seen order, one per (base address, extent)."""
    found: dict[tuple[int, int], Allocation] = {}
    for view in views.values():
        storage = view.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in found:
            found[key] = Allocation(key[0], key[1], storage_tensor(view))
    return tuple(found.values())


def _refuse(message: str, name: str, code: str = KV_VIEW_INVALID) -> SpecError:
    return SpecError(message, field=f"kv_caches[{name}]", code=code)


def describe_views(views: Mapping[str, torch.Tensor], order: PhysicalOrder) -> ViewedCache:
    """The allocations and the physical layout of one cache group's per-layer views (in layer order), which the
    engine declares to be laid out in ``order``."""
    if not views:
        raise SpecError("the engine handed no KV cache views", field="kv_caches", code=KV_VIEW_INVALID)
    names = list(views)
    first = views[names[0]]
    element = first.element_size()
    for name, view in views.items():
        if view.dim() != 4:
            raise _refuse(f"a view of shape {tuple(view.shape)}; kvbridge reads [blocks, heads, tokens, content]", name)
        alike = (view.shape, view.stride(), view.dtype, view.device)
        if alike != (first.shape, first.stride(), first.dtype, first.device):
            raise _refuse(
                f"shape {tuple(view.shape)}, strides {view.stride()}, {view.dtype} on {view.device} differ from the "
                f"first layer's {tuple(first.shape)}, {first.stride()}, {first.dtype} on {first.device}: one cache "
                "group's layers must be alike (a second group, as hybrid models have, is not supported yet)",
                name,
            )
        if view.stride(3) != 1:
            raise _refuse(f"the content axis has stride {view.stride(3)}; it must be contiguous", name)
    allocations = distinct_allocations(views)
    home = first.untyped_storage()
    for name, view in views.items():
        storage = view.untyped_storage()
        if (storage.data_ptr(), storage.nbytes()) != (home.data_ptr(), home.nbytes()):
            raise _refuse(
                f"lives in an allocation of {storage.nbytes()} bytes at {storage.data_ptr():#x}, the first layer in "
                f"one of {home.nbytes()} bytes at {home.data_ptr():#x}: a layout addresses one allocation",
                name,
                KV_VIEW_LAYOUT_MISMATCH,
            )
    starts = [view.data_ptr() for view in views.values()]
    layers = len(starts)
    blocks, heads, tokens, content = (int(size) for size in first.shape)
    strides = [s * element for s in first.stride()]
    layer_stride = starts[1] - starts[0] if layers > 1 else blocks * strides[0]
    for index, start in enumerate(starts):
        if start - starts[0] != index * layer_stride or (layers > 1 and layer_stride <= 0):
            raise _refuse(
                f"layer {index} starts {start - starts[0]} bytes after layer 0; {order.value} views of one group "
                f"start a constant stride apart ({layer_stride} bytes from layer 0 to 1)",
                names[index],
                KV_VIEW_LAYOUT_MISMATCH,
            )
    shape = (layers, blocks, heads, tokens, content * element)
    try:
        physical = PhysicalLayout(
            order=order, shape=shape, strides=(layer_stride, strides[0], strides[1], strides[2], 1)
        )
    except SpecError as exc:
        raise SpecError(
            f"the views are not laid out as the declared {order.value}: {exc.message}. Hand kvbridge the layout "
            "vLLM resolved for this cache (KVCacheConfig.kv_cache_layout)",
            field="kv_cache_layout",
            code=KV_VIEW_LAYOUT_MISMATCH,
        ) from exc
    origin = starts[0] - home.data_ptr()
    if origin < 0 or origin + physical.extent > home.nbytes():
        raise _refuse(
            f"the views reach bytes [{origin}, {origin + physical.extent}) of an allocation of {home.nbytes()}",
            names[0],
            KV_VIEW_OUT_OF_BOUNDS,
        )
    return ViewedCache(allocations, physical, origin, first.dtype)


@dataclass(frozen=True, slots=True)
class ViewedGroups:
    """Several cache groups' views: every allocation once, and each group's layout and origin in its allocation."""

    allocations: tuple[Allocation, ...]
    groups: tuple[ViewedCache, ...]
    #: per group, the index in ``allocations`` of the allocation its layout addresses
    homes: tuple[int, ...]


def describe_groups(groups: Sequence[Mapping[str, torch.Tensor]], order: PhysicalOrder) -> ViewedGroups:
    """:func:`describe_views` for each cache group (its layers in layer order), the allocations deduplicated over
    all groups by base address and extent: overlaid groups are one registration."""
    described = [describe_views(views, order) for views in groups]
    every = {f"{index}/{name}": view for index, views in enumerate(groups) for name, view in views.items()}
    allocations = distinct_allocations(every)
    keys = [(allocation.base, allocation.nbytes) for allocation in allocations]
    homes = tuple(keys.index((group.allocations[0].base, group.allocations[0].nbytes)) for group in described)
    return ViewedGroups(allocations, tuple(described), homes)


def layout_views(
    layout: PhysicalLayout, names: Sequence[str], dtype: torch.dtype, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """One zeroed allocation of ``layout``'s extent on ``device``, viewed per layer (``names``, one per layer of
    ``layout``) as ``[B, H, N, C]`` in ``dtype``: layer ``l`` starts at ``l * layer_stride``."""
    element = torch.empty(0, dtype=dtype).element_size()
    layers, blocks, heads, tokens, content = layout.shape
    if len(names) != layers or content % element:
        raise SpecError(
            f"{len(names)} layer names for {layers} layers, or {content}-byte content that is not whole {dtype}",
            field="layout",
            code=KV_VIEW_INVALID,
        )
    raw = torch.zeros(layout.extent, dtype=torch.int8, device=device)
    shape, strides = (blocks, heads, tokens, content), layout.strides[1:]
    return {
        name: torch.as_strided(raw, shape, strides, layer * layout.strides[0]).view(dtype)
        for layer, name in enumerate(names)
    }
