"""The DisaggregatedDeployment spec model parses manifests exactly as the operator will."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvbridge_agent.core import SpecError
from kvbridge_operator.api.spec import EngineKind, parse_deployment

EXAMPLES = Path(__file__).parents[2] / "examples"


def minimal() -> dict[str, object]:
    return {
        "apiVersion": "kvbridge.io/v1alpha1",
        "kind": "DisaggregatedDeployment",
        "metadata": {"name": "x", "labels": {"team": "a"}},
        "spec": {"model": {"name": "m", "numLayers": 2, "numKVHeads": 8, "headDim": 64}},
    }


def test_defaults_follow_operator_md() -> None:
    dd = parse_deployment(minimal())
    spec = dd.spec
    assert spec.engine.kind is EngineKind.VLLM  # the synthetic engine (Synthetic) is chosen explicitly
    assert (spec.transfer.side_channel_port, spec.transfer.lease_seconds) == (5600, 120)
    assert spec.transfer.handshake_timeout_seconds == 5
    assert spec.transfer.backends == ["UCX"]
    assert spec.transfer.conversion.value == "Auto"
    assert (spec.prefill.replicas, spec.prefill.tensor_parallel_size, spec.prefill.block_size) == (1, 1, 16)
    assert spec.model.kv_cache_dtype.value == "bfloat16"


@pytest.mark.parametrize(
    "path", sorted(p for p in EXAMPLES.glob("*/*.yaml") if p.parent.name != "autoscaling"), ids=lambda p: p.name
)
def test_every_example_parses(path: Path) -> None:
    for document in yaml.safe_load_all(path.read_text()):
        parse_deployment(document)


@pytest.mark.parametrize(
    ("change", "field", "code"),
    [
        (lambda d: d["spec"]["model"].pop("numLayers"), "spec.model.numLayers", "INVALID_SPEC"),
        (
            lambda d: d["spec"].update(decode={"tensorParallelSize": 0}),
            "spec.decode.tensorParallelSize",
            "INVALID_SPEC",
        ),
        (lambda d: d["spec"].update(decode={"blockSize": "big"}), "spec.decode.blockSize", "INVALID_SPEC"),
        (lambda d: d["spec"].update(prefill={"kvLayout": "HDN"}), "spec.prefill.kvLayout", "INVALID_SPEC"),
        (lambda d: d["spec"].update(bogus=1), "spec.bogus", "INVALID_SPEC"),
        (lambda d: d.update(kind="Deployment"), "kind", "WRONG_KIND"),
        (lambda d: d.pop("metadata"), "metadata", "INVALID_SPEC"),
    ],
)
def test_bad_manifests_name_the_field(change: object, field: str, code: str) -> None:
    document = minimal()
    change(document)  # type: ignore[operator]
    with pytest.raises(SpecError) as caught:
        parse_deployment(document)
    assert caught.value.field == field
    assert caught.value.code == code
