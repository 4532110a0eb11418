"""`kvbridge-agent bench --json` prints the contract document (figures are not asserted: a benchmark)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_prints_the_contract_json() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvbridge_agent", "bench", "--json", "--requests", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(result.stdout)
    assert set(document) == {"memcpyGBps", "nixlRawGBps", "results", "handshakeMs"}
    assert document["memcpyGBps"] > 0
    assert document["nixlRawGBps"] > 0
    assert document["handshakeMs"] > 0
    names = [row["name"] for row in document["results"]]
    assert names == ["split-tp1to1", "split-tp2to1", "crosslayer-tp1to1", "crosslayer-tp2to1"]
    for row in document["results"]:
        assert {"name", "cacheKind", "gbps", "ratioToRaw", "ratioToMemcpy", "descriptorsPerRequest",
                "overheadUsPerRequest"} <= set(row)  # fmt: skip
        assert row["gbps"] > 0
        assert row["descriptorsPerRequest"] > 0
