"""Property tests of the plan math against the brute-force byte model (docs/development.md, "Properties").

For random compatible prefill/decode pairs and random requests (partial last
blocks, prefix hits), every decode rank executes its plan as a real byte
copy between simulated memories, using the core's descriptor addresses and
ids.  Then, for every decode rank:

- each byte of the request's local blocks that holds prompt content is
  written exactly once, with the right byte from the right prefill head;
- no byte is written twice, and nothing outside the request's blocks;
- no descriptor crosses the end of a remote wire block or a local unit;
- the conversions the plan lists are exactly the ones needed: a side with
  none already holds its bytes in the wire format.

And across ranks: notification counts match the readers of each prefill
rank; MLA reads once per decode rank.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvbridge_agent.core import (
    Attention,
    CacheKind,
    IncompatibleError,
    KVCacheDtype,
    KVLayout,
    ModelGeometry,
    Role,
    RoleSettings,
    TransferPlan,
    build_plan,
    check_pair,
    descriptor_ids,
    map_request_blocks,
    unit_addresses,
    wire_block_ids,
)
from kvbridge_agent.core.compat import PROBLEM_CODES

from .byte_model import RankMemory, content_id, expand

SIZES = [1, 2, 3, 4, 6, 8]


@st.composite
def models(draw: st.DrawFn) -> ModelGeometry:
    mla = draw(st.booleans())
    return ModelGeometry(
        name="m",
        num_layers=draw(st.integers(1, 3)),
        num_kv_heads=1 if mla else draw(st.sampled_from([1, 2, 3, 4, 6, 8])),
        head_dim=draw(st.integers(1, 3)),
        kv_cache_dtype=draw(st.sampled_from(list(KVCacheDtype))),
        attention=Attention.MLA if mla else Attention.DENSE,
        cache_kind=CacheKind.SPLIT if mla else draw(st.sampled_from(list(CacheKind))),
    )


@st.composite
def roles(draw: st.DrawFn) -> RoleSettings:
    return RoleSettings(
        tensor_parallel_size=draw(st.sampled_from(SIZES)),
        block_size=draw(st.sampled_from(SIZES)),
        kv_layout=draw(st.sampled_from(list(KVLayout))),
    )


@st.composite
def compatible_plans(draw: st.DrawFn) -> TransferPlan:
    model, prefill, decode = draw(models()), draw(roles()), draw(roles())
    assume(not check_pair(model, prefill, decode))
    return build_plan(model, prefill, decode)


def _memory(plan: TransferPlan, role: Role, rank: int, num_blocks: int) -> RankMemory:
    settings = plan.prefill if role is Role.PREFILL else plan.decode
    return RankMemory(
        plan.model, settings.tensor_parallel_size, rank, settings.block_size, settings.kv_layout, num_blocks
    )


def _assert_within_units(addresses: np.ndarray, length: int, mem: RankMemory, unit: int, units_per_block: int) -> None:
    """No descriptor crosses the end of the (sub-)unit it starts in."""
    rel = addresses % mem.tensor_bytes
    in_block = rel % mem.stride
    region_start = np.where(in_block >= mem.unit, mem.unit, 0) if mem.stride != mem.unit else 0
    inside = in_block - region_start
    sub_bytes = unit // units_per_block
    assert np.all(inside // sub_bytes == (inside + length - 1) // sub_bytes)
    assert np.all(inside + length <= mem.unit)


@settings(max_examples=250, deadline=None)
@given(plan=compatible_plans(), data=st.data())
def test_every_decode_byte_written_once_from_the_right_place(plan: TransferPlan, data: st.DataObject) -> None:
    model, wire = plan.model, plan.wire
    tp_p, tp_d = plan.prefill.tensor_parallel_size, plan.decode.tensor_parallel_size
    bs_p, bs_d, bs_w = plan.prefill.block_size, plan.decode.block_size, wire.block_size
    num_tokens = data.draw(st.integers(1, 24), label="num_tokens")
    prefill_needed = -(-num_tokens // bs_p)
    decode_needed = -(-num_tokens // bs_d)
    num_blocks_p, num_blocks_d = prefill_needed + 2, decode_needed + 2
    prefill_blocks = data.draw(st.permutations(range(num_blocks_p)), label="prefill blocks")[:prefill_needed]
    decode_blocks = data.draw(st.permutations(range(num_blocks_d)), label="decode blocks")[:decode_needed]
    hit = data.draw(st.integers(0, decode_needed), label="prefix hit blocks")

    # Prefill computes the prompt in its native format, then converts to the wire format.
    prefill_memories = []
    for p in range(tp_p):
        mem = _memory(plan, Role.PREFILL, p, num_blocks_p)
        e = mem.elements(prefill_blocks, 0)
        ids = content_id(model, e, num_tokens)
        args = (e["layer"], e["kv"], e["local_head"], e["token"], e["dim"], e["byte"], e["block"])
        native = mem.address(*args, tokens_per_unit=bs_p, layout=mem.layout)
        wired = mem.address(*args, tokens_per_unit=bs_w, layout=wire.layout)
        if not wire.steps(Role.PREFILL):
            assert np.array_equal(native, wired), "prefill needs a conversion the plan does not list"
        buffer = np.zeros(mem.size, dtype=np.int64)
        buffer[wired] = ids
        prefill_memories.append((mem, buffer))

    offered = wire_block_ids(prefill_blocks, num_tokens, plan.split_ratio, bs_w)
    local = decode_blocks[hit:]
    readers: Counter[int] = Counter()
    for d in range(tp_d):
        rank_plan = plan.for_decode_rank(d)
        if model.is_mla:
            assert len(rank_plan.reads) == 1
        for p in {r.prefill_rank for r in rank_plan.reads} | set(rank_plan.notify_only_ranks):
            readers[p] += 1
        assert set(rank_plan.notify_only_ranks).isdisjoint(r.prefill_rank for r in rank_plan.reads)

        mem_d = _memory(plan, Role.DECODE, d, num_blocks_d)
        received = np.zeros(mem_d.size, dtype=np.int64)
        writes = np.zeros(mem_d.size, dtype=np.int64)
        mapped = map_request_blocks(local, offered, plan.block_size_ratio)
        assert mapped.local.size == mapped.remote.size
        assert mapped.full_hit == (len(local) == 0)
        for read in rank_plan.reads:
            mem_p, source = prefill_memories[read.prefill_rank]
            remote_all = unit_addresses(
                mem_p.bases,
                plan.prefill_layout,
                num_blocks_p,
                units_per_block=plan.split_ratio,
                offset=read.remote_offset,
                length=read.length,
            )
            local_all = unit_addresses(
                mem_d.bases,
                plan.decode_layout,
                num_blocks_d,
                units_per_block=plan.block_size_ratio,
                offset=read.local_offset,
                length=read.length,
            )
            regions = plan.decode_layout.num_regions
            assert regions == plan.prefill_layout.num_regions
            remote = remote_all[descriptor_ids(mapped.remote, regions, num_blocks_p * plan.split_ratio)]
            dest = local_all[descriptor_ids(mapped.local, regions, num_blocks_d * plan.block_size_ratio)]
            _assert_within_units(remote, read.length, mem_p, mem_p.unit, plan.split_ratio)
            _assert_within_units(dest, read.length, mem_d, mem_d.unit, plan.block_size_ratio)
            dst_bytes, src_bytes = expand(dest, read.length), expand(remote, read.length)
            received[dst_bytes] = source[src_bytes]
            np.add.at(writes, dst_bytes, 1)

        assert writes.max(initial=0) <= 1, "a decode byte was written twice"
        # What decode must hold before its own conversion: prompt content in the wire format.
        e = mem_d.elements(local, hit * bs_d)
        args = (e["layer"], e["kv"], e["local_head"], e["token"], e["dim"], e["byte"], e["block"])
        wired = mem_d.address(*args, tokens_per_unit=bs_w, layout=wire.layout)
        native = mem_d.address(*args, tokens_per_unit=bs_d, layout=mem_d.layout)
        if not wire.steps(Role.DECODE):
            assert np.array_equal(native, wired), "decode needs a conversion the plan does not list"
        expected = content_id(model, e, num_tokens)
        real = expected > 0
        assert np.array_equal(writes[wired[real]], np.ones(int(real.sum()), dtype=np.int64)), "content not written"
        assert np.array_equal(received[wired[real]], expected[real]), "wrong bytes"
        outside = np.ones(mem_d.size, dtype=bool)
        outside[wired] = False
        assert not writes[outside].any(), "bytes outside the request's blocks were written"

    waits = plan.notifications_per_prefill_rank
    assert dict(readers) == dict.fromkeys(range(tp_p), waits)


@settings(max_examples=300, deadline=None)
@given(model=models(), prefill=roles(), decode=roles())
def test_incompatible_pairs_raise_every_problem_with_a_known_code(
    model: ModelGeometry, prefill: RoleSettings, decode: RoleSettings
) -> None:
    problems = check_pair(model, prefill, decode)
    assume(problems)
    with pytest.raises(IncompatibleError) as caught:
        build_plan(model, prefill, decode)
    assert caught.value.problems == problems
    for problem in problems:
        assert problem.code in PROBLEM_CODES
        assert problem.field.startswith("spec.")
        assert problem.message


@settings(max_examples=300, deadline=None)
@given(model=models(), prefill=roles(), decode=roles(), claimed=st.integers(1, 1024))
def test_a_claimed_prefill_tp_is_accepted_exactly_when_the_verdict_pairs_it(
    model: ModelGeometry, prefill: RoleSettings, decode: RoleSettings, claimed: int
) -> None:
    """What a decode engine planned against ``prefill`` accepts as a peer's TP is the deployment's verdict with that
    TP, no wider: the planned TP of a compatible pair, a rollout's compatible mixed pair, nothing the verdict
    refuses (a claimed TP decides how many prefill ranks decode asks for)."""
    from kvbridge_agent.core.plan import PeerTensorParallel

    assume(not check_pair(model, prefill, decode))
    peer = PeerTensorParallel(model, prefill, decode, None)
    verdict = check_pair(model, prefill.model_copy(update={"tensor_parallel_size": claimed}), decode)
    assert (peer.refusal(claimed) == "") == (not verdict)
    if verdict:
        assert verdict[0].code in peer.refusal(claimed)
    assert peer.refusal(prefill.tensor_parallel_size) == ""
