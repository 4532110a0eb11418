"""window_backoff: which prompts prefill cuts short (vLLM's own manager decides what is freed), and how."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvbridge_agent.core import Role
from kvbridge_agent.core.signing import request_prompt_hash
from kvbridge_agent.vllm_connector.window_backoff import WindowBackoff, at_window_edge

from .vllm_engines import Engine, Model, window_table
from .vllm_engines import settings as engine_settings


@settings(max_examples=300, deadline=None)
@given(
    block=st.sampled_from([1, 8, 16, 32, 64]),
    window=st.integers(1, 300),
    extra=st.sampled_from([0, 0, 1, 5]),
    data=st.data(),
)
def test_the_edge_is_where_vllms_decode_table_misses_the_window_of_the_last_token(
    block: int, window: int, extra: int, data: st.DataObject
) -> None:
    """vLLM's own manager, decode's way (``n`` external tokens at once): the block holding token ``n - window`` —
    the first the recomputed last token attends to — is the null block exactly where :func:`at_window_edge` says."""
    length = data.draw(
        st.one_of(
            st.builds(lambda m, d: max(1, m * window + d), st.integers(0, 4), st.integers(-1, 1)),
            st.builds(lambda k, d: max(1, window - 1 + k * block + d), st.integers(0, 20), st.integers(-1, 1)),
            st.integers(1, 1200),
        ),
        label="length",
    )
    table = window_table(block, window, extra, length)
    first = length - window
    missing = first >= 0 and table[first // block] == 0
    assert at_window_edge(length, [(window, extra)], (block,)) == missing


def test_two_block_sizes_each_free_at_their_own_edges() -> None:
    windows = [(32, 0)]
    assert at_window_edge(63, windows, (32, 32))
    assert not at_window_edge(64, windows, (32, 32))
    assert at_window_edge(47, windows, (32, 16))  # decode's 16-token blocks: 47 - 31 = 16
    assert not at_window_edge(47, windows, (32, 32))
    assert not at_window_edge(31, windows, (32, 32))  # nothing skipped yet
    assert not at_window_edge(63, [], (32, 32))  # no sliding window


@pytest.fixture(scope="module")
def backoffs() -> Iterator[tuple[WindowBackoff, WindowBackoff, Engine]]:
    model = Model((None, 32), block=32)
    engine = Engine(model, Role.PREFILL, KVCacheLayout.LBHNC)
    config = engine.config
    prefill = WindowBackoff(engine_settings(model, Role.PREFILL, config))
    decode = WindowBackoff(engine_settings(model, Role.DECODE, config))
    yield prefill, decode, engine
    engine.shutdown()


def test_prefill_drops_the_last_token_at_the_edge_once_keeping_the_whole_prompts_hash(
    backoffs: tuple[WindowBackoff, WindowBackoff, Engine],
) -> None:
    prefill, _decode, engine = backoffs
    tokens = list(range(100, 163))  # 63 tokens: 63 - 31 = 32
    request = engine.request("edge", tokens, {"do_remote_decode": True})
    whole = request_prompt_hash(request)
    prefill.truncate(request)
    assert request.prompt_token_ids == tokens[:-1]
    assert request.num_prompt_tokens == 62
    assert request.num_tokens == 62
    assert prefill.prompt_hash(request) == whole != request_prompt_hash(request)
    prefill.truncate(request)  # once: a preempted request is not cut again
    assert request.num_prompt_tokens == 62
    prefill.forget("edge")
    assert prefill.prompt_hash(request) == request_prompt_hash(request)


@pytest.mark.parametrize(
    ("length", "params"),
    [
        (64, {"do_remote_decode": True}),  # not at the edge
        (63, {"do_remote_prefill": True}),  # not to be offered to decode
        (63, None),
    ],
)
def test_prefill_leaves_other_requests_alone(
    backoffs: tuple[WindowBackoff, WindowBackoff, Engine], length: int, params: dict[str, bool] | None
) -> None:
    prefill, _decode, engine = backoffs
    request = engine.request(f"other-{length}-{params}", list(range(length)), params or {})
    request.kv_transfer_params = params
    prefill.truncate(request)
    assert request.num_prompt_tokens == length


def test_decode_never_cuts_and_takes_a_prompt_one_token_longer_than_offered(
    backoffs: tuple[WindowBackoff, WindowBackoff, Engine],
) -> None:
    _prefill, decode, engine = backoffs
    request = engine.request("d", list(range(63)), {"do_remote_decode": True})
    decode.truncate(request)
    assert request.num_prompt_tokens == 63
    assert decode.remote_tokens(63, 62) == 62
    assert decode.remote_tokens(63, 63) == 63  # a prefill that offers the whole prompt (an older release)
    assert decode.mismatch(63, 62) == decode.mismatch(63, 63) == ""
    assert decode.mismatch(63, 61).startswith("PROMPT_MISMATCH")
    assert decode.mismatch(63, 64).startswith("PROMPT_MISMATCH")
