"""Block-size conversions for vLLM's CPU attention cache, whose block interior is not plain HND.

Inside a block of one layer, for each local head: its keys, then its values, each ``tokens * head_dim`` elements,
in an order that depends on the kernel vLLM picked — measured with vLLM's own cache-write kernel
(tests/vllm/test_cpu_attention_layout.py):

- ``vec``, ``vec16`` (CPUs without AMX, a model dtype other than bfloat16, or head_dim not a multiple of 32):
  keys dimension-major (``[head_dim, tokens]``), values token-major (``[tokens, head_dim]``).
- ``amx`` (CPUs with AMX, a bfloat16 model, head_dim a multiple of 32): the tiles' VNNI order. Keys in groups
  of 16 tokens, each group's dimensions in pairs (``[tokens/16, head_dim/2, 16, 2]``); values in groups of 16
  dimensions, tokens in pairs (``[head_dim/16, tokens/2, 16, 2]``).

A wire block of ``bs_w`` tokens has the interior of its kernel. Decode merges ``r`` received wire blocks into one
native block, prefill splits a native block into ``r`` wire blocks, the exact inverse: for ``vec``, keys: for every
dimension, the tokens of block 0, then block 1, ...; values: the blocks' token rows in order. For ``amx``, keys: the
blocks' token groups in order; values: for every group of dimensions, the token pairs of block 0, then block 1, ....
Each is one gather per call on the cache's own memory (torch views, no Python loop over blocks).
"""

from __future__ import annotations

import torch

from kvbridge_agent.core import Role, SpecError, TransferPlan
from kvbridge_agent.core.wire import ConversionKind
from kvbridge_agent.transfer.kv_cache import KVCache

#: the CPU attention kernels whose block interior this module knows
KNOWN_KERNELS = ("vec", "vec16", "amx")
#: the AMX kernel's tile rows: keys are grouped by this many tokens, values by this many dimensions
AMX_ROWS = 16
#: the AMX kernel's VNNI pairs: two dimensions of a key, two tokens of a value, side by side
AMX_PAIR = 2
_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


class CPUAttentionBlocks:
    """A :data:`~kvbridge_agent.transfer.relayout.Converter` for one rank's CPU attention cache."""

    def __init__(self, heads: int, head_dim: int, element_bytes: int, kernel: str) -> None:
        self.heads, self.head_dim, self.kernel = heads, head_dim, kernel
        self.element = _INTEGER_OF_SIZE[element_bytes]
        self.amx = kernel == "amx"
        #: the digest may read the blocks where they lie (keys dimension-major, values token-major, 16-bit units)
        self.keys_across = not self.amx and element_bytes == 2
        if self.amx and head_dim % (2 * AMX_ROWS):  # vLLM 0.32 runs vec16 there; measured only for multiples of 32
            raise SpecError(
                f"vLLM's AMX attention kernel with head_dim {head_dim}: kvbridge knows its block interior only for a "
                f"head_dim that is a multiple of {2 * AMX_ROWS}",
                field="spec.model.headDim",
                code="CONNECTOR_UNSUPPORTED",
            )

    def __call__(self, cache: KVCache, plan: TransferPlan, side: Role, block_ids: list[int]) -> bool:
        steps = plan.wire.steps(side)
        if not steps or not block_ids:
            return False
        if any(step.kind is ConversionKind.PERMUTE for step in steps) or self.kernel not in KNOWN_KERNELS:
            raise SpecError(
                f"{side.value} would {', '.join(s.kind.value for s in steps)} on vLLM's CPU attention cache "
                f"(kernel {self.kernel}), whose block interior kvbridge knows only for {', '.join(KNOWN_KERNELS)} "
                "and only between block sizes",
                field="spec.decode.blockSize",
                code="CONNECTOR_UNSUPPORTED",
            )
        ids = torch.tensor(block_ids, dtype=torch.int64)
        wire = plan.wire.block_size
        for index in range(len(cache.tensors)):
            view = cache.bytes_view(index).view(self.element).view(cache.num_blocks, -1)
            blocks = view[ids]
            if side is Role.DECODE:
                view[ids] = self._merge(blocks, plan.block_size_ratio, wire)
            else:
                view[ids] = self._split(blocks, plan.split_ratio, wire)
        return True

    def logical(self, cache: KVCache, block_ids: torch.Tensor, layer: int) -> torch.Tensor:
        """The blocks of one layer as the transfer digest reads any cache: ``[blocks, kv, tokens, heads, row
        bytes]`` (keys back to token-major), whatever the block size (kvbridge_agent.transfer.digest)."""
        h, d, t = self.heads, self.head_dim, cache.block_size
        x = torch.index_select(cache.bytes_view(layer).view(self.element), 0, block_ids).view(-1, h, 2, d * t)
        n = x.shape[0]
        if self.amx:  # [n, heads, tokens, dim] from the tiles' groups and pairs
            r, p = AMX_ROWS, AMX_PAIR
            keys = x[:, :, 0].reshape(n, h, t // r, d // p, r, p).permute(0, 1, 2, 4, 3, 5).reshape(n, h, t, d)
            values = x[:, :, 1].reshape(n, h, d // r, t // p, r, p).permute(0, 1, 3, 5, 2, 4).reshape(n, h, t, d)
        else:
            keys = x[:, :, 0].reshape(n, h, d, t).transpose(-1, -2)  # [n, heads, tokens, dim]
            values = x[:, :, 1].reshape(n, h, t, d)
        logical = torch.stack((keys, values), dim=1).permute(0, 1, 3, 2, 4).contiguous()  # [n, kv, tokens, heads, d]
        return logical.view(torch.uint8)

    def _merge(self, x: torch.Tensor, ratio: int, tokens: int) -> torch.Tensor:
        n, h, d = x.shape[0], self.heads, self.head_dim
        parts = x.view(n, ratio, h, 2, tokens * d)
        if self.amx:  # keys: the blocks' token groups in order; values: per group of dimensions, block after block
            keys = parts[:, :, :, 0].permute(0, 2, 1, 3).reshape(n, h, -1)
            groups = d // AMX_ROWS
            values = parts[:, :, :, 1].reshape(n, ratio, h, groups, -1).permute(0, 2, 3, 1, 4).reshape(n, h, -1)
            return torch.stack((keys, values), dim=2).reshape(n, -1)
        keys = parts[:, :, :, 0].reshape(n, ratio, h, d, tokens).permute(0, 2, 3, 1, 4).reshape(n, h, -1)
        values = parts[:, :, :, 1].reshape(n, ratio, h, tokens, d).permute(0, 2, 1, 3, 4).reshape(n, h, -1)
        return torch.stack((keys, values), dim=2).reshape(n, -1)

    def _split(self, x: torch.Tensor, ratio: int, tokens: int) -> torch.Tensor:
        n, h, d = x.shape[0], self.heads, self.head_dim
        parts = x.view(n, h, 2, ratio * tokens * d)
        if self.amx:  # the inverse of _merge's
            keys = parts[:, :, 0].reshape(n, h, ratio, -1).permute(0, 2, 1, 3)
            groups = d // AMX_ROWS
            values = parts[:, :, 1].reshape(n, h, groups, ratio, -1).permute(0, 3, 1, 2, 4).reshape(n, ratio, h, -1)
            return torch.stack((keys, values), dim=3).reshape(n, -1)
        keys = parts[:, :, 0].reshape(n, h, d, ratio, tokens).permute(0, 3, 1, 2, 4).reshape(n, ratio, h, -1)
        values = parts[:, :, 1].reshape(n, h, ratio, tokens, d).permute(0, 2, 1, 3, 4).reshape(n, ratio, h, -1)
        return torch.stack((keys, values), dim=3).reshape(n, -1)
