"""The router's signature on the ``kv_transfer_params`` it hands decode (``spec.router.signTransfers``).

Any pod that reaches a decode engine's HTTP port could otherwise hand it transfer parameters of its own: another
request's (a replay) or made up. With a shared token (the deployment's ``<name>-router-token`` Secret, mounted
into the router and the decode pods), the router adds :data:`SIGNATURE_KEY` to the parameters prefill returned, an
object that binds them to the request it sends (format :data:`SIGNATURE_VERSION`)::

    "kvbridge_router_signature": {"version": 2, "decodePod": "<pod>", "expiresAt": <Unix seconds>, "mac": "<hex>"}

``mac`` is an HMAC-SHA256 under the token of :func:`material`: a domain line, then the canonical JSON (sorted keys,
no spaces, ASCII) of the binding (``version``, ``decodePod``, ``expiresAt``) and of prefill's parameters. What
it binds, and how a decode engine that holds the token checks it (:func:`check_signature`):

- **the prompt**: prefill puts :func:`prompt_hash` of its prompt's token ids (and multimodal items) into its
  parameters (``promptHash``); decode hashes its own prompt and refuses another (:data:`TRANSFER_PROMPT_MISMATCH`)
  or none (:data:`TRANSFER_PROMPT_UNBOUND`);
- **the decode pod** the router chose (``decodePod``, its pod name): decode refuses a signature for another
  (:data:`TRANSFER_WRONG_DECODE`); an engine answers to its pod's name (:func:`decode_pods`);
- **an expiry** (``expiresAt``, the router's clock: when the router stops waiting for that decode call): decode
  refuses it past ``expiresAt`` + :data:`CLOCK_SKEW_SECONDS` (:data:`TRANSFER_SIGNATURE_EXPIRED`), and refuses an
  expiry further ahead than a router ever signs for (:data:`TRANSFER_SIGNATURE_CLOCK_SKEW`);
- **every field** prefill returned: any change breaks the MAC (:data:`TRANSFER_NOT_SIGNED`).

The request id is not bound: vLLM replaces a request's id with its own (the client's ``X-Request-Id`` plus a
random suffix), and whoever calls decode chooses that header, so decode has no id of the router's to compare.
A signature of another format (a router of another release) is refused as such (:data:`TRANSFER_SIGNATURE_FORMAT`).

The router and both engines (kvbridge's vLLM connector, the agent worker) use this one module, so they cannot
disagree on the bytes signed or on what is checked.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import sys
import time
from array import array
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .errors import KVBridgeError, SpecError
from .parallel import engine_id_of_rank

#: the key the router adds to ``kv_transfer_params`` (next to prefill's own keys)
SIGNATURE_KEY = "kvbridge_router_signature"
#: the signed format: 2 binds the prompt, the decode pod and an expiry (1, a bare hex HMAC of prefill's
#: parameters, bound none of them)
SIGNATURE_VERSION = 2
#: the parameters a decode engine was handed carry no valid router signature
TRANSFER_NOT_SIGNED = "TRANSFER_NOT_SIGNED"
#: a signature of another format than this engine checks (router and decode pods of different releases)
TRANSFER_SIGNATURE_FORMAT = "TRANSFER_SIGNATURE_FORMAT"
#: the signature's expiry has passed (beyond the clock-skew margin)
TRANSFER_SIGNATURE_EXPIRED = "TRANSFER_SIGNATURE_EXPIRED"
#: the signature expires further ahead than a router signs for: the router's clock runs ahead of decode's
TRANSFER_SIGNATURE_CLOCK_SKEW = "TRANSFER_SIGNATURE_CLOCK_SKEW"
#: the router signed the parameters for another decode pod
TRANSFER_WRONG_DECODE = "TRANSFER_WRONG_DECODE"
#: the signed parameters were computed for another prompt than the one decode was handed
TRANSFER_PROMPT_MISMATCH = "TRANSFER_PROMPT_MISMATCH"
#: the signed parameters carry no prompt hash (a prefill engine that does not add one)
TRANSFER_PROMPT_UNBOUND = "TRANSFER_PROMPT_UNBOUND"
#: the token file cannot be read, or holds too short a token
TRANSFER_TOKEN_UNREADABLE = "TRANSFER_TOKEN_UNREADABLE"
#: the shortest token accepted (the operator's are 32 random bytes, 64 hex characters)
MIN_TOKEN_BYTES = 16
#: the longest a signature is valid: the router signs for its decode timeout, which the spec bounds alike
#: (``spec.router.decodeTimeoutSeconds`` at most 86400)
MAX_VALIDITY_SECONDS = 86400
#: how far decode's clock may be from the router's: an expiry is honoured this much longer, and may lie this much
#: further ahead than :data:`MAX_VALIDITY_SECONDS`
CLOCK_SKEW_SECONDS = 10.0
#: the key of the prompt's hash among prefill's parameters (``KVTransferParams.prompt_hash``)
PROMPT_HASH_KEY = "promptHash"
#: hex characters of a prompt hash: the first 128 bits of SHA-256
PROMPT_HASH_CHARS = 32
#: the longest pod name (a DNS subdomain)
MAX_POD_CHARS = 253
_DOMAIN = b"kvbridge-transfer-signature/2\n"
_PROMPT_DOMAIN = b"kvbridge-prompt/1\n"
_MAC = re.compile(r"[0-9a-f]{64}")
#: the keys of the signature object, no more (each one is bound, or is the MAC)
_SEALED_KEYS = frozenset({"version", "decodePod", "expiresAt", "mac"})


class TransferNotSignedError(KVBridgeError):
    """A decode engine that holds the router's token was handed transfer parameters without its valid signature, or
    with one for another prompt, another decode pod or a time that has passed (``code`` says which)."""

    code = TRANSFER_NOT_SIGNED


def canonical(params: Mapping[str, object]) -> bytes:
    """``params`` without :data:`SIGNATURE_KEY` as JSON with sorted keys, no whitespace and ASCII only
    (``json.dumps(..., sort_keys=True, separators=(",", ":"))``). Key order and spacing do not matter; every key
    and value does. Raises ``TypeError``/``ValueError`` for what JSON cannot hold (``RecursionError`` for nesting
    deeper than ``json`` goes)."""
    return json.dumps(unsigned(params), sort_keys=True, separators=(",", ":")).encode("ascii")


def material(params: Mapping[str, object], decode_pod: str, expires_at: int) -> bytes:
    """The bytes the MAC covers: a domain line naming the format, then the canonical JSON of
    ``{"binding": {"decodePod", "expiresAt", "version"}, "params": <params without the signature>}``."""
    binding = {"version": SIGNATURE_VERSION, "decodePod": decode_pod, "expiresAt": expires_at}
    body = {"binding": binding, "params": unsigned(params)}
    return _DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":")).encode("ascii")


def signature(token: bytes, params: Mapping[str, object], decode_pod: str, expires_at: int) -> str:
    """HMAC-SHA256 of :func:`material` under ``token``, in hex."""
    return hmac.new(token, material(params, decode_pod, expires_at), hashlib.sha256).hexdigest()


def signed(token: bytes, params: Mapping[str, object], *, decode_pod: str, expires_at: float) -> dict[str, object]:
    """A copy of ``params`` with the signature object under :data:`SIGNATURE_KEY` that binds them to ``decode_pod``
    until ``expires_at`` (Unix time; rounded up to a second, and at most :data:`MAX_VALIDITY_SECONDS` from now).
    ``params`` is left as it is."""
    until = math.ceil(min(expires_at, time.time() + MAX_VALIDITY_SECONDS))
    mac = signature(token, params, decode_pod, until)
    sealed = {"version": SIGNATURE_VERSION, "decodePod": decode_pod, "expiresAt": until, "mac": mac}
    return {**unsigned(params), SIGNATURE_KEY: sealed}


def unsigned(params: Mapping[str, object]) -> dict[str, object]:
    """A copy of ``params`` without the signature (what the engine validates and uses)."""
    return {key: value for key, value in params.items() if key != SIGNATURE_KEY}


def prompt_hash(token_ids: Iterable[int] | None, features: Iterable[str] = ()) -> str | None:
    """The first 128 bits of SHA-256, in hex, over a domain line, the number of token ids and the ids as
    little-endian 64-bit integers, then each of ``features`` (a multimodal item's identity) with its length;
    ``None`` where there are no token ids or one is not a 64-bit integer (then nothing can be bound to them)."""
    if token_ids is None or isinstance(token_ids, str | bytes | bytearray | memoryview):  # not ids: raw bytes
        return None
    try:
        ids = array("q", token_ids)
    except (TypeError, OverflowError, ValueError):
        return None
    if sys.byteorder == "big":
        ids.byteswap()
    digest = hashlib.sha256(_PROMPT_DOMAIN)
    digest.update(len(ids).to_bytes(8, "little"))
    digest.update(ids.tobytes())
    for feature in features:
        encoded = feature.encode("utf-8", "surrogatepass")
        digest.update(len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()[:PROMPT_HASH_CHARS]


def request_prompt_hash(request: Any) -> str | None:
    """:func:`prompt_hash` of a vLLM request (duck-typed): its ``prompt_token_ids`` and, for each multimodal item
    (``mm_features``), its modality, vLLM's identifier (the content's hash, or the client's ``multi_modal_uuids``)
    and its placeholder's position: the same on prefill and decode for the same request."""
    features = []
    for feature in getattr(request, "mm_features", None) or ():
        position = getattr(feature, "mm_position", None)
        offset, length = getattr(position, "offset", ""), getattr(position, "length", "")
        features.append(f"{getattr(feature, 'modality', '')}:{getattr(feature, 'identifier', '')}@{offset}+{length}")
    return prompt_hash(getattr(request, "prompt_token_ids", None), features)


def decode_pods(engine_id: str, dp_rank: int, dp_size: int, environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The names a decode engine answers to in a signature: its pod's (the engine id without vLLM's ``_dp<rank>``,
    which the operator sets from the pod's name) and, in a multi-node engine (a LeaderWorkerSet group), its leader
    pod's, the first label of ``LWS_LEADER_ADDRESS``: the router sends to the leader, whose API server hands
    requests to DP ranks on every pod of the group."""
    environ = os.environ if environ is None else environ
    names = {engine_id.removesuffix(engine_id_of_rank("", dp_rank, dp_size))}
    leader = environ.get("LWS_LEADER_ADDRESS", "").split(".", 1)[0]
    if leader:
        names.add(leader)
    return frozenset(names)


def _refuse(code: str, message: str, field: str) -> TransferNotSignedError:
    return TransferNotSignedError(message, field=field, code=code)


def _sealed(params: Mapping[str, object], where: str) -> tuple[str, int, str]:
    """The signature object's ``decodePod``, ``expiresAt`` and ``mac``, shape-checked (not yet authenticated)."""
    given = params.get(SIGNATURE_KEY)
    if given is None:
        raise _refuse(
            TRANSFER_NOT_SIGNED,
            "this decode engine accepts transfer parameters only as kvbridge's router signs them "
            "(spec.router.signTransfers), and these carry no signature: send the request through the router",
            where,
        )
    if isinstance(given, str) and _MAC.fullmatch(given):
        raise _refuse(
            TRANSFER_SIGNATURE_FORMAT,
            f"signed in format 1 (a bare HMAC, from a router older than this engine), this engine checks format "
            f"{SIGNATURE_VERSION}: finish rolling out the router so that router and decode pods run one kvbridge "
            "release",
            where,
        )
    if not isinstance(given, Mapping):
        given = {}
    version = given.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version != SIGNATURE_VERSION:
        raise _refuse(
            TRANSFER_SIGNATURE_FORMAT,
            f"signed in format {version if abs(version) < 1 << 20 else '?'}, this engine checks format "
            f"{SIGNATURE_VERSION}: run the router and the "
            "decode pods of one kvbridge release (finish the rollout)",
            f"{where}.version",
        )
    pod, until, mac = given.get("decodePod"), given.get("expiresAt"), given.get("mac")
    if (
        given.keys() != _SEALED_KEYS
        or type(version) is not int
        or version != SIGNATURE_VERSION
        or not isinstance(pod, str)
        or not 0 < len(pod) <= MAX_POD_CHARS
        or type(until) is not int
        or not 0 <= until < 1 << 63
        or not isinstance(mac, str)
        or not _MAC.fullmatch(mac)
    ):
        raise _refuse(
            TRANSFER_NOT_SIGNED,
            f'a malformed signature: an object {{"version": {SIGNATURE_VERSION}, "decodePod": <pod name>, '
            '"expiresAt": <Unix seconds>, "mac": <64 hex digits>} is expected: send the request through the router',
            where,
        )
    return pod, until, mac


def check_signature(
    token: bytes,
    params: Mapping[str, object],
    *,
    pods: frozenset[str],
    prompt: str | None,
    params_key: str | None = None,
    field: str = "kv_transfer_params",
    now: float | None = None,
) -> None:
    """Raise :class:`TransferNotSignedError` unless ``params`` carry the router's valid signature under ``token``
    (compared in constant time) for one of ``pods`` (:func:`decode_pods`), unexpired at ``now`` (default: the
    clock), over prefill's parameters whose ``promptHash`` is ``prompt`` (:func:`prompt_hash` of the prompt this
    engine was handed; ``None``: it has none). Prefill's parameters are ``params[params_key]`` (kvbridge's vLLM
    connector: ``"kvbridge"``), or ``params`` themselves; ``field`` names ``params`` in the error."""
    where = f"{field}.{SIGNATURE_KEY}"
    pod, until, mac = _sealed(params, where)
    try:
        expected = signature(token, params, pod, until)
    except (TypeError, ValueError, RecursionError) as exc:  # nothing JSON holds, or nested beyond json's reach
        raise _refuse(TRANSFER_NOT_SIGNED, f"the transfer parameters cannot be signed: {exc}", where) from None
    if not hmac.compare_digest(expected, mac):
        raise _refuse(
            TRANSFER_NOT_SIGNED,
            "the router's signature does not match these transfer parameters (changed since the router signed them, "
            "or signed with another token): send the request through the router",
            where,
        )
    now = time.time() if now is None else now
    if now > until + CLOCK_SKEW_SECONDS:
        raise _refuse(
            TRANSFER_SIGNATURE_EXPIRED,
            f"the router's signature expired at {until} (Unix time), {now - until:.0f} s ago (clock skew allowed "
            f"{CLOCK_SKEW_SECONDS:g} s): a replay, or a request that waited longer than the router's decode "
            "timeout; send it through the router again",
            f"{where}.expiresAt",
        )
    if until - now > MAX_VALIDITY_SECONDS + CLOCK_SKEW_SECONDS:
        raise _refuse(
            TRANSFER_SIGNATURE_CLOCK_SKEW,
            f"the router's signature is valid until {until} (Unix time), {until - now:.0f} s from now on this "
            f"engine's clock, longer than a router signs for ({MAX_VALIDITY_SECONDS} s + {CLOCK_SKEW_SECONDS:g} s): "
            "the router's clock runs ahead of this node's: synchronise the nodes' clocks (NTP)",
            f"{where}.expiresAt",
        )
    if pod not in pods:
        mine = ", ".join(sorted(pods)) or "none"
        raise _refuse(
            TRANSFER_WRONG_DECODE,
            f"the router signed these transfer parameters for decode pod {pod!r}, this engine is {mine}: a replay "
            "to another pod; send the request through the router",
            f"{where}.decodePod",
        )
    ours = params.get(params_key) if params_key else params
    bound = ours.get(PROMPT_HASH_KEY) if isinstance(ours, Mapping) else None
    at = f"{field}.{params_key}.{PROMPT_HASH_KEY}" if params_key else f"{field}.{PROMPT_HASH_KEY}"
    if not isinstance(bound, str):
        raise _refuse(
            TRANSFER_PROMPT_UNBOUND,
            "the signed transfer parameters carry no prompt hash, so they cannot be bound to this request: prefill "
            "adds one on its completions routes (kvbridge's connector or agent worker of this release); finish "
            "rolling out the prefill pods",
            at,
        )
    if prompt is None or bound != prompt:  # both public (a hash of the request's own prompt): no timing to hide
        why = "no prompt token ids this engine can hash" if prompt is None else "another prompt"
        raise _refuse(
            TRANSFER_PROMPT_MISMATCH,
            f"these transfer parameters were computed for another prompt than this request's ({why}): a replay "
            "with another prompt; send the request through the router",
            at,
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
