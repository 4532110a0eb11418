"""One request's trace as a timeline picture: a bar per span, nested under its parent, on a common clock.

    python -m kvbridge_sim.trace_timeline SPANS.json -o docs/images/trace-timeline.png

``SPANS.json`` is a list of spans as tests/vllm/test_tracing.py writes them (``KVBRIDGE_TRACE_DUMP``): each with
``name``, ``service``, ``span_id``, ``parent_id``, ``start`` and ``end`` (Unix nanoseconds) and ``error``; the spans
of one trace, as an OTLP receiver decoded them. Bars are coloured by the process that sent them (the router, the
prefill engine, the decode engine) and labelled with the span's name and duration; an error is drawn hatched.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948")


def ordered(spans: Sequence[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """The spans depth-first from the root, children by start: ``(depth, span)``; spans whose parent is not in the
    trace are roots."""
    ids = {span["span_id"] for span in spans}
    children: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        parent = span["parent_id"] if span["parent_id"] in ids else ""
        children.setdefault(parent, []).append(span)
    out: list[tuple[int, dict[str, Any]]] = []
    stack = [(0, span) for span in sorted(children.get("", []), key=lambda s: s["start"], reverse=True)]
    while stack:
        depth, span = stack.pop()
        out.append((depth, span))
        below = sorted(children.get(span["span_id"], []), key=lambda s: s["start"], reverse=True)
        stack.extend((depth + 1, child) for child in below)
    return out


def draw(spans: Sequence[dict[str, Any]], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = ordered(spans)
    if not rows:
        raise ValueError("no spans to draw")
    origin = min(span["start"] for _, span in rows)
    services = sorted({span["service"] for _, span in rows})
    colour = {service: COLOURS[i % len(COLOURS)] for i, service in enumerate(services)}
    figure, axes = plt.subplots(figsize=(12, 0.42 * len(rows) + 1.8))
    for row, (depth, span) in enumerate(rows):
        start, length = (span["start"] - origin) / 1e6, max((span["end"] - span["start"]) / 1e6, 0.05)
        axes.barh(
            row,
            length,
            left=start,
            color=colour[span["service"]],
            hatch="//" if span.get("error") else None,
            edgecolor="black",
            linewidth=0.4,
        )
        label = f"{'    ' * depth}{span['name']}  {length:.1f} ms"
        axes.text(-0.55, row, label, transform=axes.get_yaxis_transform(), ha="left", va="center", fontsize=8)
    axes.set_yticks([])
    axes.invert_yaxis()
    axes.set_xlabel("milliseconds since the request reached the router")
    axes.legend(
        handles=[Patch(color=colour[s], label=s) for s in services],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.1 - 0.5 / len(rows)),
        ncol=len(services),
        fontsize=8,
    )
    axes.set_title(title or f"one request, {len(rows)} spans", fontsize=10)
    figure.subplots_adjust(left=0.36, right=0.98, bottom=0.2)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge_sim.trace_timeline", description=__doc__.split("\n")[0])
    parser.add_argument("spans", type=Path, help="the trace's spans (JSON, as tests/vllm/test_tracing.py dumps them)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--title", default="", help="the picture's title")
    args = parser.parse_args(argv)
    draw(json.loads(args.spans.read_text()), args.output, args.title)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
