"""Prometheus metrics of one engine (one registry per engine, so tests can run several; an engine's data-parallel
ranks share its registry, each under its own ``engine`` label)."""

from __future__ import annotations

import copy

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_DESCRIPTORS = (1, 16, 128, 1024, 4096, 16384, 65536, 262144, 1048576)


class AgentMetrics:
    def __init__(self, role: str, engine_id: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"role": role, "engine": engine_id}
        self.labels = labels

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=self.registry)

        self.transfer_seconds = histogram(
            "kvbridge_transfer_seconds", "Time from posting a request's READs to their completion.", _SECONDS
        )
        self.handshake_seconds = histogram(
            "kvbridge_handshake_seconds",
            "Side-channel handshake with a prefill engine, until its peer is usable.",
            _SECONDS,
        )
        self.descriptors = histogram(
            "kvbridge_descriptors_per_request", "Descriptors posted for one request (all ranks).", _DESCRIPTORS
        )
        self.bytes = counter("kvbridge_transfer_bytes", "Bytes READ from prefill engines.")
        self.requests = counter("kvbridge_requests", "Requests handled, by outcome.", ("outcome",))
        self.failed_transfers = counter("kvbridge_failed_transfers", "Decode requests that failed, by code.", ("code",))
        self.failed_notifications = counter(
            "kvbridge_failed_notifications", "Notifications ignored by prefill, by reason.", ("reason",)
        )
        self.digest_mismatches = counter(
            "kvbridge_digest_mismatches",
            "Decode requests whose KV differed from prefill's digest, by prefill engine.",
            ("peer",),
        )
        self.expired_leases = counter("kvbridge_expired_leases", "Prefill requests freed because their lease expired.")
        self.stale_evictions = counter(
            "kvbridge_stale_peer_evictions", "Remote engines evicted because they restarted or failed."
        )
        self.held_requests = gauge("kvbridge_held_requests", "Prefill requests whose blocks await readers.")
        self.held_bytes = gauge(
            "kvbridge_held_bytes",
            "KV cache bytes prefill holds for readers (the blocks of held requests): a "
            "prefill pod with none is the one to scale down.",
        )
        self.free_blocks = gauge("kvbridge_free_blocks", "Free KV blocks.")

    def relabelled(self, engine_id: str) -> AgentMetrics:
        """The same series in the same registry, labelled for another engine id (one data-parallel rank)."""
        view = copy.copy(self)
        view.labels = {**self.labels, "engine": engine_id}
        return view

    def render(self) -> bytes:
        return generate_latest(self.registry)
