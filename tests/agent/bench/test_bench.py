"""`kvbridge-agent bench --quick --json` prints the contract document (figures are not asserted: a benchmark)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # a whole bench run and its figure: about 45 s on 2 cores (`make test` runs it)
def test_bench_prints_the_contract_json_and_the_plot(tmp_path: Path) -> None:
    figure = tmp_path / "bench.png"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbridge_agent",
            "bench",
            "--json",
            "--quick",
            "--requests",
            "1",
            "--plot",
            str(figure),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(result.stdout)
    assert {"memcpyGBps", "nixlRawGBps", "results", "handshakeMs", "descriptorSweep", "peakRssMiB", "targets"} <= set(
        document
    )
    assert document["memcpyGBps"] > 0
    assert document["nixlRawGBps"] > 0
    assert document["handshakeMs"] > 0
    assert [row["descriptorBytes"] for row in document["descriptorSweep"]] == [4 << 10 << (2 * i) for i in range(6)]
    names = [row["name"] for row in document["results"]]
    assert names == [
        "split-tp1to1-contiguous",
        "split-tp1to1-scattered",
        "crosslayer-tp1to1-contiguous",
        "crosslayer-tp1to1-scattered",
    ]
    for row in document["results"]:
        assert row["gbps"] > 0
        assert row["descriptorsPerRequest"] > 0
        assert row["bytesPerDescriptor"] * row["descriptorsPerRequest"] == row["bytesPerRequest"]
        assert row["overheadUsPerRequest"] > 0
        assert row["nixlMakeUsPerRequest"] > 0
        # the bench divides unrounded figures; gbps and nixlRawGBps are printed rounded, so allow their rounding
        assert row["ratioToRaw"] == pytest.approx(row["gbps"] / document["nixlRawGBps"], abs=2e-3)
    split, crosslayer = document["results"][0], document["results"][2]
    assert split["descriptorsPerRequest"] == 64 * crosslayer["descriptorsPerRequest"]  # 32 layers x (K, V)
    assert document["peakRssMiB"]["largestEngineProcess"] > 0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "progress" not in result.stdout  # progress goes to stderr only
    assert "split-tp1to1-contiguous" in result.stderr
