"""Descriptions of a model's KV cache and of one engine role's settings.

These are the words of the CRD (camelCase aliases) and of the Python API
(snake_case names) for the same things; ``kvbridge_operator`` builds its
DisaggregatedDeployment spec from them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

#: Version of the agent protocol (side-channel envelope and plan semantics).
#: Part of the fingerprint: engines of different protocol versions never pair.
#: 2: rank metadata carries ``blockInterior`` (an agent of version 1 refuses the unknown field; with the version
#: in the envelope it gets PROTOCOL_VERSION_MISMATCH instead of a payload error).
#: 3: verified transfers (docs/protocol.md §8): transfer parameters carry ``verify``, the side channel answers
#: ``digest`` requests; engines of version 2 would ignore the flag or refuse the message, so they never pair.
#: 4: ``kvbridge-digest/2`` (a keyed digest over a prime field; the digest reply carries the request's key): an
#: engine of version 3 would compute other values and fail every verified request as a mismatch.
#: 5: side-channel envelope 3 (a metadata reply carries its agent metadata's SHA-256) and the transfer parameters'
#: ``promptHash``: an engine of version 4 refuses the unknown field and the envelope, so the pairing key (which holds
#: the version) keeps the two releases apart and a rollout between them is blue/green.
PROTOCOL_VERSION = 5


class Attention(StrEnum):
    DENSE = "Dense"
    MLA = "MLA"


class CacheKind(StrEnum):
    """How one TP rank lays out its KV cache (docs/protocol.md §1)."""

    SPLIT = "Split"  # K and V in separate tensors per layer (FlashAttention-like)
    BLOCKS_FIRST = "BlocksFirst"  # K and V inside one block per layer (FlashInfer-like)
    CROSS_LAYER = "CrossLayer"  # one tensor for all layers, block-major, heads outermost


class KVLayout(StrEnum):
    """Order inside one block: heads outermost (HND) or tokens outermost (NHD)."""

    HND = "HND"
    NHD = "NHD"


class KVCacheDtype(StrEnum):
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @property
    def element_bytes(self) -> int:
        return _ELEMENT_BYTES[self]


_ELEMENT_BYTES = {
    KVCacheDtype.FLOAT16: 2,
    KVCacheDtype.BFLOAT16: 2,
    KVCacheDtype.FLOAT32: 4,
    KVCacheDtype.FP8_E4M3: 1,
    KVCacheDtype.FP8_E5M2: 1,
}


class Conversion(StrEnum):
    """May either side re-lay blocks (docs/protocol.md §4b)."""

    AUTO = "Auto"
    OFF = "Off"


class Verification(StrEnum):
    """Which transfers decode verifies against prefill's digest (docs/protocol.md §8)."""

    ALL = "All"
    SAMPLED = "Sampled"
    OFF = "Off"


class LayerType(StrEnum):
    """What one decoder layer keeps per token (``spec.model.layerTypes``): how vLLM's cache groups it."""

    FULL = "Full"  # full attention: every token's KV
    SLIDING = "Sliding"  # sliding-window attention: the KV of the last spec.model.slidingWindow tokens
    CHUNKED_LOCAL = "ChunkedLocal"  # chunked local attention (Llama 4): the KV of the current attentionChunkSize chunk
    STATE_SPACE = "StateSpace"  # no attention: a state-space or linear-attention mixer's state (spec.model.stateSpace)
    NO_CACHE = "NoCache"  # nothing per token: a layer of an MLP only (Nemotron-H's "-")


class StateSpaceKind(StrEnum):
    MAMBA2 = "Mamba2"  # Mamba-2 mixers (Nemotron-H, Granite-4.0-H, Falcon-H1)
    GATED_DELTA_NET = "GatedDeltaNet"  # linear attention with a recurrent state (Qwen3-Next)


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class CamelModel(BaseModel):
    """Base of every spec model: snake_case in Python, camelCase (the CRD words) on the wire."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_enum_values=False,
    )


#: one size of a state's shape
_Size = Annotated[int, Field(ge=1, le=1 << 24)]


class StateSpace(CamelModel):
    """A model's state-space (or linear-attention) layers: one fixed-size state per request and layer, no KV."""

    kind: StateSpaceKind = Field(description="Mamba2 or GatedDeltaNet.")
    num_layers: int = Field(
        ge=1,
        le=1024,
        description="Layers that hold a state: those of layerTypes StateSpace, or every layer where the mixer runs "
        "beside attention (Falcon-H1).",
    )
    conv_state: tuple[_Size, ...] = Field(
        min_length=2,
        max_length=2,
        description="One layer's convolution state per request over all TP ranks: [channels, kernel width - 1].",
    )
    temporal_state: tuple[_Size, ...] = Field(
        min_length=3,
        max_length=3,
        description="One layer's recurrent state per request over all TP ranks: [heads, head dim, state size] "
        "(GatedDeltaNet: [value heads, key head dim, value head dim]).",
    )


#: other spellings of a KV cache dtype, as vLLM's ``--kv-cache-dtype`` takes them (``fp8`` is e4m3 there)
KV_CACHE_DTYPE_ALIASES = {"fp8": KVCacheDtype.FP8_E4M3}


class ModelGeometry(CamelModel):
    """What must be identical on both sides (folded into the fingerprint; the layer description, layerTypes and what
    defines its kinds, into the operator's pairing key only: vLLM reads it from the weights' config)."""

    name: str = Field(
        min_length=1,
        max_length=256,
        description="Model identity, e.g. meta-llama/Llama-3.1-8B-Instruct; the served model for VLLM.",
    )
    num_layers: int = Field(ge=1, le=1024, description="Number of attention layers.")
    num_kv_heads: int = Field(alias="numKVHeads", ge=1, le=4096, description="Total KV heads of the model; 1 for MLA.")
    head_dim: int = Field(ge=1, le=65536, description="Head dimension; the latent width for MLA (e.g. 576).")
    kv_cache_dtype: KVCacheDtype = Field(
        default=KVCacheDtype.BFLOAT16,
        description="KV cache element type; fp8 is vLLM's spelling of fp8_e4m3 (read as fp8_e4m3).",
        json_schema_extra={"enum": [*(d.value for d in KVCacheDtype), *KV_CACHE_DTYPE_ALIASES]},
    )
    attention: Attention = Field(default=Attention.DENSE, description="Dense (MHA/GQA) or MLA.")
    cache_kind: CacheKind = Field(
        default=CacheKind.SPLIT,
        description="Split | BlocksFirst | CrossLayer; MLA uses one latent region per layer (Split).",
    )
    num_experts: int = Field(
        default=0,
        ge=0,
        le=65536,
        description="Routed experts per mixture-of-experts layer (config.json's n_routed_experts or num_experts); "
        "0: a dense model. Changes no KV geometry; expertParallel needs it.",
    )
    layer_types: tuple[LayerType, ...] = Field(
        default_factory=tuple,
        max_length=1024,
        description="Per decoder layer (numLayers of them), what it keeps per token: Full, Sliding, ChunkedLocal, "
        "StateSpace or NoCache; empty: Full everywhere. Decides vLLM's KV cache groups (`kvbridge model` writes it "
        "from config.json).",
    )
    sliding_window: int = Field(
        default=0, ge=0, le=1 << 24, description="Tokens a Sliding layer attends to (its window); 0: none."
    )
    attention_chunk_size: int = Field(
        default=0, ge=0, le=1 << 24, description="Tokens of one chunk of a ChunkedLocal layer (Llama 4); 0: none."
    )
    state_space: StateSpace | None = Field(
        default=None,
        description="The model's state-space or linear-attention layers and their state shapes; unset: none.",
    )

    @field_validator("kv_cache_dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: object) -> object:
        return KV_CACHE_DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _layers_described(self) -> ModelGeometry:
        """layerTypes names every decoder layer, and each kind it names has what defines it."""
        kinds = set(self.layer_types)
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layerTypes names {len(self.layer_types)} layers, numLayers is {self.num_layers}")
        for kind, setting, value in (
            (LayerType.SLIDING, "slidingWindow", self.sliding_window),
            (LayerType.CHUNKED_LOCAL, "attentionChunkSize", self.attention_chunk_size),
        ):
            if (kind in kinds) != (value > 0):
                raise ValueError(
                    f"{setting} ({value}) is set exactly when layerTypes has {kind.value} layers: give both or neither"
                )
        if LayerType.STATE_SPACE in kinds and self.state_space is None:
            raise ValueError("layerTypes has StateSpace layers: describe them in stateSpace")
        return self

    @property
    def element_bytes(self) -> int:
        return self.kv_cache_dtype.element_bytes

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.attention is Attention.MLA

    @property
    def layer_kinds(self) -> list[LayerType]:
        """Every decoder layer's type (Full everywhere unless layerTypes says otherwise)."""
        return list(self.layer_types) or [LayerType.FULL] * self.num_layers

    @property
    def token_bytes_per_head(self) -> int:
        """One token of one KV head in one layer: its keys then its values (MLA: the single latent)."""
        return (1 if self.is_mla else 2) * self.head_dim * self.element_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """The KV cache of one token over all layers and heads (keys and values; MLA: one latent), counted once
        however tensor parallelism splits or replicates it: what a prefill engine holds per token for readers."""
        return self.num_layers * self.num_kv_heads * self.token_bytes_per_head


#: the largest tensor-parallel size a role may run (and a peer may claim on the wire)
MAX_TENSOR_PARALLEL = 1024
#: the largest KV cache block a role may use, in tokens
MAX_BLOCK_SIZE = 4096


class RoleSettings(CamelModel):
    """Settings that may differ between prefill and decode, within the rules of §2."""

    tensor_parallel_size: int = Field(default=1, ge=1, le=MAX_TENSOR_PARALLEL, description="Tensor-parallel size.")
    block_size: int = Field(default=16, ge=1, le=MAX_BLOCK_SIZE, description="KV cache block size in tokens.")
    kv_layout: KVLayout = Field(default=KVLayout.HND, description="Order inside one block: HND or NHD.")
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Data-parallel ranks per engine (vLLM's --data-parallel-size): each rank is an attention "
        "replica of tensorParallelSize GPUs with its own KV cache, engine id and side-channel port (base + rank), "
        "a KV peer of its own; an engine takes dataParallelSize x tensorParallelSize GPUs.",
    )
    expert_parallel: bool = Field(
        default=False,
        description="Shard the experts of a mixture-of-experts model over the engine's dataParallelSize x "
        "tensorParallelSize ranks (vLLM's --enable-expert-parallel); needs spec.model.numExperts. Changes no KV "
        "geometry.",
    )

    @property
    def world_size(self) -> int:
        """Ranks (GPUs) of one engine: every data-parallel rank's tensor-parallel ranks."""
        return self.data_parallel_size * self.tensor_parallel_size


#: how much of a refused value its message shows
_SHOWN_CHARACTERS = 40


def joined_item_check(pattern: str, max_length: int, what: str) -> Callable[[object], object]:
    """The check of one item of a list that is joined with commas into one setting (UCX_TLS, UCX_NET_DEVICES,
    KVBRIDGE_BACKENDS, Multus' annotation), as a ``BeforeValidator``: an item holding a comma would be two, and
    a control character or a value of any length would reach the pod. It refuses what ``pattern`` (anchored) and
    ``max_length`` refuse, which the CRD says too (``Field(pattern=..., max_length=...)`` before it in the
    ``Annotated``: after a validator, pydantic leaves the pattern out of the JSON schema), with a message that
    says what the item must be and shows the start of the value only."""
    compiled = re.compile(pattern)

    def check(value: object) -> object:
        if isinstance(value, str) and (len(value) > max_length or not compiled.fullmatch(value)):
            shown = repr(value[:_SHOWN_CHARACTERS]) + (
                f" ({len(value)} characters)" if len(value) > _SHOWN_CHARACTERS else ""
            )
            raise ValueError(
                f"{shown} is not {what}: at most {max_length} characters matching {pattern}, one name per item "
                "(the list is joined with commas, so an item may hold no comma)"
            )
        return value

    return check


BACKEND_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"
BACKEND_MAX_LENGTH = 32
#: one NIXL backend plugin's name (UCX, GDS, GDS_MT, LIBFABRIC, ...)
Backend = Annotated[
    str,
    Field(min_length=1, max_length=BACKEND_MAX_LENGTH, pattern=BACKEND_PATTERN),
    BeforeValidator(joined_item_check(BACKEND_PATTERN, BACKEND_MAX_LENGTH, "a NIXL backend's name")),
]


class TransferSettings(CamelModel):
    """How the two roles talk: side channel, leases, timeouts, conversions."""

    side_channel_port: int = Field(
        default=5600, ge=1, le=65535, description="Base port of the side channel; + data parallel index."
    )
    backends: list[Backend] = Field(
        default_factory=lambda: ["UCX"], min_length=1, max_length=8, description="NIXL backends, in order."
    )
    lease_seconds: int = Field(
        default=120,
        ge=1,
        le=3600,
        description="How long prefill keeps unread blocks without a heartbeat (vLLM: kv_lease_duration). Long "
        "enough for a loaded decode to start reading; a shorter lease frees blocks that decode may still read.",
    )
    handshake_timeout_seconds: float = Field(
        default=5.0, gt=0, le=300, description="Receive timeout of one side-channel exchange."
    )
    conversion: Conversion = Field(
        default=Conversion.AUTO, description="Auto: either side may re-lay blocks; Off: forbid every conversion."
    )
    verification: Verification = Field(
        default=Verification.SAMPLED,
        description="Which transfers decode verifies against the digest prefill computed (a mismatch fails the "
        "request with KV_DIGEST_MISMATCH, never wrong tokens). All: every one; Sampled: every request of a prefill "
        "engine's first verificationFirstSeconds, then verificationFraction of them; Off: none.",
    )
    verification_first_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description="Sampled: for this long after a prefill engine offers its first request, every request is "
        "verified.",
    )
    verification_fraction: float = Field(
        default=0.05,
        ge=0.0,
        le=1.0,
        description="Sampled: the fraction of requests verified after the first verificationFirstSeconds.",
    )
