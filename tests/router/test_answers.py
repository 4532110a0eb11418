"""A decode stream passed on whole events at a time (answers.WholeEvents)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvbridge_router.answers import _MAX_HELD_BYTES, WholeEvents

EVENTS = [b'data: {"choices": [{"text": "a"}]}', b'data: {"choices": [{"text": "b"}]}', b"data: [DONE]"]


@given(st.sampled_from([b"\n\n", b"\r\n\r\n", b"\r\r"]), st.lists(st.integers(min_value=1, max_value=40), max_size=12))
def test_any_cut_of_a_stream_is_passed_on_whole_events_at_a_time(separator: bytes, cuts: list[int]) -> None:
    stream = b"".join(event + separator for event in EVENTS)
    whole, passed, start = WholeEvents(), [], 0
    for size in [*cuts, len(stream)]:
        piece, start = stream[start : start + size], start + size
        if piece:
            out = whole.feed(piece)
            if out:
                passed.append(out)
                assert out.endswith(separator)  # never half an event
    assert b"".join(passed) + whole.rest() == stream


def test_what_is_held_is_an_events_beginning_and_a_stream_without_events_is_bounded() -> None:
    whole = WholeEvents()
    assert whole.feed(b'data: {"choi') == b""
    assert whole.feed(b'ces": []}\n\ndata: {"cho') == b'data: {"choices": []}\n\n'
    assert whole.rest() == b'data: {"cho'  # at the end: passed on as it is
    plain = WholeEvents()
    assert plain.feed(b"x" * _MAX_HELD_BYTES) == b""
    assert plain.feed(b"y") == b"x" * _MAX_HELD_BYTES + b"y"  # not Server-Sent Events: not held past the bound
    assert plain.rest() == b""
