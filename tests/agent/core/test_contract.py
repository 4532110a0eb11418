"""The environment contract: the operator renders it, the agent parses it, with the same names."""

from __future__ import annotations

import pytest

from kvbridge_agent.core import SpecError
from kvbridge_agent.core.contract import EngineEnvironment, pair_from_spec, parse_environment, render_environment

from .conftest import dense, role


def environment() -> EngineEnvironment:
    return EngineEnvironment(
        role="decode",
        engine_id="llama-decode-0",
        model=dense(8),
        prefill=role(2, 32, "NHD"),
        decode=role(1),
        side_channel_host="10.0.0.7",
        keys_dir="/var/run/kvbridge/keys",
        dp_index=1,
    )


def test_render_then_parse_round_trips() -> None:
    env = environment()
    rendered = render_environment(env)
    assert rendered["KVBRIDGE_ROLE"] == "decode"
    assert rendered["KVBRIDGE_PREFILL_KV_LAYOUT"] == "NHD"
    assert rendered["KVBRIDGE_NUM_KV_HEADS"] == "8"
    assert rendered["KVBRIDGE_BACKENDS"] == "UCX"
    assert all(key.startswith("KVBRIDGE_") and isinstance(value, str) for key, value in rendered.items())
    assert parse_environment(rendered) == env
    assert env.side_channel_port == 5601  # base port + data parallel index


def test_flags_override_the_environment() -> None:
    parsed = parse_environment(render_environment(environment()), role="prefill", num_blocks=7)
    assert parsed.role.value == "prefill"
    assert parsed.num_blocks == 7


@pytest.mark.parametrize(
    ("name", "value"),
    [("KVBRIDGE_NUM_LAYERS", "zero"), ("KVBRIDGE_DECODE_TP_SIZE", "0"), ("KVBRIDGE_ROLE", "router")],
)
def test_bad_values_name_the_variable(name: str, value: str) -> None:
    rendered = render_environment(environment())
    rendered[name] = value
    with pytest.raises(SpecError) as caught:
        parse_environment(rendered)
    assert caught.value.field == name
    assert caught.value.code == "INVALID_ENVIRONMENT"


def test_missing_variable_is_named() -> None:
    rendered = render_environment(environment())
    del rendered["KVBRIDGE_HEAD_DIM"]
    with pytest.raises(SpecError) as caught:
        parse_environment(rendered)
    assert caught.value.field == "KVBRIDGE_HEAD_DIM"


def test_pair_from_spec_ignores_pod_fields() -> None:
    spec = {
        "engine": {"kind": "Agent"},
        "model": {"name": "m", "numLayers": 2, "numKVHeads": 8, "headDim": 64},
        "prefill": {"replicas": 3, "tensorParallelSize": 2, "template": {"spec": {}}},
    }
    pair = pair_from_spec(spec)
    assert pair.prefill.tensor_parallel_size == 2
    with pytest.raises(SpecError) as caught:
        pair_from_spec({"model": {"name": "m"}})
    assert caught.value.field.startswith("spec.model.")


def test_data_and_expert_parallelism_round_trip_and_are_absent_when_unset() -> None:
    env = environment()
    assert not any(name.endswith(("_DP_SIZE", "_EXPERT_PARALLEL", "NUM_EXPERTS")) for name in render_environment(env))
    wide = env.model_copy(
        update={
            "model": env.model.model_copy(update={"num_experts": 64}),
            "prefill": env.prefill.model_copy(update={"data_parallel_size": 4, "expert_parallel": True}),
        }
    )
    rendered = render_environment(wide)
    assert (rendered["KVBRIDGE_PREFILL_DP_SIZE"], rendered["KVBRIDGE_PREFILL_EXPERT_PARALLEL"]) == ("4", "True")
    assert rendered["KVBRIDGE_NUM_EXPERTS"] == "64"
    assert "KVBRIDGE_DECODE_DP_SIZE" not in rendered
    assert parse_environment(rendered) == wide
