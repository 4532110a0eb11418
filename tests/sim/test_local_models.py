"""The local random-weight models `kvbridge demo` makes: the manifests that name them say their geometry."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvbridge_sim import tiny_model
from kvbridge_sim.demo import models_for

EXAMPLES = Path(__file__).parents[2] / "examples" / "vllm"


@pytest.mark.parametrize(
    ("manifest", "shape"),
    [
        ("tiny-cpu.yaml", tiny_model.TINY),
        ("small-cpu-kv-aware.yaml", tiny_model.SMALL),
        ("small-cpu-kv-pressure.yaml", tiny_model.SMALL),
        ("tiny-moe-cpu.yaml", tiny_model.MOE),
    ],
)
def test_the_example_manifests_say_the_models_geometry(manifest: str, shape: tiny_model.Shape) -> None:
    model = yaml.safe_load((EXAMPLES / manifest).read_text())["spec"]["model"]
    assert model["name"] == shape.name
    geometry = {k: model[k] for k in shape.geometry}
    # served in its own bfloat16 or cast to float32 (CPUs without native bfloat16: docs/vllm.md)
    assert geometry["kvCacheDtype"] in ("bfloat16", "float32")
    assert geometry == {**shape.geometry, "kvCacheDtype": geometry["kvCacheDtype"]}
    assert shape.hidden % shape.num_heads == 0


def test_only_the_models_a_manifest_names_are_made_besides_the_tiny_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[str] = []

    def make(path: Path, shape: tiny_model.Shape = tiny_model.TINY) -> Path:
        made.append(shape.name)
        return path

    monkeypatch.setattr(tiny_model, "make", make)
    docs = [yaml.safe_load((EXAMPLES / "small-cpu-kv-aware.yaml").read_text())]
    folders = models_for(docs, tmp_path)
    assert sorted(folders) == sorted(made) == sorted([tiny_model.TINY.name, tiny_model.SMALL.name])
    assert models_for([{"spec": {"engine": {"kind": "Agent"}}}], tmp_path) == {}
    assert models_for([{"spec": None}], tmp_path) == {tiny_model.TINY.name: str(tmp_path / "tiny-llama")}


@pytest.mark.vllm  # transformers and tokenizers come with vLLM's CPU build
def test_the_tokenizer_has_a_chat_template(tmp_path: Path) -> None:
    """OpenAI clients' ``chat.completions`` against the demo need one (transformers no longer guesses it)."""
    from transformers import AutoTokenizer

    folder = tiny_model.make(tmp_path / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|system|>\nbe brief</s>\n<|user|>\nhello</s>\n<|assistant|>\n"
