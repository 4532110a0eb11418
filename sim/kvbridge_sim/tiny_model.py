"""A tiny random-weight Llama with a locally trained tokenizer, for running real vLLM without a model hub.

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
from pathlib import Path
from typing import Any

#: the ``spec.model.name`` of deployments serving this model; local runners map it to the folder
NAME = "kvbridge/tiny-llama"
NUM_LAYERS = 2
HIDDEN = 256
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN // NUM_HEADS
VOCAB = 1024
MAX_POSITIONS = 1024
SEED = 1234
#: the ``spec.model`` block of a DisaggregatedDeployment serving this model (besides its name)
GEOMETRY: dict[str, Any] = {"numLayers": NUM_LAYERS, "numKVHeads": NUM_KV_HEADS, "headDim": HEAD_DIM,
                            "kvCacheDtype": "bfloat16"}  # fmt: skip
#: bumped whenever what :func:`make` writes changes, so a cached folder is rebuilt
RECIPE = 1
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


def make(path: Path) -> Path:
    """Write the model and tokenizer to ``path`` (idempotent: a folder made by the same recipe is kept)."""
    marker = path / _MARKER
    if marker.exists() and json.loads(marker.read_text()).get("recipe") == RECIPE:
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_corpus(4000, random.Random(SEED)), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        initializer_range=0.1, dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with tempfile.TemporaryDirectory(dir=path.parent) as staging:  # write then rename: no half-made model
        model.save_pretrained(staging)
        fast.save_pretrained(staging)
        Path(staging, _MARKER).write_text(json.dumps({"recipe": RECIPE, **GEOMETRY}))
        for item in Path(staging).iterdir():
            os.replace(item, path / item.name)
    return path


def prompt(length: int, salt: int = 0) -> list[int]:
    """A prompt of exactly ``length`` token ids (no special tokens), different for each ``salt``."""
    rng = random.Random(SEED * 31 + salt)
    return [rng.randrange(3, VOCAB) for _ in range(length)]
