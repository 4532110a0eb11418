"""Parallel sampling (OpenAI's ``n``): a request for ``n`` completions of one prompt is served as ``n`` P/D
requests of one completion each, whose answers are joined into the one answer the client asked for.

A prefill engine's prefix cache makes the prompt's KV once: the router sends the first sample's prefill alone and
the others' after it (generation.py), to the same prefill pod when the ``kv-aware`` policy finds it there, so they reuse
its blocks and compute only the prompt's last, partial block again. Each decode then reads its own copy of the KV
(a decode engine's blocks belong to one request). vLLM gives its ``n`` samples seeds ``seed``, ``seed + 1``, ...;
the samples here get the same.

Pure: no HTTP library, event loop or metrics client (admission checks ``n``, the proxy runs the samples).
"""

from __future__ import annotations

import json
from typing import Any

from kvbridge_operator.api.objects import Obj

#: the most completions one request may ask for (each is a prefill call and a decode call)
MAX_SAMPLES = 16


class JoinError(ValueError):
    """A sample's answer that is not a completion with a choice: the answers cannot be joined."""


def sample_bodies(body: Obj, n: int) -> list[Obj]:
    """The ``n`` requests of one completion each: ``n`` removed, ``seed`` counted up from the client's (as vLLM's
    own samples are seeded)."""
    one = {key: value for key, value in body.items() if key != "n"}
    seed = body.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        return [one] * n
    return [{**one, "seed": seed + index} for index in range(n)]


def joined(answers: list[bytes]) -> bytes:
    """The samples' answers (each an OpenAI completion or chat completion of one choice, in order) as one: the first
    answer's id and fields, every sample's choice numbered by its place, the prompt's tokens counted once and the
    completions' summed. Raises :class:`JoinError` for an answer that is not such an object."""
    parsed = [_answer(data, index) for index, data in enumerate(answers)]
    first = parsed[0]
    choices = []
    for index, answer in enumerate(parsed):
        for choice in answer["choices"]:
            choices.append({**choice, "index": index})
    out = {**first, "choices": choices}
    usages = [usage for usage in (answer.get("usage") for answer in parsed) if isinstance(usage, dict)]
    if len(usages) == len(parsed):
        completion = sum(_count(usage, "completion_tokens") for usage in usages)
        prompt = _count(usages[0], "prompt_tokens")
        out["usage"] = {**usages[0], "completion_tokens": completion, "total_tokens": prompt + completion}
    return json.dumps(out, separators=(",", ":")).encode()


def _answer(data: bytes, index: int) -> dict[str, Any]:
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list) or not answer["choices"]:
        raise JoinError(f"sample {index}: the decode engine's answer has no choices")
    return answer


def _count(usage: Any, name: str) -> int:
    value = usage.get(name) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
