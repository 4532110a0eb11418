"""The digest on the cache's device on real transfers (real NIXL on DRAM, in one process): prefill digests what it
computed, decode what it holds after its READs and conversions, and they agree for every TP pair, cache kind, layout and
block-size conversion of the transfer matrix; each injected fault is caught (KV_DIGEST_MISMATCH, the bad blocks
named) and, with verification off, the same fault leaves wrong bytes that decode would have used."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import CacheKind, ModelGeometry, Role, TransferPlan
from kvbridge_agent.core.blocks import blocks_for_tokens
from kvbridge_agent.core.digest import (
    KV_DIGEST_MISMATCH,
    LANES,
    PRIME,
    SEGMENT_UNITS,
    block_digests,
    coefficient_products,
    finish,
    key_stream,
    row_coefficients,
    stream_lanes,
    weighted_blocks,
)
from kvbridge_agent.synthetic.content import fill_request
from kvbridge_agent.transfer.digest import Digester, by_position
from kvbridge_agent.transfer.digest_kernel import compiled, compiled_finish, finish_sums, row_coefficients_of
from kvbridge_agent.transfer.kv_cache import KVCache
from kvbridge_agent.transfer.kv_view import logical_layer
from kvbridge_agent.transfer.relayout import convert_for_side

from .harness import CASES, InProcessPair, model, role, scattered

TOKENS = 45  # two full 16-token blocks and a partial one


def blocks(pair: InProcessPair, tokens: int, offset: int) -> tuple[list[int], list[int]]:
    bs_p, bs_d = pair.prefill_settings.block_size, pair.decode_settings.block_size
    return (
        scattered(pair.num_blocks, offset)[: blocks_for_tokens(tokens, bs_p)],
        scattered(pair.num_blocks, offset + 1)[: blocks_for_tokens(tokens, bs_d)],
    )


KEY = bytes(range(32))


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 4),
    size=st.sampled_from([1, 2, 16, 32]),
    blocks=st.integers(1, 5),
    head_major=st.booleans(),
    data=st.data(),
)
def test_the_compiled_finish_equals_the_reference(
    heads: int, size: int, blocks: int, head_major: bool, data: st.DataObject
) -> None:
    """The key's coefficients and the totals' last steps (weights by position, sums per wire block, packing), compiled
    and run as Python, against ``core.digest``'s numpy forms: any key, totals of either sign up to ``2**53``, any token
    count inside the blocks and any wire block size dividing the block's."""
    passes = compiled_finish()
    assert passes is not None, "numba is part of the agent's dependencies"
    key = data.draw(st.binary(min_size=32, max_size=32))
    width, groups = data.draw(st.sampled_from([1, 8, 64, 256])), data.draw(st.integers(1, 6))
    coef = np.empty((groups, LANES, width))
    for make in (passes.coefficients, row_coefficients_of):
        make(key_stream(key, "row", width), key_stream(key, "layer_kv", groups), coef)
        assert np.array_equal(coef, row_coefficients(key, width, groups))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    bound = data.draw(st.sampled_from([PRIME, 2**40, 2**53 - 1]))
    shape = (blocks, heads, size, LANES) if head_major else (blocks, size, heads, LANES)
    total = rng.integers(-bound, bound, shape, endpoint=True).astype(np.float64)
    tokens = data.draw(st.integers((blocks - 1) * size + 1, blocks * size))
    wire = data.draw(st.sampled_from([w for w in (1, 2, 4, 16, 32) if size % w == 0]))
    want = finish(by_position(total, head_major), key, tokens, wire)[:, : -(-tokens // wire)]
    for run in (passes.finish, finish_sums):
        got = np.zeros(want.shape, dtype=np.uint64)
        run(total, head_major, key_stream(key, "position", tokens), tokens, wire, got)
        assert np.array_equal(got, want)


#: totals the folds must get right at their edges: zero, multiples of p and their neighbours, the largest exact ones
EDGE_TOTALS = [
    0,
    1,
    PRIME - 1,
    PRIME,
    PRIME + 1,
    2 * PRIME,
    3 * PRIME,
    2**31,
    2**32,
    (2**53 // PRIME) * PRIME,
    2**53 - 1,
]
#: stream values the folds must get right: zero, multiples of p and their neighbours, the largest 64-bit ones
EDGE_STREAM = [0, 1, PRIME - 1, PRIME, PRIME + 1, 2 * PRIME, (2**64 // PRIME) * PRIME, 2**63, 2**64 - 1]


@settings(max_examples=40, deadline=None)
@given(data=st.data(), head_major=st.booleans(), wire=st.sampled_from([1, 2, 4]))
def test_the_compiled_finish_is_exact_at_the_folds_edges(data: st.DataObject, head_major: bool, wire: int) -> None:
    """Totals of either sign that are multiples of ``p``, next to them or the largest exact ones, and key streams of
    such values (which a SHAKE output all but never is): compiled and as Python, both loops give ``core.digest``'s
    values from the same streams (``coefficient_products``, ``weighted_blocks``)."""
    passes = compiled_finish()
    assert passes is not None, "numba is part of the agent's dependencies"
    edge = st.sampled_from(EDGE_STREAM)
    row = np.array(data.draw(st.lists(edge, min_size=2 * 4, max_size=2 * 4)), dtype=np.uint64)
    layer_kv = np.array(data.draw(st.lists(edge, min_size=2 * 3, max_size=2 * 3)), dtype=np.uint64)
    want_coef = coefficient_products(stream_lanes(row), stream_lanes(layer_kv))
    for make in (passes.coefficients, row_coefficients_of):
        coef = np.empty((3, LANES, 4))
        make(row, layer_kv, coef)
        assert np.array_equal(coef, want_coef)
    blocks, size, heads = 2, 4, 2
    sign = st.sampled_from([1, -1])
    values = data.draw(
        st.lists(st.tuples(st.sampled_from(EDGE_TOTALS), sign), min_size=16 * LANES, max_size=16 * LANES)
    )
    shape = (blocks, heads, size, LANES) if head_major else (blocks, size, heads, LANES)
    total = np.array([v * s for v, s in values], dtype=np.float64).reshape(shape)
    tokens = data.draw(st.integers(1, blocks * size))
    position = np.array(data.draw(st.lists(edge, min_size=LANES * tokens, max_size=LANES * tokens)), dtype=np.uint64)
    want = weighted_blocks(by_position(total, head_major), stream_lanes(position), wire)[:, : -(-tokens // wire)]
    for run in (passes.finish, finish_sums):
        got = np.zeros(want.shape, dtype=np.uint64)
        run(total, head_major, position, tokens, wire, got)
        assert np.array_equal(got, want)


@pytest.mark.parametrize("compiled_cpu", [True, False], ids=["numba", "torch"])
@pytest.mark.parametrize(
    ("kind", "layout", "mla"),
    [
        (CacheKind.SPLIT, "HND", False),
        (CacheKind.SPLIT, "NHD", False),
        (CacheKind.BLOCKS_FIRST, "HND", False),
        (CacheKind.BLOCKS_FIRST, "NHD", False),
        (CacheKind.CROSS_LAYER, "HND", False),
        (CacheKind.SPLIT, "HND", True),
    ],
)
def test_the_device_form_equals_the_reference(kind: CacheKind, layout: str, mla: bool, compiled_cpu: bool) -> None:
    """Both CPU forms (the compiled pass and torch's) on the blocks as they lie, and through a logical view, equal
    the reference over the logical content."""
    geometry = model(kind, mla=mla)
    cache = KVCache.allocate(geometry, 16, role(1, 16, layout).kv_layout, 1, 0, 8)
    for tensor in cache.tensors:
        tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8))
    ids = [5, 2, 7]
    got = Digester(cache, compiled_cpu=compiled_cpu).request(KEY, ids, 40, 8)
    kv, heads = (1, 1) if mla else (2, geometry.num_kv_heads)
    logical = torch.stack([logical_layer(cache, torch.tensor(ids), layer) for layer in range(2)])
    # [layers, n, kv, bs, heads, row] -> [layers, kv, positions, heads, units]
    units = logical.transpose(1, 2).reshape(2, kv, 3 * 16, heads, -1).contiguous().view(torch.int16).numpy()
    want = block_digests(units, 40, 8, KEY, kv_count=kv)[:, :5]
    assert np.array_equal(got, want)
    generic = Digester(cache, logical_layer, compiled_cpu=compiled_cpu)  # the logical path too
    assert np.array_equal(generic.request(KEY, ids, 40, 8), want)
    assert not np.array_equal(Digester(cache).request(bytes(32), ids, 40, 8), want)  # another key, other values


@pytest.mark.parametrize("compiled_cpu", [True, False], ids=["numba", "torch"])
@pytest.mark.parametrize(("head_dim", "dtype"), [(160, "bfloat16"), (288, "bfloat16"), (96, "float32")])
@pytest.mark.parametrize("fill", ["extremes", "random"])
def test_wide_rows_and_extreme_units_equal_the_reference(
    head_dim: int, dtype: str, fill: str, compiled_cpu: bool
) -> None:
    """Rows of several segments (160 and 288 units: 2 x 80, 3 x 96; float32 rows of 192 units: 2 x 96) and units
    at the ends of their range, where float64 sums come nearest their exact bound."""
    geometry = ModelGeometry(
        name="wide", num_layers=3, num_kv_heads=2, head_dim=head_dim, kv_cache_dtype=dtype, cache_kind=CacheKind.SPLIT
    )
    cache = KVCache.allocate(geometry, 8, role(1, 8).kv_layout, 1, 0, 6)
    for tensor in cache.tensors:
        if fill == "extremes":  # -32768 and 32767 in runs, so that products of one sign line up
            units = torch.where(torch.rand(tensor.numel() // 2) < 0.5, -(2**15), 2**15 - 1).to(torch.int16)
            tensor.copy_(units.view(torch.uint8))
        else:
            tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8))
    ids = [4, 1]
    got = Digester(cache, compiled_cpu=compiled_cpu).request(KEY, ids, 13, 8)
    logical = torch.stack([logical_layer(cache, torch.tensor(ids), layer) for layer in range(3)])
    rows = logical.transpose(1, 2).reshape(3, 2, 16, 2, -1).contiguous().view(torch.int16).numpy()
    assert np.array_equal(got, block_digests(rows, 13, 8, KEY))


def test_the_compiled_pass_is_exact_at_the_bound() -> None:
    """A segment of SEGMENT_UNITS units of -2**15 against coefficients of -(p - 1) / 2: the largest sum there is
    (just under 2**52), still exact, and reduced to the right residue."""
    kernel = compiled()
    assert kernel is not None, "numba is part of the agent's dependencies"
    units = np.full((1, 1, 1, 1, SEGMENT_UNITS), -(2**15), dtype=np.int16)
    coef = np.full((1, LANES, 1, SEGMENT_UNITS), -float((PRIME - 1) // 2))
    total = np.zeros((1, 1, 1, LANES))
    kernel(total, units, np.zeros(1, dtype=np.int64), coef)
    exact = SEGMENT_UNITS * 2**15 * ((PRIME - 1) // 2)
    assert exact > 2**51
    assert [int(v) % PRIME for v in total.ravel()] == [exact % PRIME] * LANES


@pytest.mark.parametrize("hit", [0, 1])
def test_prefill_and_decode_digests_agree_across_the_matrix(pair: InProcessPair, hit: int) -> None:
    request = f"agree-{hit}"
    prefill_blocks, decode_blocks = blocks(pair, TOKENS, 3 + hit)
    params = pair.offer(request, TOKENS, prefill_blocks, digest=True)
    heads = pair.model.num_kv_heads
    assert sorted(pair.digests[request].heads) == list(range(heads))  # every global head published by some rank
    results = pair.read(params, decode_blocks, min(hit, len(decode_blocks) - 1), verify=True)
    for d, result in results.items():
        assert result.ok, (d, result.code, result.message)
        assert pair.verify(d, request, decode_blocks, TOKENS) == []
    pair.poll_prefill()


FAULTS = ("bytes flipped after publish", "a wrong block id", "blocks freed and reused before the read")


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize(
    "case",
    [
        "dense-2to1",
        "dense-1to2",
        "bsr2-decode-merges",
        "mla-2to1",
        "prefill-splits-32nhd-tp2-to-16hnd-tp1",
        "cross-layer-1to4",
    ],
)
def test_each_fault_is_caught_and_without_verification_decode_holds_wrong_bytes(case: str, fault: str) -> None:
    pair = InProcessPair(*CASES[case])
    try:
        for verify in (True, False):
            request = f"fault-{verify}"
            prefill_blocks, decode_blocks = blocks(pair, TOKENS, 5 if verify else 9)
            params = pair.offer(request, TOKENS, prefill_blocks, digest=True)
            if fault == "bytes flipped after publish":
                for rank in pair.prefill:
                    rank.cache.bytes_view(0)[prefill_blocks[1]][7] ^= 0x10
            elif fault == "a wrong block id":
                spare = next(b for b in range(pair.num_blocks) if b not in prefill_blocks)
                ids = list(params.remote_block_ids)
                ids[0] = spare * pair.plan.split_ratio
                params = params.model_copy(update={"remote_block_ids": ids})
            else:  # the lease ran out, prefill freed the blocks and another request's KV now fills them
                for rank in pair.prefill:
                    fill_request(rank.cache, "another-request", prefill_blocks)
                    convert_for_side(rank.cache, pair.plan, Role.PREFILL, prefill_blocks)
            results = pair.read(params, decode_blocks, 0, verify=verify)
            pair.poll_prefill()
            wrong = {d: pair.verify(d, request, decode_blocks, TOKENS) for d in results}
            assert any(wrong.values()), "the fault must leave wrong bytes, or this test cannot fail"
            for d, result in results.items():
                if verify and wrong[d]:
                    assert (result.ok, result.code) == (False, KV_DIGEST_MISMATCH), (d, result)
                    assert set(wrong[d]) <= set(result.invalid_blocks), "every wrong block is named"
                if verify and not wrong[d]:
                    assert result.ok, (d, result)  # no false alarm on the ranks the fault did not touch
                if not verify:
                    assert result.ok  # the negative control: unverified, the wrong bytes pass as KV
    finally:
        pair.close()


@pytest.mark.parametrize("broken", ["heads swapped", "K and V swapped"])
def test_a_broken_conversion_is_caught(broken: str) -> None:
    """A decode-side merge that misplaces a head slice or swaps K and V in one block."""

    def convert(cache: KVCache, plan: TransferPlan, side: Role, block_ids: list[int]) -> bool:
        done = convert_for_side(cache, plan, side, block_ids)
        if side is Role.DECODE and block_ids:
            b = block_ids[0]
            k, v = cache.bytes_view(0).view(cache.num_blocks, -1), cache.bytes_view(1).view(cache.num_blocks, -1)
            if broken == "K and V swapped":
                saved = k[b].clone()
                k[b] = v[b]
                v[b] = saved
            else:  # HND: the first head's bytes of the block exchanged with the second's
                half = k.shape[1] // cache.heads_local
                first = k[b, :half].clone()
                k[b, :half] = k[b, half : 2 * half]
                k[b, half : 2 * half] = first
        return done

    pair = InProcessPair(*CASES["bsr2-decode-merges"])
    try:
        pair.decode[0].convert = convert
        prefill_blocks, decode_blocks = blocks(pair, TOKENS, 2)
        params = pair.offer("broken", TOKENS, prefill_blocks, digest=True)
        result = pair.read(params, decode_blocks, 0, verify=True)[0]
        assert (result.ok, result.code) == (False, KV_DIGEST_MISMATCH)
        assert decode_blocks[0] in result.invalid_blocks
    finally:
        pair.close()


def test_each_request_digest_reports_its_duration_once() -> None:
    cache = KVCache.allocate(model(CacheKind.SPLIT), 16, role(1, 16, "HND").kv_layout, 1, 0, 8)
    digester = Digester(cache)
    assert digester.take_seconds() == []
    for _ in range(3):
        digester.request(KEY, [1, 2], 20, 16)
    taken = digester.take_seconds()
    assert len(taken) == 3
    assert all(0 < s < 5 for s in taken)
    assert digester.take_seconds() == []
