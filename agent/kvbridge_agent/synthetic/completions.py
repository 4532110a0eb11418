"""The synthetic engine's OpenAI-shaped routes, so that a P/D router talks to it as it talks to vLLM.

``POST /v1/completions`` and ``/v1/chat/completions`` take what a router sends vLLM's KV connectors:
``kv_transfer_params: {"do_remote_decode": true}`` asks for a prefill (the prompt's blocks are computed and held;
the answer carries the ``kv_transfer_params`` decode needs), and a request carrying those parameters is a
decode (every rank reads and verifies its part of the KV cache). The synthetic engine generates no text: its
answer has an empty completion and, under ``kvbridge``, the transfer's result (``verified``, ``bytes``, ...).
A request without transfer parameters is refused: there is no model to run it on. The prompt's length in tokens
is the length of a token-id list, else one token per whitespace-separated word (of all chat messages).
"""

from __future__ import annotations

import json
import time
import uuid
import zlib
from typing import Any

from pydantic import ValidationError

from kvbridge_agent.core.handshake import KVTransferParams, request_id_problem
from kvbridge_agent.core.signing import TransferNotSignedError, check_signature, decode_pods, prompt_hash, unsigned
from kvbridge_agent.synthetic.data_parallel import DataParallelEngines
from kvbridge_agent.synthetic.ranks import INVALID_REQUEST, EngineError

Obj = dict[str, Any]
MODEL = "kvbridge-synthetic"


def prompt_tokens(body: Obj, chat: bool) -> int:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EngineError("messages must be a non-empty list", code=INVALID_REQUEST, field="messages")
        text = " ".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in messages)
        return max(len(text.split()), 1)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt)
    if isinstance(prompt, str) and prompt.strip():
        return len(prompt.split())
    raise EngineError("prompt must be a non-empty string or list of token ids", code=INVALID_REQUEST, field="prompt")


def prompt_digest(body: Obj, chat: bool) -> str | None:
    """:func:`~kvbridge_agent.core.signing.prompt_hash` of the prompt as this engine counts its tokens: a token-id
    list as it is, text as one id per whitespace-separated word (its CRC-32: the synthetic engine's tokenizer);
    ``None`` without a prompt of either kind."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        text = " ".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in messages)
        return prompt_hash(zlib.crc32(word.encode("utf-8", "surrogatepass")) for word in text.split())
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt_hash(prompt)
    if isinstance(prompt, str):
        return prompt_hash(zlib.crc32(word.encode("utf-8", "surrogatepass")) for word in prompt.split())
    return None


def complete(
    engine: DataParallelEngines, body: Obj, chat: bool, request_id: str, rank: int | None = None
) -> tuple[Obj, bool]:
    """The answer of one request (on DP rank ``rank``, else the least busy), and whether it is to be streamed."""
    if request_id_problem(request_id):  # an id kvbridge cannot carry (the client's X-Request-Id): one of ours
        request_id = uuid.uuid4().hex
    params = body.get("kv_transfer_params")
    tokens = prompt_tokens(body, chat)
    answer: Obj = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": str(body.get("model") or MODEL),
        "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
    }
    choice: Obj = {"index": 0, "finish_reason": "length"}
    choice.update({"message": {"role": "assistant", "content": ""}} if chat else {"text": ""})
    answer["choices"] = [choice]
    if isinstance(params, dict) and params.get("do_remote_decode"):
        with engine.pace.prefilling(tokens):  # the set speed's turn and time (pace.py)
            offered = engine.prefill(request_id, tokens, rank=rank)
        offered = offered.model_copy(update={"prompt_hash": prompt_digest(body, chat)})  # what a signature binds
        answer["kv_transfer_params"] = offered.model_dump(by_alias=True, mode="json")
        return answer, False
    if not isinstance(params, dict) or not params:
        raise EngineError(
            "the synthetic engine serves disaggregated requests only: send kv_transfer_params "
            "(do_remote_decode to prefill, or what prefill returned to decode)",
            code=INVALID_REQUEST,
            field="kv_transfer_params",
        )
    params = signed_by_router(engine, params, "kv_transfer_params", prompt_digest(body, chat))
    remote = transfer_params(params, "kv_transfer_params")
    result = engine.decode(f"decode-{request_id}", remote, rank=rank)
    if not result.get("verified") and engine.env.verify:
        raise EngineError("the KV bytes decode read differ from what prefill computed", code="NOT_VERIFIED", status=500)
    answer["kvbridge"] = {k: result[k] for k in ("verified", "bytes", "descriptors", "transferSeconds")}
    return answer, bool(body.get("stream"))


def signed_by_router(engine: DataParallelEngines, params: Obj, field: str, prompt: str | None) -> Obj:
    """``params`` without the router's signature; where the engine holds the router's token
    (``spec.router.signTransfers``) the signature is checked first, as kvbridge's connector checks it
    (core/signing.py): missing, wrong, expired, for another decode pod or for another prompt than the one whose
    :func:`prompt_digest` is ``prompt``, the request gets 403 with the refusal's code and nothing is read."""
    if engine.transfer_token is not None:
        env = engine.env
        pods = decode_pods(env.engine_id, env.dp_index, env.own.data_parallel_size)
        try:
            check_signature(engine.transfer_token, params, pods=pods, prompt=prompt, field=field)
        except TransferNotSignedError as exc:
            raise EngineError(exc.message, code=exc.code, field=exc.field, status=403) from None
    return unsigned(params)


def transfer_params(raw: object, field: str) -> KVTransferParams:
    """A decode request's transfer parameters, carried as ``field``; an :class:`EngineError` naming where they do
    not validate."""
    try:
        return KVTransferParams.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in (field, *first["loc"]))
        raise EngineError(f"{where}: {first['msg']}", code=INVALID_REQUEST, field=where) from exc


def event_stream(answer: Obj, chat: bool) -> bytes:
    """The answer as OpenAI's server-sent events: one chunk, then ``[DONE]``."""
    chunk = dict(answer, object="chat.completion.chunk" if chat else "text_completion")
    if chat:
        chunk["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": "length"}]
    return f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()


def models() -> Obj:
    return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "kvbridge"}]}
