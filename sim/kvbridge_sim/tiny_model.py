"""A tiny random-weight Llama (or Mixtral) with a locally trained tokenizer, for running real vLLM without a hub.

No hub is reachable on the machines kvbridge is developed and tested on, and a real model would not fit two
cores anyway. Random weights give deterministic greedy tokens, which is all an equality check between a
single engine and a prefill/decode pair needs. The folder is what ``vllm serve <folder>`` loads; its geometry
(:data:`GEOMETRY`) is what a DisaggregatedDeployment's ``spec.model`` must say.

Needs ``transformers`` and ``tokenizers`` (installed with vLLM); imported lazily so the operator does not.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the ``spec.model.name`` of deployments serving this model; local runners map it to the folder
NAME = "kvbridge/tiny-llama"
NUM_LAYERS = 2
HIDDEN = 256
NUM_HEADS = 4
NUM_KV_HEADS = 2
VOCAB = 1024
MAX_POSITIONS = 1024
SEED = 1234
#: bumped whenever what :func:`make` writes changes, so a cached folder is rebuilt
RECIPE = 2
#: a plain role-tagged chat format, so OpenAI clients' ``chat.completions`` work against the demo (transformers
#: refuses to guess a template for a tokenizer without one)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """A random-weight Llama's size (the tokenizer is the same for all)."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    max_positions: int
    #: a hybrid model: layers attend to a sliding window of this many tokens but for the last of each
    #: :attr:`period` layers, which attends to all (``layer_types`` as transformers and vLLM read it); ``None``: full
    #: attention everywhere
    sliding_window: int | None = None
    #: a mixture-of-experts model (transformers' and vLLM's Mixtral: routed experts in every layer, two per token)
    #: of this many experts; 0: a dense Llama
    num_experts: int = 0
    #: the architecture: ``llama`` (Llama, or Mixtral with experts) or ``gemma3`` (Gemma-3's text model: 5 sliding
    #: layers then a global one, each kind its own RoPE base; transformers' and vLLM's ``Gemma3ForCausalLM``)
    family: str = "llama"
    #: each attention head's width when it is not ``hidden // num_heads`` (0: that quotient)
    explicit_head_dim: int = 0

    @property
    def period(self) -> int:
        """Layers per repetition of the sliding/full pattern: 2 for the Llama (gpt-oss's alternation), 6 for
        Gemma-3 (5 local : 1 global)."""
        return 6 if self.family == "gemma3" else 2

    @property
    def layer_types(self) -> list[str] | None:
        if self.sliding_window is None:
            return None
        last = self.period - 1
        return ["full_attention" if i % self.period == last else "sliding_attention" for i in range(self.num_layers)]

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.num_heads

    @property
    def geometry(self) -> dict[str, Any]:
        """The ``spec.model`` block of a DisaggregatedDeployment serving it (besides its name)."""
        return {
            "numLayers": self.num_layers,
            "numKVHeads": self.num_kv_heads,
            "headDim": self.head_dim,
            "kvCacheDtype": "bfloat16",
            **({"numExperts": self.num_experts} if self.num_experts else {}),
            **({"slidingWindow": self.sliding_window, "layerTypes": self.kinds} if self.family == "gemma3" else {}),
        }

    @property
    def kinds(self) -> list[str]:
        """``spec.model.layerTypes`` (what ``kvbridge model`` writes from the folder's config.json)."""
        return ["Sliding" if kind == "sliding_attention" else "Full" for kind in self.layer_types or ()]


TINY = Shape(NAME, NUM_LAYERS, HIDDEN, NUM_HEADS, NUM_KV_HEADS, MAX_POSITIONS)
#: the ``spec.model`` block of a DisaggregatedDeployment serving the tiny model (besides its name)
GEOMETRY = TINY.geometry
#: big enough that prefill of a few hundred tokens dominates a P/D request's time to first token on a CPU (about
#: 60 M parameters: a 416-token prefill takes ~0.3 s on one core, its decode step ~30 ms), for measuring what a
#: prefix-cache hit saves (benchmarks/router_policies.py)
SMALL = Shape("kvbridge/small-llama", num_layers=4, hidden=1024, num_heads=16, num_kv_heads=4, max_positions=2048)
#: the tiny model with a sliding window of 32 tokens on its first layer and full attention on its second: two
#: KV cache groups in vLLM's hybrid allocator (one where kvbridge's connector runs on vLLM's CPU build)
HYBRID = Shape("kvbridge/tiny-hybrid-llama", NUM_LAYERS, HIDDEN, NUM_HEADS, NUM_KV_HEADS, MAX_POSITIONS, 32)
#: the tiny model's attention with a mixture of 4 experts (2 per token) in place of each MLP: what vLLM's CPU build
#: serves with its CPU MoE kernels, expert parallelism on (EP size 1: one rank; DP is what the CPU build cannot run)
MOE = Shape("kvbridge/tiny-moe", NUM_LAYERS, HIDDEN, NUM_HEADS, NUM_KV_HEADS, MAX_POSITIONS, num_experts=4)
#: Gemma-3's layer pattern shrunk: 6 layers, 5 with a 32-token sliding window then 1 global (Gemma-3-1B's 26 layers
#: and 512-token window, Gemma-3-12B's 48 and 1024), one KV head as Gemma-3-1B, the tiny model's width
GEMMA3 = Shape("kvbridge/tiny-gemma3", 6, HIDDEN, NUM_HEADS, 1, MAX_POSITIONS, 32, family="gemma3")
#: a narrow model with a wide KV cache, so that moving a request's KV takes time beside its forward
#: (benchmarks/vllm_connectors.py --model large): 16 layers of 8 KV heads of 64 (32 KiB per token in bf16: a
#: 1,024-token prompt's KV is 32 MiB, a 4,000-token one's 125 MiB) on a hidden size of 256 (about 22 M parameters)
LARGE = Shape(
    "kvbridge/large-kv-llama",
    num_layers=16,
    hidden=256,
    num_heads=8,
    num_kv_heads=8,
    max_positions=4096,
    explicit_head_dim=64,
)
#: the local models by ``spec.model.name``
SHAPES = {shape.name: shape for shape in (TINY, SMALL, HYBRID, MOE, GEMMA3, LARGE)}
_MARKER = "kvbridge-tiny-model.json"

_TEXT = (
    "prefill decode block cache layer head token tensor parallel rank engine transfer read write notify lease "
    "handshake plan descriptor region memory host device kernel attention query key value model weight sample "
    "greedy batch request response router endpoint pod node cluster operator status event ready the a of to "
    "and in is it for on with as at by from this that be are was were one two three four five six seven eight"
)


def _corpus(lines: int, rng: random.Random) -> list[str]:
    words = _TEXT.split(" ")
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 24))) for _ in range(lines)]


def make(path: Path, shape: Shape = TINY) -> Path:
    """Write the model and tokenizer to ``path`` (idempotent: a folder made by the same recipe is kept)."""
    marker = path / _MARKER
    if marker.exists():
        made = json.loads(marker.read_text())
        if made.get("recipe") == RECIPE and made.get("name", NAME) == shape.name:
            return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_corpus(4000, random.Random(SEED)), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_positions,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "initializer_range": 0.1,
        "dtype": "bfloat16",
    }
    torch.manual_seed(SEED)
    model: Any
    if shape.family == "gemma3":
        model = _gemma3(common, shape)
    elif shape.num_experts:  # each expert's MLP half as wide as the dense model's, two of them per token
        experts = MixtralConfig(
            **common, intermediate_size=2 * shape.hidden, num_local_experts=shape.num_experts, num_experts_per_tok=2
        )
        model = MixtralForCausalLM(experts).to(torch.bfloat16)
    else:
        config = LlamaConfig(
            **common,
            intermediate_size=4 * shape.hidden,
            **({} if shape.sliding_window is None else {"sliding_window": shape.sliding_window}),
            **({} if shape.layer_types is None else {"layer_types": shape.layer_types}),
        )
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    with tempfile.TemporaryDirectory(dir=path.parent) as staging:  # write then rename: no half-made model
        model.save_pretrained(staging)
        fast.save_pretrained(staging)
        Path(staging, _MARKER).write_text(json.dumps({"recipe": RECIPE, "name": shape.name, **shape.geometry}))
        for item in Path(staging).iterdir():
            os.replace(item, path / item.name)
    return path


def _gemma3(common: dict[str, Any], shape: Shape) -> Any:
    """Gemma-3's text model (random weights) of ``shape``: its layer pattern, window and per-kind RoPE bases."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **common,
        intermediate_size=4 * shape.hidden,
        pad_token_id=0,
        query_pre_attn_scalar=shape.head_dim,
        sliding_window=shape.sliding_window,
        layer_types=shape.layer_types,
    )
    return Gemma3ForCausalLM(config).to(torch.bfloat16)


def prompt(length: int, salt: int = 0) -> list[int]:
    """A prompt of exactly ``length`` token ids (no special tokens), different for each ``salt``."""
    rng = random.Random(SEED * 31 + salt)
    return [rng.randrange(3, VOCAB) for _ in range(length)]
