"""``spec.model`` from a Hugging Face ``config.json``: the KV-cache geometry without typing it by hand.

Dense models (Llama, Qwen2, Mistral and the like; MHA or GQA) and MLA models (DeepSeek-V2/V3) are read, with the
routed experts of a mixture-of-experts model (``numExperts``: what ``expertParallel`` needs) and what decides vLLM's
KV cache groups (hf_layers.py): each layer's kind (``layerTypes``), the sliding window, Llama 4's attention chunks
and a hybrid's state-space layers (``stateSpace``). What cannot be derived exactly is an error that names the
config key, never a guess.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvbridge_agent.core import ModelGeometry, SpecError
from kvbridge_agent.core.model import LayerType
from kvbridge_operator.cli import hf_layers

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32", "float": "float32"}
_MLA_TYPES = {"deepseek_v2", "deepseek_v3", "kimi_k2", "deepseek_v32"}


class ModelConfigError(SpecError):
    code = "BAD_MODEL_CONFIG"


def read_config(path: Path) -> dict[str, Any]:
    """``config.json`` itself, or the one in a model folder."""
    file = path / "config.json" if path.is_dir() else path
    try:
        loaded = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelConfigError(
            f"cannot read {file}: {exc.strerror or exc}", field=str(file), code="UNREADABLE"
        ) from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise ModelConfigError(f"{file} is not a JSON config: {exc}", field=str(file)) from exc
    if not isinstance(loaded, dict):
        raise ModelConfigError(f"{file} is not a JSON object", field=str(file))
    text_config = loaded.get("text_config")  # multimodal wrappers keep the language model's config inside
    if isinstance(text_config, dict) and "num_hidden_layers" in text_config:
        dtype = {key: loaded[key] for key in ("torch_dtype", "dtype") if key in loaded and key not in text_config}
        return {**dtype, **text_config}  # the wrapper may name the dtype for both
    return loaded


def _int(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelConfigError(f"config.json has no positive integer {key!r} (got {value!r})", field=key)
    return value


#: where a mixture-of-experts config counts its routed experts (DeepSeek, Qwen-MoE and OLMoE, Mixtral and Llama 4)
_EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


def experts(config: dict[str, Any]) -> int:
    """The routed experts per MoE layer, from the first key of :data:`_EXPERT_KEYS` the config sets; 0: dense."""
    for key in _EXPERT_KEYS:
        if config.get(key) is not None:
            return _int(config, key)
    return 0


def geometry(config: dict[str, Any], name: str) -> ModelGeometry:
    """The ``spec.model`` of a model with this config."""
    dtype_name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    if dtype_name not in _DTYPES:
        raise ModelConfigError(f"unsupported dtype {dtype_name!r} in config.json", field="torch_dtype")
    common: dict[str, Any] = {
        "name": name,
        "num_layers": _int(config, "num_hidden_layers"),
        "kv_cache_dtype": _DTYPES[dtype_name],
        "num_experts": experts(config),
        **layers(config, _int(config, "num_hidden_layers")),
    }
    if config.get("model_type") in _MLA_TYPES or "kv_lora_rank" in config:
        # MLA caches one latent per token: the compressed KV plus the decoupled RoPE key
        latent = _int(config, "kv_lora_rank") + _int(config, "qk_rope_head_dim")
        return ModelGeometry(**common, num_kv_heads=1, head_dim=latent, attention="MLA")
    heads = _int(config, "num_attention_heads")
    kv_heads = _int(config, "num_key_value_heads") if "num_key_value_heads" in config else heads  # MHA
    if config.get("head_dim") is not None:
        head_dim = _int(config, "head_dim")
    else:
        hidden = _int(config, "hidden_size")
        if hidden % heads:
            raise ModelConfigError(
                f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} and head_dim is not given",
                field="head_dim",
            )
        head_dim = hidden // heads
    return ModelGeometry(**common, num_kv_heads=kv_heads, head_dim=head_dim)


def layers(config: dict[str, Any], count: int) -> dict[str, Any]:
    """What decides vLLM's KV cache groups: ``layerTypes`` (left out where every layer is full attention), the
    window, the chunk size and the state-space layers."""
    try:
        kinds = hf_layers.layer_kinds(config, count)
        found: dict[str, Any] = {
            "layer_types": [] if set(kinds) == {LayerType.FULL} else kinds,
            "sliding_window": hf_layers.sliding_window(config, kinds),
            "attention_chunk_size": hf_layers.chunk_size(config, kinds),
            "state_space": hf_layers.state_space(config, kinds, count),
        }
    except hf_layers.LayerConfigError as exc:
        raise ModelConfigError(str(exc), field=exc.key) from exc
    return found


#: the words of spec.model that ``kvbridge model`` leaves out where they hold their default (a dense model's)
_OPTIONAL = ("cacheKind", "numExperts", "layerTypes", "slidingWindow", "attentionChunkSize", "stateSpace")


def model_block(found: ModelGeometry) -> dict[str, Any]:
    """The ``spec.model`` block ``kvbridge model`` prints: every word, less the optional ones at their default."""
    block = found.model_dump(by_alias=True, mode="json")
    defaults = ModelGeometry(name=found.name, num_layers=1, num_kv_heads=1, head_dim=1).model_dump(
        by_alias=True, mode="json"
    )
    return {key: value for key, value in block.items() if key not in _OPTIONAL or value != defaults[key]}


def model_name(path: Path, config: dict[str, Any]) -> str:
    recorded = config.get("_name_or_path")
    if isinstance(recorded, str) and recorded and not recorded.startswith(("/", ".")):
        return recorded
    return (path if path.is_dir() else path.parent).resolve().name or "model"
