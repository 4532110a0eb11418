"""Every compatibility rule of docs/protocol.md §2: code, field and an actionable message."""

from __future__ import annotations

import pytest

from kvbridge_agent.core import (
    CacheKind,
    Conversion,
    IncompatibleError,
    Problem,
    RoleSettings,
    TransferSettings,
    check_pair,
    check_same_model,
    require_compatible,
)

from .conftest import dense, mla, role

OFF = TransferSettings(conversion=Conversion.OFF)


def codes(problems: list) -> list[tuple[str, str]]:  # type: ignore[type-arg]
    return [(p.code, p.field) for p in problems]


def test_compatible_pair_has_no_problems() -> None:
    assert check_pair(dense(8), role(2), role(1)) == []
    require_compatible(dense(8), role(2), role(1))


def test_rule1_tp_sizes_must_divide_and_message_suggests_what_works() -> None:
    problems = check_pair(dense(6), role(3), role(2))
    assert codes(problems) == [("TP_NOT_DIVISIBLE", "spec.decode.tensorParallelSize")]
    assert problems[0].message == (
        "prefill TP 3 and decode TP 2 do not divide one another; set spec.decode.tensorParallelSize: 3 (or 1, 6 or 12)"
    )


def test_rule2_block_sizes_must_divide() -> None:
    problems = check_pair(dense(8), role(1, 16), role(1, 24))
    assert codes(problems) == [("BLOCK_SIZE_NOT_DIVISIBLE", "spec.decode.blockSize")]
    assert problems[0].message.endswith("set spec.decode.blockSize: 32 (or 16, 48 or 64)")


def test_rule3_replicated_prefill_heads_with_fewer_decode_ranks() -> None:
    problems = check_pair(dense(2), role(4), role(2))
    assert codes(problems) == [("PREFILL_HEADS_REPLICATED", "spec.prefill.tensorParallelSize")]
    assert problems[0].message.endswith("set spec.prefill.tensorParallelSize: 2, or spec.decode.tensorParallelSize: 4")


def test_rule3_does_not_apply_to_mla_or_to_more_decode_ranks() -> None:
    assert check_pair(mla(), role(4), role(1)) == []
    assert check_pair(dense(2), role(4), role(8)) == []


def test_rule4_no_decode_merge_with_prefill_fan_in() -> None:
    problems = check_pair(dense(8), role(2, 8), role(1, 16))
    assert codes(problems) == [("MERGE_WITH_TP_FAN_IN", "spec.decode.blockSize")]
    assert "set spec.decode.blockSize: 8 (or smaller" in problems[0].message


def test_rule4_allows_prefill_split_with_fan_in() -> None:
    assert check_pair(dense(8), role(2, 32), role(1, 16)) == []


def test_rule5_wire_layout_is_hnd_when_heads_split() -> None:
    from kvbridge_agent.core import wire_format

    wire = wire_format(dense(8), role(1, 16, "NHD"), role(2, 16, "NHD"))
    assert wire.layout.value == "HND"
    assert [c.to_dict() for c in wire.conversions] == [
        {"side": "prefill", "kind": "Permute", "from": "NHD", "to": "HND"},
        {"side": "decode", "kind": "Permute", "from": "HND", "to": "NHD"},
    ]


def test_rule5_equal_tp_keeps_prefill_layout_and_decode_converts() -> None:
    from kvbridge_agent.core import wire_format

    wire = wire_format(dense(8), role(2, 16, "NHD"), role(2, 16, "HND"))
    assert wire.layout.value == "NHD"
    assert [c.to_dict() for c in wire.conversions] == [
        {"side": "decode", "kind": "Permute", "from": "NHD", "to": "HND"}
    ]


def test_single_head_blocks_need_no_permute() -> None:
    from kvbridge_agent.core import wire_format

    assert wire_format(mla(), role(1, 16, "NHD"), role(1, 16, "HND")).conversions == ()
    # replicated: each rank holds one head on both sides
    assert wire_format(dense(2), role(2, 16, "NHD"), role(4, 16, "HND")).conversions == ()


@pytest.mark.parametrize(
    ("tp", "hint"), [(3, "4 (or 1, 2 or 8)"), (5, "4 (or 2, 8 or 16)"), (12, "16 (or 8, 24 or 32)")]
)
def test_rule6_heads_divide_evenly(tp: int, hint: str) -> None:
    problems = check_pair(dense(8), role(tp), role(tp))
    assert ("HEADS_NOT_DIVISIBLE", "spec.prefill.tensorParallelSize") in codes(problems)
    assert ("HEADS_NOT_DIVISIBLE", "spec.decode.tensorParallelSize") in codes(problems)
    assert problems[0].message.endswith(
        f"the TP size must divide 8 or be a multiple of it; set spec.prefill.tensorParallelSize: {hint}"
    )


def test_rule7_conversion_off_names_each_needed_conversion() -> None:
    problems = check_pair(dense(8), role(2, 32, "NHD"), role(1, 16, "HND"), OFF)
    assert codes(problems) == [
        ("CONVERSION_OFF", "spec.decode.blockSize"),
        ("CONVERSION_OFF", "spec.prefill.kvLayout"),
    ]
    assert "split 32-token blocks into 16-token blocks" in problems[0].message
    assert "permute its blocks from NHD to HND" in problems[1].message
    assert problems[0].message.endswith("set spec.decode.blockSize: 32, or spec.transfer.conversion: Auto")
    assert problems[1].message.endswith("set spec.prefill.kvLayout: HND, or spec.transfer.conversion: Auto")


def test_rule7_conversion_off_accepts_pairs_needing_none() -> None:
    assert check_pair(dense(8), role(2), role(1), OFF) == []
    assert check_pair(dense(8), role(2, 16, "NHD"), role(2, 16, "NHD"), OFF) == []


def test_rule8_cross_layer_needs_hnd_and_equal_block_sizes() -> None:
    model = dense(8, cacheKind=CacheKind.CROSS_LAYER.value)
    problems = check_pair(model, role(2, 16, "NHD"), role(1, 32, "NHD"))
    assert codes(problems) == [
        ("MERGE_WITH_TP_FAN_IN", "spec.decode.blockSize"),
        ("CROSS_LAYER_NEEDS_HND", "spec.prefill.kvLayout"),
        ("CROSS_LAYER_NEEDS_HND", "spec.decode.kvLayout"),
        ("CROSS_LAYER_BLOCK_SIZE", "spec.decode.blockSize"),
    ]


def test_mla_model_rules() -> None:
    bad = dense(8, attention="MLA", cacheKind="BlocksFirst")
    assert codes(check_pair(bad, role(1), role(1))) == [
        ("MLA_KV_HEADS", "spec.model.numKVHeads"),
        ("MLA_CACHE_KIND", "spec.model.cacheKind"),
    ]


def test_every_problem_is_reported_at_once() -> None:
    problems = check_pair(dense(8), role(3, 16), role(2, 24))
    assert [p.code for p in problems] == ["HEADS_NOT_DIVISIBLE", "TP_NOT_DIVISIBLE", "BLOCK_SIZE_NOT_DIVISIBLE"]
    with pytest.raises(IncompatibleError) as caught:
        require_compatible(dense(8), role(3, 16), role(2, 24))
    assert len(caught.value.problems) == 3
    assert caught.value.code == "INCOMPATIBLE"


def test_model_mismatch_between_engines_names_each_field() -> None:
    problems = check_same_model(dense(8), dense(4, head_dim=64))
    assert codes(problems) == [("MODEL_MISMATCH", "spec.model.numKVHeads"), ("MODEL_MISMATCH", "spec.model.headDim")]
    assert check_same_model(dense(8), dense(8)) == []


def test_data_parallelism_changes_no_kv_geometry_and_expert_parallelism_needs_experts() -> None:
    model = dense(heads=8)
    wide = RoleSettings(tensor_parallel_size=2, data_parallel_size=4)
    assert check_pair(model, wide, RoleSettings(data_parallel_size=8)) == []
    assert check_pair(model, wide.model_copy(update={"expert_parallel": True}), RoleSettings()) == [
        Problem(
            "EXPERT_PARALLEL_NEEDS_MOE",
            "spec.prefill.expertParallel",
            "prefill asks for expert parallelism, but spec.model.numExperts is 0 (a dense model has no experts to "
            "shard): set spec.prefill.expertParallel: false, or give spec.model.numExperts the model's routed "
            "experts (config.json's n_routed_experts or num_experts)",
        )
    ]
    moe = model.model_copy(update={"num_experts": 4})
    [few] = check_pair(moe, wide.model_copy(update={"expert_parallel": True}), RoleSettings())
    assert (few.code, few.field) == ("EXPERTS_FEWER_THAN_RANKS", "spec.prefill.dataParallelSize")
    assert few.message.endswith("set spec.prefill.dataParallelSize: 2")
