"""What the connector's two halves tell each other, and what it puts into ``kv_transfer_params``.

- worker -> scheduler, once after registration: :class:`RankHandshake` (vLLM collects one per TP rank and hands
  them to the scheduler, which serves them on the side channel);
- scheduler -> worker, every step: :class:`StepMetadata` (requests to read, requests to offer, their leases);
- prefill -> router -> decode: ``kv_transfer_params`` with ``do_remote_prefill`` and kvbridge's
  :class:`~kvbridge_agent.core.handshake.KVTransferParams` under ``"kvbridge"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from kvbridge_agent.core.handshake import KVTransferParams

#: the key of kvbridge's own parameters inside vLLM's ``kv_transfer_params``
PARAMS_KEY = "kvbridge"
#: where prefill puts why it offers nothing for a request (``{"code", "message"}``): the request's own fault, so the
#: router answers it without trying another pod
ERROR_KEY = "kvbridge_error"


def by_group(block_ids: Any) -> list[list[int]]:
    """vLLM's block ids of a request as one list per KV cache group (it hands a tuple of lists, or one list)."""
    if block_ids and isinstance(block_ids[0], list | tuple):
        return [list(group) for group in block_ids]
    return [list(block_ids or ())]


def refusal(code: str, message: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill answer that offers nothing, and why (``ERROR_KEY``)."""
    return {"do_remote_prefill": False, "do_remote_decode": False, ERROR_KEY: {"code": code, "message": message}}


@dataclass
class RankHandshake(KVConnectorHandshakeMetadata):
    """One TP rank's side-channel metadata: ``RankMetadata`` as JSON and the NIXL agent's metadata."""

    rank_metadata_json: str
    agent_metadata: bytes


@dataclass
class ReadOrder:
    """Decode: read one request's KV into these local blocks (empty: a full local prefix hit, notify only)."""

    local_block_ids: list[int]
    #: None only for a refused order (parameters that did not validate)
    params: KVTransferParams | None
    #: why this request must not be read at all (its blocks are reported invalid); empty: read it
    refused: str = ""
    #: the prefill lease's end as decode knows it: ``expiresAt`` moved on by heartbeats that got through
    expires_at: float | None = None
    #: every local block of the request in token order (prefix hits first): what a verification digests
    all_block_ids: list[int] = field(default_factory=list)
    #: a hybrid model: ``local_block_ids`` lists each cache group's blocks one group after the other, this many each
    local_group_sizes: list[int] | None = None
    #: the tokens a verification digests over ``all_block_ids`` (0: the request's); a hybrid model's flat list
    #: counts every position of every block
    digest_tokens: int = 0
    #: the request's W3C trace context, checked (tracing.py; empty: not traced)
    trace: dict[str, str] = field(default_factory=dict)
    #: a padded hybrid model: per block of ``all_block_ids``, the layers holding its KV (core.cache_groups)
    block_layers: list[int] | None = None


@dataclass
class OfferOrder:
    """Prefill: hold these blocks for a reader until ``expires_at`` (Unix time, renewed by heartbeats)."""

    block_ids: list[int]
    expires_at: float
    #: digest the request's first ``digest_tokens`` tokens before any reader (0: not verified), under this key
    #: (drawn for the request by the scheduler, which publishes it with the digests)
    digest_tokens: int = 0
    digest_key: bytes = b""
    #: the request's W3C trace context, checked (tracing.py; empty: not traced)
    trace: dict[str, str] = field(default_factory=dict)
    #: a padded hybrid model: per block, the layers holding its KV (core.cache_groups)
    block_layers: list[int] | None = None


@dataclass
class DigestOrder:
    """Prefill: digest a request's first ``num_tokens`` tokens in these blocks under ``key`` right after this step's
    forward computed them (the step completes its prompt), so the digests come back with this step's output and
    travel in the transfer parameters the request finishes with."""

    block_ids: list[int]
    num_tokens: int
    key: bytes
    #: the request's W3C trace context, checked (tracing.py; empty: not traced)
    trace: dict[str, str] = field(default_factory=dict)
    #: a padded hybrid model: per block, the layers holding its KV (core.cache_groups)
    block_layers: list[int] | None = None


@dataclass
class StepMetadata(KVConnectorMetadata):
    to_read: dict[str, ReadOrder] = field(default_factory=dict)
    to_offer: dict[str, OfferOrder] = field(default_factory=dict)
    #: prefill: requests whose prompt this step completes, to digest after its forward
    to_digest: dict[str, DigestOrder] = field(default_factory=dict)
    #: every held request's current lease end (heartbeats move it)
    leases: dict[str, float] = field(default_factory=dict)


class InvalidTransferParamsError(ValueError):
    """A request's ``kv_transfer_params`` name a kvbridge transfer but do not validate: that request fails."""

    code = "INVALID_TRANSFER_PARAMS"


def transfer_params(raw: dict[str, Any] | None) -> KVTransferParams | None:
    """kvbridge's parameters from a request's ``kv_transfer_params`` (``None``: not a kvbridge transfer); raises
    :class:`InvalidTransferParamsError` (never pydantic's error, never a traceback into vLLM) when they do not
    validate."""
    if not raw or PARAMS_KEY not in raw:
        return None
    ours = raw[PARAMS_KEY]
    if not isinstance(ours, dict):
        raise InvalidTransferParamsError(f"kv_transfer_params.{PARAMS_KEY} must be an object")
    try:
        return KVTransferParams.model_validate(ours)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in ("kv_transfer_params", PARAMS_KEY, *first["loc"]))
        raise InvalidTransferParamsError(f"{where}: {first['msg']}") from None
