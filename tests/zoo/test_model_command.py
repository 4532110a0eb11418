"""``kvbridge model`` on every zoo member: the ``spec.model`` it writes carries what decides the KV cache (each
layer's kind, the window, Llama 4's chunks, MLA's latent, a hybrid's state shapes, the dtype), a
DisaggregatedDeployment accepts it, and it reads each config.json as transformers' config classes (which vLLM reads
the layers from) and vLLM's state-shape calculators do."""

from __future__ import annotations

import io
import json
from collections import Counter
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge_agent.core.model import LayerType
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.cli.hf_config import ModelConfigError, geometry
from kvbridge_operator.cli.main import main

from .zoo import MODELS, ZOO, Member


def model_command(member: Member) -> dict[str, Any]:
    out = io.StringIO()
    with redirect_stdout(out):
        status = main(["model", str(MODELS / member.folder), "--name", member.name])
    assert status == 0
    block: dict[str, Any] = yaml.safe_load(out.getvalue())["model"]
    return block


def test_the_zoo_has_twenty_families_with_a_config_each() -> None:
    assert len(ZOO) >= 20
    assert sorted(m.folder for m in ZOO) == sorted(p.name for p in MODELS.iterdir() if p.is_dir())


@pytest.mark.parametrize("member", ZOO, ids=lambda m: m.folder)
def test_kvbridge_model_writes_what_decides_the_kv_cache(member: Member) -> None:
    block = model_command(member)
    assert (block["name"], block["numLayers"], block["numKVHeads"], block["headDim"]) == (
        member.name,
        member.layers,
        member.kv_heads,
        member.head_dim,
    )
    assert block["attention"] == ("MLA" if member.mla else "Dense")
    assert block["kvCacheDtype"] == "bfloat16"
    assert block.get("numExperts", 0) == member.experts
    kinds = Counter(block.get("layerTypes", []))
    if kinds:
        assert sum(kinds.values()) == member.layers
    assert {kind: n for kind, n in kinds.items() if kind != "Full"} == member.kinds
    assert block.get("slidingWindow", 0) == member.window
    assert block.get("attentionChunkSize", 0) == member.chunk
    state = block.get("stateSpace")
    expected = None
    if member.state is not None:
        kind, layers, conv, temporal = member.state
        expected = {"kind": kind, "numLayers": layers, "convState": conv, "temporalState": temporal}
    assert state == expected
    document = {
        "apiVersion": "kvbridge.io/v1alpha1",
        "kind": "DisaggregatedDeployment",
        "metadata": {"name": "zoo"},
        "spec": {"model": block},
    }
    parsed = parse_deployment(document).spec.model.model_dump(by_alias=True, mode="json")
    assert {key: parsed[key] for key in block} == block


#: transformers' layer_types words, as vLLM's models compare them
_TRANSFORMERS_KINDS = {
    "full_attention": LayerType.FULL,
    "sliding_attention": LayerType.SLIDING,
    "chunked_attention": LayerType.CHUNKED_LOCAL,
    "linear_attention": LayerType.STATE_SPACE,
    "mlp": LayerType.NO_CACHE,
    "hybrid": LayerType.FULL,
}


@pytest.mark.parametrize("member", [m for m in ZOO if m.folder != "kimi-k2"], ids=lambda m: m.folder)
def test_each_layer_is_what_transformers_config_says(member: Member) -> None:
    """transformers' config class (the one vLLM 0.32 loads) computes ``layer_types`` from the file's pattern
    (Gemma's period, Llama 4's NoPE layers, Qwen3-Next's interval, Nemotron-H's pattern); without one, vLLM gives
    every layer the model-level ``sliding_window`` (its ``CacheConfig.sliding_window``). kimi_k2 is remote code."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(str(MODELS / member.folder))
    text = config.get_text_config()
    words = getattr(text, "layer_types", None)
    if words is None:
        uniform = LayerType.SLIDING if getattr(text, "sliding_window", None) else LayerType.FULL
        expected = [uniform] * text.num_hidden_layers
    else:
        expected = [_TRANSFORMERS_KINDS[word] for word in words]
    assert member.model().layer_kinds == expected


@pytest.mark.parametrize("member", [m for m in ZOO if m.state is not None], ids=lambda m: m.folder)
def test_state_shapes_are_vllms(member: Member) -> None:
    """At TP 1, vLLM's ``MambaStateShapeCalculator`` gives each layer's state the shapes ``stateSpace`` names."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    raw = json.loads((MODELS / member.folder / "config.json").read_text())
    state = member.model().state_space
    assert state is not None
    if raw["model_type"] == "qwen3_next":
        conv, temporal = MambaStateShapeCalculator.gated_delta_net_state_shape(
            1,
            raw["linear_num_key_heads"],
            raw["linear_num_value_heads"],
            raw["linear_key_head_dim"],
            raw["linear_value_head_dim"],
            raw["linear_conv_kernel_dim"],
        )
    else:
        nemotron = raw["model_type"] == "nemotron_h"
        heads = raw["mamba_num_heads" if nemotron else "mamba_n_heads"]
        head_dim = raw["mamba_head_dim" if nemotron else "mamba_d_head"]
        conv, temporal = MambaStateShapeCalculator.mamba2_state_shape(
            tp_world_size=1,
            intermediate_size=heads * head_dim if nemotron else raw["mamba_d_ssm"],
            n_groups=raw["n_groups" if nemotron else "mamba_n_groups"],
            num_heads=heads,
            head_dim=head_dim,
            state_size=raw["ssm_state_size" if nemotron else "mamba_d_state"],
            conv_kernel=raw["conv_kernel" if nemotron else "mamba_d_conv"],
        )
    assert sorted(conv) == sorted(state.conv_state)  # vLLM orients [width, channels] or [channels, width]
    assert tuple(temporal) == state.temporal_state


def test_a_window_without_layer_types_of_an_unknown_family_is_refused(tmp_path: Path) -> None:
    """Which layers slide is never guessed: a family whose config class computes its own layer_types, unknown here,
    is refused naming the key to add."""
    config = {
        "model_type": "cohere2",
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "hidden_size": 512,
        "sliding_window": 4096,
    }
    with pytest.raises(ModelConfigError) as refused:
        geometry(config, "cohere2")
    assert refused.value.field == "layer_types"


def test_layer_types_of_another_length_are_refused() -> None:
    config = {
        "model_type": "gpt_oss",
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    with pytest.raises(ModelConfigError) as refused:
        geometry(config, "short")
    assert refused.value.field == "layer_types"
