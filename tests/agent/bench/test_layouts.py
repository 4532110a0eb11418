"""``kvbridge-agent bench --layouts``: its cases, its target logic, and one tiny run of every case (prefill and
decode in this process, real NIXL on DRAM, vLLM's allocator) whose rows have the paired-run descriptor counts and
the model's bytes. Figures are not asserted: a benchmark."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from kvbridge_agent.bench.layout_cases import CROSS_LAYER, LAYOUTS, LLAMA_8B, LLAMA_70B, Case, cache_bytes, cases
from kvbridge_agent.bench.layouts import add_ratios, targets, transport_note
from kvbridge_agent.core import ModelGeometry

LAYERS, HEADS, TOKENS = 3, 2, 64
TINY = ModelGeometry(name="tiny-geometry", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=64)

#: descriptors per 16-token chunk of the tiny model, from the layouts themselves (docs/protocol.md §1b): a per-layer
#: layout with heads outside tokens is one run per layer, LHBNC one per layer and head, a cross-layer layout one per
#: block; TP 2 -> 1 reads each layer from both prefill ranks; decode's 32-token LBHNC block splits each 16-token
#: chunk per head; LBHNC into LBNHC pairs single tokens of single heads; BHLNC at TP 2 -> 1 is one run per prefill
#: rank (its heads are outermost in decode's block)
RUNS_PER_CHUNK = {
    "LBHNC": LAYERS,
    "LBNHC": LAYERS,
    "LHBNC": LAYERS * HEADS,
    "BLHNC": 1,
    "BLNHC": 1,
    "BHLNC": 1,
    "LBHNC-tp2to1": 2 * LAYERS,
    "BHLNC-tp2to1": 2,
    "LBHNC-block16to32": LAYERS * HEADS,
    "LBHNC-to-BLHNC": LAYERS,
    "LBHNC-to-LBNHC": LAYERS * HEADS * 16,
}


def test_the_cases_cover_every_layout_and_the_heterogeneous_pairs() -> None:
    chosen = cases()
    assert [c.name for c in chosen] == list(RUNS_PER_CHUNK)
    assert [c.prefill.layout for c in chosen if c.kind == "same"] == list(LAYOUTS)
    assert all(c.prefill == c.decode for c in chosen if c.kind == "same")
    assert {c.kind for c in chosen} == {"same", "tp", "block", "order"}
    tp = [c for c in chosen if c.kind == "tp"]
    assert [(c.prefill.tp, c.decode.tp, c.prefill.layout) for c in tp] == [(2, 1, "LBHNC"), (2, 1, "BHLNC")]
    assert [c.name for c in cases(quick=True)] == ["LBHNC", "BLHNC", "LBHNC-tp2to1"]
    assert [c.name for c in cases(names=["LBHNC-tp2to1", "BLNHC"])] == ["BLNHC", "LBHNC-tp2to1"]
    with pytest.raises(ValueError, match="no layout case HND"):
        cases(names=["HND"])


def test_the_largest_case_stays_under_6_gib() -> None:
    largest = max(cache_bytes(model, case, 2048) for model in (LLAMA_8B, LLAMA_70B) for case in cases())
    # 70B, 16 -> 32-token blocks: 258 blocks of 16 tokens on prefill, 130 of 32 on decode (room for two requests)
    assert largest == (258 * 16 + 130 * 32) * LLAMA_70B.kv_bytes_per_token
    assert largest < 6 << 30


def _row(case: str, kind: str, gbps: float, blocks: str = "contiguous") -> dict[str, Any]:
    return {
        "name": case,
        "case": case,
        "kind": kind,
        "blockIds": blocks,
        "gbps": gbps,
        "bytesPerDescriptor": 32768,
        "ratioToRawHere": round(gbps / 6.0, 3),
    }


def test_targets_take_the_worst_row_they_cover() -> None:
    rows = [
        _row("BLHNC", "same", 6.0),
        _row("BHLNC", "same", 5.0, "scattered"),
        _row("LBHNC", "same", 1.0),  # per-layer, same TP: no target
        _row("LBHNC-tp2to1", "tp", 5.0),
        _row("LBHNC-tp2to1", "tp", 1.0, "scattered"),  # the hetero-TP target is the contiguous one
        _row("BHLNC-tp2to1", "tp", 0.5),  # and the per-layer one
    ]
    sweep = [{"descriptorBytes": 4096, "gbps": 1.0}, {"descriptorBytes": 1 << 20, "gbps": 4.0}]
    add_ratios(rows, memcpy=10.0, raw=6.0, sweep=sweep)
    assert rows[0]["ratioToRaw"] == 1.0
    assert rows[0]["ratioToMemcpy"] == 0.6
    assert 1.0 < rows[0]["ratioToRawAtDescriptorSize"] < 6.0  # 32 KiB lies between the sweep's points
    cross, hetero = targets(rows)
    assert (cross["worst"], cross["met"]) == ("BHLNC (direct)", False)
    assert cross["measured"] == pytest.approx(5 / 6, abs=1e-3)
    assert (hetero["worst"], hetero["met"]) == ("LBHNC-tp2to1 (direct)", True)
    assert hetero["measured"] == pytest.approx(5 / 6, abs=1e-3)
    assert set(CROSS_LAYER) == {"BLHNC", "BLNHC", "BHLNC"}


def test_staged_targets_judge_the_cost_models_pick_and_the_better_mode() -> None:
    """Issue 60: every case at 0.8 x raw NIXL, on the mode the cost model picks, and on the better of the two."""
    direct = [_row("LBHNC-to-LBNHC", "order", 0.3), _row("LBHNC", "same", 5.4)]
    staged = [
        {**_row("LBHNC-to-LBNHC", "order", 5.0), "mode": "staged", "costModelPick": "staged"},
        {**_row("LBHNC", "same", 4.2), "mode": "staged", "costModelPick": "direct"},
    ]
    rows = [*direct, *staged]
    add_ratios(rows, memcpy=10.0, raw=6.0, sweep=[{"descriptorBytes": 4096, "gbps": 1.0}])
    by_target = {t["target"].split(",")[1].strip(): t for t in targets(rows) if t["target"].startswith("every")}
    picked = by_target["the mode the cost model picks >= 0.8 x raw NIXL"]
    assert (picked["worst"], picked["met"]) == ("LBHNC-to-LBNHC (staged)", True)
    best = by_target["the better of direct and staged >= 0.8 x raw NIXL"]
    assert (best["worst"], best["met"]) == ("LBHNC-to-LBNHC (staged)", True)
    rows[3]["costModelPick"] = "staged"  # a pick that was the slower mode: judged on it
    picked = {t["target"]: t for t in targets(rows)}["every case, the mode the cost model picks >= 0.8 x raw NIXL"]
    assert (picked["worst"], picked["met"]) == ("LBHNC (staged)", False)


def test_a_tiny_run_reads_each_case_directly_and_staged_byte_for_byte() -> None:
    """Staged rows (docs/protocol.md §4d) beside the direct ones: the same bytes in a few descriptors."""
    pytest.importorskip("nixl")
    from kvbridge_agent.bench.layout_prefill import LocalPrefill, own_views
    from kvbridge_agent.bench.layouts import MODES, run_case

    prefills = [LocalPrefill(), LocalPrefill()]
    chosen = cases(names=["LBHNC-tp2to1", "LBHNC-block16to32", "LBHNC-to-LBNHC"])
    for case in chosen:
        rows = run_case(functools.partial(own_views, "cpu"), TINY, case, prefills, TOKENS, 1, modes=MODES)
        assert [(r["mode"], r["blockIds"]) for r in rows] == [(m, a) for m in MODES for a in case.allocations]
        for direct, staged in zip(rows[: len(case.allocations)], rows[len(case.allocations) :], strict=True):
            assert staged["stagedShare"] == 1.0, case.name
            assert staged["bytesPerRequest"] == direct["bytesPerRequest"]
            assert staged["descriptorsPerRequest"] <= direct["descriptorsPerRequest"]
            assert staged["into"] in ("blocks", "buffer")
            assert staged["costModelPick"] in ("staged", "direct")


@pytest.mark.parametrize("allocator", ["vllm", "kvbridge"])
def test_a_tiny_run_of_every_case_gives_the_paired_runs_and_the_models_bytes(allocator: str) -> None:
    """Through vLLM's allocator, and through kvbridge's own views (what a GPU machine without vLLM runs)."""
    pytest.importorskip("vllm")
    pytest.importorskip("nixl")
    from kvbridge_agent.bench.layout_prefill import Allocate, LocalPrefill, own_views
    from kvbridge_agent.bench.layouts import run_case
    from kvbridge_agent.vllm_connector.host_cache import allocate_host_views

    allocate: Allocate = allocate_host_views if allocator == "vllm" else functools.partial(own_views, "cpu")
    prefills = [LocalPrefill(), LocalPrefill()]
    chosen: list[Case] = cases()
    for case in chosen:
        rows = run_case(allocate, TINY, case, prefills, TOKENS, requests=1)
        assert [row["blockIds"] for row in rows] == list(case.allocations)
        for row in rows:
            assert row["name"] == f"{case.name}-tiny-{row['blockIds']}"
            unmerged = RUNS_PER_CHUNK[case.name] * TOKENS // 16  # one per paired run of each 16-token chunk
            if row["blockIds"] == "scattered":  # no two ids adjacent on both sides: nothing to coalesce
                assert row["descriptorsPerRequest"] == unmerged, case.name
            else:  # contiguous ids: NIXL merges adjacent runs (docs/protocol.md §4c)
                assert 0 < row["descriptorsPerRequest"] <= unmerged, case.name
            assert row["bytesPerRequest"] == TINY.kv_bytes_per_token * TOKENS // case.decode.tp
            assert row["bytesPerDescriptor"] * row["descriptorsPerRequest"] == row["bytesPerRequest"]
            assert row["gbps"] > 0
            assert row["ownUsPerRequest"] >= row["idsUsPerRequest"] > 0
            assert row["rawHereGBps"] > 0
            assert row["ratioToRawHere"] == pytest.approx(row["gbps"] / row["rawHereGBps"], abs=2e-3)


def test_a_gpu_transport_far_below_the_gpus_own_copy_is_named_with_what_to_try(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On an H100 without NVLink peers UCX emulated READs between two processes over TCP (0.52 GB/s against the
    GPU's 1,334): the bench says so and names UCX's variable; on host memory or at GPU speed it says nothing."""
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    note = transport_note("cuda", 1333.6, 0.52)
    assert "0.52 GB/s" in note
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in note
    assert transport_note("cuda", 1385.8, 1365.3) == ""
    assert transport_note("cpu", 11.6, 0.1) == ""
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "n")  # set, but off: the same advice
    assert "try UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in transport_note("cuda", 1333.6, 0.52)
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    assert "is set, so look at UCX_TLS" in transport_note("cuda", 1333.6, 0.52)
