"""Side-channel envelope (docs/protocol.md §5): the fingerprint and version are checked before the payload."""

from __future__ import annotations

import json

import pytest

from kvbridge_agent.core.digest import new_key
from kvbridge_agent.core.handshake import (
    DigestState,
    HandshakeError,
    KVTransferParams,
    MessageType,
    RankMetadata,
    decode_ack,
    decode_digest_reply,
    decode_reply,
    decode_request,
    encode_ack,
    encode_digest_reply,
    encode_error,
    encode_reply,
    encode_request,
    host_problem,
    notification,
    parse_notification,
    tcp_endpoint,
)

META = RankMetadata(
    engine_id="p-0",
    incarnation="abc",
    agent_name="p-0.abc.0",
    tp_rank=0,
    tp_size=2,
    block_size=16,
    kv_layout="HND",
    cache_kind="Split",
    num_blocks=8,
    tensor_bases=[4096, 8192],
    region_block_bytes=1024,
    wire_block_size=16,
    wire_layout="HND",
    memory_type="DRAM",
    device_id=0,
)


def test_request_and_reply_round_trip() -> None:
    kind, rank, ids = decode_request(encode_request(MessageType.METADATA, "fp", rank=1), "fp")
    assert (kind, rank, ids) == (MessageType.METADATA, 1, [])
    named = [("a", "t1"), ("b", "t2")]
    kind, _, ids = decode_request(encode_request(MessageType.HEARTBEAT, "fp", requests=named), "fp")
    assert (kind, ids) == (MessageType.HEARTBEAT, named)
    meta, agent = decode_reply(encode_reply("fp", META, b"nixl"), "fp")
    assert (meta, agent) == (META, b"nixl")
    decode_ack(encode_ack("fp"), "fp")


@pytest.mark.parametrize(
    "agent", [b"nixl-", b"nix", b"NIXL", b"nixl\x00"], ids=["longer", "cut", "changed", "a byte added"]
)
def test_agent_metadata_that_does_not_match_its_checksum_never_reaches_nixl(agent: bytes) -> None:
    """NIXL keeps part of a remote agent whose metadata failed half-way (and then refuses that agent for good), and
    UCX aborts the process on some corrupted addresses: a reply whose agent metadata is not what its header's
    checksum says is refused before anyone hands it to NIXL."""
    header, payload, _ = encode_reply("fp", META, b"nixl")
    with pytest.raises(HandshakeError, match="checksum") as caught:
        decode_reply([header, payload, agent], "fp")
    assert caught.value.code == "MALFORMED_MESSAGE"
    unchecked = json.dumps({"version": 3, "fingerprint": "fp"}).encode()  # no checksum at all
    with pytest.raises(HandshakeError, match="checksum"):
        decode_reply([unchecked, payload, b"nixl"], "fp")


def test_fingerprint_is_checked_before_the_payload() -> None:
    frames = encode_reply("other", META, b"nixl")
    frames[1] = b"not even json"  # a schema change must not surface as a parse error
    with pytest.raises(HandshakeError) as caught:
        decode_reply(frames, "fp")
    assert caught.value.code == "FINGERPRINT_MISMATCH"


def test_version_mismatch_is_named() -> None:
    header = json.dumps({"version": 99, "fingerprint": "fp", "type": "metadata", "rank": 0}).encode()
    with pytest.raises(HandshakeError) as caught:
        decode_request([header], "fp")
    assert caught.value.code == "PROTOCOL_VERSION_MISMATCH"
    assert "run the same kvbridge version" in caught.value.message


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([b"\xff\xfe garbage"], "MALFORMED_MESSAGE"),
        ([b"[1, 2]"], "MALFORMED_MESSAGE"),
        ([b'{"version": 3, "fingerprint": "fp", "type": "metadata", "rank": -1}'], "MALFORMED_MESSAGE"),
        ([b'{"version": 3, "fingerprint": "fp", "type": "metadata", "rank": true}'], "MALFORMED_MESSAGE"),
        ([b'{"version": 3, "fingerprint": "fp", "type": "steal"}'], "UNKNOWN_MESSAGE_TYPE"),
        ([b'{"version": 3, "fingerprint": "fp", "type": "heartbeat", "requestIds": [1]}'], "MALFORMED_MESSAGE"),
        ([b"x" * 5000], "MALFORMED_MESSAGE"),
        ([], "MALFORMED_MESSAGE"),
        ([b"{}", b"extra"], "MALFORMED_MESSAGE"),
    ],
)
def test_bad_requests_are_typed_errors(frames: list[bytes], code: str) -> None:
    with pytest.raises(HandshakeError) as caught:
        decode_request(frames, "fp")
    assert caught.value.code == code


def test_truncated_and_invalid_replies() -> None:
    good = encode_reply("fp", META, b"nixl")
    for frames in (good[:1], good[:2], [good[0], b"{}", b"nixl"], [good[0], good[1], b""]):
        with pytest.raises(HandshakeError) as caught:
            decode_reply(frames, "fp")
        assert caught.value.code == "MALFORMED_MESSAGE"


def test_peer_errors_carry_the_peer_code() -> None:
    with pytest.raises(HandshakeError) as caught:
        decode_reply(encode_error("fp", "UNKNOWN_RANK", "no rank 7"), "fp")
    assert caught.value.code == "UNKNOWN_RANK"


def test_notification_names_the_prefill_request_and_decode_tp() -> None:
    assert notification("prefill-req-7", 4) == b"prefill-req-7:4"
    assert parse_notification(b"prefill-req-7:4") == ("prefill-req-7", 4)
    for bad in (b"nope", b":4", b"x:", b"x:0", b"x:-1", b"\xff:1"):
        assert parse_notification(bad) is None


def test_kv_transfer_params_reject_ids_with_colons() -> None:
    base = {
        "remoteEngineId": "p",
        "remoteIncarnation": "i",
        "remoteHost": "h",
        "remotePort": 1,
        "remoteRequestId": "a:b",
        "remoteBlockIds": [1],
        "numTokens": 1,
        "remoteTpSize": 1,
        "fingerprint": "f",
    }
    with pytest.raises(ValueError, match="remoteRequestId"):
        KVTransferParams.model_validate(base)


def test_a_lease_token_is_the_request_s_own_under_the_engine_s_secret() -> None:
    from kvbridge_agent.core.handshake import lease_token, token_matches

    token = lease_token(b"s" * 32, "req-1")
    assert token_matches(b"s" * 32, "req-1", token)
    assert not token_matches(b"s" * 32, "req-2", token)  # another request's token
    assert not token_matches(b"t" * 32, "req-1", token)  # another engine (or a restart) drew another secret
    assert not token_matches(b"s" * 32, "req-1", "")


@pytest.mark.parametrize(
    "header",
    [
        b'{"version":3,"fingerprint":"fp","type":"heartbeat","requestIds":["a"]}',
        b'{"version":3,"fingerprint":"fp","type":"heartbeat","requestIds":["a"],"tokens":["t","u"]}',
        b'{"version":3,"fingerprint":"fp","type":"heartbeat","requestIds":["a"],"tokens":[1]}',
    ],
)
def test_request_ids_without_one_token_each_are_malformed(header: bytes) -> None:
    with pytest.raises(HandshakeError) as caught:
        decode_request([header], "fp")
    assert caught.value.code == "MALFORMED_MESSAGE"


def test_a_digest_reply_carries_the_requests_key_and_only_a_ready_one_does() -> None:
    """docs/protocol.md §8: the key the digests were computed under travels with them, on the side channel."""
    key = new_key()
    reply = encode_digest_reply("fp", DigestState.READY, [0, 1], b"x" * 16, key)
    state, heads, data, got = decode_digest_reply(reply, "fp")
    assert (state, heads, data, got) == (DigestState.READY, [0, 1], b"x" * 16, key)
    assert decode_digest_reply(encode_digest_reply("fp", DigestState.PENDING, [], b""), "fp")[3] == b""
    for state, bad in [(DigestState.READY, b""), (DigestState.READY, key[:8]), (DigestState.UNKNOWN, key)]:
        with pytest.raises(HandshakeError) as caught:
            decode_digest_reply(encode_digest_reply("fp", state, [], b"", bad), "fp")
        assert caught.value.code == "MALFORMED_MESSAGE"
    frames = encode_digest_reply("fp", DigestState.READY, [], b"", key)
    frames[0] = frames[0].replace(key.hex().encode(), b"not hex!" * 8)
    with pytest.raises(HandshakeError, match="key"):
        decode_digest_reply(frames, "fp")


def test_group_sizes_must_add_up_to_the_block_ids() -> None:
    from pydantic import ValidationError

    from kvbridge_agent.core.handshake import KVTransferParams

    base = {
        "remoteEngineId": "p",
        "remoteIncarnation": "i",
        "remoteHost": "h",
        "remotePort": 1,
        "remoteRequestId": "r",
        "remoteBlockIds": [1, 2, 3],
        "numTokens": 40,
        "remoteTpSize": 1,
        "fingerprint": "f",
    }
    assert KVTransferParams.model_validate({**base, "remoteGroupSizes": [2, 1]}).remote_group_sizes == [2, 1]
    for sizes in ([2, 2], [4, -1], [3]):
        with pytest.raises(ValidationError):
            KVTransferParams.model_validate({**base, "remoteGroupSizes": sizes})


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"tp_size": 1025}, "tpSize"),
        ({"tp_rank": 2}, "outside the 2 ranks"),
        ({"num_blocks": (1 << 24) + 1}, "numBlocks"),
        ({"tensor_bases": [0] * 4097}, "tensorBases"),
        ({"tensor_bases": [1 << 64]}, "tensorBases"),
        ({"num_blocks": 1 << 24, "tensor_bases": [4096] * 16}, "descriptors"),
        ({"block_size": 8192}, "blockSize"),
        ({"region_block_bytes": 1 << 40}, "regionBlockBytes"),
        ({"device_id": 1 << 20}, "deviceId"),
    ],
)
def test_a_peer_s_metadata_is_bounded_before_decode_allocates_for_it(change: dict[str, object], why: str) -> None:
    """A prefill (faulty, or holding the keys) claiming a cache decode would build descriptor lists of billions of
    entries for is refused as malformed, before anything is allocated."""
    raw = json.loads(META.model_dump_json(by_alias=True))
    raw.update({RankMetadata.model_fields[k].alias or k: v for k, v in change.items()})
    with pytest.raises(ValueError, match=why):
        RankMetadata.model_validate(raw)


@pytest.mark.parametrize(
    "change",
    [
        {"remoteTpSize": 1_000_000_000},
        {"numTokens": 1 << 40},
        {"remoteBlockIds": [1 << 63]},
        {"remoteBlockIds": [-1]},
        {"remoteGroupSizes": [-1, 2], "remoteBlockIds": [0]},
    ],
)
def test_transfer_parameters_bound_every_number(change: dict[str, object]) -> None:
    raw = {
        "remoteEngineId": "p-0",
        "remoteIncarnation": "inc",
        "remoteHost": "127.0.0.1",
        "remotePort": 5600,
        "remoteRequestId": "r1",
        "remoteBlockIds": [1, 2],
        "numTokens": 20,
        "remoteTpSize": 1,
        "fingerprint": "abcd",
    }
    KVTransferParams.model_validate(raw)
    with pytest.raises(ValueError, match="validation error"):
        KVTransferParams.model_validate({**raw, **change})


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("10.244.1.5", True),
        ("fd00:10:244::5", True),  # an IPv6 pod IP, as Kubernetes writes it
        ("::1", True),
        ("localhost", True),
        ("llama-prefill-0.llama-prefill.default.svc.cluster.local", True),
        ("x.svc.cluster.local.", True),  # a trailing dot: a fully qualified name
        ("a b", False),
        ("a:b", False),  # neither an address nor a name
        ("[fd00::5]", False),  # a URL's form, not an address
        ("-bad", False),
        ("x" * 64 + ".local", False),  # a label over 63 characters
        ("", False),
    ],
)
def test_remote_host_is_an_address_or_a_dns_name(host: str, ok: bool) -> None:
    assert (host_problem(host) == "") is ok
    raw = {
        "remoteEngineId": "p-0",
        "remoteIncarnation": "inc",
        "remoteHost": host,
        "remotePort": 5600,
        "remoteRequestId": "r1",
        "remoteBlockIds": [1],
        "numTokens": 20,
        "remoteTpSize": 1,
        "fingerprint": "abcd",
    }
    if ok:
        assert KVTransferParams.model_validate(raw).remote_host == host
    else:
        with pytest.raises(ValueError, match="validation error"):
            KVTransferParams.model_validate(raw)


def test_tcp_endpoints_bracket_ipv6() -> None:
    assert tcp_endpoint("10.0.0.1", 5600) == "tcp://10.0.0.1:5600"
    assert tcp_endpoint("fd00::5", 5600) == "tcp://[fd00::5]:5600"
    assert tcp_endpoint("::1") == "tcp://[::1]"
    assert tcp_endpoint("p-0.svc", 1) == "tcp://p-0.svc:1"
