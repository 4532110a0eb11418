"""TP mapping (docs/protocol.md §3)."""

from __future__ import annotations

import pytest

from kvbridge_agent.core import SpecError
from kvbridge_agent.core.tp import (
    handshake_ranks,
    head_offset_factor,
    notifications_per_prefill_rank,
    notify_only_ranks,
    read_ranks,
    tp_ratio,
)

from .conftest import dense, mla


@pytest.mark.parametrize(("tp_p", "tp_d", "ratio"), [(1, 1, 1), (1, 4, 4), (2, 4, 2), (4, 1, -4), (8, 2, -4)])
def test_tp_ratio_uses_vllm_sign_convention(tp_p: int, tp_d: int, ratio: int) -> None:
    assert tp_ratio(tp_p, tp_d) == ratio


def test_handshake_ranks() -> None:
    assert handshake_ranks(2, 4, 3) == [1]
    assert handshake_ranks(4, 2, 1) == [2, 3]
    assert handshake_ranks(4, 1, 0) == [0, 1, 2, 3]


def test_read_ranks_dense_and_mla() -> None:
    assert read_ranks(dense(8), 2, 4, 3) == [1]
    assert read_ranks(dense(8), 4, 2, 1) == [2, 3]
    assert read_ranks(mla(), 4, 2, 1) == [2]
    assert notify_only_ranks(mla(), 4, 2, 1) == [3]
    assert notify_only_ranks(dense(8), 4, 2, 1) == []


def test_head_offset_factor_when_decode_tp_exceeds_heads() -> None:
    # K=4, tp_P=2 (2 heads per prefill rank), tp_D=8 (each head on 2 decode ranks)
    model = dense(4)
    factors = [head_offset_factor(model, 2, 8, d) for d in range(8)]
    assert factors == [0, 0, 1, 1, 0, 0, 1, 1]
    # d % ratio would give 0..3 and read past the 2-head remote block
    assert max(factors) < 2


def test_head_offset_factor_within_heads_and_mla() -> None:
    assert [head_offset_factor(dense(8), 2, 8, d) for d in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert head_offset_factor(mla(), 1, 4, 3) == 0


def test_notifications_per_prefill_rank() -> None:
    assert notifications_per_prefill_rank(1, 4) == 4
    assert notifications_per_prefill_rank(4, 1) == 1
    assert notifications_per_prefill_rank(2, 2) == 1


def test_bad_inputs_raise_typed_errors() -> None:
    with pytest.raises(SpecError) as caught:
        tp_ratio(3, 2)
    assert caught.value.code == "TP_NOT_DIVISIBLE"
    with pytest.raises(SpecError) as caught:
        handshake_ranks(2, 4, 4)
    assert caught.value.code == "DECODE_RANK_OUT_OF_RANGE"
