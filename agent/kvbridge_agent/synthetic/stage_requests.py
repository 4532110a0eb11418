"""Staged reads in the synthetic engine (docs/protocol.md §4d): the ``stage`` message between its processes.

Prefill: the engine's side channel hands a stage request (its lease token checked) to the rank process it names,
which packs the request into its staging buffer (``transfer.prefill_rank.PrefillRank.stage``) and answers.
Decode: a rank process asks prefill's side channel itself, at the address the engine admitted for the request (its
prefill hosts and Service, as every other exchange), with the deployment's side-channel keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbridge_agent.core import KVBridgeError
from kvbridge_agent.core.contract import EngineEnvironment
from kvbridge_agent.core.handshake import HandshakeError, KVTransferParams
from kvbridge_agent.core.stage_requests import STAGE_PLAN_INVALID, StageReply, StageRequest
from kvbridge_agent.transfer.keys import CurveKeys, load_keys
from kvbridge_agent.transfer.peers import PrefillService, SideChannelStager

if TYPE_CHECKING:
    from kvbridge_agent.synthetic.ranks import RankHandle

#: how long the engine waits for a rank to pack a request
STAGE_TIMEOUT = 30.0


def stage_on_rank(ranks: list[RankHandle], request_id: str, request: StageRequest) -> StageReply:
    """Prefill: the rank a stage request names packs it; its refusal keeps its code."""
    if request.rank >= len(ranks):
        raise KVBridgeError(f"this engine has {len(ranks)} ranks", field="stage.rank", code=STAGE_PLAN_INVALID)
    message = {"op": "stage", "request_id": request_id, "request": request.model_dump_json()}
    reply = ranks[request.rank].call(message, STAGE_TIMEOUT)
    if not reply.get("ok"):
        raise KVBridgeError(str(reply.get("message", "")), code=str(reply.get("code", "STAGE_REFUSED")))
    return StageReply.model_validate_json(reply["reply"])


def stage_host(service: PrefillService, params: KVTransferParams) -> str:
    """Decode: where a rank asks prefill to stage a request (the admitted address; its own host where none is)."""
    try:
        return service.address(params.remote_host)
    except HandshakeError:  # the rank's stage request then fails, and it reads directly
        return params.remote_host


def rank_stager(env: EngineEnvironment) -> SideChannelStager:
    """Decode: a rank's stage requests over prefill's side channel, to the host the engine admitted per request
    (``hosts``, set with each read), with the deployment's side-channel keys."""
    keys: CurveKeys | None = load_keys(env.keys_dir) if env.keys_dir else None
    return SideChannelStager(keys, env.transfer.handshake_timeout_seconds)
