"""The synthetic engine bounds what it is asked by its own deployment (core/admission.py), in the engine itself,
before anything is allocated, recorded or connected to: a decode's transfer parameters (tokens within the
synthetic model's length, the cache it holds; block ids within what the tokens fill; the prefill TP the verdict
allows; a remoteHost among ``KVBRIDGE_PREFILL_HOSTS``, and an address of ``KVBRIDGE_PREFILL_SERVICE`` before any
connection) and a prefill's token count."""

from __future__ import annotations

import select
import socket

import pytest

from kvbridge_agent.core import ModelGeometry, Role, RoleSettings
from kvbridge_agent.core.contract import EngineEnvironment
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.synthetic.engine import Engine
from kvbridge_agent.synthetic.ranks import EngineError

MODEL = ModelGeometry(name="m", num_layers=1, num_kv_heads=2, head_dim=8)


def engine(role: Role, hosts: list[str] | None = None, service: str | None = None) -> Engine:
    """An engine of 8 blocks of 16 tokens (its length: 128 tokens), not started (no ranks, no side channel)."""
    return Engine(
        EngineEnvironment(
            role=role,
            engine_id=f"{role.value}-0",
            model=MODEL,
            prefill=RoleSettings(),
            decode=RoleSettings(),
            num_blocks=8,
            prefill_hosts=hosts,
            prefill_service=service,
        )
    )


def params(**changes: object) -> KVTransferParams:
    fields: dict[str, object] = {
        "remote_engine_id": "prefill-0",
        "remote_incarnation": "i",
        "remote_host": "10.1.2.3",
        "remote_port": 5600,
        "remote_request_id": "r",
        "remote_block_ids": [0, 1, 2],
        "num_tokens": 40,
        "remote_tp_size": 1,
        "fingerprint": "f",
    }
    return KVTransferParams(**{**fields, **changes})


@pytest.mark.parametrize(
    ("changes", "code", "field"),
    [
        # past the model's length (a decode of 8 blocks of 16: 128 tokens), not 2^24: before, NO_FREE_BLOCKS (503,
        # which a router retries elsewhere) after an allocation attempt. The synthetic engine's code for parameters
        # it refuses is INVALID_REQUEST (the vLLM connector's INVALID_TRANSFER_PARAMS), the field says which
        ({"num_tokens": 129, "remote_block_ids": list(range(9))}, "INVALID_REQUEST", "numTokens"),
        ({"num_tokens": 1 << 24}, "INVALID_REQUEST", "numTokens"),
        ({"remote_block_ids": [0, 1, 2, 3]}, "INVALID_REQUEST", "remoteBlockIds"),  # 40 tokens fill 3
        ({"remote_tp_size": 3}, "INVALID_REQUEST", "remoteTpSize"),
        ({"remote_host": "127.0.0.1"}, "REMOTE_HOST_NOT_ALLOWED", "remoteHost"),
        ({"remote_host": "169.254.169.254"}, "REMOTE_HOST_NOT_ALLOWED", "remoteHost"),
        ({"remote_host": "prefill.elsewhere.svc"}, "REMOTE_HOST_NOT_ALLOWED", "remoteHost"),
    ],
)
def test_decode_refuses_parameters_past_its_deployment_s_bounds_before_anything(
    changes: dict[str, object], code: str, field: str
) -> None:
    decode = engine(Role.DECODE, hosts=["10.0.0.0/8", "dd-prefill.ns.svc"])
    with pytest.raises(EngineError) as caught:
        decode.decode("d1", params(**changes))
    assert (caught.value.code, caught.value.field, caught.value.status) == (code, f"kvTransferParams.{field}", 400)
    assert decode.allocator.free_count == 8  # nothing allocated
    assert decode._waiting == {}  # no heartbeat
    assert decode.peers._peers == {}  # no handshake, no connection


def test_without_prefill_hosts_decode_admits_any_host() -> None:
    """Unset (the operator's podNetworks empty): no host is refused at admission (the handshake is what fails)."""
    decode = engine(Role.DECODE)
    for host in ("127.0.0.1", "169.254.169.254", "prefill.elsewhere.svc"):
        decode._admission.check(params(remote_host=host), "kvTransferParams")


def test_prefill_refuses_a_prompt_longer_than_the_model_before_allocating() -> None:
    prefill = engine(Role.PREFILL)
    with pytest.raises(EngineError) as caught:
        prefill.prefill("r1", 129)
    assert (caught.value.code, caught.value.field, caught.value.status) == ("INVALID_REQUEST", "numTokens", 400)
    assert prefill.allocator.free_count == 8


def test_decode_connects_only_to_an_address_of_the_prefill_service() -> None:
    """KVBRIDGE_PREFILL_SERVICE ``localhost`` (127.0.0.1, from the hosts file: a real lookup): a request naming
    127.0.0.2 fails REMOTE_HOST_NOT_ALLOWED (400) at its handshake, its blocks freed; nothing connects to the
    listener there, and the heartbeat thread would skip it."""
    listener = socket.socket()
    listener.bind(("127.0.0.2", 0))
    listener.listen(8)
    decode = engine(Role.DECODE, service="localhost")
    try:
        forged = params(remote_host="127.0.0.2", remote_port=listener.getsockname()[1])
        with pytest.raises(EngineError) as caught:
            decode.decode("d1", forged)
        assert (caught.value.code, caught.value.status) == ("REMOTE_HOST_NOT_ALLOWED", 400)
        assert caught.value.field == "kvTransferParams.remoteHost"
        assert decode.allocator.free_count == 8
        assert decode.peers.service.reachable({"d1": forged}) == {}
        assert decode.peers.service.address("127.0.0.1") == "127.0.0.1"
        assert not select.select([listener], [], [], 0.3)[0]
    finally:
        listener.close()
