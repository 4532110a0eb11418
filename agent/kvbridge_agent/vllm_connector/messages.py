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

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from kvbridge_agent.core.handshake import KVTransferParams

#: the key of kvbridge's own parameters inside vLLM's ``kv_transfer_params``
PARAMS_KEY = "kvbridge"


@dataclass
class RankHandshake(KVConnectorHandshakeMetadata):
    """One TP rank's side-channel metadata: ``RankMetadata`` as JSON and the NIXL agent's metadata."""

    rank_metadata_json: str
    agent_metadata: bytes


@dataclass
class ReadOrder:
    """Decode: read one request's KV into these local blocks (empty: a full local prefix hit, notify only)."""

    local_block_ids: list[int]
    params: KVTransferParams
    #: why this request must not be read at all (its blocks are reported invalid); empty: read it
    refused: str = ""
    #: the prefill lease's end as decode knows it: ``expiresAt`` moved on by heartbeats that got through
    expires_at: float | None = None
    #: every local block of the request in token order (prefix hits first): what a verification digests
    all_block_ids: list[int] = field(default_factory=list)


@dataclass
class OfferOrder:
    """Prefill: hold these blocks for a reader until ``expires_at`` (Unix time, renewed by heartbeats)."""

    block_ids: list[int]
    expires_at: float
    #: digest the request's first ``digest_tokens`` tokens before any reader (0: not verified), under this key
    #: (drawn for the request by the scheduler, which publishes it with the digests)
    digest_tokens: int = 0
    digest_key: bytes = b""


@dataclass
class StepMetadata(KVConnectorMetadata):
    to_read: dict[str, ReadOrder] = field(default_factory=dict)
    to_offer: dict[str, OfferOrder] = field(default_factory=dict)
    #: every held request's current lease end (heartbeats move it)
    leases: dict[str, float] = field(default_factory=dict)


def transfer_params(raw: dict[str, Any] | None) -> KVTransferParams | None:
    """kvbridge's parameters from a request's ``kv_transfer_params`` (``None``: not a kvbridge transfer)."""
    if not raw or not isinstance(raw.get(PARAMS_KEY), dict):
        return None
    return KVTransferParams.model_validate(raw[PARAMS_KEY])
