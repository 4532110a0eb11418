"""The W3C trace-context checks the router and the connector share: what they pass on is well formed, whatever a
client sent, and nothing raises."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from kvbridge_agent.core.tracing import context_of, trace_context, valid_traceparent, valid_tracestate

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
STRICT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def test_a_valid_context_is_kept_and_a_bad_one_dropped() -> None:
    assert trace_context([GOOD], ["a=1, b@t=2"]) == {"traceparent": GOOD, "tracestate": "a=1, b@t=2"}
    assert trace_context([GOOD], ["a=1", "b=2"]) == {"traceparent": GOOD, "tracestate": "a=1,b=2"}
    assert trace_context([GOOD], ["A=1"]) == {"traceparent": GOOD}
    assert trace_context([GOOD, GOOD], []) == {}
    assert trace_context([], ["a=1"]) == {}
    assert not valid_traceparent(GOOD.replace("00-", "01-", 1))
    assert not valid_traceparent(GOOD + "\n")
    assert valid_tracestate("")
    assert valid_tracestate(",,a=1,")
    assert context_of({"traceparent": GOOD}) == {"traceparent": GOOD}
    assert context_of(None) == {}


@given(st.lists(st.text(max_size=80), max_size=3), st.lists(st.text(max_size=80), max_size=3))
def test_whatever_a_client_sends_what_goes_on_is_well_formed(parents: list[str], states: list[str]) -> None:
    found = trace_context(parents, states)
    assert set(found) <= {"traceparent", "tracestate"}
    if found:
        assert STRICT.fullmatch(found["traceparent"])
    assert all(0x20 <= ord(c) < 0x7F for c in found.get("tracestate", ""))
