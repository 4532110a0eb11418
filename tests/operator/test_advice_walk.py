"""Advice never loops: every suggestion a problem's message makes (``set spec.X: V``) is applied on its own, and
the problems that follow must not advise setting the same field back; where the search finds no checked fix,
every problem's message still says what to do.

The walk runs over the remedy corpus, the examples, network and template cases, and generated specs (engine kind,
device, connector, MLA, TP sizes, block sizes, layouts, conversion policy, transports).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import Problem
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.children.remedy import apply_fix, suggested_fix
from kvbridge_operator.children.verdict import verdict_for

from .test_remedy import CORPUS, manifest

ROOT = Path(__file__).resolve().parents[2]
#: ``set spec.decode.blockSize: 32``, ``or spec.prefill.tensorParallelSize: 2``: one suggested value per match
_SUGGESTION = re.compile(r"(spec\.[A-Za-z.]+): ([A-Za-z0-9_.-]+)")
#: what a message says when it offers no value to set
_PLAIN = re.compile(r"\b(remove|add|set|use|write|raise|keep|give)\b", re.IGNORECASE)


def problems_of(document: dict[str, Any]) -> list[Problem]:
    result = verdict_for(DisaggregatedDeployment.model_validate(document))
    return result if isinstance(result, list) else []


def alternatives(problem: Problem) -> list[dict[str, Any]]:
    """The changes a message offers after ``set``: alternatives separated by ``, or``/``or``/``,``, each one or
    more ``path: value`` joined by ``and`` (applied together)."""
    if " set " not in problem.message:
        return []
    advice = problem.message.split(" set ", 1)[1]
    found = []
    for alternative in re.split(r",\s*or\s+|\s+or\s+|,\s+(?=spec\.)", advice):
        changes = {
            path: int(raw) if raw.isdigit() else raw.rstrip(".") for path, raw in _SUGGESTION.findall(alternative)
        }
        if changes:
            found.append(changes)
    return found


def suggestions(problem: Problem) -> list[tuple[str, Any]]:
    """Every single ``path: value`` a message offers, alternatives and parts of combined ones alike."""
    return [item for changes in alternatives(problem) for item in changes.items()]


def current(document: dict[str, Any], path: str) -> Any:
    node: Any = document
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def walk(document: dict[str, Any]) -> list[str]:
    """The loops and the silent problems of one document (empty: none)."""
    found: list[str] = []
    try:
        problems = problems_of(document)
    except ValueError:  # a generated spec the schema refuses: not advice
        return found
    for problem in problems:
        if not suggestions(problem) and not _PLAIN.search(problem.message):
            found.append(f"{problem.code}: the message says nothing to do: {problem.message}")
        for changes in alternatives(problem):
            before = {path: current(document, path) for path in changes}
            if any(before[path] is None for path in changes) or all(before[p] == v for p, v in changes.items()):
                continue
            try:
                after = problems_of(apply_fix(document, changes))
            except ValueError:
                found.append(f"{problem.code}: {changes} is a value the schema refuses")
                continue
            for following in after:
                back = [
                    (p, before[p])
                    for p in changes
                    if before[p] != changes[p] and (p, before[p]) in suggestions(following)
                ]
                if back:
                    found.append(f"{problem.code} advises {changes}, then {following.code} advises {back} back")
    if problems and suggested_fix(DisaggregatedDeployment.model_validate(document)) is None:
        for problem in problems:
            if not _PLAIN.search(problem.message):
                found.append(f"{problem.code}: no checked fix and the message does not say what to do")
    return found


def examples() -> dict[str, dict[str, Any]]:
    found = {}
    for path in sorted((ROOT / "examples").rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if isinstance(document, dict) and document.get("kind") == "DisaggregatedDeployment":
                found[str(path.relative_to(ROOT))] = document
    return found


CASES = {
    **CORPUS,
    **examples(),
    "node-local-transports": manifest("net", transfer={"network": {"ucxTransports": ["sm", "cuda_ipc"]}}),
    "unknown-transport": manifest("net", transfer={"network": {"ucxTransports": ["rdma"]}}),
    "vllm-gpu-kvbridge-conversion": manifest(
        "conv", engine={"kind": "VLLM", "connector": "KVBridge"}, prefill={"blockSize": 32}, decode={"blockSize": 16}
    ),
    "vllm-gpu-prefill-conversion": manifest(
        "conv", engine={"kind": "VLLM"}, prefill={"blockSize": 32}, decode={"blockSize": 16}
    ),
    "vllm-cpu-gpu-buffer": manifest(
        "buf",
        engine={"kind": "VLLM", "device": "CPU"},
        transfer={"network": {"kvBufferDevice": "cuda"}},
        prefill={"blockSize": 32},
        decode={"blockSize": 32},
    ),
    "vllm-gpu-nixl-verification-all": manifest("ver", engine={"kind": "VLLM"}, transfer={"verification": "All"}),
    "mla-heads": manifest("mla", model={"attention": "MLA", "numKVHeads": 8, "headDim": 576}),
    "mla-vllm-block": manifest(
        "mla", engine={"kind": "VLLM"}, model={"attention": "MLA", "numKVHeads": 1, "headDim": 576}
    ),
    "template-args": manifest(
        "tpl",
        engine={"kind": "VLLM"},
        decode={
            "template": {
                "spec": {"containers": [{"name": "engine", "args": ["x"], "env": [{"name": "UCX_TLS", "value": "sm"}]}]}
            }
        },
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_advice_loops_and_every_problem_says_what_to_do(name: str) -> None:
    assert walk(CASES[name]) == []


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["Synthetic", "VLLM"]),
    device=st.sampled_from(["GPU", "CPU"]),
    connector=st.sampled_from(["Nixl", "KVBridge"]),
    mla=st.booleans(),
    heads=st.sampled_from([1, 2, 4, 8]),
    tp_p=st.sampled_from([1, 2, 4, 8]),
    tp_d=st.sampled_from([1, 2, 4, 8]),
    bs_p=st.sampled_from([16, 32, 64]),
    bs_d=st.sampled_from([16, 32, 64]),
    layout_p=st.sampled_from(["HND", "NHD"]),
    layout_d=st.sampled_from(["HND", "NHD"]),
    conversion=st.sampled_from(["Auto", "Off"]),
    transports=st.sampled_from([[], ["rc"], ["sm"], ["cuda_ipc", "bogus"]]),
)
def test_generated_specs_get_advice_that_does_not_loop(
    kind: str,
    device: str,
    connector: str,
    mla: bool,
    heads: int,
    tp_p: int,
    tp_d: int,
    bs_p: int,
    bs_d: int,
    layout_p: str,
    layout_d: str,
    conversion: str,
    transports: list[str],
) -> None:
    engine: dict[str, Any] = {"kind": kind, "device": device} | ({"connector": connector} if kind == "VLLM" else {})
    model: dict[str, Any] = {"numKVHeads": heads} | ({"attention": "MLA", "headDim": 576} if mla else {})
    document = manifest(
        "gen",
        engine=engine,
        model=model,
        transfer={"conversion": conversion, "network": {"ucxTransports": transports}},
        prefill={"tensorParallelSize": tp_p, "blockSize": bs_p, "kvLayout": layout_p},
        decode={"tensorParallelSize": tp_d, "blockSize": bs_d, "kvLayout": layout_d},
    )
    assert walk(document) == []
