"""The pairing key: equal only for pods rendered from one checked plan."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge_agent.core import RoleSettings
from kvbridge_agent.core.model import ModelGeometry
from kvbridge_operator.api.spec import DisaggregatedDeployment, parse_deployment
from kvbridge_operator.children.pairing import pairing
from kvbridge_operator.children.verdict import verdict_for

BASE: dict[str, Any] = {
    "apiVersion": "kvbridge.io/v1alpha1",
    "kind": "DisaggregatedDeployment",
    "metadata": {"name": "llama"},
    "spec": {
        "model": {"name": "meta-llama/Llama-3.1-8B", "numLayers": 32, "numKVHeads": 8, "headDim": 128},
        "prefill": {"tensorParallelSize": 1, "blockSize": 16},
        "decode": {"tensorParallelSize": 1, "blockSize": 16},
    },
}


def with_(**changes: Any) -> DisaggregatedDeployment:
    doc = copy.deepcopy(BASE)
    for path, value in changes.items():
        node = doc["spec"]
        *parents, leaf = path.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return DisaggregatedDeployment.model_validate(doc)


def key(dd: DisaggregatedDeployment) -> str:
    return pairing(dd.spec)


def test_prefill_tp_1_2_4_8_share_a_fingerprint_but_not_a_pairing_key() -> None:
    deployments = [with_(prefill__tensorParallelSize=tp) for tp in (1, 2, 4, 8)]
    plans = [verdict_for(dd) for dd in deployments]
    assert len({plan.fingerprint for plan in plans if not isinstance(plan, list)}) == 1
    assert len({key(dd) for dd in deployments}) == 4


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tensorParallelSize", 2),
        ("blockSize", 32),
        ("kvLayout", "NHD"),
        ("dataParallelSize", 2),
        ("expertParallel", True),
    ],
)
def test_every_role_setting_changes_the_key(role: str, field: str, value: object) -> None:
    changed = {f"{role}__{field}": value}
    if field == "expertParallel":
        changed["model__numExperts"] = 8
        assert key(with_(**changed)) != key(with_(model__numExperts=8))
    else:
        assert key(with_(**changed)) != key(with_())


def test_data_and_expert_parallelism_left_unset_keep_the_key_they_had() -> None:
    """Keys of deployments without them are what they were before the fields existed (no rollout on upgrade)."""
    assert key(with_(prefill__dataParallelSize=1, decode__expertParallel=False)) == key(with_())
    assert key(with_()) == "7872541c86"  # the key without them (protocol version 5: every key changed with it)


def test_the_test_above_covers_every_role_setting() -> None:
    assert {f.alias or name for name, f in RoleSettings.model_fields.items()} == {
        "tensorParallelSize",
        "blockSize",
        "kvLayout",
        "dataParallelSize",
        "expertParallel",
    }


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("model__name", "other"),
        ("model__numLayers", 16),
        ("model__numKVHeads", 4),
        ("model__headDim", 64),
        ("model__kvCacheDtype", "fp8_e4m3"),
        ("model__attention", "MLA"),
        ("model__cacheKind", "BlocksFirst"),
        ("model__numExperts", 64),
        ("model__layerTypes", ["Full"] * 31 + ["NoCache"]),
        ("model__stateSpace", {"kind": "Mamba2", "numLayers": 2, "convState": [8, 3], "temporalState": [2, 4, 8]}),
        ("transfer__conversion", "Off"),
        ("transfer__backends", ["UCX", "LIBFABRIC"]),
        ("engine__kind", "Synthetic"),
        ("engine__device", "CPU"),
    ],
)
def test_model_transfer_and_engine_fields_change_the_key(path: str, value: object) -> None:
    assert key(with_(**{path: value})) != key(with_())


def test_every_model_field_is_in_the_key() -> None:
    covered = {"name", "numLayers", "numKVHeads", "headDim", "kvCacheDtype", "attention", "cacheKind", "numExperts"}
    covered |= {"layerTypes", "slidingWindow", "attentionChunkSize", "stateSpace"}  # issue 58: the model's layers
    assert {f.alias or name for name, f in ModelGeometry.model_fields.items()} == covered


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("prefill__replicas", 5),
        ("decode__replicas", 3),
        ("decode__minReplicas", 0),
        ("engine__image", "example.com/engine:2"),
        ("transfer__leaseSeconds", 30),
        ("transfer__sideChannelPort", 7000),
        ("transfer__handshakeTimeoutSeconds", 9),
        ("prefill__template", {"spec": {"nodeSelector": {"pool": "a"}}}),
    ],
)
def test_what_does_not_change_the_plan_keeps_the_key(path: str, value: object) -> None:
    assert key(with_(**{path: value})) == key(with_())


def test_renaming_the_synthetic_engine_changes_no_key() -> None:
    """Issue 57: the kind Agent became Synthetic (Agent still read): pods the operator ran before keep their key, so
    an upgrade rolls nothing; the key written in the README before the rename is still the one computed now."""
    assert key(with_(engine__kind="Synthetic")) == key(with_(engine__kind="Agent"))
    readme_before = "d17a158943"  # examples/llama3-8b-hetero-tp.yaml (kind Agent), as the README showed it
    moved = yaml.safe_load(
        (Path(__file__).parents[2] / "examples" / "synthetic" / "llama3-8b-hetero-tp.yaml").read_text()
    )
    assert moved["spec"]["engine"]["kind"] == "Synthetic"
    assert pairing(parse_deployment(moved).spec) == readme_before
