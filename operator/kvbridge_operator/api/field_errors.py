"""What a refused manifest is told: pydantic's errors in the resource's words, a misspelt field named with the
field it most likely meant and the fields allowed where it stands (``parse_deployment`` uses it).

A typo is the commonest mistake in a hand-written manifest, and pydantic says only "Extra inputs are not permitted"
(or, for a misspelt required field, "Field required" about the field the author did write): the message here
names the unknown field, the closest allowed one (``difflib``) and every allowed one.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

#: how close a word must be to be offered (difflib's ratio; 0.6 is its default)
CUTOFF = 0.6


def _unwrap(annotation: Any, step: int | str) -> Any:
    """The annotation a step goes into: a model's field, a list's item, a dict's value, an Optional's model."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        found = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return _unwrap(found[0], step) if len(found) == 1 else None
    if origin in (list, tuple) and isinstance(step, int):
        return typing.get_args(annotation)[0]
    if origin is dict and isinstance(step, str):
        return typing.get_args(annotation)[1]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel) and isinstance(step, str):
        field = next((f for n, f in annotation.model_fields.items() if step in (n, f.alias)), None)
        return field.annotation if field is not None else None
    return None


def model_at(root: type[BaseModel], path: Sequence[int | str]) -> type[BaseModel] | None:
    """The model a document's ``path`` (an error's location, aliases or names) holds, if it is a model."""
    current: Any = root
    for step in path:
        current = _unwrap(current, step)
        if current is None:
            return None
    origin = typing.get_origin(current)
    if origin in (typing.Union, types.UnionType):
        found = [arg for arg in typing.get_args(current) if arg is not type(None)]
        current = found[0] if len(found) == 1 else None
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def allowed_fields(model: type[BaseModel]) -> list[str]:
    """The fields a model takes, as a manifest spells them."""
    return [field.alias or name for name, field in model.model_fields.items()]


def closest(word: str, choices: Sequence[str]) -> str | None:
    """The choice ``word`` most likely meant, ignoring case, or None when none is close."""
    by_lower = {choice.lower(): choice for choice in choices}
    found = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=CUTOFF)
    return by_lower[found[0]] if found else None


def value_at(document: object, path: Sequence[int | str]) -> object:
    """What ``document`` holds at ``path``, or None."""
    for step in path:
        if isinstance(document, dict) and isinstance(step, str):
            document = document.get(step)
        elif isinstance(document, list) and isinstance(step, int) and 0 <= step < len(document):
            document = document[step]
        else:
            return None
    return document


def _where(path: Sequence[int | str]) -> str:
    return ".".join(str(step) for step in path) or "the document"


def unknown_field_message(root: type[BaseModel], path: Sequence[int | str]) -> str:
    """For a field no model at its place has (``path`` ends with it): the field, the closest allowed and all."""
    parent, key = path[:-1], str(path[-1])
    model = model_at(root, parent)
    if model is None:
        return f"unknown field {key!r}"
    allowed = allowed_fields(model)
    match = closest(key, allowed)
    hint = f" (did you mean {match!r}?)" if match else ""
    return f"unknown field {key!r}{hint}; {_where(parent)} takes {', '.join(allowed)}"


def missing_field_message(root: type[BaseModel], path: Sequence[int | str], document: object) -> str:
    """For a required field that is absent: the field, and a field written beside it that was likely meant."""
    parent, key = path[:-1], str(path[-1])
    written = value_at(document, parent)
    model = model_at(root, parent)
    if not isinstance(written, dict) or model is None:
        return f"required field {key!r} is missing"
    allowed = set(allowed_fields(model))
    unknown = [str(k) for k in written if str(k) not in allowed]
    match = closest(key, unknown)
    hint = f"; {_where(parent)} has {match!r}: did you mean {key!r}?" if match else ""
    return f"required field {key!r} is missing{hint}"


def enum_message(value: object, expected: str) -> str:
    """For a value outside an enumeration: pydantic's list of values, and the one likely meant."""
    choices = [part.strip(" '") for part in expected.replace(" or ", ", ").split(",") if part.strip(" '")]
    match = closest(value, choices) if isinstance(value, str) else None
    hint = f" (did you mean {match!r}?)" if match else ""
    return f"{value!r} is not one of {expected}{hint}"


def message_of(root: type[BaseModel], error: Any, document: object) -> str:
    """One pydantic error in the resource's words (its own message for any error but a typo's)."""
    loc = tuple(error["loc"])
    if error["type"] == "extra_forbidden" and loc:
        return unknown_field_message(root, loc)
    if error["type"] == "missing" and loc:
        return missing_field_message(root, loc, document)
    if error["type"] == "enum" and "expected" in (error.get("ctx") or {}):
        return enum_message(error.get("input"), str(error["ctx"]["expected"]))
    return str(error["msg"])
