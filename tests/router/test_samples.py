"""Parallel sampling (``n``): the checks on ``n``, the samples' bodies and the one answer joined from theirs."""

from __future__ import annotations

import json

import pytest

from kvbridge_router.admission import sample_count
from kvbridge_router.errors import RouteError
from kvbridge_router.samples import MAX_SAMPLES, JoinError, joined, sample_bodies


def completion(text: str, prompt_tokens: int, completion_tokens: int, chat: bool = False) -> bytes:
    """A vLLM answer of one choice, as a decode engine gives it."""
    choice: dict[str, object] = {"index": 0, "finish_reason": "length"}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text, "token_ids": [1]})
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    usage["total_tokens"] = prompt_tokens + completion_tokens
    answer = {"id": f"cmpl-{text}", "object": "text_completion", "model": "tiny", "choices": [choice], "usage": usage}
    return json.dumps(answer).encode()


@pytest.mark.parametrize(
    ("body", "expected"),
    [({}, 1), ({"n": None}, 1), ({"n": 1, "stream": True}, 1), ({"n": MAX_SAMPLES}, MAX_SAMPLES)],
)
def test_n_is_counted(body: dict[str, object], expected: int) -> None:
    assert sample_count(body) == expected


@pytest.mark.parametrize("n", [0, -1, MAX_SAMPLES + 1, 2.0, True, "2", [2]])
def test_an_n_that_is_not_a_count_is_refused_with_its_param(n: object) -> None:
    with pytest.raises(RouteError) as refused:
        sample_count({"n": n})
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "INVALID_REQUEST", "n")


def test_several_streamed_samples_are_refused_with_what_to_do_instead() -> None:
    with pytest.raises(RouteError, match="stream: false, or n requests"):
        sample_count({"n": 2, "stream": True})


def test_samples_are_seeded_as_vllm_seeds_its_own() -> None:
    body = {"prompt": "hi", "n": 3, "seed": 41, "temperature": 0.8}
    assert [b["seed"] for b in sample_bodies(body, 3)] == [41, 42, 43]
    assert all("n" not in b and b["temperature"] == 0.8 for b in sample_bodies(body, 3))
    assert sample_bodies({"prompt": "hi", "n": 2}, 2) == [{"prompt": "hi"}] * 2
    assert body["n"] == 3  # the client's body is not changed


@pytest.mark.parametrize("chat", [False, True])
def test_the_answers_join_into_one_with_the_prompt_counted_once(chat: bool) -> None:
    answer = json.loads(joined([completion("a", 12, 4, chat), completion("b", 12, 3, chat)]))
    assert answer["id"] == "cmpl-a"
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert [c["message"]["content"] if chat else c["text"] for c in answer["choices"]] == ["a", "b"]
    assert answer["usage"] == {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}


def test_an_answer_without_choices_cannot_be_joined_and_names_its_sample() -> None:
    with pytest.raises(JoinError, match="sample 1"):
        joined([completion("a", 1, 1), b'{"object": "error"}'])
    without_usage = json.loads(joined([b'{"choices": [{"text": "a"}]}', b'{"choices": [{"text": "b"}]}']))
    assert "usage" not in without_usage
