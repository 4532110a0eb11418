"""The single-engine comparison real-vLLM tests make: equal tokens, or a tie the engine itself had."""

from __future__ import annotations

import pytest

from kvbridge_sim.pd_requests import TIE_NATS, Completion, divergence


def _alone(tokens: list[int], *top: dict[int, float]) -> Completion:
    return Completion(tokens, None, 0.0, top)


def test_equal_tokens_agree() -> None:
    assert divergence([4, 5, 6], _alone([4, 5, 6])) is None


def test_a_tie_the_engine_had_alone_may_go_either_way_and_ends_the_comparison() -> None:
    tied = {5: -3.6542, 9: -3.6542}
    want = _alone([4, 5, 6], {4: -1.0, 7: -2.0}, tied, {6: -0.5, 8: -2.5})
    assert divergence([4, 9, 1], want) is None  # what follows the other choice is another continuation


@pytest.mark.parametrize(
    ("got", "why"),
    [
        ([4, 9, 6], "token 1: 9, the single engine 5"),  # the runner-up, but well behind
        ([4, 3, 6], "token 1: 3, the single engine 5"),  # not even among the best
        ([7, 5, 6], "token 0: 7, the single engine 4"),
        ([4, 5], "2 tokens, the single engine 3"),
    ],
)
def test_any_other_difference_is_a_fault(got: list[int], why: str) -> None:
    want = _alone([4, 5, 6], {4: -1.0, 7: -2.0}, {5: -1.0, 9: -1.0 - 4 * TIE_NATS}, {6: -0.5, 8: -2.5})
    found = divergence(got, want)
    assert found is not None
    assert found.startswith(why)


def test_without_the_engines_best_tokens_a_difference_is_a_fault() -> None:
    assert divergence([4, 9], _alone([4, 5])) is not None
