"""The demo's text report shows what `kubectl get dd` shows, Available beside Ready (a scale-up in progress serves)."""

from __future__ import annotations

from kvbridge_sim.demo_report import entry_of, render_text


def test_the_report_shows_available_beside_ready() -> None:
    obj = {
        "metadata": {"name": "tiny-cpu"},
        "status": {
            "conditions": [
                {"type": "Ready", "status": "False"},
                {"type": "Available", "status": "True"},
            ],
            "prefill": {"ready": "1/1"},
            "decode": {"ready": "1/3"},
            "tp": "1->1",
        },
    }
    text = render_text({"deployments": [entry_of(obj)], "events": [], "ok": True})
    header, row = text.splitlines()[1:3]
    assert header.split() == ["NAME", "READY", "AVAILABLE", "PREFILL", "DECODE", "TP"]
    assert row.split() == ["tiny-cpu", "False", "True", "1/1", "1/3", "1->1"]
