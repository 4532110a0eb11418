"""Model and role descriptions: CRD words, defaults, validation, the fingerprint."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvbridge_agent.core import PROTOCOL_VERSION, KVCacheDtype, ModelGeometry, RoleSettings, fingerprint

from .conftest import dense


def test_camel_case_aliases_match_the_crd() -> None:
    model = ModelGeometry.model_validate(
        {"name": "m", "numLayers": 2, "numKVHeads": 8, "headDim": 64, "kvCacheDtype": "fp8_e4m3"}
    )
    assert model.num_kv_heads == 8
    assert model.element_bytes == 1
    dumped = model.model_dump(by_alias=True, mode="json")
    assert set(dumped) == {
        "name",
        "numLayers",
        "numKVHeads",
        "headDim",
        "kvCacheDtype",
        "attention",
        "cacheKind",
        "numExperts",
        "layerTypes",
        "slidingWindow",
        "attentionChunkSize",
        "stateSpace",
    }


@pytest.mark.parametrize(
    "layers",
    [
        {"layerTypes": ["Full", "Sliding"]},  # Sliding without a window
        {"layerTypes": ["Full", "Full"], "slidingWindow": 512},  # a window without Sliding layers
        {"layerTypes": ["ChunkedLocal", "Full"]},  # chunks without a size
        {"layerTypes": ["Full"], "slidingWindow": 0},  # one layer named of two
        {"layerTypes": ["StateSpace", "Full"]},  # state-space layers without stateSpace
    ],
)
def test_layer_types_name_every_layer_and_what_defines_each_kind(layers: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ModelGeometry.model_validate({"name": "m", "numLayers": 2, "numKVHeads": 2, "headDim": 64, **layers})


def test_the_layer_description_changes_no_fingerprint() -> None:
    """vLLM reads the layers from the weights' config, which the name pins: the fingerprints of engines running
    before ``layerTypes`` existed stay as they were (the operator's pairing key holds it)."""
    plain = ModelGeometry(name="g", num_layers=2, num_kv_heads=1, head_dim=64)
    words = {"name": "g", "numLayers": 2, "numKVHeads": 1, "headDim": 64}
    hybrid = ModelGeometry.model_validate({**words, "layerTypes": ["Sliding", "Full"], "slidingWindow": 512})
    assert hybrid.layer_kinds == ["Sliding", "Full"]
    assert plain.layer_kinds == ["Full", "Full"]
    assert fingerprint(hybrid) == fingerprint(plain)


def test_role_defaults() -> None:
    settings = RoleSettings()
    assert (settings.tensor_parallel_size, settings.block_size, settings.kv_layout.value) == (1, 16, "HND")


@pytest.mark.parametrize(
    "bad",
    [
        {"numLayers": 0},
        {"numKVHeads": -1},
        {"kvCacheDtype": "int4"},
        {"attention": "Sparse"},
        {"unknownField": 1},
    ],
)
def test_invalid_values_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ModelGeometry.model_validate({"name": "m", "numLayers": 2, "numKVHeads": 8, "headDim": 64, **bad})


def test_element_bytes() -> None:
    assert [d.element_bytes for d in KVCacheDtype] == [2, 2, 4, 1, 1]


def test_fingerprint_is_stable_and_covers_the_must_match_fields() -> None:
    base = fingerprint(dense(8))
    assert base == fingerprint(dense(8))
    assert len(base) == 8
    assert int(base, 16) >= 0
    assert fingerprint(dense(4)) != base
    assert fingerprint(dense(8, kvCacheDtype="bfloat16")) != base
    assert fingerprint(dense(8, cacheKind="CrossLayer")) != base
    assert fingerprint(dense(8), protocol_version=PROTOCOL_VERSION + 1) != base
