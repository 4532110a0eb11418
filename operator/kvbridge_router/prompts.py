"""What a request's prompt is, read without HTTP: the checks admission refuses by and kv-aware scores by; pure."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

#: a list of token ids as msgspec checks it: ints (strictly: not bools, not floats), none negative
_IDS = list[Annotated[int, msgspec.Meta(ge=0)]]


def one_prompt(prompt: Any) -> Any:
    """``prompt`` itself, or the one prompt of a list holding one (a string or a list of token ids)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0]
    return prompt


def token_ids(values: list[Any]) -> bool:
    """A non-empty list of token ids: ints (not bools, not floats) none negative; checked at C speed (msgspec's
    check of a 1,700-id prompt takes a fifth of the time of Python's ``set(map(type, ...))`` and ``min``)."""
    try:
        msgspec.convert(values, _IDS)
    except msgspec.ValidationError:
        return False
    return bool(values)
