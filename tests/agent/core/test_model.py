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
    }


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
