"""What the connector reports through vLLM's metrics.

Each worker records what happened since vLLM last asked (:meth:`KVBridgeStats.take`); vLLM gathers the TP ranks'
records (``aggregate``), logs a summary every logging interval (``reduce``) and exports them on the front end's
``/metrics`` through :class:`KVBridgePromMetrics` — the same names as the synthetic engine's metrics, with vLLM's
``vllm:`` prefix. A read is one TP rank's READs for one request.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

#: prefill ranks' digests of offered requests, (request id, heads, bytes): taken out by the scheduler half
#: (update_connector_output) and served on the side channel; they never reach the metrics
DIGESTS = "digests"
#: each observation list: read durations (s), bytes and descriptors per read, handshake durations (s), the codes
#: of failed reads, and a 1 per lease that ended unread (prefill) and per stale peer evicted (decode); ``held``:
#: (TP rank, requests, bytes) a prefill rank holds for readers, each time it changes; ``digest_seconds``: how long
#: each verified request's digest took on this rank (on its digest thread); ``digest_wait_seconds``: per step that
#: waited, how long vLLM's thread waited for verification; ``hooks_seconds``: per step, how long vLLM's thread spent
#: in kvbridge's hooks (see :data:`HOOKS_RECORDED_SECONDS`); ``staged_reads``: a 1 per read made through staging
#: buffers (docs/protocol.md §4d)
_KEYS = (
    "read_seconds",
    "read_bytes",
    "read_descriptors",
    "staged_reads",
    "handshake_seconds",
    "failed_reads",
    "expired_leases",
    "stale_peer_evictions",
    "held",
    "digest_mismatches",
    "digest_seconds",
    "digest_wait_seconds",
    "hooks_seconds",
    DIGESTS,
)
#: a step whose hooks took less is not recorded on its own (recording every step would ship stats every step): its
#: time is added to the next step recorded, so that the observations' sum is all the time the hooks took
HOOKS_RECORDED_SECONDS = 0.0001
_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_DIGEST_SECONDS = (0.00005, 0.0001, 0.0002, *_SECONDS)
_DESCRIPTORS = (1, 16, 128, 1024, 4096, 16384, 65536, 262144, 1048576)
_BYTES = tuple(float(2 ** (10 + 2 * i)) for i in range(13))  # 1 KiB .. 16 GiB


@dataclass
class KVBridgeStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, list[Any]] = {key: [] for key in _KEYS}

    def record_read(self, seconds: float, nbytes: int, descriptors: int, mode: str = "direct") -> None:
        """One read that completed; ``mode``: ``direct``, or ``staged`` through staging buffers."""
        self.data["read_seconds"].append(seconds)
        self.data["read_bytes"].append(nbytes)
        self.data["read_descriptors"].append(descriptors)
        if mode == "staged":
            self.data["staged_reads"].append(1)

    def record_failure(self, code: str) -> None:
        self.data["failed_reads"].append(code)

    def record_handshake(self, seconds: float) -> None:
        self.data["handshake_seconds"].append(seconds)

    def record_held(self, tp_rank: int, requests: int, nbytes: int) -> None:
        self.data["held"].append((tp_rank, requests, nbytes))

    def record_digests(self, request_id: str, heads: list[int], data: bytes) -> None:
        self.data[DIGESTS].append((request_id, heads, data))

    def record_digest_seconds(self, seconds: list[float]) -> None:
        self.data["digest_seconds"].extend(seconds)

    def record_digest_wait(self, seconds: float) -> None:
        self.data["digest_wait_seconds"].append(seconds)

    def record_hooks(self, seconds: float) -> None:
        self.data["hooks_seconds"].append(seconds)

    def record_digest_mismatch(self, peer: str) -> None:
        self.data["digest_mismatches"].append(peer)

    def record_expired_lease(self) -> None:
        self.data["expired_leases"].append(1)

    def record_eviction(self) -> None:
        self.data["stale_peer_evictions"].append(1)

    def take(self) -> KVBridgeStats | None:
        """What was recorded since the last call (``None``: nothing), leaving this one empty."""
        if self.is_empty():
            return None
        taken = copy.copy(self)
        self.reset()
        return taken

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in _KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _KEYS:
            self.data.setdefault(key, []).extend(other.data.get(key, ()))
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = np.asarray(self.data["read_seconds"], dtype=np.float64)
        reads = len(seconds)
        summary: dict[str, int | float] = {"Reads": reads}
        if reads:
            megabytes = np.asarray(self.data["read_bytes"], dtype=np.float64) / 2**20
            summary |= {
                "Avg read (ms)": round(float(seconds.mean()) * 1e3, 3),
                "P90 read (ms)": round(float(np.percentile(seconds, 90)) * 1e3, 3),
                "Avg MB per read": round(float(megabytes.mean()), 3),
                "Throughput (MB/s)": round(float(megabytes.sum() / max(seconds.sum(), 1e-9)), 1),
                "Avg descriptors": round(float(np.mean(self.data["read_descriptors"])), 1),
            }
        if self.data.get("staged_reads"):
            summary["Staged reads"] = len(self.data["staged_reads"])
        if self.data["digest_seconds"]:
            summary["Avg digest (ms)"] = round(float(np.mean(self.data["digest_seconds"])) * 1e3, 3)
        return summary | {
            "Failed reads": len(self.data["failed_reads"]),
            "Expired leases": len(self.data["expired_leases"]),
            "Handshakes": len(self.data["handshake_seconds"]),
            "Stale peers evicted": len(self.data["stale_peer_evictions"]),
        }


#: each observation list that is a histogram: its key, then the metric's name, help and buckets
_HISTOGRAMS: tuple[tuple[str, str, str, tuple[float, ...]], ...] = (
    (
        "read_seconds",
        "vllm:kvbridge_transfer_seconds",
        "One TP rank's READs of one request, from posting to completion.",
        _SECONDS,
    ),
    ("read_bytes", "vllm:kvbridge_transfer_bytes", "Bytes one TP rank READ for one request.", _BYTES),
    (
        "read_descriptors",
        "vllm:kvbridge_descriptors_per_request",
        "Descriptors one TP rank posted for one request.",
        _DESCRIPTORS,
    ),
    (
        "digest_seconds",
        "vllm:kvbridge_digest_seconds",
        "One TP rank's digest of one request's KV (prefill: after the step that completed the prompt; decode: "
        "checking what it read), on kvbridge's digest thread beside the engine's steps.",
        _DIGEST_SECONDS,
    ),
    (
        "digest_wait_seconds",
        "vllm:kvbridge_digest_wait_seconds",
        "How long one engine step waited for verification on the engine's own thread (prefill: an offer waiting "
        "for its request's digest, or taking it there; decode: a check its step gave up to 2 ms to finish, so "
        "that its request goes in that step).",
        _DIGEST_SECONDS,
    ),
    (
        "hooks_seconds",
        "vllm:kvbridge_step_hooks_seconds",
        "How long vLLM's thread spent in kvbridge's hooks in one engine step (start_load_kv, wait_for_save, "
        "get_finished): all the connector cost the step, waits for verification included. A step under 0.1 ms "
        "is added to the next one recorded, so the sum is exact.",
        _DIGEST_SECONDS,
    ),
    (
        "handshake_seconds",
        "vllm:kvbridge_handshake_seconds",
        "Side-channel handshake with a prefill engine, until its peer is usable.",
        _SECONDS,
    ),
)
#: each observation list that is counted (one per entry): its key, then the counter's name and help
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("expired_leases", "vllm:kvbridge_expired_leases", "Prefill requests freed because their lease ended unread."),
    ("stale_peer_evictions", "vllm:kvbridge_stale_peer_evictions", "Prefill engines evicted because they restarted."),
    (
        "staged_reads",
        "vllm:kvbridge_staged_reads",
        "Decode: reads made through staging buffers (prefill packed the request, decode read a few large "
        "descriptors; docs/protocol.md §4d).",
    ),
)


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvbridge_*`` on the engine's ``/metrics``, one child per engine of the front end."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(kind: type, name: str, doc: str, **extra: Any) -> dict[int, Any]:
            metric = kind(name=name, documentation=doc, labelnames=labelnames, **extra)
            children: dict[int, Any] = create_metric_per_engine(metric, per_engine_labelvalues)
            return children

        histogram, counter, gauge = self._histogram_cls, self._counter_cls, self._gauge_cls
        #: each histogram's and counter's children, by the key of the observations it takes
        self._histograms = {
            key: per_engine(histogram, name, doc, buckets=list(buckets)) for key, name, doc, buckets in _HISTOGRAMS
        }
        self._counters = {key: per_engine(counter, name, doc) for key, name, doc in _COUNTERS}
        # one child per (engine, code), made when a code first occurs
        self._failed = counter(
            name="vllm:kvbridge_failed_transfers",
            documentation="Failed reads, by code.",
            labelnames=[*labelnames, "code"],
        )
        self._mismatches = counter(
            name="vllm:kvbridge_digest_mismatches",
            documentation="Requests whose KV differed from prefill's digest, by prefill engine.",
            labelnames=[*labelnames, "peer"],
        )
        self.held_requests = per_engine(
            gauge,
            "vllm:kvbridge_held_requests",
            "Prefill requests whose KV this engine holds for readers.",
            multiprocess_mode="mostrecent",
        )
        self.held_bytes = per_engine(
            gauge,
            "vllm:kvbridge_held_bytes",
            "KV cache bytes this prefill engine holds for readers (the model's KV per token "
            "over the held blocks): a pod with none is the one to scale down.",
            multiprocess_mode="mostrecent",
        )
        #: each engine's TP ranks' last (requests, bytes): the engine holds the most requests any rank holds
        self._held: dict[int, dict[int, tuple[int, int]]] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for key, histogram in self._histograms.items():
            for value in data.get(key, ()):
                histogram[engine_idx].observe(value)
        for key, counter in self._counters.items():
            if data.get(key):
                counter[engine_idx].inc(len(data[key]))
        for code in data.get("failed_reads", ()):
            self._failed.labels(*self.per_engine_labelvalues[engine_idx], code).inc()
        for peer in data.get("digest_mismatches", ()):
            self._mismatches.labels(*self.per_engine_labelvalues[engine_idx], peer).inc()
        if data.get("held"):
            ranks = self._held.setdefault(engine_idx, {})
            for rank, requests, nbytes in data["held"]:
                ranks[int(rank)] = (int(requests), int(nbytes))
            self.held_requests[engine_idx].set(max(r for r, _ in ranks.values()))
            self.held_bytes[engine_idx].set(max(b for _, b in ranks.values()))
