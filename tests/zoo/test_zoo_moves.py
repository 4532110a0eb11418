"""The zoo's hybrid layer patterns moved byte-exact on vLLM's allocator: gpt-oss (sliding and full alternating, a
128-token window; groups of 12 and 12) and Gemma-3-27B (five sliding to one full, a 1024-token window; vLLM pads its
52 sliding layers into groups of 9 and 8 beside 10 full ones), with prompts around the edge where vLLM frees a
sliding group's first block (``n - window + 1`` a multiple of the block size: 143 and 1087 tokens). vLLM's own
cache, block tables from vLLM's ``KVCacheManager``, both connector halves, real NIXL and verification ``All``
(tests/agent/vllm_connector/vllm_engines.py).

Scaled down: 2 KV heads of 16 elements (the layer pattern, the window and the block size are the model's).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from vllm.v1.kv_cache_layout import KVCacheLayout

from kvbridge_agent.core import Role
from kvbridge_agent.core.model import LayerType
from tests.agent.vllm_connector.vllm_engines import Engine, Model, check_bytes, move, window_gaps

from .zoo import ZOO

pytestmark = pytest.mark.vllm


def pattern(folder: str, block: int, num_blocks: int) -> Model:
    model = next(m for m in ZOO if m.folder == folder).model()
    windows = tuple(model.sliding_window if kind is LayerType.SLIDING else None for kind in model.layer_kinds)
    return Model(windows, block=block, heads=2, head_size=16, num_blocks=num_blocks)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    opened: list[Engine] = []
    yield opened
    for engine in reversed(opened):
        engine.shutdown()


@pytest.mark.parametrize(
    ("folder", "block", "lengths"),
    [
        ("gpt-oss-20b", 16, (127, 142, 143, 144, 257)),
        ("gemma-3-27b", 64, (1023, 1086, 1087, 1088)),
    ],
)
def test_a_zoo_pattern_moves_byte_exact_at_the_window_edge(
    folder: str, block: int, lengths: tuple[int, ...], engines: list[Engine]
) -> None:
    model = pattern(folder, block, num_blocks=160)
    prefill = Engine(model, Role.PREFILL, KVCacheLayout.LBHNC)
    decode = Engine(model, Role.DECODE, KVCacheLayout.LBNHC)
    engines += [prefill, decode]
    for engine in (prefill, decode):
        engine.register()
    handshake = prefill.worker.get_handshake_metadata()
    assert handshake is not None
    prefill.scheduler.set_xfer_handshake_metadata({0: handshake})
    for length in lengths:
        moved = move(prefill, decode, f"{folder}-{length}", [11 + (i * 37) % 3000 for i in range(length)])
        assert moved.ok, (length, moved.failures, moved.load_errors)
        check_bytes(decode, moved)
        assert not window_gaps(decode, moved), length  # 143 and 1087 are at the edge: prefill left the last token
