"""What the connector reports to vLLM's metrics: records per interval, summed over TP ranks, exported."""

from __future__ import annotations

import pickle
import time
from functools import partial
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvbridge_agent.vllm_connector import KVBridgeConnector
from kvbridge_agent.vllm_connector.messages import StepMetadata
from kvbridge_agent.vllm_connector.stats import HOOKS_RECORDED_SECONDS, KVBridgePromMetrics, KVBridgeStats


def test_take_hands_over_what_was_recorded_once() -> None:
    stats = KVBridgeStats()
    assert stats.take() is None
    stats.record_read(0.004, 2 << 20, 8)
    stats.record_failure("LEASE_EXPIRED")
    taken = stats.take()
    assert taken is not None
    assert stats.is_empty()
    assert stats.take() is None
    assert taken.data["read_descriptors"] == [8]
    assert taken.data["failed_reads"] == ["LEASE_EXPIRED"]
    # vLLM ships stats between processes: they must survive pickling and be rebuilt from their data
    rebuilt = KVBridgeConnector.build_kv_connector_stats(pickle.loads(pickle.dumps(taken.to_dict())))
    assert rebuilt.data == taken.data


def test_ranks_aggregate_and_reduce_to_a_summary() -> None:
    rank0, rank1 = KVBridgeStats(), KVBridgeStats()
    for seconds in (0.001, 0.002, 0.003):
        rank0.record_read(seconds, 1 << 20, 4)
    rank1.record_read(0.010, 1 << 20, 4)
    rank1.record_failure("HANDSHAKE_TIMEOUT")
    rank1.record_handshake(0.02)
    rank1.record_eviction()
    summary = rank0.aggregate(rank1).reduce()
    assert summary["Reads"] == 4
    assert summary["Avg read (ms)"] == pytest.approx(4.0)
    assert summary["Avg MB per read"] == 1.0
    assert summary["Avg descriptors"] == 4.0
    assert summary["Throughput (MB/s)"] == pytest.approx(4 / 0.016, rel=1e-3)
    assert (summary["Failed reads"], summary["Handshakes"], summary["Stale peers evicted"]) == (1, 1, 1)


def test_only_failures_still_reduce() -> None:
    stats = KVBridgeStats()
    stats.record_expired_lease()
    assert not stats.is_empty()
    assert stats.reduce() == {
        "Reads": 0,
        "Failed reads": 0,
        "Expired leases": 1,
        "Handshakes": 0,
        "Stale peers evicted": 0,
    }


def prometheus_metrics(registry: CollectorRegistry) -> KVBridgePromMetrics:
    """The connector's metrics as vLLM's front end builds them (one engine, labels model_name and engine)."""
    kinds = {kind: partial(kind, registry=registry) for kind in (Gauge, Counter, Histogram)}
    metrics = KVBridgeConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        kinds,  # type: ignore[arg-type]
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    assert isinstance(metrics, KVBridgePromMetrics)
    return metrics


def test_prometheus_metrics_carry_the_engine_label_and_the_failure_code() -> None:
    registry = CollectorRegistry()
    metrics = prometheus_metrics(registry)
    stats = KVBridgeStats()
    stats.record_read(0.003, 4096, 2)
    stats.record_read(0.005, 4096, 2)
    stats.record_failure("LEASE_EXPIRED")
    stats.record_failure("LEASE_EXPIRED")
    stats.record_failure("PROMPT_MISMATCH")
    stats.record_expired_lease()
    metrics.observe(stats.to_dict(), 0)
    text = generate_latest(registry).decode()
    assert 'vllm:kvbridge_transfer_seconds_count{engine="0",model_name="tiny"} 2.0' in text
    assert 'vllm:kvbridge_descriptors_per_request_sum{engine="0",model_name="tiny"} 4.0' in text
    assert 'vllm:kvbridge_failed_transfers_total{code="LEASE_EXPIRED",engine="0",model_name="tiny"} 2.0' in text
    assert 'vllm:kvbridge_failed_transfers_total{code="PROMPT_MISMATCH",engine="0",model_name="tiny"} 1.0' in text
    assert 'vllm:kvbridge_expired_leases_total{engine="0",model_name="tiny"} 1.0' in text


def test_held_kv_is_a_gauge_of_the_most_any_rank_holds() -> None:
    """What a prefill engine holds for readers (requests, bytes), for autoscalers and the pod's preStop drain:
    every TP rank holds the same requests, so the engine's figure is the most any rank reports, and it falls back
    to 0 when the readers are done."""
    registry = CollectorRegistry()
    metrics = prometheus_metrics(registry)
    stats = KVBridgeStats()
    stats.record_held(0, 3, 3 << 20)
    stats.record_held(1, 3, 3 << 20)
    assert not stats.is_empty()
    metrics.observe(pickle.loads(pickle.dumps(stats.take())).to_dict(), 0)
    text = generate_latest(registry).decode()
    assert 'vllm:kvbridge_held_requests{engine="0",model_name="tiny"} 3.0' in text
    assert 'vllm:kvbridge_held_bytes{engine="0",model_name="tiny"} 3.145728e+06' in text
    stats.record_held(0, 0, 0)
    metrics.observe(stats.to_dict(), 0)  # rank 1 still holds
    assert 'vllm:kvbridge_held_requests{engine="0",model_name="tiny"} 3.0' in generate_latest(registry).decode()
    stats = KVBridgeStats()
    stats.record_held(1, 0, 0)
    metrics.observe(stats.to_dict(), 0)
    assert 'vllm:kvbridge_held_requests{engine="0",model_name="tiny"} 0.0' in generate_latest(registry).decode()


def test_digest_durations_are_a_histogram_and_in_the_summary() -> None:
    """What verification costs an engine, per request: the histogram operators compare against the step time."""
    registry = CollectorRegistry()
    metrics = prometheus_metrics(registry)
    stats = KVBridgeStats()
    stats.record_digest_seconds([0.00004, 0.0003])
    assert stats.reduce()["Avg digest (ms)"] == pytest.approx(0.17)
    metrics.observe(pickle.loads(pickle.dumps(stats.take())).to_dict(), 0)
    text = generate_latest(registry).decode()
    assert 'vllm:kvbridge_digest_seconds_count{engine="0",model_name="tiny"} 2.0' in text
    assert 'vllm:kvbridge_digest_seconds_bucket{engine="0",le="5e-05",model_name="tiny"} 1.0' in text
    assert "Avg digest (ms)" not in KVBridgeStats().reduce()


def test_what_a_step_waited_for_verification_is_a_histogram() -> None:
    registry = CollectorRegistry()
    metrics = prometheus_metrics(registry)
    stats = KVBridgeStats()
    stats.record_digest_wait(0.0004)
    metrics.observe(pickle.loads(pickle.dumps(stats.take())).to_dict(), 0)
    text = generate_latest(registry).decode()
    assert 'vllm:kvbridge_digest_wait_seconds_count{engine="0",model_name="tiny"} 1.0' in text
    assert 'vllm:kvbridge_digest_wait_seconds_bucket{engine="0",le="0.0005",model_name="tiny"} 1.0' in text


def test_the_time_a_step_spends_in_the_hooks_is_recorded_and_none_is_lost() -> None:
    """All the connector costs vLLM's thread, per step: start_load_kv, wait_for_save and get_finished timed together
    and recorded with the step's stats; a step too short to record on its own is carried into the next record."""
    stats = KVBridgeStats()
    pause = [0.0]

    class Worker:
        def __init__(self) -> None:
            self.stats = stats

        def start_load_kv(self, meta: StepMetadata) -> None:
            time.sleep(pause[0])

        def get_finished(self, finished: set[str]) -> tuple[None, None]:
            return None, None

    connector = object.__new__(KVBridgeConnector)
    connector._worker, connector._scheduler, connector._hooks_seconds = Worker(), None, 0.0  # type: ignore[assignment]
    connector._connector_metadata = StepMetadata()

    def step() -> None:
        connector.start_load_kv(None)
        connector.wait_for_save()
        assert connector.get_finished(set()) == (None, None)

    step()  # a few microseconds: carried unless the machine stalled it
    quick = [*stats.data["hooks_seconds"], connector._hooks_seconds]
    pause[0] = 0.003
    step()
    recorded = stats.data["hooks_seconds"]
    assert recorded
    assert all(seconds >= HOOKS_RECORDED_SECONDS for seconds in recorded)
    assert connector._hooks_seconds == 0.0
    assert sum(recorded) >= 0.003 + sum(quick) - 1e-9  # the quick step's time is in the record, not lost

    registry = CollectorRegistry()
    prometheus_metrics(registry).observe(pickle.loads(pickle.dumps(stats.take())).to_dict(), 0)
    text = generate_latest(registry).decode()
    assert f'vllm:kvbridge_step_hooks_seconds_count{{engine="0",model_name="tiny"}} {float(len(recorded))}' in text
