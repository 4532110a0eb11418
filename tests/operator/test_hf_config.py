"""``kvbridge model``: spec.model from a Hugging Face config.json (issue 13 #15), for config files written here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.cli.main import main

CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "llama-gqa": (
        {
            "model_type": "llama",
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 4096,
            "torch_dtype": "bfloat16",
            "_name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
        },
        {
            "name": "meta-llama/Llama-3.1-8B-Instruct",
            "numLayers": 32,
            "numKVHeads": 8,
            "headDim": 128,
            "kvCacheDtype": "bfloat16",
            "attention": "Dense",
        },
    ),
    "qwen2-gqa": (
        {
            "model_type": "qwen2",
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "hidden_size": 896,
            "torch_dtype": "bfloat16",
        },
        {
            "name": "qwen2-gqa",
            "numLayers": 24,
            "numKVHeads": 2,
            "headDim": 64,
            "kvCacheDtype": "bfloat16",
            "attention": "Dense",
        },
    ),
    "mistral-head-dim": (
        {
            "model_type": "mistral",
            "num_hidden_layers": 40,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 5120,
            "head_dim": 128,
            "torch_dtype": "bfloat16",
        },
        {
            "name": "mistral-head-dim",
            "numLayers": 40,
            "numKVHeads": 8,
            "headDim": 128,
            "kvCacheDtype": "bfloat16",
            "attention": "Dense",
        },
    ),
    "mha-fp16": (
        {
            "model_type": "llama",
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "hidden_size": 256,
            "torch_dtype": "float16",
        },
        {
            "name": "mha-fp16",
            "numLayers": 2,
            "numKVHeads": 4,
            "headDim": 64,
            "kvCacheDtype": "float16",
            "attention": "Dense",
        },
    ),
    "deepseek-v2-mla": (
        {
            "model_type": "deepseek_v2",
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "hidden_size": 2048,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "torch_dtype": "bfloat16",
        },
        {
            "name": "deepseek-v2-mla",
            "numLayers": 27,
            "numKVHeads": 1,
            "headDim": 576,
            "kvCacheDtype": "bfloat16",
            "attention": "MLA",
        },
    ),
    "deepseek-v3-mla": (
        {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "hidden_size": 7168,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "n_routed_experts": 256,
            "torch_dtype": "bfloat16",
        },
        {
            "name": "deepseek-v3-mla",
            "numLayers": 61,
            "numKVHeads": 1,
            "headDim": 576,
            "kvCacheDtype": "bfloat16",
            "attention": "MLA",
            "numExperts": 256,
        },
    ),
    "qwen2-moe": (
        {
            "model_type": "qwen2_moe",
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "hidden_size": 2048,
            "num_experts": 60,
            "torch_dtype": "bfloat16",
        },
        {
            "name": "qwen2-moe",
            "numLayers": 24,
            "numKVHeads": 16,
            "headDim": 128,
            "kvCacheDtype": "bfloat16",
            "attention": "Dense",
            "numExperts": 60,
        },
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_block_from_a_model_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    config, expected = CONFIGS[name]
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["model", str(folder)]) == 0
    block = yaml.safe_load(capsys.readouterr().out)
    assert block == {"model": expected}
    manifest = {
        "apiVersion": "kvbridge.io/v1alpha1",
        "kind": "DisaggregatedDeployment",
        "metadata": {"name": "m"},
        "spec": block,
    }
    parse_deployment(manifest)  # what it prints is a valid spec.model


def test_the_file_itself_and_a_name_override(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS["qwen2-gqa"][0]))
    assert main(["model", str(path), "--name", "Qwen/Qwen2.5-0.5B-Instruct"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["name"] == "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"num_attention_heads": 4, "hidden_size": 256}, "num_hidden_layers"),
        ({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 256}, "not a multiple"),
        ({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "int8"}, "dtype"),
        ({"num_hidden_layers": 2, "model_type": "deepseek_v3", "kv_lora_rank": 512}, "qk_rope_head_dim"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_what_cannot_be_derived_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: Any, message: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["model", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_folder_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err
