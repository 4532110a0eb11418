"""A prompt of token ids kept as the JSON the client sent (prompts.TokenIds): read only when it is what the decoded
check accepts, keyed as the decoded list is, and sent to prefill as it came."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_router.admission import parse
from kvbridge_router.errors import RouteError
from kvbridge_router.prefill import prefill_bytes
from kvbridge_router.prefixes import _MODULUS, MAX_CHUNKS, prefix_keys, prompt_ids
from kvbridge_router.prompts import MAX_ID_DIGITS, TokenIds, token_ids

LAYOUTS = [(None, None), (2, None), (None, (" , ", " : ")), (None, (",", ":")), (1, ("\t,\r\n", ": "))]


@settings(max_examples=300)
@given(st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=80), st.sampled_from(LAYOUTS))
def test_token_ids_read_from_any_layout_are_the_ids_and_written_one_way(
    ids: list[int], layout: tuple[int | None, tuple[str, str] | None]
) -> None:
    indent, separators = layout
    raw = json.dumps(ids, indent=indent, separators=separators).encode()
    read = TokenIds.read(raw)
    if not ids:
        assert read is None  # [] is refused by admission, not kept
        return
    assert read is not None
    assert read.ids() == ids
    assert len(read) == len(ids)
    assert read.text == json.dumps(ids, separators=(",", ":")).encode()[1:-1] == TokenIds.of(ids).text


@pytest.mark.parametrize(
    "raw",
    [b"[]", b"[1.0]", b"[1e5]", b"[-1]", b"[1, -0]", b"[[1, 2]]", b'"12"', b'[1, "2"]', b"[true]", b"[1, null]", b"{}"],
)
def test_what_is_not_a_flat_list_of_digit_ids_is_left_to_the_decoder(raw: bytes) -> None:
    assert TokenIds.read(raw) is None


def test_an_id_longer_than_the_bound_is_decoded_and_judged_as_before() -> None:
    kept, longer = b"9" * MAX_ID_DIGITS, b"9" * (MAX_ID_DIGITS + 1)
    assert TokenIds.read(b"[1," + kept + b",2]") is not None
    assert TokenIds.read(b"[1," + longer + b",2]") is None
    body, _ = parse(b'{"prompt": [1, ' + longer + b"]}")
    assert body["prompt"] == [1, int(longer)]  # decoded: the same prompt as before TokenIds
    with pytest.raises(RouteError) as refused:  # too long for any integer: refused as before
        parse(b'{"prompt": [1, ' + b"9" * 5000 + b"]}")
    assert refused.value.code == "INVALID_JSON"


@settings(max_examples=200)
@given(
    st.lists(st.integers(min_value=0, max_value=200_000), max_size=300),
    st.sampled_from([1, 2, 3, 16]),
    st.sampled_from(LAYOUTS),
)
def test_keys_of_ids_kept_as_text_are_those_of_the_list_and_chain_by_block(
    ids: list[int], block: int, layout: tuple[int | None, tuple[str, str] | None]
) -> None:
    indent, separators = layout
    body, plain = parse(json.dumps({"prompt": ids}, indent=indent, separators=separators).encode())
    keys = prefix_keys(body, block, ids_checked=True)
    assert plain
    assert keys == prefix_keys({"prompt": ids}, block) == prefix_keys({"prompt": [ids]}, block)
    assert len(keys) == min(len(ids) // block, MAX_CHUNKS)
    for blocks in range(len(keys) + 1):  # a key stands for its whole prefix, nothing after it
        assert prefix_keys({"prompt": ids[: blocks * block] + [7] * (block - 1)}, block) == keys[:blocks]
    if keys:  # any id of a whole block changes that block's key and every later one
        changed = [*ids]
        changed[len(keys) * block - 1] += 1
        assert prefix_keys({"prompt": changed}, block)[-1] != keys[-1]
        assert prefix_keys({"prompt": changed}, block)[:-1] == keys[:-1]


def test_a_prompt_kept_as_text_counts_and_is_sent_to_prefill_from_its_text() -> None:
    raw = b'{"model": "m", "prompt": [ 5, 6 ,\n7 ], "max_tokens": 9}'
    body, plain = parse(raw)
    ids = prompt_ids(body, ids_checked=True)
    assert isinstance(ids, TokenIds)
    assert len(ids) == 3
    sent = prefill_bytes(body, plain)
    assert b'"prompt":[5,6,7]' in sent  # the ids' text, compact whatever the client's layout
    assert json.loads(sent)["prompt"] == [5, 6, 7]
    assert json.loads(prefill_bytes(body, plain=False))["prompt"] == [5, 6, 7]  # the standard library's path too
    assert token_ids(ids.ids())


def test_blocks_that_differ_never_share_a_key_by_construction() -> None:
    """Python hashes an integer modulo 2^61 - 1, where bytes 61 apart weigh the same: a block's text read as one
    integer would key alike two blocks differing by +1 at one byte and -1 sixty-one bytes on. Not so here."""
    block = list(range(151000, 151016))  # 7 bytes an id: byte 0 is the first id's first digit, byte 61 the ninth's last
    text = ",".join(map(str, block)).encode()
    changed = [251000, *block[1:8], 151008 - 1, *block[9:]]
    changed_text = ",".join(map(str, changed)).encode()
    weight = int.from_bytes(changed_text, "little") - int.from_bytes(text, "little")
    assert weight % ((1 << 61) - 1) == 0  # an integer hash alone could not tell them apart
    assert prefix_keys({"prompt": changed}) != prefix_keys({"prompt": block})
    # the other modulus has no such short period over a chunk's bytes (any block size up to 16 KiB of text)
    weights = itertools.accumulate(range(1 << 14), lambda weight, _: weight * 256 % _MODULUS, initial=1)
    assert 1 not in itertools.islice(weights, 1, None)
    # nor does a text prompt of the same bytes as an id prompt's block (a text chunk is 4 bytes a token)
    as_text = "1000," + ",".join(["100"] * 15)
    ids = [1000, *[100] * 15]
    assert as_text.encode() == ",".join(map(str, ids)).encode()
    assert len(as_text.encode()) == 4 * 16
    assert prefix_keys({"prompt": as_text}) != prefix_keys({"prompt": ids})
