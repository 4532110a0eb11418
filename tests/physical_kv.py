"""Position-tagged KV content in vLLM's physical layouts, shared by the host-memory proof
(tests/agent/vllm_connector/test_gpu_layouts.py, vLLM's own allocator) and the CUDA one
(tests/gpu/test_cuda_transfer.py, kvbridge's ``layout_views``, checked equal to vLLM's allocator on the host).

Every byte is a function of the logical layer, block, global head, token and content index, so a byte that lands
anywhere else shows.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvbridge_agent.core.handshake import RankMetadata
from kvbridge_agent.core.layout import PhysicalLayout, PhysicalOrder, dense_strides
from kvbridge_agent.transfer.allocations import layout_views

LAYERS, HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS = 3, 2, 64, 16, 24
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


class Rank(Protocol):
    """What tagging needs of one side: its kernel blocks per block, block size, and one rank's heads."""

    @property
    def ratio(self) -> int: ...

    @property
    def block(self) -> int: ...

    @property
    def heads(self) -> int: ...

    @property
    def tp(self) -> int: ...

    @property
    def model_heads(self) -> int: ...

    def first_head(self, rank: int) -> int: ...


def own_views(
    order: str, block: int, kernel: int | None, heads: int, mla: bool, device: str | torch.device
) -> dict[str, torch.Tensor]:
    """kvbridge's ``layout_views`` for the views vLLM's ``allocate_kv_cache`` builds for this small model (bf16; keys
    and values packed per token, or one latent for MLA; ``kernel``: each block split into kernel blocks)."""
    tokens = kernel or block
    content = HEAD_SIZE * 2 * (1 if mla else 2)
    layout = PhysicalLayout.dense(PhysicalOrder(order), LAYERS, NUM_BLOCKS * block // tokens, heads, tokens, content)
    return layout_views(layout, NAMES, torch.bfloat16, device)


def tag(
    layer: int, kernel_blocks: torch.Tensor, ratio: int, tokens: int, first_head: int, heads: int, width: int
) -> torch.Tensor:
    """Position-tagged content ``[len(kernel_blocks), heads, N, C]`` (int16 bit patterns) on ``kernel_blocks``'
    device. Kernel block ``k`` of ``tokens`` tokens is part ``k % ratio`` of block ``k // ratio``."""
    device = kernel_blocks.device
    k = kernel_blocks.view(-1, 1, 1, 1).to(torch.int64)
    b = k // ratio
    h = first_head + torch.arange(heads, device=device).view(1, -1, 1, 1)
    n = (k % ratio) * tokens + torch.arange(tokens, device=device).view(1, 1, -1, 1)
    c = torch.arange(width, device=device).view(1, 1, 1, -1)
    value = (layer * 7919 + b * 104729 + h * 1299709 + n * 15485863 + c * 32452843 + 12345) % 65521
    return (value - 32768).to(torch.int16)


def fill(views: dict[str, torch.Tensor], side: Rank, rank: int) -> None:
    """Tag every kernel block of every layer of one rank's views."""
    for layer, view in enumerate(views.values()):
        first, heads = side.first_head(rank), side.heads
        every = torch.arange(view.shape[0], device=view.device)
        view.view(torch.int16).copy_(tag(layer, every, side.ratio, view.shape[2], first, heads, view.shape[3]))


def tokens_of(views: dict[str, torch.Tensor], blocks: list[int], side: Rank) -> torch.Tensor:
    """What a rank's views hold for ``blocks``, in token order: ``[layers, tokens, heads, content]`` (int16)."""
    device = next(iter(views.values())).device
    ids = torch.tensor(blocks, device=device).view(-1, 1) * side.ratio
    kernels = (ids + torch.arange(side.ratio, device=device).view(1, -1)).view(-1)
    layers = []
    for view in views.values():
        held = view.view(torch.int16)[kernels]  # [kernel blocks, heads, kernel tokens, content]
        layers.append(held.permute(0, 2, 1, 3).reshape(len(blocks) * side.block, side.heads, -1))
    return torch.stack(layers)


def check_bytes(
    prefill: Rank,
    decode: Rank,
    prefill_views: list[dict[str, torch.Tensor]],
    decode_views: list[dict[str, torch.Tensor]],
    prefill_blocks: list[int],
    decode_blocks: list[int],
) -> None:
    """Every byte where decode's vLLM reads it — through each decode rank's own views — is the byte prefill's rank
    holding that head has at the same token; the request's blocks past what was read, and every other block, were
    not written."""
    tokens = min(len(prefill_blocks) * prefill.block, len(decode_blocks) * decode.block)
    computed = torch.cat(
        [
            tokens_of(views, prefill_blocks, prefill)
            for views in prefill_views[:: max(1, prefill.tp // prefill.model_heads)]
        ],
        dim=2,
    )  # every global head once: [layers, tokens, heads, content]
    for rank, views in enumerate(decode_views):
        got = tokens_of(views, decode_blocks, decode)
        first = decode.first_head(rank)
        expected = computed[:, :tokens, first : first + decode.heads]
        for layer in range(LAYERS):
            assert torch.equal(got[layer, :tokens], expected[layer]), f"layer {layer} differs (decode rank {rank})"
        assert not got[:, tokens:].any(), f"decode rank {rank}: tokens past the read were written"
        read = set(
            (torch.tensor(decode_blocks).view(-1, 1) * decode.ratio + torch.arange(decode.ratio)).view(-1).tolist()
        )
        untouched = torch.tensor(sorted(set(range(NUM_BLOCKS * decode.ratio)) - read), device=got.device)
        for view in views.values():
            assert not view.view(torch.int16)[untouched].any(), f"decode rank {rank}: a block outside was written"


def lying(meta: RankMetadata) -> RankMetadata:
    """A prefill rank's metadata with its heads' and tokens' strides exchanged: decode then reads each byte as if it
    lay elsewhere (the negative control: only the digest can tell)."""
    layout = meta.physical_layout
    if layout is None:
        raise ValueError("a rank without a physical layout")
    order = {"LBHNC": "LBNHC", "LBNHC": "LBHNC", "BLHNC": "BLNHC", "BLNHC": "BLHNC"}[layout.order.value]
    strides = list(layout.strides)
    strides[2], strides[3] = dense_strides(PhysicalOrder(order), layout.shape)[2:4]
    lie = PhysicalLayout(order=PhysicalOrder(order), shape=layout.shape, strides=tuple(strides))
    return meta.model_copy(update={"physical_layout": lie})
