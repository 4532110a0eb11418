"""The digest's definition (core.digest, protocol kvbridge-digest/2), on its numpy reference: keyed coefficients in
the field, positions past the request's tokens do not count, blocks and layers combine, and every corruption —
structured ones above all (sign bits flipped in pairs, in a row, in a block; rows, heads, K/V or blocks swapped; a
block replaced by another's; a layer zeroed; any single bit) — changes it. The old construction
(kvbridge-digest/1, kept here) misses the sign-bit pairs, so these tests can fail. And the verification policy:
a secret draw per request, which a client's choice of request ids cannot steer."""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import TransferSettings, Verification
from kvbridge_agent.core.digest import (
    KEY_BYTES,
    LANES,
    MISS_PROBABILITY,
    PRIME,
    SEGMENT_UNITS,
    VerificationPolicy,
    block_digests,
    coefficients,
    combine,
    decode_verifies,
    mismatched,
    new_key,
    pack,
    row_coefficients,
    row_units,
    segments,
    should_verify,
    unpack,
)

KEY = bytes(range(KEY_BYTES))  # a fixed test key: every structured corruption below must be caught under it
LAYERS, KV, POSITIONS, HEADS, WIDTH, BLOCK = 2, 2, 32, 4, 8, 16
Units = npt.NDArray[np.int16]


def content(seed: int = 0, positions: int = POSITIONS) -> Units:
    """``[layers, kv, positions, heads, width]`` random 16-bit units (the bytes of bf16 rows, say)."""
    rng = np.random.default_rng(seed)
    return rng.integers(-(2**15), 2**15, size=(LAYERS, KV, positions, HEADS, WIDTH)).astype(np.int16)


def caught(good: Units, bad: Units, key: bytes = KEY, num_tokens: int = POSITIONS) -> bool:
    """Whether decode, holding ``bad``, finds a mismatch with prefill's digest of ``good``."""
    want, got = block_digests(good, num_tokens, BLOCK, key), block_digests(bad, num_tokens, BLOCK, key)
    return bool(mismatched(dict(enumerate(want)), list(range(HEADS)), got))


def words(units: Units) -> npt.NDArray[np.uint32]:
    """The same memory as little-endian 32-bit words (a view: writing it writes ``units``)."""
    return units.view(np.uint32)


# -- the old construction (kvbridge-digest/1), to show what the new one catches -------------------------------------
def old_digests(units: Units, num_tokens: int, block_size: int) -> npt.NDArray[np.uint64]:
    """kvbridge-digest/1: a linear form mod 2**32 over 32-bit words, odd public coefficients, then mod 2**64."""

    def odd(seed: int, count: int) -> npt.NDArray[np.uint64]:
        values = [int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:8], "little") for i in range(count)]
        return np.array(values, dtype=np.uint64) | np.uint64(1)

    w = words(units)
    layers, kv, positions, heads, width = w.shape
    a = odd(1, width) & np.uint64(0xFFFFFFFF)
    b = odd(2, layers * kv).reshape(layers, kv)
    p = odd(3, positions)
    p[num_tokens:] = 0
    with np.errstate(over="ignore"):
        rows32 = (w * a.astype(np.uint32)).sum(axis=-1, dtype=np.uint32)
        rows = rows32.view(np.int32).astype(np.int64).view(np.uint64)
        weighted = (rows * b[:, :, None, None] * p[None, None, :, None]).sum(axis=(0, 1), dtype=np.uint64)
        blocks = weighted.reshape(positions // block_size, block_size, heads).sum(axis=1, dtype=np.uint64)
    return np.ascontiguousarray(blocks.T)


def test_the_old_construction_misses_sign_bits_flipped_in_pairs_and_the_new_one_does_not() -> None:
    """Two words of a row each changed by 2**31: ``2**31 * odd = 2**31 (mod 2**32)``, the two cancel."""
    good = content()
    bad = good.copy()
    words(bad)[1, 0, 5, 2, 0] ^= np.uint32(1 << 31)
    words(bad)[1, 0, 5, 2, 3] ^= np.uint32(1 << 31)
    assert np.array_equal(old_digests(good, POSITIONS, BLOCK), old_digests(bad, POSITIONS, BLOCK)), "missed"
    assert caught(good, bad)
    whole_block = good.copy()  # every word of a block, all heads
    words(whole_block)[:, :, :BLOCK] ^= np.uint32(1 << 31)
    assert np.array_equal(old_digests(good, POSITIONS, BLOCK), old_digests(whole_block, POSITIONS, BLOCK))
    assert caught(good, whole_block)


# -- coefficients and the field -------------------------------------------------------------------------------------
def test_coefficients_are_keyed_in_the_field_and_extend() -> None:
    a = coefficients(KEY, "row", 64)
    assert a.shape == (64, LANES)
    assert a.dtype == np.int64
    assert (a >= 0).all()
    assert (a < PRIME).all()
    assert np.array_equal(a, coefficients(KEY, "row", 64))  # deterministic: prefill and decode agree
    assert np.array_equal(coefficients(KEY, "position", 12)[:8], coefficients(KEY, "position", 8))
    assert not np.array_equal(a, coefficients(new_key(), "row", 64))  # another key, other coefficients
    assert not np.array_equal(a, coefficients(KEY, "position", 64))  # each axis its own stream
    assert len(set(a.ravel().tolist())) == a.size
    with pytest.raises(ValueError, match="32 bytes"):
        coefficients(b"short", "row", 4)
    assert len(new_key()) == KEY_BYTES
    assert new_key() != new_key()


def test_the_bound_is_below_two_to_the_minus_32() -> None:
    assert MISS_PROBABILITY < 2**-58


def test_rows_are_whole_units_and_segments_keep_float64_sums_exact() -> None:
    assert row_units(128 * 2) == 128
    with pytest.raises(ValueError, match="whole number"):
        row_units(7)
    for width in range(1, 2049):
        count, units = segments(width)
        assert count * units == width
        assert units <= SEGMENT_UNITS
    assert segments(128) == (1, 128)
    assert segments(576) == (6, 96)
    # the bound: |x| <= 2**15 and centred coefficients below 2**30, SEGMENT_UNITS of them, stay below 2**52
    c = row_coefficients(KEY, 576, 4)
    assert np.abs(c).max() < 2**30
    assert SEGMENT_UNITS * 2**15 * 2**30 <= 2**52
    a, b = coefficients(KEY, "row", 576), coefficients(KEY, "layer_kv", 4)
    assert np.array_equal(np.mod(c.astype(np.int64), PRIME), (b[:, :, None] * a.T[None]) % PRIME)


def test_lanes_pack_into_64_bits_and_back() -> None:
    lanes = np.array([[0, PRIME - 1], [123, 456]], dtype=np.int64)
    assert np.array_equal(unpack(pack(lanes)), lanes)
    assert int(pack(lanes)[1]) == 123 + (456 << 32)


# -- what is and is not content -------------------------------------------------------------------------------------
def test_positions_past_the_tokens_do_not_count() -> None:
    w = content()
    d = block_digests(w, 20, BLOCK, KEY)
    w[:, :, 20:] = 12345  # stale bytes in the last block's tail
    assert np.array_equal(d, block_digests(w, 20, BLOCK, KEY))
    w[:, :, 19, 0, 0] += 1  # the last counted position does count
    assert not np.array_equal(d, block_digests(w, 20, BLOCK, KEY))


STRUCTURED = (
    "sign bits of two words of a row",
    "sign bits of two words in two rows",
    "sign bit of every word of a row",
    "sign bit of every word of a block",
    "every word plus 2**31",
    "two rows swapped",
    "two heads swapped",
    "K and V swapped",
    "two blocks swapped",
    "a block replaced by another's",
    "a layer zeroed",
    "two units of a row swapped",
)


def corrupt(good: Units, kind: str, rng: np.random.Generator) -> Units:
    """``good`` with one structured corruption at places ``rng`` picks."""
    bad = good.copy()
    w = words(bad)
    layer, kv, head = (int(rng.integers(n)) for n in (LAYERS, KV, HEADS))
    t, u = (int(x) for x in rng.choice(POSITIONS, 2, replace=False))
    i, j = (int(x) for x in rng.choice(WIDTH // 2, 2, replace=False))
    block = int(rng.integers(POSITIONS // BLOCK))
    blocks = slice(block * BLOCK, (block + 1) * BLOCK)
    other = slice((1 - block) * BLOCK, (2 - block) * BLOCK)
    sign = np.uint32(1 << 31)
    if kind == "sign bits of two words of a row":
        w[layer, kv, t, head, i] ^= sign
        w[layer, kv, t, head, j] ^= sign
    elif kind == "sign bits of two words in two rows":
        w[layer, kv, t, head, i] ^= sign
        w[LAYERS - 1 - layer, 1 - kv, u, head, j] ^= sign
    elif kind == "sign bit of every word of a row":
        w[layer, kv, t, head] ^= sign
    elif kind == "sign bit of every word of a block":
        w[:, :, blocks] ^= sign
    elif kind == "every word plus 2**31":
        w += sign
    elif kind == "two rows swapped":
        bad[layer, kv, t, head], bad[layer, kv, u, head] = good[layer, kv, u, head], good[layer, kv, t, head]
    elif kind == "two heads swapped":
        bad[..., head, :], bad[..., (head + 1) % HEADS, :] = good[..., (head + 1) % HEADS, :], good[..., head, :]
    elif kind == "K and V swapped":
        bad[layer, 0], bad[layer, 1] = good[layer, 1], good[layer, 0]
    elif kind == "two blocks swapped":
        bad[:, :, blocks], bad[:, :, other] = good[:, :, other], good[:, :, blocks]
    elif kind == "a block replaced by another's":
        bad[:, :, blocks] = good[:, :, other]
    elif kind == "a layer zeroed":
        bad[layer] = 0
    else:
        bad[..., 2 * i], bad[..., 2 * j] = good[..., 2 * j], good[..., 2 * i]
    return bad


@pytest.mark.parametrize("kind", STRUCTURED)
def test_each_structured_corruption_is_caught_under_the_test_key(kind: str) -> None:
    for seed in range(8):
        good = content(seed)
        bad = corrupt(good, kind, np.random.default_rng(seed))
        assert not np.array_equal(good, bad)
        assert caught(good, bad), (kind, seed)


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(STRUCTURED), seed=st.integers(0, 2**32 - 1), key=st.binary(min_size=32, max_size=32))
def test_structured_corruptions_are_caught_under_any_key(kind: str, seed: int, key: bytes) -> None:
    good = content(seed % 1000)
    bad = corrupt(good, kind, np.random.default_rng(seed))
    assume(not np.array_equal(good, bad))
    assert caught(good, bad, key)


@pytest.mark.parametrize("bit", range(32))
def test_a_single_bit_flip_at_every_position_of_a_word_is_caught(bit: int) -> None:
    good = content(bit)
    for layer, kv, t, head, word in [
        (0, 0, 0, 0, 0),
        (1, 1, POSITIONS - 1, HEADS - 1, WIDTH // 2 - 1),
        (1, 0, 17, 2, 1),
    ]:
        bad = good.copy()
        words(bad)[layer, kv, t, head, word] ^= np.uint32(1 << bit)
        assert caught(good, bad), (bit, layer, kv, t, head, word)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), changes=st.integers(1, 64), key=st.binary(min_size=32, max_size=32))
def test_random_changes_are_caught(seed: int, changes: int, key: bytes) -> None:
    """Any set of units changed to any values (the unstructured case)."""
    rng = np.random.default_rng(seed)
    good = content(seed % 1000)
    bad = good.copy()
    flat = bad.reshape(-1)
    where = rng.choice(flat.size, changes, replace=False)
    flat[where] = rng.integers(-(2**15), 2**15, changes).astype(np.int16)
    assume(not np.array_equal(good, bad))
    assert caught(good, bad, key)


def test_a_mismatch_names_the_blocks_it_is_in() -> None:
    good = content()
    bad = good.copy()
    words(bad)[0, 1, BLOCK + 3, 1, 2] ^= np.uint32(1 << 31)
    want, got = block_digests(good, POSITIONS, BLOCK, KEY), block_digests(bad, POSITIONS, BLOCK, KEY)
    assert mismatched(dict(enumerate(want)), list(range(HEADS)), got) == [1]


# -- combinable: blocks and layers ----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(1, 64),
    block=st.sampled_from([4, 8, 16]),
    ratio=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_a_larger_block_is_the_sum_of_its_wire_blocks_and_layers_combine(
    num_tokens: int, block: int, ratio: int, seed: int
) -> None:
    """Combinable: digests at wire granularity summed (mod p, lane by lane) over ``ratio`` wire blocks are the
    digest at the larger block size; layers digested separately (with their layer numbers) sum to the whole."""
    w = content(seed, positions=64)
    fine = block_digests(w, num_tokens, block, KEY)
    coarse = block_digests(w, num_tokens, block * ratio, KEY)
    parts = fine.reshape(HEADS, -1, ratio)
    assert np.array_equal(combine([parts[:, :, r] for r in range(ratio)]), coarse)
    layers = [block_digests(w[:1], num_tokens, block, KEY), block_digests(w[1:], num_tokens, block, KEY, first_layer=1)]
    assert np.array_equal(combine(layers), fine)


def test_a_missing_head_or_another_shape_mismatches_every_block() -> None:
    d = block_digests(content(), POSITIONS, BLOCK, KEY)
    assert mismatched({0: d[0]}, [0, 1], d[:2]) == [0, 1]
    assert mismatched({0: d[0][:1]}, [0], d[:1]) == [0, 1]
    assert mismatched(dict(enumerate(d)), [0, 1, 2, 3], d) == []


# -- the policy -----------------------------------------------------------------------------------------------------
EVERY = TransferSettings(verification=Verification.ALL)
NEVER = TransferSettings(verification=Verification.OFF)
SOME = TransferSettings(verification=Verification.SAMPLED, verification_first_seconds=300, verification_fraction=0.05)


def test_the_policy_verifies_all_none_or_a_warm_up_then_a_drawn_sample() -> None:
    draws = [i / 1000 for i in range(1000)]
    assert all(should_verify(EVERY, 1e6, d) for d in draws)
    assert not any(should_verify(NEVER, 0.0, d) for d in draws)
    assert all(should_verify(SOME, 299.0, d) for d in draws)  # the warm-up: every request
    assert sum(should_verify(SOME, 301.0, d) for d in draws) == 50  # then the draws below the fraction
    assert not should_verify(SOME.model_copy(update={"verification_fraction": 0.0}), 301.0, 0.0)
    assert should_verify(SOME.model_copy(update={"verification_fraction": 1.0}), 301.0, 0.999)
    scripted = iter([0.01, 0.5])
    after = VerificationPolicy(SOME.model_copy(update={"verification_first_seconds": 0}), draw=lambda: next(scripted))
    assert [after.decide(), after.decide()] == [True, False]


def old_sampled(request_id: str, fraction: float) -> bool:
    """The old decision: a hash of the request id alone (the id comes from the client, X-Request-Id)."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little") / 2**64 < fraction


def test_request_ids_a_client_chose_to_avoid_sampling_are_sampled_all_the_same() -> None:
    """A client that picks ids the old hash never sampled (or sends one id again and again) is verified at the
    sample's rate: the decision is a secret draw per request, and the id does not enter it."""
    chosen = [f"req-{i}" for i in range(20000) if not old_sampled(f"req-{i}", 0.05)][:4000]
    assert not any(old_sampled(i, 0.05) for i in chosen)  # under the old decision: never verified
    policy = VerificationPolicy(SOME.model_copy(update={"verification_first_seconds": 0}))
    verified = sum(policy.decide() for _ in chosen)  # one decision per request; nothing of the id enters it
    assert 120 <= verified <= 280, verified  # 5 % of 4000 = 200 (sd 14): the client avoided nothing
    again = sum(policy.decide() for _ in range(4000))  # one id, offered 4000 times
    assert 120 <= again <= 280, again


def test_decode_verifies_what_prefill_digested_and_everything_under_all() -> None:
    assert decode_verifies(SOME, True)
    assert decode_verifies(NEVER, True)
    assert not decode_verifies(SOME, False)
    assert not decode_verifies(NEVER, False)
    assert decode_verifies(EVERY, False)  # decode's own policy: All requires it whatever prefill decided


def test_digests_round_trip_through_bytes_and_refuse_ragged_data() -> None:
    from kvbridge_agent.core.digest import from_bytes, to_bytes

    digests = {2: np.array([1, 2**64 - 1], dtype=np.uint64), 0: np.array([7, 8], dtype=np.uint64)}
    heads, data = to_bytes(digests)
    assert heads == [0, 2]
    back = from_bytes(heads, data)
    assert {h: r.tolist() for h, r in back.items()} == {h: r.tolist() for h, r in digests.items()}
    with pytest.raises(ValueError, match="not 2 rows"):
        from_bytes([0, 2], data[:-8])
    with pytest.raises(ValueError, match="without heads"):
        from_bytes([], b"x")
