"""The model zoo: real families' ``config.json`` (models/<id>/config.json, the facts of their model cards, no weights)
and what kvbridge makes of each — the ``spec.model`` that ``kvbridge model`` writes and the outcome with kvbridge's
connector. models/README.md says where each file's values come from and what was left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvbridge_agent.core.model import ModelGeometry
from kvbridge_operator.cli.hf_config import geometry, read_config

MODELS = Path(__file__).parent / "models"


@dataclass(frozen=True)
class Member:
    """One family: its folder, its Hugging Face name and the ``spec.model`` facts ``kvbridge model`` must find."""

    folder: str
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    experts: int = 0
    mla: bool = False
    #: layers of each kind (Full, Sliding, ChunkedLocal, StateSpace, NoCache) that are not Full
    kinds: dict[str, int] = field(default_factory=dict)
    window: int = 0
    chunk: int = 0
    #: stateSpace: kind, layers, convState, temporalState
    state: tuple[str, int, list[int], list[int]] | None = None
    #: the code kvbridge's connector (spec.engine.connector: KVBridge, GPU) refuses the model with, whatever the
    #: parallelism; "" where some settings are compatible
    refused: str = ""

    def model(self) -> ModelGeometry:
        return geometry(read_config(MODELS / self.folder), self.name)


ZOO = [
    Member("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", 32, 8, 128),
    Member("llama-3.1-70b", "meta-llama/Llama-3.1-70B-Instruct", 80, 8, 128),
    Member(
        "llama-4-scout",
        "meta-llama/Llama-4-Scout-17B-16E-Instruct",
        48,
        8,
        128,
        experts=16,
        kinds={"ChunkedLocal": 36},
        chunk=8192,
        refused="VLLM_KVBRIDGE_CHUNKED_ATTENTION",
    ),
    Member("qwen3-8b", "Qwen/Qwen3-8B", 36, 8, 128),
    Member("qwen3-32b", "Qwen/Qwen3-32B", 64, 8, 128),
    Member("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 48, 4, 128, experts=128),
    Member("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", 94, 4, 128, experts=128),
    Member(
        "qwen3-next-80b-a3b",
        "Qwen/Qwen3-Next-80B-A3B-Instruct",
        48,
        2,
        256,
        experts=512,
        kinds={"StateSpace": 36},
        state=("GatedDeltaNet", 36, [8192, 3], [32, 128, 128]),
        refused="VLLM_KVBRIDGE_STATE_SPACE",
    ),
    Member("deepseek-v3", "deepseek-ai/DeepSeek-V3", 61, 1, 576, experts=256, mla=True),
    Member("kimi-k2", "moonshotai/Kimi-K2-Instruct", 61, 1, 576, experts=384, mla=True),
    Member("gpt-oss-20b", "openai/gpt-oss-20b", 24, 8, 64, experts=32, kinds={"Sliding": 12}, window=128),
    Member("gpt-oss-120b", "openai/gpt-oss-120b", 36, 8, 64, experts=128, kinds={"Sliding": 18}, window=128),
    Member("gemma-3-1b", "google/gemma-3-1b-it", 26, 1, 256, kinds={"Sliding": 22}, window=512),
    Member("gemma-3-12b", "google/gemma-3-12b-it", 48, 8, 256, kinds={"Sliding": 40}, window=1024),
    Member("gemma-3-27b", "google/gemma-3-27b-it", 62, 16, 128, kinds={"Sliding": 52}, window=1024),
    Member("mistral-small-3.1-24b", "mistralai/Mistral-Small-3.1-24B-Instruct-2503", 40, 8, 128),
    Member(
        "mistral-7b-v0.1",
        "mistralai/Mistral-7B-v0.1",
        32,
        8,
        128,
        kinds={"Sliding": 32},
        window=4096,
        refused="VLLM_KVBRIDGE_SLIDING_ONLY",
    ),
    Member("phi-4", "microsoft/phi-4", 40, 10, 128),
    Member("glm-4.5", "zai-org/GLM-4.5", 92, 8, 128, experts=160),
    Member(
        "nemotron-nano-9b-v2",
        "nvidia/NVIDIA-Nemotron-Nano-9B-v2",
        56,
        8,
        128,
        kinds={"StateSpace": 27, "NoCache": 25},
        state=("Mamba2", 27, [12288, 3], [128, 80, 128]),
        refused="VLLM_KVBRIDGE_STATE_SPACE",
    ),
    Member(
        "falcon-h1-1.5b",
        "tiiuae/Falcon-H1-1.5B-Instruct",
        24,
        2,
        128,
        state=("Mamba2", 24, [3584, 3], [48, 64, 256]),
        refused="VLLM_KVBRIDGE_STATE_SPACE",
    ),
]
