"""The timeline picture of one trace (kvbridge_sim.trace_timeline): spans nested under their parents, drawn."""

from __future__ import annotations

import json
from pathlib import Path

from kvbridge_sim.trace_timeline import main, ordered


def span(name: str, span_id: str, parent: str, start: int, end: int, error: bool = False) -> dict[str, object]:
    return {
        "name": name,
        "service": "router" if name.startswith("router") else "engine",
        "span_id": span_id,
        "parent_id": parent,
        "start": start,
        "end": end,
        "error": error,
    }


SPANS = [
    span("decode", "d", "r", 50, 90),
    span("router", "r", "", 0, 100),
    span("read", "x", "d", 55, 60),
    span("prefill", "p", "r", 5, 45),
    span("check", "c", "d", 61, 62, error=True),
    span("orphan", "o", "gone", 1, 2),  # its parent was not received: drawn as a root
]


def test_spans_are_ordered_depth_first_children_by_start() -> None:
    assert [(depth, s["name"]) for depth, s in ordered(SPANS)] == [
        (0, "router"),
        (1, "prefill"),
        (1, "decode"),
        (2, "read"),
        (2, "check"),
        (0, "orphan"),
    ]


def test_the_command_draws_a_png(tmp_path: Path) -> None:
    spans = tmp_path / "spans.json"
    spans.write_text(json.dumps(SPANS))
    picture = tmp_path / "trace.png"
    assert main([str(spans), "-o", str(picture), "--title", "a test"]) == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
