"""Decode refuses a prefill whose CPU attention kernel lays block bytes out differently (checked at handshake)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvbridge_agent.core import CacheKind, KVLayout
from kvbridge_agent.core.handshake import HandshakeError, MemoryType, RankMetadata
from kvbridge_agent.vllm_connector.cache_geometry import BLOCK_INTERIOR_MISMATCH, check_block_interior


def rank(tp_rank: int, interior: str) -> tuple[RankMetadata, bytes]:
    meta = RankMetadata(
        engine_id="prefill-0",
        incarnation="i1",
        agent_name="a",
        tp_rank=tp_rank,
        tp_size=2,
        block_size=32,
        kv_layout=KVLayout.HND,
        cache_kind=CacheKind.SPLIT,
        num_blocks=8,
        tensor_bases=[4096],
        region_block_bytes=64,
        wire_block_size=32,
        wire_layout=KVLayout.HND,
        memory_type=MemoryType.DRAM,
        device_id=0,
        block_interior=interior,
    )
    return meta, b""


def test_the_same_kernel_on_both_sides_passes() -> None:
    check_block_interior("vllm-cpu-attention/vec", "prefill-0", {0: rank(0, "vllm-cpu-attention/vec")})
    check_block_interior("", "prefill-0", {0: rank(0, "")})  # neither side is a CPU attention cache


@pytest.mark.parametrize(
    ("mine", "theirs"),
    [
        ("vllm-cpu-attention/vec", ["vllm-cpu-attention/amx"]),
        ("vllm-cpu-attention/vec", ["vllm-cpu-attention/vec", "vllm-cpu-attention/amx"]),  # one rank differs
        ("vllm-cpu-attention/vec", [""]),  # an older prefill that does not say
        ("", ["vllm-cpu-attention/neon"]),
    ],
)
def test_a_different_block_interior_is_refused_with_a_reason(mine: str, theirs: list[str]) -> None:
    with pytest.raises(HandshakeError) as caught:
        check_block_interior(mine, "prefill-0", {r: rank(r, t) for r, t in enumerate(theirs)})
    assert caught.value.code == BLOCK_INTERIOR_MISMATCH
    assert "prefill-0" in caught.value.message
    assert "same attention kernel" in caught.value.message


def test_the_handshake_carries_the_interior_and_older_metadata_reads_as_empty() -> None:
    meta, _ = rank(0, "vllm-cpu-attention/vec")
    assert RankMetadata.model_validate_json(meta.model_dump_json(by_alias=True)).block_interior.endswith("/vec")
    without = meta.model_dump(by_alias=True)
    del without["blockInterior"]
    assert RankMetadata.model_validate(without).block_interior == ""
