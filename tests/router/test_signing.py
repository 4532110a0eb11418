"""The router signs the kv_transfer_params it hands decode (--transfer-token-file, spec.router.signTransfers), for
the decode pod it sends them to, until it stops waiting for that pod's answer."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvbridge_agent.core.signing import SIGNATURE_KEY, SIGNATURE_VERSION, signature, unsigned
from kvbridge_router.cli import main
from kvbridge_router.proxy import RouterConfig

from .test_proxy import Rig, running_rig

TOKEN = b"0123456789abcdef0123456789abcdef"


def bound(params: dict[str, Any], pod: str, within: float) -> None:
    """``params`` carry the router's valid signature (under TOKEN) for the decode pod ``pod``, expiring within
    ``within`` seconds from now (what decode checks: core/signing.py; the fake prefill adds no prompt hash)."""
    sealed = params[SIGNATURE_KEY]
    assert sealed["version"] == SIGNATURE_VERSION
    assert sealed["decodePod"] == pod
    assert time.time() <= sealed["expiresAt"] <= time.time() + within + 1
    assert sealed["mac"] == signature(TOKEN, params, pod, sealed["expiresAt"])


@pytest.fixture
async def signing_rig() -> AsyncIterator[Rig]:
    config = RouterConfig(prefill_timeout=1.0, decode_timeout=5.0, transfer_token=TOKEN)
    async with running_rig(config, ["prefill-0"], ["decode-0", "decode-1"]) as rig:
        yield rig


async def test_decode_gets_prefills_parameters_with_the_routers_signature(signing_rig: Rig) -> None:
    for body in ({"prompt": [1, 2, 3], "max_tokens": 3}, {"prompt": "hi", "stream": True}):
        status, _ = await signing_rig.post(body)
        assert status == 200
    sent = [(engine.name, body["kv_transfer_params"]) for engine in signing_rig.decode for body in engine.received]
    assert len(sent) == 2
    for pod, params in sent:
        bound(params, pod, within=5.0)  # for the pod that got them, until the router's decode timeout
        assert unsigned(params) == {"remote_engine_id": "prefill-0", "remote_block_ids": [7]}  # prefill's, as is
    # prefill is asked for parameters, and is handed no signature
    assert all(SIGNATURE_KEY not in body["kv_transfer_params"] for body in signing_rig.prefill[0].received)


async def test_a_decode_retried_on_another_pod_carries_a_valid_signature_too(signing_rig: Rig) -> None:
    signing_rig.route(
        decode=[{"pod": "gone", "ip": "127.0.0.1", "httpPort": 1, "pairing": "k"}, signing_rig.decode[1].endpoint]
    )
    for i in range(3):
        status, answer = await signing_rig.post({"prompt": [i]})
        assert status == 200, answer
    for body in signing_rig.decode[1].received:
        bound(body["kv_transfer_params"], "decode-1", within=5.0)  # signed anew for the pod that got them
    metrics = await (await signing_rig.session.get(signing_rig.url + "/metrics")).text()
    assert 'kvbridge_router_decode_retries_total{pod="gone"}' in metrics  # the same parameters, signed once more


async def test_the_signature_expires_when_the_router_stops_waiting(signing_rig: Rig) -> None:
    """A signature lasts the decode call's bound: the decode timeout, or what is left of the request's."""
    signing_rig.router.config = replace(signing_rig.router.config, decode_timeout=600.0, request_timeout=30.0)
    status, _ = await signing_rig.post({"prompt": [5]})
    assert status == 200
    [(pod, params)] = [(e.name, b["kv_transfer_params"]) for e in signing_rig.decode for b in e.received]
    bound(params, pod, within=30.0)


async def test_without_a_token_the_router_adds_no_signature(signing_rig: Rig) -> None:
    signing_rig.router.config = replace(signing_rig.router.config, transfer_token=b"")
    status, _ = await signing_rig.post({"prompt": [1]})
    assert status == 200
    [body] = [b for engine in signing_rig.decode for b in engine.received]
    assert SIGNATURE_KEY not in body["kv_transfer_params"]


def test_the_token_is_not_shown_with_the_routers_settings() -> None:
    assert "0123456789abcdef" not in repr(RouterConfig(transfer_token=TOKEN))


def test_an_unreadable_token_file_exits_2_with_the_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "short").write_text("tiny\n")
    for path in (tmp_path / "missing", tmp_path / "short"):
        assert main(["--status-file", "f", "--transfer-token-file", str(path)]) == 2
        err = capsys.readouterr().err
        assert "TRANSFER_TOKEN_UNREADABLE" in err
        assert "Traceback" not in err


class _StartedError(Exception):
    pass


def test_the_flag_gives_the_router_the_files_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "token").write_bytes(TOKEN + b"\n")
    seen: list[RouterConfig] = []

    def started(config: RouterConfig, *rest: Any, **named: Any) -> None:
        seen.append(config)
        raise _StartedError

    monkeypatch.setattr("kvbridge_router.proxy.Router", started)
    with pytest.raises(_StartedError):
        main(["--status-file", "f", "--transfer-token-file", str(tmp_path / "token")])
    assert seen[0].transfer_token == TOKEN
