"""The wide-KV local model (benchmarks/vllm_connectors.py --model large): its heads are wider than hidden / heads."""

from __future__ import annotations

from kvbridge_agent.core import TransferPlan
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_sim import tiny_model
from kvbridge_sim.vllm_engines import deployment


def test_the_large_shape_has_heads_of_64_and_32_kib_of_kv_per_token() -> None:
    shape = tiny_model.LARGE
    assert shape.head_dim == 64 != shape.hidden // shape.num_heads
    assert shape.geometry["headDim"] == 64
    per_token = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * 2  # K and V, bf16
    assert per_token == 32 * 1024
    assert shape.max_positions >= 4096
    assert tiny_model.SHAPES[shape.name] is shape


def test_the_other_shapes_keep_hidden_over_heads() -> None:
    for shape in (s for s in tiny_model.SHAPES.values() if s is not tiny_model.LARGE):
        assert shape.explicit_head_dim == 0
        assert shape.head_dim == shape.hidden // shape.num_heads


def test_a_deployment_of_the_large_shape_is_compatible() -> None:
    document = deployment("large", 1, connector="KVBridge", shape=tiny_model.LARGE)
    plan = verdict_for(parse_deployment(document))
    assert isinstance(plan, TransferPlan)
    assert plan.for_decode_rank(0).descriptors_per_block == 2 * tiny_model.LARGE.num_layers  # K and V per layer
