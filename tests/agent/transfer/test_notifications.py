"""Prefill keeps a request until every expected reader notified it (docs/protocol.md §3, §6)."""

from __future__ import annotations

from kvbridge_agent.core import KVLayout, ModelGeometry, RoleSettings

from .harness import InProcessPair

MODEL = ModelGeometry(name="tiny", num_layers=2, num_kv_heads=8, head_dim=16)


def test_prefill_waits_for_every_decode_rank_that_reads_it() -> None:
    pair = InProcessPair(MODEL, RoleSettings(tensor_parallel_size=1), RoleSettings(tensor_parallel_size=2))
    try:
        params = pair.offer("req", 40, [5, 9, 2])
        first = pair.read(params, [1, 3, 7], 0, ranks=[0])
        assert first[0].ok
        for _ in range(20):
            pair.poll_prefill()
        assert pair.prefill[0].pending == ["req"]  # one of two readers notified
        assert pair.completed.get(0, []) == []
        second = pair.read(params, [1, 3, 7], 0, ranks=[1])
        assert second[1].ok
        for _ in range(200):
            if pair.completed.get(0):
                break
            pair.poll_prefill()
        assert pair.completed[0] == ["req"]
        assert pair.prefill[0].pending == []
    finally:
        pair.close()


def test_notification_carries_the_prefill_request_id_not_the_decode_one() -> None:
    pair = InProcessPair(MODEL, RoleSettings(tensor_parallel_size=2), RoleSettings(tensor_parallel_size=1))
    try:
        params = pair.offer("prefill-side-id", 20, [4, 6])
        results = pair.read(params, [0, 1], 0)  # the decode side calls it "d-prefill-side-id"
        assert results[0].ok
        for _ in range(200):
            if len(pair.completed.get(0, [])) and len(pair.completed.get(1, [])):
                break
            pair.poll_prefill()
        assert pair.completed == {0: ["prefill-side-id"], 1: ["prefill-side-id"]}
    finally:
        pair.close()


def test_forgotten_request_counts_late_notifications_as_unknown() -> None:
    pair = InProcessPair(
        MODEL, RoleSettings(tensor_parallel_size=1, kv_layout=KVLayout.HND), RoleSettings(tensor_parallel_size=1)
    )
    try:
        params = pair.offer("late", 16, [3])
        assert pair.prefill[0].forget("late")  # the lease expired
        assert pair.read(params, [0], 0)[0].ok  # the bytes are still there in this test; the notification is late
        for _ in range(200):
            if pair.unknown:
                break
            pair.poll_prefill()
        assert pair.unknown == 1
        assert pair.completed.get(0, []) == []
    finally:
        pair.close()
