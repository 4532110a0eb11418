"""Block-size conversions and the digest's view of vLLM's CPU attention blocks, for each kernel's interior.

The reference here writes each element where the interior's formula (cpu_blocks' docstring, measured with vLLM's own
cache-write kernel in tests/vllm/test_cpu_attention_layout.py) puts it, one index at a time; the module under test
reshapes and permutes whole blocks. Runs on any CPU: no vLLM kernel is called.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings
from kvbridge_agent.core.digest import new_key
from kvbridge_agent.core.errors import SpecError
from kvbridge_agent.core.plan import build_plan
from kvbridge_agent.transfer.digest import Digester
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.vllm_connector.cache_geometry import cpu_kernel, transfer_geometry
from kvbridge_agent.vllm_connector.cpu_blocks import CPUAttentionBlocks
from kvbridge_agent.vllm_connector.settings import ConnectorSettings

from .test_scheduler import environ, vllm_config

HEADS = 2


def offset(kernel: str, kv: int, token: int, dim: int, tokens: int, head_dim: int) -> int:
    """Where a head's key (kv 0) or value (kv 1) element lies within that head's half of a block."""
    if kernel == "amx":
        if kv == 0:  # [tokens/16, head_dim/2, 16, 2]
            return ((token // 16 * (head_dim // 2) + dim // 2) * 16 + token % 16) * 2 + dim % 2
        return (
            (dim // 16 * (tokens // 2) + token // 2) * 16 + dim % 16
        ) * 2 + token % 2  # [head_dim/16, tokens/2, 16, 2]
    return dim * tokens + token if kv == 0 else token * head_dim + dim  # vec: keys [dim, tokens], values [tokens, dim]


def element(kv: int, token: int, head: int, dim: int) -> int:
    """A distinct int16 for every (kv, token, head, dim) of the prompt (tokens < 128, head_dim <= 64)."""
    return ((kv * 128 + token) * HEADS + head) * 64 + dim - 16384


def write(kernel: str, block_size: int, head_dim: int, blocks: int, first: int, count: int) -> torch.Tensor:
    """A one-layer cache of ``blocks`` blocks holding prompt tokens ``first .. first + count - 1`` from block 1."""
    cache = np.zeros((blocks, HEADS, 2, block_size * head_dim), dtype=np.int16)
    for index in range(count):
        block, token = 1 + index // block_size, index % block_size
        for head in range(HEADS):
            for kv in (0, 1):
                for dim in range(head_dim):
                    where = offset(kernel, kv, token, dim, block_size, head_dim)
                    cache[block, head, kv, where] = element(kv, first + index, head, dim)
    return torch.from_numpy(cache.reshape(blocks, HEADS, block_size, 2 * head_dim))


def attach(geometry: ModelGeometry, block_size: int, tensor: torch.Tensor) -> KVCache:
    return KVCache.attach(geometry, block_size, "HND", 1, 0, tensor.shape[0], [tensor])  # type: ignore[arg-type]


@pytest.mark.parametrize("kernel", ["vec", "amx"])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_the_digest_view_is_the_prompt_token_major(kernel: str, head_dim: int) -> None:
    block_size = 32
    model = ModelGeometry(name="m", num_layers=1, num_kv_heads=HEADS, head_dim=head_dim)
    tensor = write(kernel, block_size, head_dim, 3, 0, 2 * block_size)
    cache = attach(transfer_geometry(model, [tensor], 1), block_size, tensor)
    convert = CPUAttentionBlocks(HEADS, head_dim, 2, kernel)
    logical = convert.logical(cache, torch.tensor([1, 2]), 0).view(torch.int16)  # [n, kv, tokens, heads, dim]
    assert logical.shape == (2, 2, block_size, HEADS, head_dim)
    for block in range(2):
        for kv in (0, 1):
            for token in range(block_size):
                for head in range(HEADS):
                    expected = [element(kv, block * block_size + token, head, d) for d in range(head_dim)]
                    assert logical[block, kv, token, head].tolist() == expected, (kernel, block, kv, token, head)


@pytest.mark.parametrize("kernel", ["vec", "amx"])
@pytest.mark.parametrize(("ratio", "head_dim"), [(2, 64), (4, 32), (3, 32)])
def test_merging_and_splitting_give_the_blocks_the_kernel_writes(kernel: str, ratio: int, head_dim: int) -> None:
    """Decode merges ``ratio`` 32-token wire blocks into the block the kernel would have written for the same
    tokens; prefill splits that block into the wire blocks, the exact inverse."""
    small, large = 32, 32 * ratio
    model = ModelGeometry(name="m", num_layers=1, num_kv_heads=HEADS, head_dim=head_dim)
    convert = CPUAttentionBlocks(HEADS, head_dim, 2, kernel)
    reference = write(kernel, large, head_dim, 3, 0, large)
    pieces = write(kernel, small, head_dim, 2 + ratio, 0, large)
    geometry = transfer_geometry(model, [reference], 1)

    received = torch.zeros_like(reference)
    received.view(3, -1)[1] = pieces.view(2 + ratio, -1)[1 : 1 + ratio].reshape(-1)
    merge = build_plan(geometry, RoleSettings(block_size=small), RoleSettings(block_size=large))
    assert convert(attach(geometry, large, received), merge, Role.DECODE, [1])
    assert torch.equal(received[1], reference[1])
    assert not received[2].any()  # blocks not listed are not touched

    offered = reference.clone()
    split = build_plan(geometry, RoleSettings(block_size=large), RoleSettings(block_size=small))
    assert convert(attach(geometry, large, offered), split, Role.PREFILL, [1])
    assert torch.equal(offered.view(3, -1)[1], pieces.view(2 + ratio, -1)[1 : 1 + ratio].reshape(-1))


@pytest.mark.parametrize("head_dim", [48, 72])
def test_an_amx_head_dim_it_does_not_know_is_refused(head_dim: int) -> None:
    with pytest.raises(SpecError) as caught:
        CPUAttentionBlocks(HEADS, head_dim, 2, "amx")
    assert caught.value.code == "CONNECTOR_UNSUPPORTED"
    assert caught.value.field == "spec.model.headDim"


def test_the_kernel_is_asked_by_the_models_dtype_as_vllm_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp8 cache of a bfloat16 model on an AMX CPU runs vLLM's amx kernel, though the cache tensor is uint8: the
    connector must name the kernel vLLM runs (its handshake's block interior and its conversions depend on it)."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert cpu_kernel(torch.bfloat16, 32, 64, "fp8_e4m3") == "amx"
    assert cpu_kernel(torch.uint8, 32, 64, "fp8_e4m3") != "amx"  # what asking by the cache tensor gave
    assert cpu_kernel(torch.float32, 32, 64) != "amx"
    config = vllm_config("kv_producer")
    config.model_config = SimpleNamespace(dtype=torch.bfloat16)
    config.cache_config.cache_dtype = "fp8_e4m3"
    settings = ConnectorSettings.from_vllm(config, environ(Role.PREFILL))
    assert (settings.model_dtype, settings.kv_cache_dtype) == (torch.bfloat16, "fp8_e4m3")
    assert ConnectorSettings.from_vllm(vllm_config("kv_producer"), environ(Role.PREFILL)).model_dtype is None


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    head_dim=st.sampled_from([16, 32, 64, 80, 128, 256]),
    block_size=st.sampled_from([1, 8, 16, 32, 128]),
    data=st.data(),
)
def test_the_digest_reads_vec_blocks_where_they_lie(
    layers: int, heads: int, head_dim: int, block_size: int, data: st.DataObject
) -> None:
    """The compiled pass over the blocks as the ``vec`` kernel lays them (keys dimension-major) gives the values of
    the logical view (keys copied back to token-major), for any geometry, block ids and length; extreme units
    included (a 256-dim head is two segments)."""
    blocks = 6
    model = ModelGeometry(name="m", num_layers=layers, num_kv_heads=heads, head_dim=head_dim)
    fill = data.draw(st.sampled_from(["random", "extreme"]))
    seed = data.draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    shape = (blocks, heads, block_size, 2 * head_dim)
    if fill == "random":
        tensors = [torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator) for _ in range(layers)]
    else:
        signs = [torch.randint(0, 2, shape, dtype=torch.int16, generator=generator) for _ in range(layers)]
        tensors = [torch.where(sign == 1, torch.tensor(-(2**15), dtype=torch.int16), 2**15 - 1) for sign in signs]
    tensors = [tensor.view(torch.bfloat16) for tensor in tensors]
    cache = KVCache.attach(transfer_geometry(model, tensors, 1), block_size, "HND", 1, 0, blocks, tensors)  # type: ignore[arg-type]
    convert = CPUAttentionBlocks(heads, head_dim, 2, "vec")
    assert convert.keys_across
    count = data.draw(st.integers(1, blocks))
    ids = data.draw(st.permutations(range(blocks)))[:count]
    tokens = data.draw(st.integers((count - 1) * block_size + 1, count * block_size))
    owned = list(range(heads))
    across = Digester(cache, convert.logical, owned, keys_across=True)
    assert across._across is not None  # the pass under test, not the view
    key = new_key()
    expected = Digester(cache, convert.logical, owned).request(key, ids, tokens, block_size)
    assert (across.request(key, ids, tokens, block_size) == expected).all()


@pytest.mark.parametrize(("kernel", "element_bytes"), [("amx", 2), ("vec", 4), ("vec", 1), ("vec16", 1)])
def test_interiors_the_pass_does_not_read_go_through_the_view(kernel: str, element_bytes: int) -> None:
    assert not CPUAttentionBlocks(HEADS, 64, element_bytes, kernel).keys_across
