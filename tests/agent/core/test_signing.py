"""The router's signature on decode's kv_transfer_params (spec.router.signTransfers): one canonical form for the
router and both engines, and every change to the parameters breaks it."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

import pytest

from kvbridge_agent.core import SpecError
from kvbridge_agent.core.signing import (
    SIGNATURE_KEY,
    TRANSFER_NOT_SIGNED,
    TRANSFER_TOKEN_UNREADABLE,
    TransferNotSignedError,
    canonical,
    check_signature,
    load_token,
    signature,
    signed,
    unsigned,
)

TOKEN = b"0123456789abcdef" * 4
OURS = {
    "remoteEngineId": "prefill-0",
    "remoteBlockIds": [7, 8, 9],
    "numTokens": 70,
    "expiresAt": 1.5e9 + 0.1,
    "remoteRequestId": "cmpl-caf\u00e9",
}
PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "kvbridge": OURS}


def test_the_signature_is_hmac_sha256_of_the_canonical_json_in_hex() -> None:
    text = json.dumps(PARAMS, sort_keys=True, separators=(",", ":"))
    assert canonical(PARAMS) == text.encode()
    assert b"\\u00e9" in canonical(PARAMS)  # ASCII: the same bytes whatever encoding a side prefers
    assert signature(TOKEN, PARAMS) == hmac.new(TOKEN, text.encode(), hashlib.sha256).hexdigest()


def test_signed_parameters_pass_and_the_original_is_left_alone() -> None:
    before = json.dumps(PARAMS)
    sent = signed(TOKEN, PARAMS)
    assert json.dumps(PARAMS) == before
    assert sent[SIGNATURE_KEY] == signature(TOKEN, PARAMS)
    check_signature(TOKEN, sent)
    assert unsigned(sent) == PARAMS
    # what decode parses from the router's bytes (another key order, another spacing) still passes
    check_signature(TOKEN, json.loads(json.dumps(dict(reversed(list(sent.items()))), indent=2)))


def test_key_order_and_the_signature_key_do_not_change_the_canonical_form() -> None:
    shuffled = {"kvbridge": dict(reversed(list(OURS.items()))), "do_remote_decode": False, "do_remote_prefill": True}
    assert canonical(shuffled) == canonical(PARAMS)
    assert canonical({**PARAMS, SIGNATURE_KEY: "anything"}) == canonical(PARAMS)
    assert signature(TOKEN, shuffled) == signature(TOKEN, PARAMS)


def _changed(path: tuple[str, ...], value: object) -> dict[str, object]:
    copy: dict[str, object] = json.loads(json.dumps(signed(TOKEN, PARAMS)))
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
        (("kvbridge", "expiresAt"), 1.5e9 + 3600),  # a replay with a longer lease
        (("kvbridge", "extra"), 1),
        (("do_remote_prefill",), 1),  # true as a number: other JSON, another signature
    ],
)
def test_any_changed_field_breaks_the_signature(path: tuple[str, ...], value: object) -> None:
    with pytest.raises(TransferNotSignedError) as caught:
        check_signature(TOKEN, _changed(path, value))
    assert caught.value.code == TRANSFER_NOT_SIGNED
    assert caught.value.field == f"kv_transfer_params.{SIGNATURE_KEY}"
    assert "does not match" in caught.value.message


@pytest.mark.parametrize(
    "given",
    [None, "", 7, ["x"], "0" * 64, signature(b"another token, 32 bytes long....", PARAMS), "\ud800"],
)
def test_a_missing_malformed_or_foreign_signature_is_refused(given: object) -> None:
    params = dict(PARAMS) if given is None else {**PARAMS, SIGNATURE_KEY: given}
    with pytest.raises(TransferNotSignedError) as caught:
        check_signature(TOKEN, params, "kvTransferParams")
    assert caught.value.code == TRANSFER_NOT_SIGNED
    assert caught.value.field == f"kvTransferParams.{SIGNATURE_KEY}"
    if given is None:
        assert "carry no signature" in caught.value.message


def test_parameters_json_cannot_hold_are_refused_typed() -> None:
    with pytest.raises(TransferNotSignedError):
        check_signature(TOKEN, {"x": {1, 2}, SIGNATURE_KEY: "0" * 64})


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
