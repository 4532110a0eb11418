"""A decode stream passed on whole events at a time (answers.WholeEvents)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvbridge_router.answers import _MAX_HELD_BYTES, Start, StreamStart, WholeEvents

EVENTS = [b'data: {"choices": [{"text": "a"}]}', b'data: {"choices": [{"text": "b"}]}', b"data: [DONE]"]
#: every pair of line endings (LF, CR, CRLF) ends an event
BLANK_LINES = [b"\n\n", b"\r\r", b"\r\n\r\n", b"\n\r\n", b"\r\n\n", b"\n\r", b"\r\n\r"]


def ends_an_event(data: bytes) -> bool:
    return data.endswith((b"\n\n", b"\r\r", b"\n\r"))


@given(st.sampled_from(BLANK_LINES), st.lists(st.integers(min_value=1, max_value=40), max_size=12))
def test_any_cut_of_a_stream_is_passed_on_whole_events_at_a_time(blank: bytes, cuts: list[int]) -> None:
    stream = b"".join(event + blank for event in EVENTS)
    whole, passed, start = WholeEvents(), [], 0
    for size in [*cuts, len(stream)]:
        piece, start = stream[start : start + size], start + size
        if piece:
            out = whole.feed(piece)
            if out:
                passed.append(out)
                assert ends_an_event(out)  # never half an event
    assert b"".join(passed) + whole.rest() == stream
    assert b"".join(passed).count(b"data: ") == len(EVENTS)  # every event passed on once it ended


def test_what_is_held_is_an_events_beginning_and_a_stream_without_events_is_bounded() -> None:
    whole = WholeEvents()
    assert whole.feed(b'data: {"choi') == b""
    assert whole.feed(b'ces": []}\n') == b""
    assert whole.feed(b'\ndata: {"cho') == b'data: {"choices": []}\n\n'  # an end split over two chunks
    assert whole.rest() == b'data: {"cho'  # at the end: passed on as it is
    plain = WholeEvents()
    for _ in range(_MAX_HELD_BYTES // 1024):  # held as the pieces came, not joined again at each one
        assert plain.feed(b"x" * 1024) == b""
    assert len(plain._held) == _MAX_HELD_BYTES // 1024
    assert plain.feed(b"y") == b"x" * _MAX_HELD_BYTES + b"y"  # not Server-Sent Events: not held past the bound
    assert plain.rest() == b""


@given(st.sampled_from(BLANK_LINES), st.integers(min_value=1, max_value=60))
def test_a_streams_first_token_is_found_whatever_its_line_endings_and_cuts(blank: bytes, cut: int) -> None:
    """A stream is held back until its first token (StreamStart): events ended by any blank line are judged as they
    end, not held to the stream's end."""
    role = b'data: {"choices": [{"delta": {"role": "assistant"}}]}' + blank
    stream = role + b'data: {"choices": [{"delta": {"content": "a"}}]}' + blank
    start = StreamStart()
    states = [start.feed(piece) for piece in (stream[:cut], stream[cut:]) if piece]
    assert states[-1] is Start.STARTED
    aborted = StreamStart()
    assert aborted.feed(role + b'data: {"choices": [{"finish_reason": "abort"}]}' + blank) is Start.FAILED
