"""kvbridge's connector behind a signing router (spec.router.signTransfers): decode reads only what the router
signed, for this request's prompt, for this pod, before the signature expires (issue 56, "signed means bound")."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings, SpecError
from kvbridge_agent.core.contract import EngineEnvironment, render_environment
from kvbridge_agent.core.signing import CLOCK_SKEW_SECONDS, SIGNATURE_KEY, prompt_hash, signed
from kvbridge_agent.vllm_connector.messages import ReadOrder
from kvbridge_agent.vllm_connector.scheduler import ConnectorScheduler
from kvbridge_agent.vllm_connector.settings import ConnectorSettings
from kvbridge_agent.vllm_connector.worker import ConnectorWorker

from .test_scheduler import blocks_of, environ, prefill_scheduler, published, request, vllm_config

TOKEN = b"a" * 64
#: the prompt test_scheduler's prefill computed (``request(..., 70, ...)``: token ids 0..69)
PROMPT = list(range(70))


def signing_decode(tmp_path: Path, variables: dict[str, str] | None = None, dp_index: int = 0) -> ConnectorScheduler:
    """A decode scheduler holding the router's token (KVBRIDGE_TRANSFER_TOKEN_FILE), as the operator renders it;
    its pod is ``decode-0``."""
    (tmp_path / "token").write_bytes(TOKEN + b"\n")
    variables = {**(variables or environ(Role.DECODE)), "KVBRIDGE_TRANSFER_TOKEN_FILE": str(tmp_path / "token")}
    config = vllm_config("kv_consumer")
    config.parallel_config.data_parallel_index = dp_index
    return ConnectorScheduler(ConnectorSettings.from_vllm(config, variables))


def routed(params: dict[str, Any], pod: str = "decode-0", until: float | None = None) -> dict[str, Any]:
    """What kvbridge's router hands the decode pod ``pod``: prefill's parameters, signed for it."""
    return signed(TOKEN, params, decode_pod=pod, expires_at=time.time() + 600 if until is None else until)


def refusal(decode: ConnectorScheduler, params: dict[str, Any], request_id: str = "d20", prompt: Any = None) -> str:
    """What decode makes of a request with these parameters (and ``prompt``'s token ids, else prefill's): its
    order's refusal (empty: it is read)."""
    req = request(request_id, 70, params)
    if prompt is not None:
        req.prompt_token_ids = list(prompt)
    assert decode.get_num_new_matched_tokens(req, 0) == (70, True)  # a refusal too: its blocks are reported invalid
    decode.update_state_after_alloc(req, blocks_of([1, 2, 3]), 70)
    return decode.build_connector_meta().to_read[request_id].refused


def reported(decode: ConnectorScheduler, refused: str) -> tuple[bool, str, list[int]]:
    """The worker's result for a refused order: the request fails with the refusal's code, nothing is read."""
    worker = ConnectorWorker(decode.settings, 0, "inc")
    try:
        result = worker._start_read(None, "d20", ReadOrder([1, 2, 3], None, refused))  # type: ignore[arg-type]
        assert result is not None
        return result.ok, result.code, result.invalid_blocks
    finally:
        worker.shutdown()


def test_prefill_publishes_the_hash_of_its_prompt() -> None:
    prefill = prefill_scheduler()
    try:
        assert published(prefill)["kvbridge"]["promptHash"] == prompt_hash(PROMPT)
    finally:
        prefill.shutdown()


def test_decode_with_the_routers_token_reads_what_the_router_signed_for_it(tmp_path: Path) -> None:
    prefill = prefill_scheduler()
    decode = signing_decode(tmp_path)
    try:
        assert refusal(decode, routed(published(prefill)), "ok") == ""
        assert "ok" in decode._waiting  # its prefill lease is renewed while it waits
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_replay_with_another_prompt_of_the_same_length_is_refused(tmp_path: Path) -> None:
    """Issue 56: the old signature covered prefill's parameters only (a token count), so decode read another
    request's KV for a prompt of the same length."""
    prefill = prefill_scheduler()
    decode = signing_decode(tmp_path)
    try:
        refused = refusal(decode, routed(published(prefill)), prompt=[69 - i for i in PROMPT])
        assert refused.startswith("TRANSFER_PROMPT_MISMATCH: kv_transfer_params.kvbridge.promptHash: ")
        assert decode._waiting == {}  # no heartbeat renews a lease for it
        assert reported(decode, refused) == (False, "TRANSFER_PROMPT_MISMATCH", [1, 2, 3])
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_replay_to_another_decode_pod_is_refused(tmp_path: Path) -> None:
    prefill = prefill_scheduler()
    decode = signing_decode(tmp_path)  # decode-0
    try:
        refused = refusal(decode, routed(published(prefill), pod="decode-1"))
        assert refused.startswith(f"TRANSFER_WRONG_DECODE: kv_transfer_params.{SIGNATURE_KEY}.decodePod: ")
        assert "'decode-1'" in refused
        assert reported(decode, refused)[1] == "TRANSFER_WRONG_DECODE"
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_replay_after_the_signature_expired_is_refused(tmp_path: Path) -> None:
    prefill = prefill_scheduler()
    decode = signing_decode(tmp_path)
    try:
        late = routed(published(prefill), until=time.time() - CLOCK_SKEW_SECONDS - 2)
        refused = refusal(decode, late)
        assert refused.startswith(f"TRANSFER_SIGNATURE_EXPIRED: kv_transfer_params.{SIGNATURE_KEY}.expiresAt: ")
        # within the clock-skew margin it is read
        assert refusal(decode, routed(published(prefill), until=time.time() - 1), "skewed") == ""
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_data_parallel_rank_answers_to_its_pods_name(tmp_path: Path) -> None:
    """vLLM names a DP rank's engine ``<pod>_dp<index>``; the router signs for the pod it sends to."""
    env = EngineEnvironment(
        role=Role.DECODE,
        engine_id="decode-0",
        model=ModelGeometry(name="m", num_layers=2, num_kv_heads=2, head_dim=64),
        prefill=RoleSettings(block_size=32),
        decode=RoleSettings(block_size=32, data_parallel_size=2),
        side_channel_host="127.0.0.1",
        side_channel_listen_port=0,
    )
    prefill = prefill_scheduler()
    decode = signing_decode(tmp_path, render_environment(env), dp_index=1)
    try:
        assert decode.engine_id == "decode-0_dp1"
        assert refusal(decode, routed(published(prefill)), "dp") == ""
        assert refusal(decode, routed(published(prefill), pod="decode-0_dp1"), "rank").startswith(
            "TRANSFER_WRONG_DECODE"
        )
    finally:
        prefill.shutdown()
        decode.shutdown()


def _unsigned(params: dict[str, Any]) -> dict[str, Any]:
    return params


def _zeros(params: dict[str, Any]) -> dict[str, Any]:
    sealed = routed(params)[SIGNATURE_KEY]
    assert isinstance(sealed, dict)
    return {**params, SIGNATURE_KEY: {**sealed, "mac": "0" * 64}}


def _another_token(params: dict[str, Any]) -> dict[str, Any]:
    return signed(b"b" * 64, params, decode_pod="decode-0", expires_at=time.time() + 60)


def _replayed(params: dict[str, Any]) -> dict[str, Any]:
    """Parameters the router signed, replayed with another request's blocks."""
    sent = routed(params)
    kvbridge = sent["kvbridge"]
    assert isinstance(kvbridge, dict)
    sent["kvbridge"] = {**kvbridge, "remoteBlockIds": [1, 2, 3]}
    return sent


def _readdressed(params: dict[str, Any]) -> dict[str, Any]:
    """Parameters the router signed for another pod, with the pod's name changed to this one."""
    sent = routed(params, pod="decode-1")
    sealed = sent[SIGNATURE_KEY]
    assert isinstance(sealed, dict)
    return {**sent, SIGNATURE_KEY: {**sealed, "decodePod": "decode-0"}}


def _older_router(params: dict[str, Any]) -> dict[str, Any]:
    """Format 1: a bare hex HMAC, as a router before issue 56 signed."""
    return {**params, SIGNATURE_KEY: "0" * 64}


@pytest.mark.parametrize(
    ("forge", "code", "said"),
    [
        (_unsigned, "TRANSFER_NOT_SIGNED", "carry no signature"),
        (_zeros, "TRANSFER_NOT_SIGNED", "does not match"),
        (_another_token, "TRANSFER_NOT_SIGNED", "does not match"),
        (_replayed, "TRANSFER_NOT_SIGNED", "does not match"),
        (_readdressed, "TRANSFER_NOT_SIGNED", "does not match"),
        (_older_router, "TRANSFER_SIGNATURE_FORMAT", "format 1"),
    ],
)
def test_decode_with_the_routers_token_refuses_unsigned_forged_or_changed_parameters(
    tmp_path: Path, forge: Any, code: str, said: str
) -> None:
    prefill = prefill_scheduler()
    decode = signing_decode(tmp_path)
    try:
        refused = refusal(decode, forge(published(prefill)))
        assert refused.startswith(f"{code}: kv_transfer_params.{SIGNATURE_KEY}: ")
        assert said in refused
        assert decode._waiting == {}  # no heartbeat renews a lease for it
        assert reported(decode, refused) == (False, code, [1, 2, 3])
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_request_that_asks_decode_to_read_without_kvbridge_parameters_needs_the_signature_too(
    tmp_path: Path,
) -> None:
    decode = signing_decode(tmp_path)
    try:
        assert refusal(decode, {"do_remote_prefill": True}).startswith("TRANSFER_NOT_SIGNED")
        assert refusal(decode, routed({"do_remote_prefill": True}), "bare").startswith("TRANSFER_PROMPT_UNBOUND")
        req = request("plain", 40, None)  # a request that reads nothing is none of the token's business
        assert decode.get_num_new_matched_tokens(req, 0) == (0, False)
    finally:
        decode.shutdown()


def test_decode_without_the_token_ignores_the_signature() -> None:
    """The router may sign before the decode pods hold the token (or after they stopped checking)."""
    prefill = prefill_scheduler()
    decode = ConnectorScheduler(ConnectorSettings.from_vllm(vllm_config("kv_consumer"), environ(Role.DECODE)))
    try:
        assert refusal(decode, published(prefill), "unsigned") == ""
        assert refusal(decode, routed(published(prefill), pod="elsewhere"), "signed") == ""
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_token_file_decode_cannot_read_stops_the_engine(tmp_path: Path) -> None:
    variables = {**environ(Role.DECODE), "KVBRIDGE_TRANSFER_TOKEN_FILE": str(tmp_path / "missing")}
    with pytest.raises(SpecError) as caught:
        ConnectorScheduler(ConnectorSettings.from_vllm(vllm_config("kv_consumer"), variables))
    assert caught.value.code == "TRANSFER_TOKEN_UNREADABLE"
