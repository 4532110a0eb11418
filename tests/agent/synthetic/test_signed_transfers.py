"""The agent worker behind a signing router (spec.router.signTransfers): decode reads only the transfer parameters
the router signed, for the request's prompt, for this pod, before the signature expires; anything else gets 403
with the refusal's code before a byte is read."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings, SpecError
from kvbridge_agent.core.contract import EngineEnvironment
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.core.signing import CLOCK_SKEW_SECONDS, SIGNATURE_KEY, signed
from kvbridge_agent.synthetic.completions import complete, prompt_digest
from kvbridge_agent.synthetic.engine import Engine
from kvbridge_agent.synthetic.http_api import AgentHTTPServer
from kvbridge_agent.synthetic.pace import Pace, Pacer
from kvbridge_agent.synthetic.processes import EngineProcess, start_engine
from kvbridge_agent.synthetic.ranks import EngineError
from kvbridge_agent.transfer.keys import generate_keys
from kvbridge_router.pool import Pool
from kvbridge_router.proxy import Router, RouterConfig, listening

TOKEN = b"f" * 64
#: the decode engine's pod (its engine id)
POD = "decode-a"
PROMPT = "a b c"
PARAMS = KVTransferParams(
    remote_engine_id="p1",
    remote_incarnation="inc",
    remote_host="127.0.0.1",
    remote_port=5600,
    remote_request_id="r1",
    remote_block_ids=[3, 4],
    num_tokens=20,
    remote_tp_size=1,
    fingerprint="abcd1234",
    prompt_hash=prompt_digest({"prompt": PROMPT}, chat=False),
).model_dump(by_alias=True, mode="json")


def routed(params: dict[str, Any], pod: str = POD, until: float | None = None) -> dict[str, Any]:
    """What kvbridge's router hands the decode pod ``pod``: prefill's parameters, signed for it."""
    return signed(TOKEN, params, decode_pod=pod, expires_at=time.time() + 600 if until is None else until)


class StubEngine:
    """What the completions route uses of a decode engine: its token, and a decode that records what it read."""

    def __init__(self, token: bytes | None) -> None:
        self.transfer_token = token
        self.env = SimpleNamespace(verify=True, engine_id=POD, dp_index=0, own=SimpleNamespace(data_parallel_size=1))
        self.read: list[KVTransferParams] = []
        self.pace = Pacer(Pace(), Role.DECODE)  # unpaced: answered at once (synthetic/pace.py)

    def rank_of(self, header: str | None) -> int | None:
        return None

    def decode(self, request_id: str, params: KVTransferParams, *rest: Any, **options: Any) -> dict[str, Any]:
        self.read.append(params)
        return {"verified": True, "bytes": 1, "descriptors": 1, "transferSeconds": 0.0}


def body(params: dict[str, Any], prompt: str = PROMPT) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": 3, "kv_transfer_params": params}


def test_decode_reads_what_the_router_signed() -> None:
    engine = StubEngine(TOKEN)
    answer, _ = complete(engine, body(routed(PARAMS)), False, "req-1")  # type: ignore[arg-type]
    assert answer["kvbridge"]["verified"] is True
    assert [p.remote_block_ids for p in engine.read] == [[3, 4]]


@pytest.mark.parametrize(
    "params",
    [
        PARAMS,  # unsigned
        {**routed(PARAMS), "remoteBlockIds": [5, 6]},  # replayed with another request's blocks
        signed(b"another token of enough bytes", PARAMS, decode_pod=POD, expires_at=time.time() + 60),
        {**PARAMS, SIGNATURE_KEY: None},
    ],
)
def test_decode_refuses_unsigned_or_changed_parameters_with_403_before_reading(params: dict[str, Any]) -> None:
    engine = StubEngine(TOKEN)
    with pytest.raises(EngineError) as caught:
        complete(engine, body(params), False, "req-2")  # type: ignore[arg-type]
    assert (caught.value.status, caught.value.code) == (403, "TRANSFER_NOT_SIGNED")
    assert caught.value.field == f"kv_transfer_params.{SIGNATURE_KEY}"
    assert engine.read == []


@pytest.mark.parametrize(
    ("params", "prompt", "code", "field"),
    [
        # issue 56: the same signed parameters with another prompt of the same length (3 tokens)
        (routed(PARAMS), "x y z", "TRANSFER_PROMPT_MISMATCH", "kv_transfer_params.promptHash"),
        (
            routed(PARAMS, pod="decode-b"),
            PROMPT,
            "TRANSFER_WRONG_DECODE",
            f"kv_transfer_params.{SIGNATURE_KEY}.decodePod",
        ),
        (
            routed(PARAMS, until=time.time() - CLOCK_SKEW_SECONDS - 2),
            PROMPT,
            "TRANSFER_SIGNATURE_EXPIRED",
            f"kv_transfer_params.{SIGNATURE_KEY}.expiresAt",
        ),
        (
            routed({k: v for k, v in PARAMS.items() if k != "promptHash"}),
            PROMPT,
            "TRANSFER_PROMPT_UNBOUND",
            "kv_transfer_params.promptHash",
        ),
    ],
)
def test_decode_refuses_a_replay_with_another_prompt_to_another_pod_or_too_late(
    params: dict[str, Any], prompt: str, code: str, field: str
) -> None:
    engine = StubEngine(TOKEN)
    with pytest.raises(EngineError) as caught:
        complete(engine, body(params, prompt), False, "req-5")  # type: ignore[arg-type]
    assert (caught.value.status, caught.value.code, caught.value.field) == (403, code, field)
    assert engine.read == []


def test_decode_without_the_token_takes_signed_and_unsigned_parameters() -> None:
    engine = StubEngine(None)
    complete(engine, body(PARAMS), False, "req-3")  # type: ignore[arg-type]
    complete(engine, body(routed(PARAMS, pod="anywhere")), False, "req-4")  # type: ignore[arg-type]
    assert len(engine.read) == 2  # the signature is no field of the parameters: it is dropped, not refused


@pytest.fixture
def server() -> Iterator[tuple[AgentHTTPServer, StubEngine]]:
    engine = StubEngine(TOKEN)
    http = AgentHTTPServer("127.0.0.1", 0, engine)  # type: ignore[arg-type]
    http.start()
    try:
        yield http, engine
    finally:
        http.shutdown()
        http.server_close()


def post(http: AgentHTTPServer, path: str, data: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://127.0.0.1:{http.port}{path}", data=json.dumps(data).encode())
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_http_api_answers_403_with_the_code_on_both_decode_routes(
    server: tuple[AgentHTTPServer, StubEngine],
) -> None:
    http, engine = server
    status, answer = post(http, "/v1/completions", body(PARAMS))
    assert status == 403
    assert answer["error"]["code"] == "TRANSFER_NOT_SIGNED"
    status, answer = post(http, "/v1/decode", {"requestId": "d1", "kvTransferParams": PARAMS})
    assert (status, answer["error"]["code"]) == (403, "TRANSFER_NOT_SIGNED")
    assert answer["error"]["field"] == f"kvTransferParams.{SIGNATURE_KEY}"
    # /v1/decode checks the prompt it is given (none: none matches)
    status, answer = post(http, "/v1/decode", {"requestId": "d2", "kvTransferParams": routed(PARAMS)})
    assert (status, answer["error"]["code"]) == (403, "TRANSFER_PROMPT_MISMATCH")
    assert answer["error"]["field"] == "kvTransferParams.promptHash"
    assert engine.read == []
    status, _ = post(http, "/v1/completions", body(routed(PARAMS)))
    assert status == 200
    status, _ = post(http, "/v1/decode", {"requestId": "d3", "kvTransferParams": routed(PARAMS), "prompt": PROMPT})
    assert status == 200
    assert len(engine.read) == 2


def environment(role: Role, token_file: Path) -> EngineEnvironment:
    return EngineEnvironment(
        role=role,
        engine_id="e",
        model=ModelGeometry(name="m", num_layers=1, num_kv_heads=1, head_dim=8),
        prefill=RoleSettings(),
        decode=RoleSettings(),
        transfer_token_file=str(token_file),
    )


def test_a_decode_engine_reads_its_token_from_the_contract_and_a_prefill_engine_ignores_it(tmp_path: Path) -> None:
    (tmp_path / "token").write_bytes(TOKEN + b"\n")
    assert Engine(environment(Role.DECODE, tmp_path / "token")).transfer_token == TOKEN
    assert Engine(environment(Role.PREFILL, tmp_path / "token")).transfer_token is None
    with pytest.raises(SpecError) as caught:
        Engine(environment(Role.DECODE, tmp_path / "missing"))
    assert caught.value.code == "TRANSFER_TOKEN_UNREADABLE"


# -- end to end: agent engines as processes, kvbridge's router in front ---------------------------------------------


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    root = tmp_path_factory.mktemp("signed")
    generate_keys(root / "keys")
    (root / "token").write_bytes(TOKEN + b"\n")
    model = ModelGeometry(name="tiny", num_layers=2, num_kv_heads=4, head_dim=16)

    def env(role: Role, token: str | None) -> EngineEnvironment:
        return EngineEnvironment(
            role=role,
            engine_id=f"signed-{role.value}",
            model=model,
            prefill=RoleSettings(),
            decode=RoleSettings(),
            keys_dir=str(root / "keys"),
            num_blocks=32,
            http_port=0,
            side_channel_listen_port=0,
            transfer_timeout_seconds=10,
            transfer_token_file=token,
        )

    started = [start_engine(env(Role.PREFILL, None))]
    try:
        started.append(start_engine(env(Role.DECODE, str(root / "token"))))
        yield started[0], started[1]
    finally:
        for engine in started:
            engine.stop()


def endpoint(engine: EngineProcess) -> dict[str, Any]:
    return {"pod": engine.env.engine_id, "ip": "127.0.0.1", "httpPort": engine.ready["httpPort"], "pairing": "k"}


async def test_through_the_signing_router_decode_reads_and_around_it_decode_refuses(
    engines: tuple[EngineProcess, EngineProcess],
) -> None:
    prefill, decode = engines
    router = Router(RouterConfig(transfer_token=TOKEN))
    router.set_pool(
        Pool.from_status({"prefill": {"endpoints": [endpoint(prefill)]}, "decode": {"endpoints": [endpoint(decode)]}})
    )
    served = contextlib.AsyncExitStack()
    port = await served.enter_async_context(listening(router))
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"prompt": "one two three four five", "max_tokens": 1},
            ) as answer,
        ):
            assert answer.status == 200, await answer.text()
            assert (await answer.json())["kvbridge"]["verified"] is True
    finally:
        await served.aclose()
    # a caller that reaches decode with what prefill returned, not through the router
    status, offered = prefill.post(
        "/v1/completions", {"prompt": "six seven", "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert status == 200
    status, refused = decode.post(
        "/v1/completions", {"prompt": "six seven", "kv_transfer_params": offered["kv_transfer_params"]}
    )
    assert (status, refused["error"]["code"]) == (403, "TRANSFER_NOT_SIGNED")
    # issue 56: what the router signed for this decode pod, replayed with another prompt of the same length
    handed = signed(TOKEN, offered["kv_transfer_params"], decode_pod=decode.env.engine_id, expires_at=time.time() + 60)
    status, refused = decode.post("/v1/completions", {"prompt": "ten eleven", "kv_transfer_params": handed})
    assert (status, refused["error"]["code"]) == (403, "TRANSFER_PROMPT_MISMATCH")
    status, read = decode.post("/v1/completions", {"prompt": "six seven", "kv_transfer_params": handed})
    assert status == 200, read  # its own prompt: read (the refusals left prefill's blocks held)
    assert read["kvbridge"]["verified"] is True
