"""One TP rank's KV cache as torch tensors, in the tensor order the core's geometry expects — or, for an engine
that hands strided views of one allocation (vLLM's ``KVCacheLayout``), the allocation and its physical layout."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvbridge_agent.core import KVLayout, ModelGeometry, RegionLayout, SpecError, region_layout
from kvbridge_agent.core.geometry import heads_local
from kvbridge_agent.core.handshake import MemoryType
from kvbridge_agent.core.layout import PhysicalLayout, PhysicalOrder, block_runs, run_regions
from kvbridge_agent.core.model import CacheKind
from kvbridge_agent.transfer.allocations import ViewedCache, describe_groups, describe_views

#: a physical-layout cache the connector cannot serve yet (stable code, docs/troubleshooting.md)
LAYOUT_UNSUPPORTED = "LAYOUT_UNSUPPORTED"


def overlaid_groups(
    views: Mapping[str, torch.Tensor], groups: Sequence[Sequence[str]], order: PhysicalOrder
) -> ViewedCache:
    """A hybrid model's cache groups as vLLM allocates them: every group the deepest group's layout at the same
    origin of one allocation (a block id then belongs to one group), a group vLLM padded being that layout's first
    layers (core.cache_groups); anything else is refused."""
    try:
        described = describe_groups([{name: views[name] for name in group} for group in groups], order)
    except KeyError as exc:
        raise SpecError(
            f"cache group layer {exc} has no KV view", field="kv_cache_config", code="INVALID_KV_TENSOR"
        ) from exc
    deepest = max(described.groups, key=lambda g: g.physical.num_layers)
    if len(described.allocations) != 1 or not all(overlays(g, deepest) for g in described.groups):
        depths = sorted({g.physical.num_layers for g in described.groups})
        raise SpecError(
            f"{len(groups)} KV cache groups of {depths} layers in {len(described.allocations)} allocation(s), with "
            f"layouts {sorted({g.physical.order.value for g in described.groups})}: kvbridge moves groups that "
            "overlay one another (one layout, one origin, one allocation; a padded group the first layers of it), "
            "as vLLM's hybrid allocator lays them out in every layout but BHLNC, whose head stride grows with a "
            "group's layers: run such a model with a layer-outer layout (kvLayout HND or NHD, cache kind Split)",
            field="kv_cache_config",
            code=LAYOUT_UNSUPPORTED,
        )
    return deepest


def overlays(group: ViewedCache, deepest: ViewedCache) -> bool:
    """``group`` is the first layers of ``deepest``: the same origin, order, shape but for fewer layers, and strides
    (an axis of one element has none that matters: a one-layer group's views do not show its layer stride)."""
    mine, theirs = group.physical, deepest.physical
    return (
        group.origin == deepest.origin
        and mine.order is theirs.order
        and mine.num_layers <= theirs.num_layers
        and mine.shape[1:] == theirs.shape[1:]
        and all(size == 1 or a == b for size, a, b in zip(mine.shape, mine.strides, theirs.strides, strict=True))
    )


def distinct_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Keep the first tensor of each base address (engines that share a tensor hand it several times)."""
    seen: set[int] = set()
    kept: list[torch.Tensor] = []
    for tensor in tensors:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            kept.append(tensor)
    return kept


@dataclass
class KVCache:
    """The tensors of one rank; each is ``num_blocks`` blocks of ``layout.block_stride`` bytes."""

    model: ModelGeometry
    block_size: int
    kv_layout: KVLayout
    tp_size: int
    tp_rank: int
    num_blocks: int
    tensors: list[torch.Tensor]
    layout: RegionLayout
    #: for a cache attached from views (:meth:`attach_views`): its physical layout, whose logical
    #: ``(0, 0, 0, 0, 0)`` lies ``origin`` bytes into ``tensors[0]`` (the allocation); ``layout`` then numbers
    #: the layout's own runs of a block as regions
    physical: PhysicalLayout | None = None
    origin: int = 0
    #: kernel blocks per block (vLLM's kernel block size below the block size): the physical layout's blocks are
    #: kernel blocks, block ``b`` is kernel blocks ``b*ratio + j``
    kernel_ratio: int = 1

    @classmethod
    def attach(
        cls,
        model: ModelGeometry,
        block_size: int,
        kv_layout: KVLayout,
        tp_size: int,
        tp_rank: int,
        num_blocks: int,
        tensors: Sequence[torch.Tensor],
    ) -> KVCache:
        """Use an engine's own cache tensors (any dtype), deduplicating shared base addresses."""
        kept = distinct_tensors(tensors)
        default = region_layout(model, block_size, tp_size)
        layout = (
            default
            if len(kept) == default.num_tensors
            else region_layout(model, block_size, tp_size, num_tensors=len(kept))
        )
        want = num_blocks * layout.block_stride
        for index, tensor in enumerate(kept):
            if not tensor.is_contiguous():
                raise SpecError(f"KV tensor {index} is not contiguous", field="tensors", code="INVALID_KV_TENSOR")
            have = tensor.numel() * tensor.element_size()
            if have != want:
                raise SpecError(
                    f"KV tensor {index} holds {have} bytes; {num_blocks} blocks of {layout.block_stride} bytes "
                    f"need {want}",
                    field="tensors",
                    code="INVALID_KV_TENSOR",
                )
        if len({t.device for t in kept}) != 1:
            raise SpecError("KV tensors live on different devices", field="tensors", code="INVALID_KV_TENSOR")
        return cls(model, block_size, kv_layout, tp_size, tp_rank, num_blocks, kept, layout)

    @classmethod
    def attach_views(
        cls,
        model: ModelGeometry,
        block_size: int,
        tp_size: int,
        tp_rank: int,
        views: Mapping[str, torch.Tensor],
        order: PhysicalOrder,
        groups: Sequence[Sequence[str]] | None = None,
    ) -> KVCache:
        """Use an engine's per-layer ``[B, H, N, C]`` views of one allocation, laid out as ``order`` declares
        (vLLM's resolved ``KVCacheLayout``): the allocation is registered once, the bytes addressed by strides.
        With ``groups`` (a hybrid model's cache groups, each its layer names in layer order) the groups must overlay
        each other — one layout, one origin — and the cache is that layout, one group's layers deep
        (core.cache_groups)."""
        if groups is None:
            viewed = describe_views(views, order)
        else:
            viewed = overlaid_groups(views, groups, order)
            layers = sum(len(group) for group in groups)
            if layers != model.num_layers:
                raise SpecError(
                    f"vLLM's {len(groups)} KV cache groups hold {layers} layers, the model geometry says "
                    f"{model.num_layers}",
                    field="spec.model.numLayers",
                    code="INVALID_KV_TENSOR",
                )
            model = model.model_copy(update={"num_layers": viewed.physical.num_layers})
        physical = viewed.physical
        wanted = (
            ("spec.model.numLayers", physical.num_layers, model.num_layers, "layers"),
            ("spec.model.numKVHeads", physical.num_heads, heads_local(model, tp_size), "KV heads on this rank"),
            # a token's keys then its values; MLA's single latent
            ("kv_caches.content", physical.content_bytes, model.token_bytes_per_head, "content bytes per token"),
        )
        for field, have, want, what in wanted:
            if have != want:
                raise SpecError(
                    f"vLLM's views hold {have} {what}, the model geometry says {want}: the contract's model "
                    "(layers, KV heads, head dimension, dtype) must be the one vLLM serves",
                    field=field,
                    code="INVALID_KV_TENSOR",
                )
        ratio = block_size // physical.block_size
        if block_size % physical.block_size or physical.num_blocks % ratio:
            raise SpecError(
                f"vLLM's views hold {physical.num_blocks} kernel blocks of {physical.block_size} tokens, which do not "
                f"split {block_size}-token blocks evenly",
                field="spec.blockSize",
                code=LAYOUT_UNSUPPORTED,
            )
        allocation = viewed.allocations[0]
        tensors = [allocation.tensor]
        layout = run_regions(block_runs(physical))
        return cls(
            model=model,
            block_size=block_size,
            kv_layout=KVLayout.HND,
            tp_size=tp_size,
            tp_rank=tp_rank,
            num_blocks=physical.num_blocks // ratio,
            tensors=tensors,
            layout=layout,
            physical=physical,
            origin=viewed.origin,
            kernel_ratio=ratio,
        )

    @classmethod
    def allocate(
        cls,
        model: ModelGeometry,
        block_size: int,
        kv_layout: KVLayout,
        tp_size: int,
        tp_rank: int,
        num_blocks: int,
        device: str = "cpu",
    ) -> KVCache:
        """Allocate a zeroed cache of the shape the cache kind defines (the synthetic engine's)."""
        layout = region_layout(model, block_size, tp_size)
        size = num_blocks * layout.block_stride
        tensors = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(layout.num_tensors)]
        return cls(model, block_size, kv_layout, tp_size, tp_rank, num_blocks, tensors, layout)

    @property
    def bases(self) -> list[int]:
        """Where the regions' offsets count from: each tensor's start (a physical layout's logical origin)."""
        if self.physical is not None:
            return [self.tensors[0].data_ptr() + self.origin]
        return [t.data_ptr() for t in self.tensors]

    @property
    def memory_type(self) -> MemoryType:
        return MemoryType.VRAM if self.tensors[0].is_cuda else MemoryType.DRAM

    @property
    def device_id(self) -> int:
        index = self.tensors[0].device.index
        return 0 if index is None else index

    @property
    def heads_local(self) -> int:
        return heads_local(self.model, self.tp_size)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token of one head."""
        return self.model.head_dim * self.model.element_bytes

    def bytes_view(self, tensor_index: int) -> torch.Tensor:
        """Tensor ``tensor_index`` as ``[num_blocks, block_stride]`` bytes."""
        return self.tensors[tensor_index].view(torch.uint8).view(self.num_blocks, self.layout.block_stride)

    @property
    def per_layer_tensors(self) -> bool:
        """True when tensors are one per layer (and K/V) as the cache kind defines, not shared."""
        return self.layout.num_tensors == region_layout(self.model, self.block_size, self.tp_size).num_tensors

    @property
    def kv_count(self) -> int:
        return 1 if self.model.is_mla else 2

    @property
    def cross_layer(self) -> bool:
        return self.model.cache_kind is CacheKind.CROSS_LAYER and not self.model.is_mla
