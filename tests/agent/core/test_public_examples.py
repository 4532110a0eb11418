"""The worked public examples of docs/protocol.md §7, row by row."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge_agent.core import IncompatibleError, build_plan, descriptor_ids

from .conftest import dense, mla, role

# (prefill tp/bs/layout, decode tp/bs/layout, model, decode rank,
#  reads as (prefill rank, remote offset, local offset, length), notify-only, prefill waits for)
EXAMPLES = [
    ((1, 16, "HND"), (1, 16, "HND"), dense(8), 0, [(0, 0, 0, 32768)], [], 1),
    ((1, 16, "HND"), (2, 16, "HND"), dense(8), 1, [(0, 16384, 0, 16384)], [], 2),
    ((2, 16, "HND"), (1, 16, "HND"), dense(8), 0, [(0, 0, 0, 16384), (1, 0, 16384, 16384)], [], 1),
    ((1, 8, "HND"), (1, 16, "HND"), dense(8), 0, [(0, 0, 0, 16384)], [], 1),
    ((2, 16, "HND"), (1, 16, "HND"), mla(576), 0, [(0, 0, 0, 18432)], [1], 1),
    ((2, 32, "NHD"), (1, 16, "HND"), dense(8), 0, [(0, 0, 0, 16384), (1, 0, 16384, 16384)], [], 1),
]


@pytest.mark.parametrize(("prefill", "decode", "model", "rank", "reads", "notify_only", "waits"), EXAMPLES)
def test_worked_example(
    prefill: tuple[int, int, str],
    decode: tuple[int, int, str],
    model: object,
    rank: int,
    reads: list[tuple[int, int, int, int]],
    notify_only: list[int],
    waits: int,
) -> None:
    plan = build_plan(model, role(*prefill), role(*decode))  # type: ignore[arg-type]
    rank_plan = plan.for_decode_rank(rank)
    got = [(r.prefill_rank, r.remote_offset, r.local_offset, r.length) for r in rank_plan.reads]
    assert got == reads
    assert list(rank_plan.notify_only_ranks) == notify_only
    assert plan.notifications_per_prefill_rank == waits


def test_block_size_ratio_example_reports_bsr_2() -> None:
    plan = build_plan(dense(8), role(1, 8), role(1, 16))
    assert plan.block_size_ratio == 2
    assert [c.to_dict() for c in plan.wire.conversions] == [
        {"side": "decode", "kind": "MergeBlocks", "from": 8, "to": 16}
    ]


def test_prefill_split_and_permute_example() -> None:
    plan = build_plan(dense(8), role(2, 32, "NHD"), role(1, 16, "HND"))
    assert (plan.wire.block_size, plan.wire.layout.value) == (16, "HND")
    assert [c.to_dict() for c in plan.wire.conversions] == [
        {"side": "prefill", "kind": "SplitBlocks", "from": 32, "to": 16},
        {"side": "prefill", "kind": "Permute", "from": "NHD", "to": "HND"},
    ]
    assert plan.split_ratio == 2
    assert plan.remote_block_bytes == 16384
    assert not plan.wire.prefill_prefix_caching_allowed


def test_replicated_prefill_heads_example_is_incompatible() -> None:
    with pytest.raises(IncompatibleError) as caught:
        build_plan(dense(2), role(4), role(1))
    assert [p.code for p in caught.value.problems] == ["PREFILL_HEADS_REPLICATED"]
    assert caught.value.problems[0].field == "spec.prefill.tensorParallelSize"


def test_descriptor_id_example() -> None:
    ids = descriptor_ids(np.array([1, 5, 10, 20]), num_regions=4, units_per_region=64)
    assert ids.tolist() == [1, 5, 10, 20, 65, 69, 74, 84, 129, 133, 138, 148, 193, 197, 202, 212]
