"""What a request's prompt is, read without HTTP: the checks admission refuses by and kv-aware scores by; pure."""

from __future__ import annotations

from typing import Any


def one_prompt(prompt: Any) -> Any:
    """``prompt`` itself, or the one prompt of a list holding one (a string or a list of token ids)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0]
    return prompt


def token_ids(values: list[Any]) -> bool:
    """A non-empty list of token ids: ints (not bools, not floats) none negative; checked at C speed."""
    return bool(values) and set(map(type, values)) == {int} and min(values) >= 0
