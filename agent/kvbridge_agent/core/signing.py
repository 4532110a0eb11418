"""The router's signature on the ``kv_transfer_params`` it hands decode (``spec.router.signTransfers``).

Any pod that reaches a decode engine's HTTP port could otherwise hand it transfer parameters of its own: another
request's (a replay) or made up. With a shared token (the deployment's ``<name>-router-token`` Secret, mounted
into the router and the decode pods), the router adds :data:`SIGNATURE_KEY` to the parameters prefill returned:
an HMAC-SHA256 under the token of their canonical JSON (:func:`canonical`: sorted keys, no spaces, ASCII; the
signature key itself left out), in hex. Decode engines configured with the token refuse parameters whose
signature is missing or wrong (:data:`TRANSFER_NOT_SIGNED`); changing any field breaks it.

The router and both engines (kvbridge's vLLM connector, the agent worker) use this one module, so they cannot
disagree on the bytes signed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from pathlib import Path

from .errors import KVBridgeError, SpecError

#: the key the router adds to ``kv_transfer_params`` (next to prefill's own keys)
SIGNATURE_KEY = "kvbridge_router_signature"
#: the parameters a decode engine was handed carry no valid router signature
TRANSFER_NOT_SIGNED = "TRANSFER_NOT_SIGNED"
#: the token file cannot be read, or holds too short a token
TRANSFER_TOKEN_UNREADABLE = "TRANSFER_TOKEN_UNREADABLE"
#: the shortest token accepted (the operator's are 32 random bytes, 64 hex characters)
MIN_TOKEN_BYTES = 16


class TransferNotSignedError(KVBridgeError):
    """A decode engine that holds the router's token was handed transfer parameters without its valid signature."""

    code = TRANSFER_NOT_SIGNED


def canonical(params: Mapping[str, object]) -> bytes:
    """The bytes signed: ``params`` without :data:`SIGNATURE_KEY` as JSON with sorted keys, no whitespace and
    ASCII only (``json.dumps(..., sort_keys=True, separators=(",", ":"))``). Key order and spacing do not matter;
    every key and value does. Raises ``TypeError``/``ValueError`` for what JSON cannot hold (``RecursionError``
    for nesting deeper than ``json`` goes)."""
    unsigned = {key: value for key, value in params.items() if key != SIGNATURE_KEY}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode("ascii")


def signature(token: bytes, params: Mapping[str, object]) -> str:
    """HMAC-SHA256 of :func:`canonical` ``params`` under ``token``, in hex."""
    return hmac.new(token, canonical(params), hashlib.sha256).hexdigest()


def signed(token: bytes, params: Mapping[str, object]) -> dict[str, object]:
    """A copy of ``params`` with its signature under :data:`SIGNATURE_KEY` (``params`` is left as it is)."""
    return {**params, SIGNATURE_KEY: signature(token, params)}


def unsigned(params: Mapping[str, object]) -> dict[str, object]:
    """A copy of ``params`` without the signature (what the engine validates and uses)."""
    return {key: value for key, value in params.items() if key != SIGNATURE_KEY}


def check_signature(token: bytes, params: Mapping[str, object], field: str = "kv_transfer_params") -> None:
    """Raise :class:`TransferNotSignedError` unless ``params`` carry their valid signature under ``token``
    (compared in constant time); ``field`` names the parameters in the error."""
    where = f"{field}.{SIGNATURE_KEY}"
    given = params.get(SIGNATURE_KEY)
    if given is None:
        raise TransferNotSignedError(
            "this decode engine accepts transfer parameters only as kvbridge's router signs them "
            "(spec.router.signTransfers), and these carry no signature: send the request through the router",
            field=where,
        )
    try:
        expected = signature(token, params)
    except (TypeError, ValueError, RecursionError) as exc:  # nothing JSON holds, or nested beyond json's reach
        raise TransferNotSignedError(f"the transfer parameters cannot be signed: {exc}", field=where) from None
    if not isinstance(given, str) or not hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace")):
        raise TransferNotSignedError(
            "the router's signature does not match these transfer parameters (changed since the router signed them, "
            "or signed with another token): send the request through the router",
            field=where,
        )


def load_token(path: str) -> bytes:
    """The token in the file at ``path`` (its bytes, surrounding whitespace removed); raises :class:`SpecError`
    with :data:`TRANSFER_TOKEN_UNREADABLE` when it cannot be read or is shorter than :data:`MIN_TOKEN_BYTES`."""
    try:
        token = Path(path).read_bytes().strip()
    except OSError as exc:
        raise SpecError(
            f"cannot read the transfer token {path}: {exc.strerror or exc}", field=path, code=TRANSFER_TOKEN_UNREADABLE
        ) from None
    if len(token) < MIN_TOKEN_BYTES:
        raise SpecError(
            f"the transfer token in {path} has {len(token)} bytes, at least {MIN_TOKEN_BYTES} are needed (the "
            "operator writes 64 hex characters into the <name>-router-token Secret)",
            field=path,
            code=TRANSFER_TOKEN_UNREADABLE,
        )
    return token
