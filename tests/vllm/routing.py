"""``kvbridge-router`` in front of the session's real vLLM engines: its pool as the operator's status would
list them (each engine's address and its rendered pod's pairing key)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from kvbridge_agent.core import Role
from kvbridge_operator.api.names import LABEL_PAIRING
from kvbridge_router.pool import Pool
from kvbridge_router.proxy import Router, RouterConfig, listening
from kvbridge_sim.vllm_engines import Engines, metric, rendered_template

Obj = dict[str, Any]


def endpoint(engines: Engines, name: str, document: Obj, role: Role) -> Obj:
    engine = engines.engines[name]
    key = rendered_template(document, role)["metadata"]["labels"][LABEL_PAIRING]
    return {"pod": name, "ip": engine.ip, "httpPort": engine.spec.http_port, "pairing": key}


def pool(prefill: list[Obj], decode: list[Obj]) -> Pool:
    return Pool.from_status({"prefill": {"endpoints": prefill}, "decode": {"endpoints": decode}})


@asynccontextmanager
async def running_router(config: RouterConfig | None = None) -> AsyncIterator[tuple[Router, str]]:
    router = Router(config or RouterConfig(prefill_timeout=60, decode_timeout=120))
    async with listening(router) as port:
        yield router, f"http://127.0.0.1:{port}"


def streamed_tokens(text: str) -> list[int]:
    """Token ids of a streamed completion (vLLM sends them per chunk with ``return_token_ids``)."""
    tokens: list[int] = []
    for event in text.split("\n\n"):
        data = event.strip().removeprefix("data: ")
        if data and data != "[DONE]":
            chunk = json.loads(data)
            if "error" in chunk:
                raise AssertionError(f"the stream ended with an error: {chunk['error']}")
            for choice in chunk.get("choices", []):
                tokens += choice.get("token_ids") or []
    return tokens


async def pod_calls(session: Any, url: str, role: str, pod: str) -> float:
    """Calls the router at ``url`` sent to one pod (its ``kvbridge_router_pod_requests_total``)."""
    return await metric(session, url, "kvbridge_router_pod_requests_total", f'pod="{pod}",role="{role}"')
