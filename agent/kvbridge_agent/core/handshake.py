"""Side-channel messages (docs/protocol.md §5): a versioned envelope and per-rank metadata.

Wire format: a ZeroMQ multipart message.

- request: ``[header]`` with header ``{"version", "fingerprint", "type", "rank" | "requestIds"}``
- reply:   ``[header, payload, agent_metadata]`` with header ``{"version", "fingerprint"}``,
  or ``[header]`` with header ``{"version", "fingerprint", "error": {"code", "message"}}``
- acknowledgement (of a heartbeat): ``[header]`` with header ``{"version", "fingerprint", "renewed"}``, the ids of
  the requests whose lease prefill renewed
- digest reply: ``[header, digests]`` with header ``{"version", "fingerprint", "state", "heads", "key"}`` (the
  request's digest key in hex, docs/protocol.md §8)

The receiver checks the version and the fingerprint in the header *before*
it decodes the payload, so a schema change or a different model fails with a
clear message instead of a parse error.  Only this module knows the layout.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import ipaddress
import json
import re
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated

from pydantic import AfterValidator, Field, ValidationError, model_validator

from .digest import KEY_BYTES, RequestDigests, from_bytes, to_bytes
from .errors import KVBridgeError, SpecError
from .layout import PhysicalLayout
from .model import MAX_BLOCK_SIZE, MAX_TENSOR_PARALLEL, CacheKind, CamelModel, KVLayout

#: 2: heartbeats and digest requests carry each request's lease token (a request's capability, §5)
#: 3: a metadata reply's header carries the SHA-256 of the NIXL agent metadata (``agentSha256``): decode checks it
#: before NIXL reads the bytes (UCX aborts the whole process on some corrupted addresses, and NIXL keeps part of a
#: remote agent whose metadata failed half-way, so that the peer can never be added again)
ENVELOPE_VERSION = 3
MAX_HEADER_BYTES = 4096
MAX_PAYLOAD_BYTES = 1 << 20
#: brackets a request header may contain (a real one has 2); counted before parsing
MAX_HEADER_NESTING = 16
#: blocks of one rank's KV cache a peer may describe (the agent's own caches are bounded alike)
MAX_BLOCKS = 1 << 24
#: KV tensors one rank may register (two per layer at most, layers bounded by the model's 1024)
MAX_TENSORS = 4096
#: descriptors a decode rank prepares for one prefill rank (blocks x tensors): a peer claiming more is refused
#: before anything is allocated (Llama-3.1-70B at TP 8 on a 141 GB GPU is about 3.4e7)
MAX_REMOTE_DESCRIPTORS = 1 << 27
#: bytes of one block of one region (a 4096-token block of 1024 heads of width 512 in fp32 is 2^33)
MAX_REGION_BLOCK_BYTES = 1 << 34
#: tokens of one request (more than any model's context)
MAX_TOKENS = 1 << 24
#: a wire block id: a prefill block id times its split into wire blocks
MAX_BLOCK_ID = MAX_BLOCKS * MAX_BLOCK_SIZE

# Stable error codes of the side channel.
MALFORMED_MESSAGE = "MALFORMED_MESSAGE"
PROTOCOL_VERSION_MISMATCH = "PROTOCOL_VERSION_MISMATCH"
FINGERPRINT_MISMATCH = "FINGERPRINT_MISMATCH"
UNKNOWN_RANK = "UNKNOWN_RANK"
UNKNOWN_MESSAGE_TYPE = "UNKNOWN_MESSAGE_TYPE"
HANDSHAKE_TIMEOUT = "HANDSHAKE_TIMEOUT"
PEER_ERROR = "PEER_ERROR"
WIRE_FORMAT_MISMATCH = "WIRE_FORMAT_MISMATCH"
PEER_INCOMPATIBLE = "PEER_INCOMPATIBLE"


class HandshakeError(KVBridgeError):
    """The side-channel exchange failed; the requests waiting on it fail, the next one retries."""

    code = "HANDSHAKE_FAILED"


class MessageType(StrEnum):
    METADATA = "metadata"  # ask for one TP rank's metadata
    HEARTBEAT = "heartbeat"  # renew the leases of requests decode still waits on
    DIGEST = "digest"  # the digests prefill computed for one request (docs/protocol.md §8)
    STAGE = "stage"  # pack a request's segments for one read into the staging buffer (docs/protocol.md §4d)


class DigestState(StrEnum):
    READY = "ready"
    PENDING = "pending"  # offered but not digested yet (vLLM: the worker reports it a step later)
    UNKNOWN = "unknown"  # never offered for verification, or no longer held


class MemoryType(StrEnum):
    DRAM = "DRAM"
    VRAM = "VRAM"


class RankMetadata(CamelModel):
    """What a decode rank needs to READ from one prefill rank."""

    engine_id: str = Field(min_length=1, max_length=256)
    incarnation: str = Field(min_length=1, max_length=64, description="New on every process start.")
    agent_name: str = Field(min_length=1, max_length=512)
    tp_rank: int = Field(ge=0, lt=MAX_TENSOR_PARALLEL)
    tp_size: int = Field(ge=1, le=MAX_TENSOR_PARALLEL)
    block_size: int = Field(ge=1, le=MAX_BLOCK_SIZE)
    kv_layout: KVLayout
    cache_kind: CacheKind
    num_blocks: int = Field(ge=1, le=MAX_BLOCKS)
    tensor_bases: list[Annotated[int, Field(ge=0, lt=1 << 64)]] = Field(
        min_length=1, max_length=MAX_TENSORS, description="Base address of every registered tensor, in order."
    )
    region_block_bytes: int = Field(
        ge=1, le=MAX_REGION_BLOCK_BYTES, description="Bytes of one native block of one region."
    )
    wire_block_size: int = Field(ge=1, le=MAX_BLOCK_SIZE)
    wire_layout: KVLayout
    memory_type: MemoryType
    device_id: int = Field(ge=0, lt=1 << 16)
    block_interior: str = Field(
        default="",
        max_length=64,
        description="How the engine's kernel arranges a block's bytes where ``kv_layout`` does not say it all "
        "(vLLM's CPU attention kernel); both sides must agree. Empty: as ``kv_layout`` says.",
    )
    physical_layout: PhysicalLayout | None = Field(
        default=None,
        description="The cache's physical layout (vLLM's KVCacheLayout as byte strides, docs/protocol.md §1b) when "
        "the engine handed strided views of one allocation; ``tensor_bases`` then holds the address of logical "
        "(0, 0, 0, 0, 0). Left out of the message when absent, so caches without one encode as before.",
    )
    staging_base: int | None = Field(
        default=None, ge=0, lt=1 << 64, description="Address of the registered staging buffer (docs/protocol.md §4d)."
    )
    staging_bytes: int | None = Field(default=None, ge=1, le=1 << 40, description="Its size, whole pieces.")
    staging_piece: int | None = Field(default=None, ge=1 << 12, le=1 << 30, description="Bytes of one piece.")

    @model_validator(mode="after")
    def _bounded(self) -> RankMetadata:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tpRank {self.tp_rank} is outside the {self.tp_size} ranks tpSize says")
        descriptors = self.num_blocks * len(self.tensor_bases)
        if descriptors > MAX_REMOTE_DESCRIPTORS:
            raise ValueError(
                f"{self.num_blocks} blocks of {len(self.tensor_bases)} tensors would take {descriptors} descriptors, "
                f"at most {MAX_REMOTE_DESCRIPTORS}"
            )
        return self


def _dump(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _header(frame: bytes) -> dict[str, object]:
    if len(frame) > MAX_HEADER_BYTES:
        raise HandshakeError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}", code=MALFORMED_MESSAGE)
    depth = max(frame.count(b"["), frame.count(b"{"))
    if depth > MAX_HEADER_NESTING:  # a bound before parsing: deep nesting makes json.loads raise RecursionError
        raise HandshakeError(f"header nests up to {depth} levels, at most {MAX_HEADER_NESTING}", code=MALFORMED_MESSAGE)
    try:
        header = json.loads(frame)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise HandshakeError(f"header is not JSON: {exc}", code=MALFORMED_MESSAGE) from exc
    if not isinstance(header, dict):
        raise HandshakeError("header is not a JSON object", code=MALFORMED_MESSAGE)
    return header


def _check_envelope(header: dict[str, object], fingerprint: str) -> None:
    version = header.get("version")
    if version != ENVELOPE_VERSION:
        raise HandshakeError(
            f"peer speaks side-channel version {version!r}, this agent speaks {ENVELOPE_VERSION}: "
            "run the same kvbridge version on prefill and decode",
            code=PROTOCOL_VERSION_MISMATCH,
            field="version",
        )
    theirs = header.get("fingerprint")
    if fingerprint and theirs != fingerprint:
        raise HandshakeError(
            f"peer fingerprint {theirs!r} differs from ours {fingerprint!r}: the two engines run a "
            "different model, dtype, cache kind or protocol version",
            code=FINGERPRINT_MISMATCH,
            field="fingerprint",
        )


#: a request named in a heartbeat or a digest request: prefill's request id and its lease token
Named = tuple[str, str]


def encode_request(
    kind: MessageType, fingerprint: str, *, rank: int = 0, requests: Sequence[Named] = ()
) -> list[bytes]:
    header: dict[str, object] = {"version": ENVELOPE_VERSION, "fingerprint": fingerprint, "type": kind.value}
    if kind is MessageType.METADATA:
        header["rank"] = rank
    else:
        header["requestIds"] = [request_id for request_id, _ in requests]
        header["tokens"] = [token for _, token in requests]
    return [_dump(header)]


def decode_request(frames: Sequence[bytes], fingerprint: str) -> tuple[MessageType, int, list[Named]]:
    """``(type, rank, (request id, lease token) pairs)`` of a request; raises :class:`HandshakeError` for anything
    else."""
    if len(frames) != 1:
        raise HandshakeError(f"request has {len(frames)} frames, expected 1", code=MALFORMED_MESSAGE)
    header = _header(frames[0])
    _check_envelope(header, fingerprint)
    try:
        kind = MessageType(str(header.get("type")))
    except ValueError as exc:
        raise HandshakeError(f"unknown message type {header.get('type')!r}", code=UNKNOWN_MESSAGE_TYPE) from exc
    if kind is MessageType.METADATA:
        rank = header.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise HandshakeError(f"rank must be a non-negative integer, got {rank!r}", code=MALFORMED_MESSAGE)
        return kind, rank, []
    ids, tokens = header.get("requestIds"), header.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise HandshakeError("requestIds must be a list of strings", code=MALFORMED_MESSAGE)
    if not isinstance(tokens, list) or len(tokens) != len(ids) or not all(isinstance(t, str) for t in tokens):
        raise HandshakeError("tokens must be a list of strings, one per request id", code=MALFORMED_MESSAGE)
    return kind, 0, list(zip(ids, tokens, strict=True))


def agent_checksum(agent_metadata: bytes) -> str:
    """What a metadata reply's header says of its NIXL agent metadata: SHA-256, hex."""
    return hashlib.sha256(agent_metadata).hexdigest()


def encode_reply(fingerprint: str, metadata: RankMetadata, agent_metadata: bytes) -> list[bytes]:
    header = {"version": ENVELOPE_VERSION, "fingerprint": fingerprint, "agentSha256": agent_checksum(agent_metadata)}
    return [_dump(header), metadata.model_dump_json(by_alias=True, exclude_none=True).encode(), agent_metadata]


def encode_digest_reply(
    fingerprint: str, state: DigestState, heads: list[int], data: bytes, key: bytes = b""
) -> list[bytes]:
    header: dict[str, object] = {"version": ENVELOPE_VERSION, "fingerprint": fingerprint, "state": state.value}
    header.update(heads=heads, key=key.hex())
    return [_dump(header), data]


def decode_digest_reply(frames: Sequence[bytes], fingerprint: str) -> tuple[DigestState, list[int], bytes, bytes]:
    """``(state, heads, digest bytes, key)`` of a digest reply; the envelope is checked first. A ``ready`` reply
    carries the request's key (``KEY_BYTES``), any other none."""
    header = _reply_header(frames, fingerprint)
    heads = header.get("heads")
    if len(frames) != 2 or not isinstance(heads, list) or not all(isinstance(h, int) for h in heads):
        raise HandshakeError("a digest reply is a header with heads and one data frame", code=MALFORMED_MESSAGE)
    if len(frames[1]) > MAX_PAYLOAD_BYTES:
        raise HandshakeError("digest payload too large", code=MALFORMED_MESSAGE)
    try:
        state = DigestState(str(header.get("state")))
    except ValueError as exc:
        raise HandshakeError(f"unknown digest state {header.get('state')!r}", code=MALFORMED_MESSAGE) from exc
    text = header.get("key", "")
    try:
        key = bytes.fromhex(text) if isinstance(text, str) else None
    except ValueError:
        key = None
    if key is None or len(key) != (KEY_BYTES if state is DigestState.READY else 0):
        raise HandshakeError(f"a {state.value} digest reply with a key of {text!r}", code=MALFORMED_MESSAGE)
    return state, [int(h) for h in heads], bytes(frames[1]), key


def encode_ack(fingerprint: str, renewed: Sequence[str] = ()) -> list[bytes]:
    """An acknowledgement; a heartbeat's names the requests whose lease prefill renewed (held, and named with
    their token): decode extends its view of a lease only for those."""
    return [_dump({"version": ENVELOPE_VERSION, "fingerprint": fingerprint, "renewed": list(renewed)})]


def encode_error(fingerprint: str, code: str, message: str) -> list[bytes]:
    header = {"version": ENVELOPE_VERSION, "fingerprint": fingerprint, "error": {"code": code, "message": message}}
    return [_dump(header)]


def _reply_header(frames: Sequence[bytes], fingerprint: str) -> dict[str, object]:
    """A reply's header, its envelope checked; the error a peer answered with raised as a :class:`HandshakeError`."""
    if not frames:
        raise HandshakeError("empty reply", code=MALFORMED_MESSAGE)
    header = _header(frames[0])
    _check_envelope(header, fingerprint)
    error = header.get("error")
    if error is not None:
        detail = error if isinstance(error, dict) else {}
        code = str(detail.get("code", PEER_ERROR))
        raise HandshakeError(f"peer refused: {detail.get('message', error)}", code=code)
    return header


def decode_ack(frames: Sequence[bytes], fingerprint: str) -> list[str] | None:
    """The request ids an acknowledgement says were renewed; None where it does not say (a listener from before
    renewals were named, which renewed every request it held of those named)."""
    header = _reply_header(frames, fingerprint)
    renewed = header.get("renewed")
    if renewed is None:
        return None
    if not isinstance(renewed, list) or not all(isinstance(r, str) for r in renewed):
        raise HandshakeError("renewed must be a list of request ids", code=MALFORMED_MESSAGE)
    return [str(r) for r in renewed]


def decode_reply(frames: Sequence[bytes], fingerprint: str) -> tuple[RankMetadata, bytes]:
    """Check the envelope, then decode the payload."""
    header = _reply_header(frames, fingerprint)
    if len(frames) != 3:
        raise HandshakeError(f"reply has {len(frames)} frames, expected 3", code=MALFORMED_MESSAGE)
    if len(frames[1]) > MAX_PAYLOAD_BYTES:
        raise HandshakeError("payload too large", code=MALFORMED_MESSAGE)
    try:
        metadata = RankMetadata.model_validate_json(frames[1])
    except ValidationError as exc:
        raise HandshakeError(
            f"payload does not match the metadata schema: {exc.errors()[0]['msg']}", code=MALFORMED_MESSAGE
        ) from exc
    except SpecError as exc:  # a physical layout whose strides contradict its order
        raise HandshakeError(f"payload describes an impossible layout: {exc.message}", code=MALFORMED_MESSAGE) from exc
    if not frames[2]:
        raise HandshakeError("reply carries no NIXL agent metadata", code=MALFORMED_MESSAGE)
    if header.get("agentSha256") != agent_checksum(frames[2]):
        raise HandshakeError(
            "the reply's NIXL agent metadata does not match the checksum in its header (corrupted on the way, or a "
            "faulty peer): not handed to NIXL",
            code=MALFORMED_MESSAGE,
        )
    return metadata, frames[2]


#: a request id kvbridge can carry: it names the request in notifications (``"<id>:<tp>"``) and on the side channel
MAX_REQUEST_ID_CHARS = 256
#: visible ASCII but ``:``
REQUEST_ID_PATTERN = r"^[\x21-\x39\x3b-\x7e]+$"
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)
INVALID_REQUEST_ID = "INVALID_REQUEST_ID"


def request_id_problem(request_id: object) -> str:
    """Why ``request_id`` cannot name a transfer (empty when it can): a non-empty string of at most
    :data:`MAX_REQUEST_ID_CHARS` visible ASCII characters without ``:`` (the notification's separator). Engines
    check it before they record anything for the request, so a bad id fails that request and leaves nothing held."""
    if not isinstance(request_id, str) or not request_id:
        return "the request id is empty"
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        return f"the request id has {len(request_id)} characters, at most {MAX_REQUEST_ID_CHARS}"
    if ":" in request_id:
        return "the request id contains ':' (kvbridge's notifications use it as a separator)"
    if not _REQUEST_ID.fullmatch(request_id):
        return "the request id holds characters other than visible ASCII (no spaces or control characters)"
    return ""


def lease_token(secret: bytes, request_id: str) -> str:
    """The capability to renew a request's lease and fetch its digests (§5): an HMAC of prefill's request id under
    the engine's own random secret. Prefill puts it in the request's transfer parameters, so only whoever was handed
    them (the decode the router chose) can hold the blocks longer or ask for the digests; prefill checks it without
    keeping any state."""
    return hmac.new(secret, request_id.encode(), hashlib.sha256).hexdigest()[:32]


def token_matches(secret: bytes, request_id: str, token: str) -> bool:
    """Whether ``token`` is ``request_id``'s lease token under ``secret`` (a constant-time comparison)."""
    return hmac.compare_digest(lease_token(secret, request_id), token)


class TransferDigests(CamelModel):
    """A verified request's digests as they travel in its transfer parameters (docs/protocol.md §8): the key the
    coefficients came from, and ``D[head, wire block]`` for every global head, as :func:`~.digest.to_bytes` lays them
    out (base64). Decode checks what it read against them in the step its READs complete, with no side-channel
    exchange; without them (prefill could not digest the request before answering) decode asks the side channel."""

    key: str = Field(pattern=f"^[0-9a-f]{{{2 * KEY_BYTES}}}$")
    heads: list[int] = Field(min_length=1, max_length=4096)
    rows: str = Field(min_length=1, max_length=MAX_PAYLOAD_BYTES * 4 // 3 + 4, pattern=r"^[A-Za-z0-9+/]*={0,2}$")

    @classmethod
    def of(cls, found: RequestDigests) -> TransferDigests:
        heads, data = to_bytes(found.heads)
        return cls(key=found.key.hex(), heads=heads, rows=base64.b64encode(data).decode("ascii"))

    def request_digests(self) -> RequestDigests:
        """As the digest check takes them; raises ValueError when the rows are not whole rows of the heads."""
        return RequestDigests(bytes.fromhex(self.key), from_bytes(self.heads, base64.b64decode(self.rows)))


_DNS_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def host_problem(host: str) -> str:
    """Why ``host`` cannot name a side channel (empty when it can): an IPv4 or IPv6 address, or a DNS name of labels
    of letters, digits and inner hyphens (at most 63 characters each, 253 in all; a trailing dot allowed)."""
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        return ""
    name = host.removesuffix(".")
    if name and len(name) <= 253 and all(_DNS_LABEL.fullmatch(label) for label in name.split(".")):
        return ""
    return "neither an IP address nor a DNS name"


def _valid_host(host: str) -> str:
    problem = host_problem(host)
    if problem:
        raise ValueError(problem)
    return host


def tcp_endpoint(host: str, port: int | None = None) -> str:
    """ZeroMQ's ``tcp://`` endpoint of a host (an IPv6 address in brackets) and, when given, a port."""
    literal = f"[{host}]" if ":" in host else host
    return f"tcp://{literal}" if port is None else f"tcp://{literal}:{port}"


class KVTransferParams(CamelModel):
    """What prefill returns for a request and the router hands to decode."""

    remote_engine_id: str = Field(min_length=1, max_length=256)
    remote_incarnation: str = Field(min_length=1, max_length=64)
    #: an IPv4 or IPv6 address (a pod's IP) or a DNS name (:func:`host_problem`): anything else is refused here,
    #: before decode's handshake thread hands it to ZeroMQ
    remote_host: Annotated[str, AfterValidator(_valid_host)] = Field(min_length=1, max_length=253)
    remote_port: int = Field(ge=1, le=65535)
    remote_request_id: str = Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS, pattern=REQUEST_ID_PATTERN)
    remote_block_ids: list[Annotated[int, Field(ge=0, lt=MAX_BLOCK_ID)]] = Field(max_length=1 << 20)
    #: a hybrid model (several KV cache groups): ``remote_block_ids`` lists each group's blocks one group after the
    #: other, this many each (core.cache_groups); absent for one group
    remote_group_sizes: list[Annotated[int, Field(ge=0, le=1 << 20)]] | None = Field(
        default=None, min_length=2, max_length=64
    )
    num_tokens: int = Field(ge=1, le=MAX_TOKENS)
    #: prefill's TP size: bounded here; whether this decode may pair with it at all is the deployment's verdict
    #: (:func:`~kvbridge_agent.core.plan.peer_tp_problem`), checked before any handshake
    remote_tp_size: int = Field(ge=1, le=MAX_TENSOR_PARALLEL)
    fingerprint: str = Field(min_length=1, max_length=64)
    #: when prefill's lease on the blocks ends (Unix time, prefill's clock) unless decode's heartbeats renew it;
    #: decode refuses to read, or to use a read that finished, after it (minus a clock-skew margin)
    expires_at: float | None = Field(default=None, ge=0)
    #: prefill digested this request (spec.transfer.verification): decode must verify what it read before use
    verify: bool = False
    #: the request's lease token (:func:`lease_token`): heartbeats and digest requests without it are refused
    lease_token: str = Field(default="", max_length=64)
    #: a verified request's key and digests, when prefill had them before it answered (vLLM: digested right after
    #: the forward step that completed the prompt); else decode asks the side channel for them
    digests: TransferDigests | None = None
    #: the first 128 bits of SHA-256 of the prompt's token ids (core.signing.prompt_hash), in hex: a router that
    #: signs (spec.router.signTransfers) binds it, and decode refuses parameters computed for another prompt
    prompt_hash: str | None = Field(default=None, min_length=32, max_length=64, pattern=r"^[0-9a-f]+$")

    @model_validator(mode="after")
    def _groups_add_up(self) -> KVTransferParams:
        sizes = self.remote_group_sizes
        if sizes is not None and sum(sizes) != len(self.remote_block_ids):
            raise ValueError(f"remoteGroupSizes {sizes} do not add up to the {len(self.remote_block_ids)} block ids")
        return self


def notification(prefill_request_id: str, decode_tp_size: int) -> bytes:
    """The completion message: ``"<prefill_request_id>:<tp_D>"`` (never the decode-side id)."""
    return f"{prefill_request_id}:{decode_tp_size}".encode()


def parse_notification(message: bytes) -> tuple[str, int] | None:
    """``(prefill request id, decode TP size)``, or ``None`` for a malformed message."""
    try:
        text = message.decode()
    except UnicodeDecodeError:
        return None
    request_id, sep, tp = text.rpartition(":")
    if not sep or not request_id or not tp.isdigit() or int(tp) < 1:
        return None
    return request_id, int(tp)
