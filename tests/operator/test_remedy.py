"""Every problem at once, advice that names the field and the value, and one checked fix for all of them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge_operator.api.spec import DisaggregatedDeployment, parse_deployment
from kvbridge_operator.children.remedy import apply_fix, suggested_fix
from kvbridge_operator.children.verdict import verdict_for

ROOT = Path(__file__).resolve().parents[2]


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": {"name": "m", "numLayers": 2, "numKVHeads": 8, "headDim": 64}}
    for key, value in spec.items():
        base[key] = {**base.get(key, {}), **value}
    return {
        "apiVersion": "kvbridge.io/v1alpha1",
        "kind": "DisaggregatedDeployment",
        "metadata": {"name": name},
        "spec": base,
    }


CORPUS = {
    # compatibility problems, vLLM extraArgs, CPU rules and an fp8 cache, all in one manifest
    "many": manifest(
        "many",
        engine={"kind": "VLLM", "device": "CPU", "extraArgs": ["--pipeline-parallel-size=2", "--block_size=8"]},
        model={"numKVHeads": 6, "kvCacheDtype": "fp8_e4m3"},
        transfer={"conversion": "Off"},
        prefill={"tensorParallelSize": 4, "blockSize": 16, "kvLayout": "NHD"},
        decode={"tensorParallelSize": 3, "blockSize": 48},
    ),
    # a compatibility rule (merge with TP fan-in) and a vLLM rule (prefill must not permute) together
    "merge-and-permute": manifest(
        "merge-and-permute",
        engine={"kind": "VLLM"},
        prefill={"tensorParallelSize": 2, "blockSize": 16, "kvLayout": "NHD"},
        decode={"tensorParallelSize": 1, "blockSize": 32, "kvLayout": "HND"},
    ),
    "conversion-off": manifest(
        "conversion-off",
        transfer={"conversion": "Off"},
        prefill={"tensorParallelSize": 4, "kvLayout": "NHD"},
        decode={"tensorParallelSize": 3, "blockSize": 48},
    ),
    "replicated-heads": manifest(
        "replicated-heads",
        model={"numKVHeads": 2},
        prefill={"tensorParallelSize": 4},
        decode={"tensorParallelSize": 1},
    ),
    "cross-layer": manifest(
        "cross-layer",
        model={"cacheKind": "CrossLayer"},
        prefill={"kvLayout": "NHD", "blockSize": 32},
        decode={"blockSize": 16},
    ),
    "blocks-not-dividing": manifest("blocks", prefill={"blockSize": 24}, decode={"blockSize": 16}),
    "cpu-ratio": manifest(
        "cpu-ratio", engine={"kind": "VLLM", "device": "CPU"}, prefill={"blockSize": 16}, decode={"blockSize": 96}
    ),
}


def codes(doc: dict[str, Any]) -> set[str]:
    result = verdict_for(DisaggregatedDeployment.model_validate(doc))
    assert isinstance(result, list)
    return {problem.code for problem in result}


def test_compatibility_and_engine_problems_come_in_one_round() -> None:
    assert codes(CORPUS["many"]) == {
        "HEADS_NOT_DIVISIBLE",
        "TP_NOT_DIVISIBLE",
        "MERGE_WITH_TP_FAN_IN",
        "VLLM_UNMODELLED_ARGUMENT",
        "VLLM_MANAGED_ARGUMENT",
        "VLLM_CPU_BLOCK_SIZE",
        "VLLM_CPU_KV_LAYOUT",
        "VLLM_CPU_BLOCK_SIZE_RATIO",
        "VLLM_CPU_KV_CACHE_DTYPE",
    }
    # before: the prefill-side permute vLLM cannot do was looked at only once the plan existed
    assert codes(CORPUS["merge-and-permute"]) == {"MERGE_WITH_TP_FAN_IN", "VLLM_PREFILL_CONVERSION"}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_every_problem_says_which_field_to_set_to_what(name: str) -> None:
    result = verdict_for(DisaggregatedDeployment.model_validate(CORPUS[name]))
    assert isinstance(result, list)
    for problem in result:
        assert re.search(r"set spec\.[a-zA-Z.]+: \S+|remove it from extraArgs", problem.message), problem


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_the_suggested_fix_makes_the_manifest_compatible(name: str) -> None:
    dd = DisaggregatedDeployment.model_validate(CORPUS[name])
    fix = suggested_fix(dd)
    assert fix, name
    assert not any(
        path.startswith("spec.model.") and path.split(".")[2] not in ("kvCacheDtype", "cacheKind") for path in fix
    )
    fixed = DisaggregatedDeployment.model_validate(apply_fix(CORPUS[name], fix))
    assert not isinstance(verdict_for(fixed), list)


def test_a_compatible_manifest_gets_no_fix() -> None:
    assert suggested_fix(DisaggregatedDeployment.model_validate(manifest("fine"))) is None


def test_the_fix_for_two_rules_on_one_field_satisfies_both() -> None:
    # a compatibility rule asks decode for 16-token blocks, vLLM's CPU attention for multiples of 32
    dd = DisaggregatedDeployment.model_validate(
        manifest(
            "two-rules",
            engine={"kind": "VLLM", "device": "CPU"},
            prefill={"tensorParallelSize": 2, "blockSize": 16},
            decode={"tensorParallelSize": 1, "blockSize": 32},
        )
    )
    fix = suggested_fix(dd)
    assert fix is not None
    fixed = apply_fix(dd.model_dump(by_alias=True, mode="json"), fix)["spec"]
    assert fixed["prefill"]["blockSize"] == fixed["decode"]["blockSize"]
    assert fixed["prefill"]["blockSize"] % 32 == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tp_p=st.sampled_from([1, 2, 3, 4, 6, 8, 16]),
    tp_d=st.sampled_from([1, 2, 3, 4, 6, 8, 16]),
    bs_p=st.sampled_from([8, 16, 24, 32, 64]),
    bs_d=st.sampled_from([8, 16, 24, 32, 64]),
    layout_p=st.sampled_from(["HND", "NHD"]),
    layout_d=st.sampled_from(["HND", "NHD"]),
    heads=st.sampled_from([1, 2, 4, 6, 8]),
    kind=st.sampled_from(["Synthetic", "VLLM"]),
    device=st.sampled_from(["GPU", "CPU"]),
    conversion=st.sampled_from(["Auto", "Off"]),
)
def test_a_suggested_fix_is_always_compatible(
    tp_p: int,
    tp_d: int,
    bs_p: int,
    bs_d: int,
    layout_p: str,
    layout_d: str,
    heads: int,
    kind: str,
    device: str,
    conversion: str,
) -> None:
    doc = manifest(
        "p",
        engine={"kind": kind, "device": device},
        model={"numKVHeads": heads},
        transfer={"conversion": conversion},
        prefill={"tensorParallelSize": tp_p, "blockSize": bs_p, "kvLayout": layout_p},
        decode={"tensorParallelSize": tp_d, "blockSize": bs_d, "kvLayout": layout_d},
    )
    dd = DisaggregatedDeployment.model_validate(doc)
    fix = suggested_fix(dd)
    if isinstance(verdict_for(dd), list):
        assert fix is not None  # the searched settings can always reach a compatible spec here
        assert not isinstance(verdict_for(DisaggregatedDeployment.model_validate(apply_fix(doc, fix))), list)
    else:
        assert fix is None


def _plan_fix(text: str) -> object:
    return suggested_fix(parse_deployment(yaml.safe_load(text)))


AGENT_HEAD = """apiVersion: kvbridge.io/v1alpha1
kind: DisaggregatedDeployment
metadata: {name: x}
spec:
  engine: {kind: Synthetic}
"""


def test_every_problem_named_here_gets_the_checked_fix_its_message_offers() -> None:
    """The fix the search finds is one the message names, so the advice never points somewhere else (or loops)."""
    from kvbridge_agent.core.compat import check_pair

    fan_in = (
        AGENT_HEAD
        + """  model: {name: m, numLayers: 4, numKVHeads: 8, headDim: 128}
  prefill: {tensorParallelSize: 2, blockSize: 16}
  decode: {tensorParallelSize: 1, blockSize: 32}
"""
    )
    dd = parse_deployment(yaml.safe_load(fan_in))
    [problem] = check_pair(dd.spec.model, dd.spec.prefill.settings(), dd.spec.decode.settings(), dd.spec.transfer)
    fix = _plan_fix(fan_in)
    assert fix == {"spec.prefill.tensorParallelSize": 1}
    assert "spec.prefill.tensorParallelSize: 1" in problem.message
    mla = (
        AGENT_HEAD
        + """  model: {name: m, numLayers: 4, numKVHeads: 8, headDim: 576, attention: MLA}
"""
    )
    assert _plan_fix(mla) == {"spec.model.numKVHeads": 1}
    gpu_buffer_on_cpu = (
        (ROOT / "examples" / "vllm" / "tiny-cpu.yaml")
        .read_text()
        .replace("spec:\n", "spec:\n  transfer:\n    network: {kvBufferDevice: cuda}\n", 1)
    )
    assert _plan_fix(gpu_buffer_on_cpu) == {"spec.transfer.network.kvBufferDevice": "cpu"}


def test_roles_that_do_not_fit_a_node_are_spread_as_their_problems_advise() -> None:
    """Prefill TP 16 and decode TP 8 on nodes of 4 GPUs: each problem advises more nodes, and so does the checked
    fix — not a smaller TP size for both roles (as far from the spec by size, but a different model sharding)."""
    doc = yaml.safe_load((ROOT / "examples" / "vllm" / "deepseek-v3-h200.yaml").read_text())
    doc["spec"]["prefill"]["tensorParallelSize"] = 16
    doc["spec"]["placement"]["gpusPerNode"] = 4
    dd = parse_deployment(doc)
    problems = verdict_for(dd)
    assert isinstance(problems, list)
    advice = {p.field: re.search(r"set (spec\.\w+\.nodes) to (\d+)", p.message) for p in problems}
    assert {m.group(1): int(m.group(2)) for m in advice.values() if m} == {
        "spec.prefill.nodes": 4,
        "spec.decode.nodes": 2,
    }
    assert suggested_fix(dd) == {"spec.prefill.nodes": 4, "spec.decode.nodes": 2}


def test_no_fix_is_claimed_for_what_the_search_cannot_change() -> None:
    """A template overlay that replaces the engine's args has no fix among the searched fields: none is claimed
    (the message says what to remove)."""
    doc = yaml.safe_load((ROOT / "examples" / "vllm" / "llama3-8b-hetero-tp.yaml").read_text())
    doc["spec"]["decode"]["template"] = {"spec": {"containers": [{"name": "engine", "args": ["x"]}]}}
    assert suggested_fix(parse_deployment(doc)) is None
