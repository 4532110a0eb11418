"""The block interior of vLLM's CPU attention cache, measured with vLLM's own cache-write kernel.

Why block-size conversions are refused on CPU, for NixlConnector and kvbridge's connector alike: inside a
``[heads, block_size, 2 * head_dim]`` block, a head's keys are stored dimension-major (``[head_dim, tokens]``)
and its values token-major (``[tokens, head_dim]``), so concatenating two 32-token blocks into a 64-token one
scrambles the keys. Whole heads, however, are contiguous (keys, then values), which is what kvbridge's connector
relies on to move them between TP ranks. If vLLM changes this layout, this test says so.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

HEADS, DIM = 2, 64


@pytest.mark.parametrize("block_size", [32, 64])
def test_keys_are_dimension_major_values_token_major_and_each_head_contiguous(block_size: int) -> None:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm import _custom_ops as ops

    isa = _get_attn_isa(torch.bfloat16, block_size, DIM)
    if isa not in ("vec", "vec16"):
        pytest.skip(f"measured for the vec kernels; this CPU runs {isa}")
    cache = torch.zeros(3, HEADS, block_size, 2 * DIM, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(3, HEADS, 2 * block_size, DIM).chunk(2, dim=2)
    tokens = torch.arange(block_size, dtype=torch.bfloat16).view(-1, 1, 1) + 1  # token t holds t + 1
    heads = torch.arange(HEADS, dtype=torch.bfloat16).view(1, -1, 1) * 1000
    key = (tokens + heads).expand(block_size, HEADS, DIM).contiguous()
    value = -(tokens + heads).expand(block_size, HEADS, DIM).contiguous()
    slots = torch.arange(block_size, dtype=torch.int64) + block_size  # fill block 1
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    block = cache[1].reshape(HEADS, 2, block_size * DIM)  # per head: keys, then values
    for head in range(HEADS):
        keys, values = block[head, 0].view(DIM, block_size), block[head, 1].view(block_size, DIM)
        expected = torch.arange(block_size, dtype=torch.bfloat16) + 1 + 1000 * head
        assert torch.equal(keys[0], expected)  # one dimension of every token, token after token
        assert torch.equal(keys[DIM - 1], expected)
        assert torch.equal(values[:, 0], -expected)  # every dimension of one token, token after token
        assert torch.equal(values[3], torch.full((DIM,), -(4.0 + 1000 * head), dtype=torch.bfloat16))
