"""What a request's prompt is, read without HTTP: the checks admission refuses by and kv-aware scores by; pure."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import numpy as np
import numpy.typing as npt

#: a list of token ids as msgspec checks it: ints (strictly: not bools, not floats), none negative
_IDS = list[Annotated[int, msgspec.Meta(ge=0)]]


def one_prompt(prompt: Any) -> Any:
    """``prompt`` itself, or the one prompt of a list holding one (a string or a list of token ids; a prompt admission
    kept as :class:`TokenIds` is one already)."""
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


#: the bytes a flat JSON array of non-negative integers is written with (digits, commas, brackets, whitespace)
_ID_BYTES = b"0123456789,[] \t\r\n"
_SPACE = b" \t\r\n"
#: the most digits of an id kept as text (a 64-bit id has at most 20): a longer one's prompt is decoded and judged
#: as any other
MAX_ID_DIGITS = 20
_COMMA = ord(",")
#: the ufuncs themselves (``np.diff`` and ``ndarray.max`` go through Python wrappers: 50 µs a request under load)
_SUBTRACT, _LARGEST = np.subtract, np.maximum.reduce


class TokenIds:
    """A prompt of token ids kept as JSON text, never made into Python integers: admission
    (:meth:`read`) checks it, kv-aware keys it (prefixes.py) and prefill is sent it from its text. (Decoded, a
    1,700-id prompt's integers cost the router about 0.3 ms a request among the index's million keys.)

    ``text``: the ids as the client wrote them without brackets or whitespace (``1,2,3``), one spelling per list of
    ids (what prefill is sent); ``commas``: where ``text``'s commas are, so that the ``k``-th id ends at
    ``commas[k]``. Not JSON to the standard library's or msgspec's encoders without a hook (encoding.py has them)."""

    __slots__ = ("commas", "text")

    def __init__(self, text: bytes) -> None:
        self.text = text
        # the array's own method, not numpy's functions: those are Python wrappers, costly on a request's cold caches
        self.commas: npt.NDArray[np.intp] = (np.frombuffer(text, np.uint8) == _COMMA).nonzero()[0]

    @classmethod
    def read(cls, raw: bytes | msgspec.Raw) -> TokenIds | None:
        """``raw``, a JSON value whose syntax msgspec's parser has checked (``msgspec.Raw``), as token ids when it is a
        non-empty flat array of integers of at most :data:`MAX_ID_DIGITS` digits (what :func:`token_ids` accepts, as
        nearly every client writes it: its bytes are digits, commas, whitespace and one pair of brackets, so ASCII);
        None otherwise, for the caller to decode."""
        data = bytes(raw)
        if data[:1] != b"[" or data.find(b"[", 1) >= 0 or data.translate(None, _ID_BYTES):
            return None  # text, an object, a float, a negative number, a nested list
        inner = data[1:-1]
        text = inner.translate(None, _SPACE) if any(space in inner for space in _SPACE) else inner
        if not text:
            return None  # []: the caller refuses it
        ids = cls(text)
        commas = ids.commas
        if len(commas):  # the longest id: the first, the last, or one between two commas
            gaps = _LARGEST(_SUBTRACT(commas[1:], commas[:-1]), initial=1)
            widest = max(int(commas[0]), len(text) - 1 - int(commas[-1]), int(gaps) - 1)
        else:
            widest = len(text)
        return ids if widest <= MAX_ID_DIGITS else None

    @classmethod
    def of(cls, ids: list[int]) -> TokenIds:
        """A non-empty list of token ids (checked: :func:`token_ids`) in the same form, keyed alike."""
        if not ids:
            raise ValueError("a prompt of no token ids")
        return cls(_ENCODE(ids)[1:-1])

    def __len__(self) -> int:
        return len(self.commas) + 1

    def ids(self) -> list[int]:
        """The ids as Python integers (for the few uses that need them: none on a request's way)."""
        ids: list[int] = _DECODE_IDS(b"[" + self.text + b"]")
        return ids

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenIds) and self.text == other.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"TokenIds({len(self)} ids)"


_ENCODE = msgspec.json.Encoder().encode
_DECODE_IDS = msgspec.json.Decoder(list[int]).decode
