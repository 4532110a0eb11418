"""What each layer of a Hugging Face model keeps per token, read from its ``config.json`` as vLLM 0.32 reads it.

vLLM takes a layer's kind from ``layer_types`` where the model's transformers config has one (written in the file,
or computed from a pattern: Gemma's ``sliding_window_pattern``, Llama 4's NoPE layers, Qwen3-Next's
``full_attention_interval``), from the model's own pattern otherwise (Nemotron-H's ``hybrid_override_pattern``),
and gives every layer the model-level ``sliding_window`` when there is no ``layer_types`` at all. Each rule here is
one of those; a config whose layers none of them can place is an error naming the key, never a guess.
"""

from __future__ import annotations

from typing import Any

from kvbridge_agent.core.model import LayerType, StateSpace, StateSpaceKind

#: ``layer_types`` values of transformers' configs (vLLM compares them to these names)
_LAYER_TYPES = {
    "full_attention": LayerType.FULL,
    "attention": LayerType.FULL,  # granitemoehybrid
    "sliding_attention": LayerType.SLIDING,
    "chunked_attention": LayerType.CHUNKED_LOCAL,
    "linear_attention": LayerType.STATE_SPACE,
    "mamba": LayerType.STATE_SPACE,
    "hybrid": LayerType.FULL,  # falcon_h1: attention beside a Mamba-2 mixer (stateSpace)
    "mlp": LayerType.NO_CACHE,  # nemotron_h, as transformers writes its pattern
    "moe": LayerType.NO_CACHE,
}
#: Nemotron-H's ``hybrid_override_pattern``: one character per layer
_PATTERN = {"*": LayerType.FULL, "M": LayerType.STATE_SPACE, "-": LayerType.NO_CACHE, "E": LayerType.NO_CACHE}
#: model types whose transformers config computes ``layer_types`` from a period (the last layer of each period is
#: full attention, the others slide), with the default period where the file gives no ``sliding_window_pattern``
_SLIDING_PERIODS = {"gemma2": 2, "gemma3_text": 6, "gemma3": 6}
#: model types vLLM runs with every layer at the model-level window when the config has one (no ``layer_types``)
_UNIFORM_WINDOW = frozenset({"llama", "mistral", "mixtral", "phi3", "starcoder2", "qwen2", "qwen3", "qwen2_moe"})


class LayerConfigError(ValueError):
    """A config.json whose layers cannot be placed exactly; ``key`` names the config key at fault."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


def _positive(config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayerConfigError(f"config.json has no positive integer {key!r} (got {value!r})", key)
    return value


def _window(config: dict[str, Any]) -> int:
    """The model-level sliding window in tokens, 0 where there is none (null, 0, or ``use_sliding_window: false``)."""
    window = config.get("sliding_window")
    if window in (None, 0) or config.get("use_sliding_window") is False:
        return 0
    return _positive(config, "sliding_window")


def layer_kinds(config: dict[str, Any], layers: int) -> list[LayerType]:
    """Every layer's kind, in order (vLLM's reading of the config)."""
    model_type = str(config.get("model_type", ""))
    if isinstance(config.get("layer_types"), list):
        named = [_LAYER_TYPES.get(str(name)) for name in config["layer_types"]]
        if None in named or len(named) != layers:
            raise LayerConfigError(
                f"layer_types names {len(named)} layers of {sorted(set(map(str, config['layer_types'])))}; "
                f"kvbridge reads {layers} layers of {sorted(_LAYER_TYPES)}",
                "layer_types",
            )
        return [kind for kind in named if kind is not None]
    if isinstance(config.get("hybrid_override_pattern"), str):
        pattern = config["hybrid_override_pattern"]
        if len(pattern) != layers or set(pattern) - set(_PATTERN):
            raise LayerConfigError(
                f"hybrid_override_pattern {pattern!r} is not {layers} of {''.join(_PATTERN)}", "hybrid_override_pattern"
            )
        return [_PATTERN[char] for char in pattern]
    if model_type == "qwen3_next":
        interval = _positive(config, "full_attention_interval", 4)
        return [LayerType.FULL if (i + 1) % interval == 0 else LayerType.STATE_SPACE for i in range(layers)]
    if config.get("attention_chunk_size") and model_type.startswith("llama4"):
        return _llama4_layers(config, layers)
    return _windowed_layers(config, layers, model_type)


def _llama4_layers(config: dict[str, Any], layers: int) -> list[LayerType]:
    """Llama 4: layers with RoPE attend in chunks, the NoPE layers (every ``no_rope_layer_interval``-th, or those
    ``no_rope_layers`` marks 0) attend to everything."""
    marks = config.get("no_rope_layers") or []
    if not marks:
        interval = _positive(config, "no_rope_layer_interval", 4)
        marks = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(marks) != layers:
        raise LayerConfigError(f"no_rope_layers names {len(marks)} layers, not {layers}", "no_rope_layers")
    return [LayerType.CHUNKED_LOCAL if mark else LayerType.FULL for mark in marks]


def _windowed_layers(config: dict[str, Any], layers: int, model_type: str) -> list[LayerType]:
    """Full attention everywhere, but where the config has a sliding window: every layer of a period but its last
    (Gemma), the layers from ``max_window_layers`` on (Qwen2/3 with ``use_sliding_window``), or every layer."""
    window = _window(config)
    if not window:
        return [LayerType.FULL] * layers
    if model_type in _SLIDING_PERIODS:
        period = _positive(config, "sliding_window_pattern", _SLIDING_PERIODS[model_type])
        return [LayerType.FULL if (i + 1) % period == 0 else LayerType.SLIDING for i in range(layers)]
    if model_type not in _UNIFORM_WINDOW:
        raise LayerConfigError(
            f"sliding_window {window} without layer_types in a {model_type or 'model'} config: kvbridge cannot tell "
            "which layers slide; add the model's layer_types to config.json",
            "layer_types",
        )
    first = config.get("max_window_layers", 0) if model_type.startswith("qwen") else 0
    return [LayerType.SLIDING if i >= first else LayerType.FULL for i in range(layers)]


def sliding_window(config: dict[str, Any], kinds: list[LayerType]) -> int:
    return _positive(config, "sliding_window") if LayerType.SLIDING in kinds else 0


def chunk_size(config: dict[str, Any], kinds: list[LayerType]) -> int:
    return _positive(config, "attention_chunk_size") if LayerType.CHUNKED_LOCAL in kinds else 0


def state_space(config: dict[str, Any], kinds: list[LayerType], layers: int) -> StateSpace | None:
    """The state-space or linear-attention layers' states, as vLLM's ``MambaStateShapeCalculator`` shapes them
    (over all TP ranks): Qwen3-Next's Gated DeltaNet, Nemotron-H's, Granite-4.0-H's and Falcon-H1's Mamba-2."""
    model_type = str(config.get("model_type", ""))
    stateful = kinds.count(LayerType.STATE_SPACE)
    if model_type == "qwen3_next":
        k_heads, v_heads = _positive(config, "linear_num_key_heads"), _positive(config, "linear_num_value_heads")
        k_dim, v_dim = _positive(config, "linear_key_head_dim"), _positive(config, "linear_value_head_dim")
        channels = 2 * k_heads * k_dim + v_heads * v_dim
        kernel = _positive(config, "linear_conv_kernel_dim")
        return StateSpace(
            kind=StateSpaceKind.GATED_DELTA_NET,
            num_layers=stateful,
            conv_state=[channels, kernel - 1],
            temporal_state=[v_heads, v_dim, k_dim],
        )
    names = _MAMBA_KEYS.get(model_type)
    if names is None:
        if stateful:
            raise LayerConfigError(f"{stateful} state-space layers of an unknown kind ({model_type})", "model_type")
        return None
    heads, head_dim, state, groups, kernel = (_positive(config, key) for key in names)
    intermediate = _mamba_intermediate(config, model_type, heads * head_dim)
    return StateSpace(
        kind=StateSpaceKind.MAMBA2,
        num_layers=stateful or layers,  # Falcon-H1: a Mamba-2 mixer beside attention in every layer
        conv_state=[intermediate + 2 * groups * state, kernel - 1],
        temporal_state=[heads, head_dim, state],
    )


#: a Mamba-2 mixer's heads, head dim, state size, groups and convolution kernel, as each model type names them
_MAMBA_KEYS = {
    "nemotron_h": ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel"),
    "falcon_h1": ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv"),
    "granitemoehybrid": ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv"),
}


def _mamba_intermediate(config: dict[str, Any], model_type: str, heads_width: int) -> int:
    """A Mamba-2 mixer's inner width as vLLM takes it: heads x head dim (Nemotron-H), ``mamba_d_ssm`` (Falcon-H1),
    else ``mamba_expand`` x ``hidden_size``."""
    if model_type == "nemotron_h":
        return heads_width
    if model_type == "falcon_h1" and config.get("mamba_d_ssm") is not None:
        return _positive(config, "mamba_d_ssm")
    expand = config.get("mamba_expand")
    if not isinstance(expand, (int, float)) or isinstance(expand, bool) or expand <= 0:
        raise LayerConfigError(f"config.json has no positive mamba_expand (got {expand!r})", "mamba_expand")
    return int(expand * _positive(config, "hidden_size"))
