"""The block interior of vLLM's CPU attention cache, measured with vLLM's own cache-write kernel.

Why block-size conversions are refused on CPU for NixlConnector, and why kvbridge's connector converts the
interior itself: inside a ``[heads, block_size, 2 * head_dim]`` block, the ``vec`` kernels store a head's keys
dimension-major (``[head_dim, tokens]``) and its values token-major (``[tokens, head_dim]``), so concatenating two
32-token blocks into a 64-token one scrambles the keys. On a CPU with AMX the kernel is ``amx`` and the interior
is the tiles' order (cpu_blocks' docstring). Whole heads are contiguous (keys, then values) in both, which is what
kvbridge's connector relies on to move them between TP ranks. If vLLM changes a layout, these tests say so; each
runs for the kernel this CPU gives vLLM and skips the other's.
"""

from __future__ import annotations

from typing import Any

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


@pytest.mark.parametrize("block_size", [32, 96])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_the_amx_kernel_stores_keys_and_values_in_tile_order(block_size: int, head_dim: int) -> None:
    """Keys ``[tokens/16, head_dim/2, 16, 2]``, values ``[head_dim/16, tokens/2, 16, 2]``, each head contiguous."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm import _custom_ops as ops

    isa = _get_attn_isa(torch.bfloat16, block_size, head_dim)
    if isa != "amx":
        pytest.skip(f"measured for the amx kernel; this CPU runs {isa}")
    found = {}
    for name in ("token", "dim", "head"):  # one write per coordinate: bfloat16 holds integers up to 256 exactly
        index = {"token": 0, "head": 1, "dim": 2}[name]
        shape = [1, 1, 1]
        shape[index] = (block_size, HEADS, head_dim)[index]
        coordinate = torch.arange(shape[index]).view(shape).expand(block_size, HEADS, head_dim) + 1
        cache = torch.zeros(3, HEADS, block_size, 2 * head_dim, dtype=torch.bfloat16)
        key_cache, value_cache = cache.view(3, HEADS, 2 * block_size, head_dim).chunk(2, dim=2)
        source = coordinate.to(torch.bfloat16).contiguous()
        slots = torch.arange(block_size, dtype=torch.int64) + block_size  # fill block 1
        ops.cpu_attn_reshape_and_cache(source, -source, key_cache, value_cache, slots, isa)
        found[name] = cache[1].reshape(HEADS, 2, -1).to(torch.int64)
    d, t = head_dim, block_size
    keys = [(g * 16 + i, 2 * p + e) for g in range(t // 16) for p in range(d // 2) for i in range(16) for e in range(2)]
    values = [
        (2 * q + e, 16 * g + i) for g in range(d // 16) for q in range(t // 2) for i in range(16) for e in range(2)
    ]
    for head in range(HEADS):
        for kv, expected in ((0, keys), (1, values)):
            sign = 1 if kv == 0 else -1
            assert torch.equal(found["head"][head, kv], torch.full((t * d,), sign * (head + 1)))
            stored = zip(found["token"][head, kv].tolist(), found["dim"][head, kv].tolist(), strict=True)
            assert [(sign * token - 1, sign * dim - 1) for token, dim in stored] == expected


def write_tokens(block_size: int, num_blocks: int, count: int, isa: str) -> Any:
    """A CPU attention cache (one layer) holding ``count`` tokens from block 1 on, written by vLLM's kernel."""
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(0)
    key = torch.randn(count, HEADS, DIM, generator=generator).to(torch.bfloat16)
    value = torch.randn(count, HEADS, DIM, generator=generator).to(torch.bfloat16)
    cache = torch.zeros(num_blocks, HEADS, block_size, 2 * DIM, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(num_blocks, HEADS, 2 * block_size, DIM).chunk(2, dim=2)
    slots = torch.arange(count, dtype=torch.int64) + block_size
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    return cache


@pytest.mark.parametrize("ratio", [2, 3, 4])
def test_kvbridge_merges_and_splits_cpu_blocks_exactly_as_vllm_writes_them(ratio: int) -> None:
    """Blocks of 32 tokens read into one 64- or 128-token block and merged by kvbridge are byte-equal to what
    vLLM writes into the larger block directly; splitting is the exact inverse."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvbridge_agent.core import ModelGeometry, Role, RoleSettings
    from kvbridge_agent.core.plan import build_plan
    from kvbridge_agent.transfer.kv_cache import KVCache
    from kvbridge_agent.vllm_connector.cache_geometry import transfer_geometry
    from kvbridge_agent.vllm_connector.cpu_blocks import KNOWN_KERNELS, CPUAttentionBlocks

    small, large = 32, 32 * ratio
    isa = _get_attn_isa(torch.bfloat16, small, DIM)
    if isa != _get_attn_isa(torch.bfloat16, large, DIM) or isa not in KNOWN_KERNELS:
        pytest.skip(f"kvbridge converts for the {', '.join(KNOWN_KERNELS)} kernels; this CPU runs {isa}")
    model = ModelGeometry(name="m", num_layers=1, num_kv_heads=HEADS, head_dim=DIM)
    convert = CPUAttentionBlocks(HEADS, DIM, 2, isa)
    reference = write_tokens(large, 3, large, isa)  # block 1: every token
    pieces = write_tokens(small, 2 + ratio, large, isa)  # blocks 1 .. ratio: the same tokens
    geometry = transfer_geometry(model, [reference], 1)

    received = torch.zeros_like(reference)  # decode: the READs put wire block j into sub-block j of block 1
    received.view(3, -1)[1] = pieces.view(2 + ratio, -1)[1 : 1 + ratio].reshape(-1)
    decode = KVCache.attach(geometry, large, "HND", 1, 0, 3, [received])  # type: ignore[arg-type]
    merge = build_plan(geometry, RoleSettings(block_size=small), RoleSettings(block_size=large))
    assert convert(decode, merge, Role.DECODE, [1])
    assert torch.equal(received[1], reference[1])

    offered = reference.clone()  # prefill: split its native block into wire blocks in place
    prefill = KVCache.attach(geometry, large, "HND", 1, 0, 3, [offered])  # type: ignore[arg-type]
    split = build_plan(geometry, RoleSettings(block_size=large), RoleSettings(block_size=small))
    assert convert(prefill, split, Role.PREFILL, [1])
    assert torch.equal(offered.view(3, -1)[1], pieces.view(2 + ratio, -1)[1 : 1 + ratio].reshape(-1))
