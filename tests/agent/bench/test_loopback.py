"""`kvbridge-agent loopback`: every TP rank its own process, real side channel and NIXL, every byte verified."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge_agent.bench.loopback import loopback
from kvbridge_agent.core import Attention, CacheKind, ModelGeometry, RoleSettings
from kvbridge_agent.core.contract import PairSpec

ROOT = Path(__file__).parents[3]
EXAMPLES = ROOT / "examples" / "synthetic"


def pair(tp_p: int, tp_d: int, *, kind: str = "Split", mla: bool = False, decode_layout: str = "HND") -> PairSpec:
    model = ModelGeometry(
        name="tiny",
        num_layers=2,
        num_kv_heads=1 if mla else 8,
        head_dim=64 if mla else 32,
        attention=Attention.MLA if mla else Attention.DENSE,
        cache_kind=CacheKind(kind),
    )
    return PairSpec(
        model=model,
        prefill=RoleSettings(tensor_parallel_size=tp_p),
        decode=RoleSettings.model_validate({"tensorParallelSize": tp_d, "kvLayout": decode_layout}),
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow  # processes per rank for each pairing: about 95 s on 2 cores (`make test` runs it)
@pytest.mark.parametrize(
    ("spec", "label"),
    [
        (pair(1, 1, kind="CrossLayer"), "1to1-cross-layer"),
        (pair(1, 2, mla=True), "1to2-mla"),
        (pair(4, 2, kind="BlocksFirst"), "4to2-blocks-first"),
        (pair(2, 4, decode_layout="NHD"), "2to4-decode-nhd"),
        (pair(4, 1), "4to1-split"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_tp_pairs_verify_across_processes(spec: PairSpec, label: str) -> None:
    report = loopback(label, spec, requests=6, seed=3, num_blocks=32)
    assert report.failures == []
    assert report.ok
    assert (report.verified, report.requests) == (6, 6)
    assert report.bytes > 0
    assert report.prefill_ranks == spec.prefill.tensor_parallel_size


@pytest.mark.slow  # the CLI for each example: about 55 s on 2 cores (`make test` runs it)
@pytest.mark.parametrize("example", ["llama3-8b-hetero-tp", "deepseek-mla", "hetero-block-size"])
def test_cli_json_for_each_example(example: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbridge_agent",
            "loopback",
            "-f",
            str(EXAMPLES / f"{example}.yaml"),
            "--num-layers",
            "2",
            "--num-blocks",
            "48",
            "--requests",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(result.stdout)
    assert set(document) == {
        "ok",
        "requests",
        "verifiedRequests",
        "failures",
        "bytesTransferred",
        "seconds",
        "gbps",
        "prefillRanks",
        "decodeRanks",
        "descriptorsPerRequest",
    }
    assert document["ok"] is True
    assert document["verifiedRequests"] == document["requests"] == 8
    assert document["gbps"] > 0


def test_incompatible_example_is_refused_before_anything_starts() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbridge_agent",
            "loopback",
            "-f",
            str(EXAMPLES / "incompatible-replicated-heads.yaml"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1
    assert "PREFILL_HEADS_REPLICATED" in result.stderr
    assert result.stdout == ""
