"""The bench's figure: throughput against descriptor size, per cache kind, with the ceilings as lines."""

from __future__ import annotations

from typing import Any

MARKERS = {"Split": "o", "BlocksFirst": "s", "CrossLayer": "D", "MLA": "^"}


def plot(result: dict[str, Any], path: str) -> None:
    """Write a PNG of one ``bench`` result (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 5.5), dpi=110)
    sweep = result["descriptorSweep"]
    axes.plot(
        [row["descriptorBytes"] for row in sweep],
        [row["gbps"] for row in sweep],
        color="tab:gray",
        marker=".",
        label="raw NIXL, descriptors of one size in shuffled order",
    )
    axes.axhline(result["memcpyGBps"], color="black", linestyle="--", label=f"memcpy {result['memcpyGBps']:.1f} GB/s")
    axes.axhline(
        result["nixlRawGBps"],
        color="tab:red",
        linestyle=":",
        label=f"raw NIXL, one descriptor {result['nixlRawGBps']:.1f} GB/s",
    )
    for kind, marker in MARKERS.items():
        for ids, fill in (("contiguous", True), ("scattered", False)):
            rows = [
                r
                for r in result["results"]
                if (("MLA" if r["attention"] == "MLA" else r["cacheKind"]) == kind) and r["blockIds"] == ids
            ]
            if rows:
                axes.scatter(
                    [r["bytesPerDescriptor"] for r in rows],
                    [r["gbps"] for r in rows],
                    marker=marker,
                    s=46,
                    facecolors=None if fill else "none",
                    edgecolors=f"C{list(MARKERS).index(kind)}",
                    color=f"C{list(MARKERS).index(kind)}",
                    label=f"kvbridge {kind}, {ids} block ids",
                )
    axes.set_xscale("log", base=2)
    axes.set_xlabel("bytes per descriptor (kvbridge: bytes / descriptors of a request)")
    axes.set_ylabel("GB/s")
    axes.set_ylim(bottom=0)
    axes.set_title("kvbridge READ throughput vs descriptor size (host memory, two processes)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
