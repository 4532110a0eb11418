"""The digest's definition (core.digest, protocol kvbridge-digest/1), on its numpy reference: positions past the
request's tokens do not count, blocks combine by position, and every fault class the protocol names changes it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_agent.core.digest import block_digests, coefficients, mismatched, row_words


def words(layers: int = 2, kv: int = 2, positions: int = 32, heads: int = 4, width: int = 4, seed: int = 0
          ) -> np.ndarray:  # fmt: skip
    return np.random.default_rng(seed).integers(0, 2**32, size=(layers, kv, positions, heads, width)).astype(np.uint32)


def test_coefficients_are_odd_deterministic_and_distinct_per_axis() -> None:
    a = coefficients("word", 64)
    assert np.all(a & np.uint64(1))
    assert np.all(a < 2**32)  # row words are 32-bit
    assert np.array_equal(a, coefficients("word", 64))
    assert np.array_equal(coefficients("position", 8, start=4), coefficients("position", 12)[4:])
    assert len(set(a.tolist()) | set(coefficients("position", 64).tolist())) == 128


def test_rows_must_be_whole_words() -> None:
    assert row_words(128 * 2) == 64
    with pytest.raises(ValueError, match="whole number"):
        row_words(6)


def test_positions_past_the_tokens_do_not_count() -> None:
    w = words()
    d = block_digests(w, num_tokens=20, block_size=16)
    w[:, :, 20:] = np.uint32(12345)  # stale bytes in the last block's tail
    assert np.array_equal(d, block_digests(w, num_tokens=20, block_size=16))


@pytest.mark.parametrize(
    "fault",
    ["one word", "one bit", "blocks swapped", "heads swapped", "K and V swapped", "words of a row swapped",
     "layers swapped"],
)  # fmt: skip
def test_every_fault_class_changes_the_digest(fault: str) -> None:
    w = words()
    bad = w.copy()
    if fault == "one word":
        bad[1, 0, 5, 2, 3] += np.uint32(1)
    elif fault == "one bit":
        bad[0, 1, 17, 0, 0] ^= np.uint32(1 << 31)
    elif fault == "blocks swapped":
        bad[:, :, :16], bad[:, :, 16:] = w[:, :, 16:], w[:, :, :16]
    elif fault == "heads swapped":
        bad[..., 0, :], bad[..., 1, :] = w[..., 1, :], w[..., 0, :]
    elif fault == "K and V swapped":
        bad[:, 0], bad[:, 1] = w[:, 1], w[:, 0]
    elif fault == "words of a row swapped":
        bad[..., 0], bad[..., 1] = w[..., 1], w[..., 0]
    else:
        bad[0], bad[1] = w[1], w[0]
    want, got = block_digests(w, 32, 16), block_digests(bad, 32, 16)
    assert mismatched(dict(enumerate(want)), list(range(4)), got), fault


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
    """Combinable: digests at wire granularity summed over ``ratio`` wire blocks are the digest at the larger block
    size; layers digested separately (with their layer numbers) sum to the whole."""
    w = words(positions=64, seed=seed)
    fine = block_digests(w, num_tokens, block)
    coarse = block_digests(w, num_tokens, block * ratio)
    with np.errstate(over="ignore"):
        assert np.array_equal(fine.reshape(4, -1, ratio).sum(axis=2, dtype=np.uint64), coarse)
        parts = block_digests(w[:1], num_tokens, block) + block_digests(w[1:], num_tokens, block, first_layer=1)
    assert np.array_equal(parts, fine)


def test_a_missing_head_or_another_shape_mismatches_every_block() -> None:
    d = block_digests(words(), 32, 16)
    assert mismatched({0: d[0]}, [0, 1], d[:2]) == [0, 1]
    assert mismatched({0: d[0][:1]}, [0], d[:1]) == [0, 1]
    assert mismatched(dict(enumerate(d)), [0, 1, 2, 3], d) == []


def test_the_policy_verifies_all_none_or_a_warm_up_then_a_stable_sample() -> None:
    from kvbridge_agent.core import TransferSettings, Verification
    from kvbridge_agent.core.digest import sampled, should_verify

    ids = [f"req-{i}" for i in range(4000)]
    every = TransferSettings(verification=Verification.ALL)
    never = TransferSettings(verification=Verification.OFF)
    some = TransferSettings(verification=Verification.SAMPLED, verification_first_seconds=300,
                            verification_fraction=0.05)  # fmt: skip
    assert all(should_verify(every, i, 1e6) for i in ids)
    assert not any(should_verify(never, i, 0.0) for i in ids)
    assert all(should_verify(some, i, 299.0) for i in ids)  # the warm-up: every request
    later = [i for i in ids if should_verify(some, i, 301.0)]
    assert 0.035 < len(later) / len(ids) < 0.065  # about the fraction, chosen by id
    assert later == [i for i in ids if should_verify(some, i, 9e9)]  # the same ids every time (every rank agrees)
    assert sampled("x", 1.0)
    assert not any(sampled(i, 0.0) for i in ids)


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
