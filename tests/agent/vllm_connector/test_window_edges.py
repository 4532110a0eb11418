"""Sliding windows at every block and window edge: kvbridge keeps exactly the blocks vLLM keeps.

vLLM's ``SlidingWindowManager`` frees (makes its null block) the first ``max(0, n - window + 1) // block`` blocks of
a sliding-window group once ``n`` tokens are computed; decode allocates a transferred prompt's ``n`` tokens at once,
so its table holds exactly those nulls. kvbridge used to keep ``ceil(window / block) + 1`` blocks — one more than
vLLM whenever ``n % block`` is 0 or ``block - 1`` — and refused the request with ``NULL_BLOCK_IN_WINDOW``.

Prompt lengths are drawn by hypothesis around every multiple of the window and of the block (``m * window +
j * block + d``, ``d`` in -1, 0, 1); block tables come from vLLM's own ``KVCacheManager`` (prefix caching on, so
prompts of one family hit each other's blocks on both sides); both connector halves move them with real NIXL and
verification ``All`` (vllm_engines.py), byte-exact where decode's vLLM reads them.

Moving those blocks is not enough at one edge: vLLM's decode recomputes the prompt's last token after the load, and
its window reaches one token before what either side keeps when ``n - window + 1`` is a multiple of the block.
So prefill leaves that token to decode (window_backoff.py) and every token the first computed one attends to is
checked to lie in a block decode holds (``window_gaps``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvbridge_agent.core import Role
from kvbridge_agent.vllm_connector.connector import cache_groups
from kvbridge_agent.vllm_connector.window_backoff import at_window_edge, sliding_windows

from .vllm_engines import Engine, Model, check_bytes, move, window_gaps

#: (model, prefill layout, decode layout): windows a multiple of the block, below it, above it but not a multiple;
#: 32-token blocks; vLLM's padded groups [2, 2, 1]
CASES = {
    "w16-b16": (Model((None, 16), block=16), KVCacheLayout.LBHNC, KVCacheLayout.LBHNC),
    "w8-b16": (Model((8, None), block=16), KVCacheLayout.BLHNC, KVCacheLayout.LBNHC),
    "w40-b16": (Model((None, 40, 40), block=16), KVCacheLayout.LHBNC, KVCacheLayout.BLNHC),
    "w32-b32": (Model((None, 32), block=32), KVCacheLayout.LBNHC, KVCacheLayout.BLHNC),
    "w32-b16-padded": (Model((None, None, 32, 32, 32), block=16), KVCacheLayout.BLNHC, KVCacheLayout.LBHNC),
}


@st.composite
def lengths_and_families(draw: Any, model: Model) -> tuple[int, int]:
    """``m * window + j * block + d`` for a window of the model, ``m`` 0..3, ``j`` -2..2, ``d`` -1..1 (at least 1),
    and a prompt family (prompts of one family share their prefix: prefix hits on both sides)."""
    window = draw(st.sampled_from(sorted({w for w in model.windows if w is not None})), label="window")
    m, j, d = draw(st.integers(0, 3), label="m"), draw(st.integers(-2, 2), label="j"), draw(st.integers(-1, 1), "d")
    return max(1, m * window + j * model.block + d), draw(st.integers(0, 2), label="family")


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, Engine]]:
    model, prefill_layout, decode_layout = CASES[request.param]
    prefill = Engine(model, Role.PREFILL, prefill_layout)
    decode = Engine(model, Role.DECODE, decode_layout)
    try:
        for engine in (prefill, decode):
            engine.register()
        handshake = prefill.worker.get_handshake_metadata()
        assert handshake is not None
        prefill.scheduler.set_xfer_handshake_metadata({0: handshake})
        yield prefill, decode
    finally:
        decode.shutdown()
        prefill.shutdown()


COUNTER = iter(range(1 << 30))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_prompts_at_every_edge_move_byte_exact(engines: tuple[Engine, Engine], data: st.DataObject) -> None:
    prefill, decode = engines
    length, family = data.draw(lengths_and_families(prefill.model), label="length, family")
    tokens = [family * 100_000 + 17 * i % 9973 for i in range(length)]
    moved = move(prefill, decode, f"e{next(COUNTER)}", tokens)
    assert moved.ok, (length, moved.failures, moved.load_errors)
    check_bytes(decode, moved)
    groups = cache_groups(decode.config)
    assert groups is not None
    # at a window edge prefill left the prompt's last token to decode (window_backoff), whose first forward computes it
    offered = len(moved.tokens)
    blocks = (prefill.model.block, decode.model.block)
    assert offered == (
        length - 1 if at_window_edge(length, sliding_windows(decode.scheduler.settings), blocks) else length
    )
    assert moved.computes_from == min(offered, length - 1)
    # decode read every block its table holds for what prefill offered, none of vLLM's null blocks, per group
    held = [len([b for b in ids[: -(-offered // prefill.model.block)] if b]) for ids in moved.decode_table]
    assert moved.params["remoteGroupSizes"] == held == groups.sizes(offered)
    # and every token the first computed token's window reaches is in a block decode holds (check_bytes: its KV)
    assert not window_gaps(decode, moved), (length, window_gaps(decode, moved))


@pytest.mark.parametrize(
    ("backoff", "length", "gaps"), [(False, 63, 1), (False, 95, 1), (False, 64, 0), (True, 63, 0), (True, 95, 0)]
)
def test_without_the_backoff_vllm_recomputes_the_last_token_over_a_null_block(
    monkeypatch: pytest.MonkeyPatch, backoff: bool, length: int, gaps: int
) -> None:
    """vLLM's own managers, window 32, blocks 32, the whole prompt offered (no backoff, as vLLM's NixlConnector
    does): decode allocates ``n`` external tokens with the first ``(n - 31) // 32`` blocks null, then recomputes
    token ``n - 1``, whose window reaches token ``n - 32`` — in a null block when ``n - 31`` is a multiple of 32
    (63, 95; not 64), on prefill too (freed before the offer). With the backoff nothing is missing. Seen in real
    vLLM with NixlConnector (docs/vllm.md, "Sliding windows at the edge")."""
    from kvbridge_agent.vllm_connector import window_backoff

    if not backoff:
        monkeypatch.setattr(window_backoff, "at_window_edge", lambda *args: False)
    model, prefill_layout, decode_layout = CASES["w32-b32"]
    prefill, decode = Engine(model, Role.PREFILL, prefill_layout), Engine(model, Role.DECODE, decode_layout)
    try:
        for engine in (prefill, decode):
            engine.register()
        handshake = prefill.worker.get_handshake_metadata()
        assert handshake is not None
        prefill.scheduler.set_xfer_handshake_metadata({0: handshake})
        moved = move(prefill, decode, f"nb{backoff}-{length}", list(range(1000, 1000 + length)))
        assert moved.ok, (moved.failures, moved.load_errors)
        check_bytes(decode, moved)
        assert len(window_gaps(decode, moved)) == gaps, window_gaps(decode, moved)
    finally:
        decode.shutdown()
        prefill.shutdown()


@settings(max_examples=300, deadline=None)
@given(
    block=st.sampled_from([1, 8, 16, 32, 64]),
    window=st.integers(1, 300),
    extra=st.sampled_from([0, 0, 1, 5]),
    data=st.data(),
)
def test_kept_blocks_are_the_ones_vllm_keeps(block: int, window: int, extra: int, data: st.DataObject) -> None:
    """vLLM's own manager, decode's way (``n`` external tokens at once): the null blocks of each group are exactly
    the ones kvbridge leaves out, so clipping its table never meets one."""

    from kvbridge_agent.core.cache_groups import CacheGroups

    from .vllm_engines import window_table

    length = data.draw(
        st.one_of(
            st.builds(lambda m, d: max(1, m * window + d), st.integers(0, 4), st.integers(-1, 1)),
            st.builds(lambda k, d: max(1, k * block + d), st.integers(0, 40), st.integers(-1, 1)),
            st.integers(1, 1200),
        ),
        label="length",
    )
    table = window_table(block, window, extra, length)
    nulls = next((i for i, b in enumerate(table) if b), len(table))
    groups = CacheGroups.of([window], block, [extra])
    assert nulls == groups.skipped_blocks(0, length)
    assert groups.clip([table], length) == [table[nulls:]]
    assert 0 not in table[nulls:]
