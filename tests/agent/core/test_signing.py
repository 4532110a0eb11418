"""The router's signature on decode's kv_transfer_params (spec.router.signTransfers): one canonical form for the
router and both engines; it binds the prompt, the decode pod and an expiry, and every change breaks it."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import SpecError
from kvbridge_agent.core.signing import (
    CLOCK_SKEW_SECONDS,
    MAX_VALIDITY_SECONDS,
    SIGNATURE_KEY,
    SIGNATURE_VERSION,
    TRANSFER_NOT_SIGNED,
    TRANSFER_PROMPT_MISMATCH,
    TRANSFER_PROMPT_UNBOUND,
    TRANSFER_SIGNATURE_CLOCK_SKEW,
    TRANSFER_SIGNATURE_EXPIRED,
    TRANSFER_SIGNATURE_FORMAT,
    TRANSFER_TOKEN_UNREADABLE,
    TRANSFER_WRONG_DECODE,
    TransferNotSignedError,
    canonical,
    check_signature,
    decode_pods,
    load_token,
    material,
    prompt_hash,
    request_prompt_hash,
    signature,
    signed,
    unsigned,
)

TOKEN = b"0123456789abcdef" * 4
NOW = 1.7e9
PROMPT = list(range(1000, 1070))
HASH = prompt_hash(PROMPT)
OURS = {
    "remoteEngineId": "prefill-0",
    "remoteBlockIds": [7, 8, 9],
    "numTokens": 70,
    "expiresAt": NOW + 120.1,
    "remoteRequestId": "cmpl-caf\u00e9",
    "promptHash": HASH,
}
PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "kvbridge": OURS}
POD = "decode-0"
PODS = frozenset({POD})


def sent(params: dict[str, Any] = PARAMS, pod: str = POD, until: float = NOW + 600) -> dict[str, Any]:
    """What the router hands decode: ``params`` signed for ``pod`` until ``until``."""
    handed: dict[str, Any] = json.loads(json.dumps(signed(TOKEN, params, decode_pod=pod, expires_at=until)))
    return handed


def check(params: dict[str, Any], prompt: str | None = HASH, pods: frozenset[str] = PODS, now: float = NOW) -> None:
    """What kvbridge's vLLM connector checks (prefill's parameters under ``kvbridge``)."""
    check_signature(TOKEN, params, pods=pods, prompt=prompt, params_key="kvbridge", now=now)


def refused(params: dict[str, Any], **context: Any) -> TransferNotSignedError:
    with pytest.raises(TransferNotSignedError) as caught:
        check(params, **context)
    return caught.value


# -- the format ------------------------------------------------------------------------------------------------------


def test_the_mac_is_hmac_sha256_of_the_binding_and_the_canonical_parameters() -> None:
    text = json.dumps(PARAMS, sort_keys=True, separators=(",", ":"))
    assert canonical(PARAMS) == text.encode()
    assert b"\\u00e9" in canonical(PARAMS)  # ASCII: the same bytes whatever encoding a side prefers
    binding = {"version": SIGNATURE_VERSION, "decodePod": POD, "expiresAt": 1_700_000_600}
    body = json.dumps({"binding": binding, "params": PARAMS}, sort_keys=True, separators=(",", ":"))
    assert material(PARAMS, POD, 1_700_000_600) == b"kvbridge-transfer-signature/2\n" + body.encode()
    want = hmac.new(TOKEN, material(PARAMS, POD, 1_700_000_600), hashlib.sha256).hexdigest()
    assert signature(TOKEN, PARAMS, POD, 1_700_000_600) == want
    assert sent(until=1_700_000_599.2)[SIGNATURE_KEY] == {
        "version": 2,
        "decodePod": POD,
        "expiresAt": 1_700_000_600,  # rounded up to a second: an integer in the JSON
        "mac": want,
    }


def test_signed_parameters_pass_and_the_original_is_left_alone() -> None:
    before = json.dumps(PARAMS)
    handed = signed(TOKEN, PARAMS, decode_pod=POD, expires_at=NOW + 600)
    assert json.dumps(PARAMS) == before
    check(handed)
    assert unsigned(handed) == PARAMS
    # what decode parses from the router's bytes (another key order, another spacing) still passes
    check(json.loads(json.dumps(dict(reversed(list(handed.items()))), indent=2)))
    # signed again (a retry on another pod): one signature, the new one
    again = signed(TOKEN, handed, decode_pod="decode-1", expires_at=NOW + 600)
    check(again, pods=frozenset({"decode-1"}))
    assert unsigned(again) == PARAMS


def test_the_validity_is_at_most_a_day_from_now() -> None:
    handed = signed(TOKEN, PARAMS, decode_pod=POD, expires_at=time.time() + 10 * MAX_VALIDITY_SECONDS)
    assert handed[SIGNATURE_KEY]["expiresAt"] <= time.time() + MAX_VALIDITY_SECONDS + 1  # type: ignore[index]
    check_signature(TOKEN, handed, pods=PODS, prompt=HASH, params_key="kvbridge")  # on this clock: valid


def test_key_order_and_the_signature_key_do_not_change_the_canonical_form() -> None:
    shuffled = {"kvbridge": dict(reversed(list(OURS.items()))), "do_remote_decode": False, "do_remote_prefill": True}
    assert canonical(shuffled) == canonical(PARAMS)
    assert canonical({**PARAMS, SIGNATURE_KEY: "anything"}) == canonical(PARAMS)
    assert signature(TOKEN, shuffled, POD, 1) == signature(TOKEN, PARAMS, POD, 1)


# -- what it binds: the replays of issue 56 ------------------------------------------------------------------------


def test_a_replay_with_another_prompt_of_the_same_length_is_refused() -> None:
    other = [1069 - i for i in range(70)]  # 70 tokens too: the token count alone cannot tell
    caught = refused(sent(), prompt=prompt_hash(other))
    assert caught.code == TRANSFER_PROMPT_MISMATCH
    assert caught.field == "kv_transfer_params.kvbridge.promptHash"
    assert "another prompt" in caught.message
    assert refused(sent(), prompt=None).code == TRANSFER_PROMPT_MISMATCH  # a request decode cannot hash


def test_a_replay_to_another_decode_pod_is_refused() -> None:
    caught = refused(sent(pod="decode-0"), pods=frozenset({"decode-1"}))
    assert caught.code == TRANSFER_WRONG_DECODE
    assert caught.field == f"kv_transfer_params.{SIGNATURE_KEY}.decodePod"
    assert "'decode-0'" in caught.message
    assert "decode-1" in caught.message


def test_a_replay_after_the_expiry_is_refused_and_the_clock_skew_margin_is_honoured() -> None:
    handed = sent(until=NOW)
    check(handed, now=NOW + CLOCK_SKEW_SECONDS)  # decode's clock up to the margin behind the router's
    caught = refused(handed, now=NOW + CLOCK_SKEW_SECONDS + 1)
    assert caught.code == TRANSFER_SIGNATURE_EXPIRED
    assert caught.field == f"kv_transfer_params.{SIGNATURE_KEY}.expiresAt"
    # an expiry further ahead than a router signs for: the router's clock runs ahead
    far = sent(until=time.time() + MAX_VALIDITY_SECONDS)
    skewed = time.time() - CLOCK_SKEW_SECONDS - 5
    assert refused(far, now=skewed).code == TRANSFER_SIGNATURE_CLOCK_SKEW


def test_the_untampered_path_is_accepted_where_each_check_passes() -> None:
    check(sent(), pods=frozenset({"x", POD}), now=NOW + 599)
    # the agent worker's parameters are prefill's object itself (no "kvbridge" key)
    check_signature(TOKEN, sent(OURS), pods=PODS, prompt=HASH, now=NOW)


def test_parameters_without_a_prompt_hash_are_refused_as_unbound() -> None:
    bare = {**PARAMS, "kvbridge": {k: v for k, v in OURS.items() if k != "promptHash"}}
    caught = refused(sent(bare))
    assert (caught.code, caught.field) == (TRANSFER_PROMPT_UNBOUND, "kv_transfer_params.kvbridge.promptHash")
    caught = refused(sent({"do_remote_prefill": True}))  # asks decode to read, names nothing
    assert caught.code == TRANSFER_PROMPT_UNBOUND


def _with(path: tuple[str, ...], value: object, params: dict[str, Any] | None = None) -> dict[str, Any]:
    copy: dict[str, Any] = json.loads(json.dumps(params or sent()))
    target: Any = copy
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return copy


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("kvbridge", "remoteBlockIds"), [7, 8, 10]),  # another request's blocks
        (("kvbridge", "remoteEngineId"), "prefill-1"),
        (("kvbridge", "numTokens"), 71),
        (("kvbridge", "expiresAt"), NOW + 3600),  # a replay with a longer lease
        (("kvbridge", "promptHash"), prompt_hash([1, 2, 3])),  # rebound to another prompt
        (("kvbridge", "extra"), 1),
        (("do_remote_prefill",), 1),  # true as a number: other JSON, another signature
        ((SIGNATURE_KEY, "decodePod"), "decode-1"),  # re-addressed to another pod
        ((SIGNATURE_KEY, "expiresAt"), int(NOW) + 7200),  # made to last longer
    ],
)
def test_any_changed_field_breaks_the_signature(path: tuple[str, ...], value: object) -> None:
    caught = refused(_with(path, value), pods=frozenset({POD, "decode-1"}))
    assert caught.code == TRANSFER_NOT_SIGNED
    assert caught.field == f"kv_transfer_params.{SIGNATURE_KEY}"
    assert "does not match" in caught.message


@pytest.mark.parametrize(
    "given",
    [
        None,
        "",
        7,
        ["x"],
        {},
        {"version": 2},
        {"version": True, "decodePod": POD, "expiresAt": int(NOW), "mac": "0" * 64},
        {"version": 2, "decodePod": "", "expiresAt": int(NOW), "mac": "0" * 64},
        {"version": 2, "decodePod": "x" * 254, "expiresAt": int(NOW), "mac": "0" * 64},
        {"version": 2, "decodePod": POD, "expiresAt": NOW + 0.5, "mac": "0" * 64},
        {"version": 2, "decodePod": POD, "expiresAt": -1, "mac": "0" * 64},
        {"version": 2, "decodePod": POD, "expiresAt": int(NOW), "mac": "0" * 63},
        {"version": 2, "decodePod": POD, "expiresAt": int(NOW), "mac": "A" * 64},
        {"version": 2, "decodePod": POD, "expiresAt": int(NOW), "mac": "\ud800" * 64},
        {"version": 2, "decodePod": POD, "expiresAt": int(NOW), "mac": "0" * 64},
    ],
)
def test_a_missing_malformed_or_foreign_signature_is_refused(given: object) -> None:
    params = dict(PARAMS) if given is None else {**PARAMS, SIGNATURE_KEY: given}
    with pytest.raises(TransferNotSignedError) as caught:
        check_signature(TOKEN, params, pods=PODS, prompt=HASH, params_key="kvbridge", field="kvTransferParams")
    assert caught.value.code == TRANSFER_NOT_SIGNED
    assert caught.value.field == f"kvTransferParams.{SIGNATURE_KEY}"
    if given is None:
        assert "carry no signature" in caught.value.message


def test_another_token_is_refused() -> None:
    handed = signed(b"another token, 32 bytes long....", PARAMS, decode_pod=POD, expires_at=NOW + 60)
    assert refused(handed).code == TRANSFER_NOT_SIGNED


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (hmac.new(TOKEN, canonical(PARAMS), hashlib.sha256).hexdigest(), "format 1"),  # an older router's
        ({"version": 1, "decodePod": POD, "expiresAt": int(NOW), "mac": "0" * 64}, "format 1"),
        ({"version": 3, "decodePod": POD, "expiresAt": int(NOW), "mac": "0" * 64}, "format 3"),
        ({"version": 10**400}, "format ?"),
    ],
)
def test_a_signature_of_another_format_says_so(given: object, said: str) -> None:
    caught = refused({**PARAMS, SIGNATURE_KEY: given})
    assert caught.code == TRANSFER_SIGNATURE_FORMAT
    assert said in caught.message
    assert f"format {SIGNATURE_VERSION}" in caught.message


def test_parameters_json_cannot_hold_are_refused_typed() -> None:
    handed = {"x": {1, 2}, SIGNATURE_KEY: {"version": 2, "decodePod": POD, "expiresAt": 1, "mac": "0" * 64}}
    with pytest.raises(TransferNotSignedError):
        check_signature(TOKEN, handed, pods=PODS, prompt=HASH)


# -- hypothesis: any mutation of what the router signed is refused -------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every position in a JSON value (object keys and list indexes)."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*prefix, index))
    return found


@st.composite
def mutated(draw: st.DrawFn) -> dict[str, Any]:
    """The router's signed parameters with one position replaced, deleted, or a key added."""
    handed = sent()
    path = draw(st.sampled_from(_paths(handed)))
    copy: dict[str, Any] = json.loads(json.dumps(handed))
    parent: Any = copy
    for key in path[:-1]:
        parent = parent[key]
    action = draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "delete" and isinstance(parent, dict):
        del parent[path[-1]]
    elif action == "add" and isinstance(parent, dict):
        parent[draw(st.text(max_size=8))] = draw(JSON)
    else:
        parent[path[-1]] = draw(JSON)
    return copy


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_hypothesis_any_field_mutation_is_refused(params: dict[str, Any]) -> None:
    assume(json.dumps(params, sort_keys=True) != json.dumps(sent(), sort_keys=True))
    with pytest.raises(TransferNotSignedError) as caught:
        check(params, pods=frozenset({POD}))
    assert caught.value.code in {TRANSFER_NOT_SIGNED, TRANSFER_SIGNATURE_FORMAT}  # the MAC is checked first


@settings(max_examples=200, deadline=None)
@given(
    other=st.lists(st.integers(0, 2**63 - 1), min_size=70, max_size=70),
    pod=st.text(min_size=1, max_size=40),
    late=st.floats(CLOCK_SKEW_SECONDS + 0.001, 1e7),
)
def test_hypothesis_another_prompt_pod_or_time_is_refused(other: list[int], pod: str, late: float) -> None:
    assume(other != PROMPT)
    assert refused(sent(), prompt=prompt_hash(other)).code == TRANSFER_PROMPT_MISMATCH
    assume(pod != POD)
    assert refused(sent(pod=pod)).code == TRANSFER_WRONG_DECODE
    assert refused(sent(until=NOW), now=NOW + late).code == TRANSFER_SIGNATURE_EXPIRED


# -- the prompt hash and the names a decode engine answers to ---------------------------------------------------


def test_the_prompt_hash_is_128_bits_of_sha256_over_the_ids() -> None:
    assert HASH is not None
    assert len(HASH) == 32
    assert int(HASH, 16) >= 0
    assert prompt_hash(PROMPT) == prompt_hash(tuple(PROMPT)) == prompt_hash(np.array(PROMPT, dtype=np.int64))
    assert prompt_hash(PROMPT) != prompt_hash(PROMPT[::-1])  # the order counts
    assert prompt_hash([1, 2]) != prompt_hash([1, 2, 0])
    assert prompt_hash([]) is not None
    assert prompt_hash(PROMPT, ["image:abc@3+10"]) != HASH  # a multimodal item binds too
    for hopeless in (None, [1.5], [2**63], [-(2**63) - 1], ["1"], b"\0" * 8, "12"):
        assert prompt_hash(hopeless) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "0" * 31, "0" * 65, "A" * 32, "g" * 32, 7])
def test_the_transfer_parameters_bound_their_prompt_hash(bad: object) -> None:
    from pydantic import ValidationError

    from kvbridge_agent.core.handshake import KVTransferParams

    base = {
        "remoteEngineId": "p",
        "remoteIncarnation": "i",
        "remoteHost": "127.0.0.1",
        "remotePort": 5600,
        "remoteRequestId": "r",
        "remoteBlockIds": [1],
        "numTokens": 3,
        "remoteTpSize": 1,
        "fingerprint": "f",
    }
    assert KVTransferParams.model_validate({**base, "promptHash": HASH}).prompt_hash == HASH
    assert KVTransferParams.model_validate(base).prompt_hash is None
    with pytest.raises(ValidationError):
        KVTransferParams.model_validate({**base, "promptHash": bad})


def test_a_vllm_requests_hash_covers_its_token_ids_and_multimodal_items() -> None:
    plain = SimpleNamespace(prompt_token_ids=PROMPT)
    assert request_prompt_hash(plain) == HASH
    image = SimpleNamespace(
        modality="image", identifier="h1", mm_position=SimpleNamespace(offset=3, length=10), data=None
    )
    with_image = SimpleNamespace(prompt_token_ids=PROMPT, mm_features=[image])
    other_image = SimpleNamespace(
        prompt_token_ids=PROMPT, mm_features=[SimpleNamespace(**{**vars(image), "identifier": "h2"})]
    )
    assert request_prompt_hash(with_image) == prompt_hash(PROMPT, ["image:h1@3+10"])
    assert request_prompt_hash(with_image) != request_prompt_hash(other_image)
    assert request_prompt_hash(SimpleNamespace(prompt_token_ids=None)) is None  # prompt embeddings only


def test_a_decode_engine_answers_to_its_pod_and_its_groups_leader() -> None:
    assert decode_pods("decode-0", 0, 1, {}) == {"decode-0"}
    assert decode_pods("decode-0_dp3", 3, 4, {}) == {"decode-0"}  # vLLM's engine id of a DP rank
    assert decode_pods("decode-0_dp3", 3, 1, {}) == {"decode-0_dp3"}
    lws = {"LWS_LEADER_ADDRESS": "llm-decode-0.llm-decode.ns"}
    assert decode_pods("llm-decode-0-1_dp5", 5, 8, lws) == {"llm-decode-0-1", "llm-decode-0"}


# -- the token -----------------------------------------------------------------------------------------------------


def test_the_token_is_the_files_bytes_without_surrounding_whitespace(tmp_path: Path) -> None:
    (tmp_path / "token").write_bytes(b"  " + TOKEN + b"\n")
    assert load_token(str(tmp_path / "token")) == TOKEN


@pytest.mark.parametrize("content", [None, b"", b"short\n"])
def test_an_unreadable_or_short_token_is_a_typed_error(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SpecError) as caught:
        load_token(str(path))
    assert caught.value.code == TRANSFER_TOKEN_UNREADABLE
    assert caught.value.field == str(path)
