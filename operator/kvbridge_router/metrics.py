"""The router's Prometheus metrics (``GET /metrics``), one registry per router.

A request touches a few labelled series (its outcome, each pod it calls); their children are looked up once and
kept (a ``labels()`` call validates and locks, a few microseconds each, nine times a request). The series of a pod
that left the pool are removed once nothing is in flight to it (:meth:`RouterMetrics.keep_pods`), so months of
rollouts do not grow the scrape without bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

TEXT = "text/plain; version=0.0.4; charset=utf-8"

#: latency buckets in seconds, from a cached-prefix decode on a GPU to a long prompt on a CPU
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: the time to first token's, finer where TTFT targets lie (steps of at most 1.33x from 0.15 to 2.5 s): the planner
#: reads its percentile, which says only which bucket it lies in (planner.buckets); 10 more series per router
TTFT_BUCKETS = (*BUCKETS[:4], 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0, 1.25, 1.5, 2.0, *BUCKETS[8:])


@dataclass(frozen=True)
class Metric:
    """One of the router's metrics: its kind, name, help and labels (a histogram's buckets: :data:`BUCKETS` unless
    given)."""

    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = BUCKETS

    def made(self, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
        if self.kind is Histogram:
            return Histogram(self.name, self.help, self.labels, registry=registry, buckets=self.buckets)
        return self.kind(self.name, self.help, self.labels, registry=registry)


#: every metric of the router, by the attribute of :class:`RouterMetrics` that holds it
METRICS: dict[str, Metric] = {
    "requests": Metric(
        Counter,
        "kvbridge_router_requests",
        "Requests by API route and outcome: ok, or the error code returned.",
        ("route", "outcome"),
    ),
    "picks": Metric(
        Counter,
        "kvbridge_router_picks",
        "Pairs the policy chose (one per choice, retries included), by policy and why: prefix (kv-aware: the prefill "
        "pod was sent the longest leading part of the prompt), ring (kv-aware: no pod was; the hash ring placed it), "
        "load (the fewest requests in flight), turn (round-robin: the next in turn).",
        ("policy", "reason"),
    ),
    "retries": Metric(
        Counter,
        "kvbridge_router_prefill_retries",
        "Prefill calls that failed, by pod (the request went to another pod while attempts were left).",
        ("pod",),
    ),
    "prefix_chunks": Metric(
        Counter,
        "kvbridge_router_prefix_chunks",
        "Leading prompt chunks of routed requests (kv-aware policy), by whether "
        "the chosen prefill pod had been sent them before (hit) or not (miss): the router's view of the "
        "prefix-cache hit rate.",
        ("result",),
    ),
    "prefix_evictions": Metric(
        Counter,
        "kvbridge_router_prefix_evictions",
        "Prefill answers in which the pod held fewer leading chunks of the prompt than the router had sent it "
        "(its prefix cache evicted them, as vLLM's remote_prefill_cached_tokens says): the router then forgot "
        "what it had sent that pod before them.",
    ),
    "decode_retries": Metric(
        Counter,
        "kvbridge_router_decode_retries",
        "Decode calls that failed before anything reached the client, by pod (the request went to another pair).",
        ("pod",),
    ),
    "engines_lost": Metric(
        Counter,
        "kvbridge_router_engines_lost",
        "Engines still in the pool that answered a request 500 and were unhealthy right after, by role and pod "
        "(a request is sent to one more engine after such a loss, never a second: it may be what kills them).",
        ("role", "pod"),
    ),
    "ttft": Metric(
        Histogram,
        "kvbridge_router_ttft_seconds",
        "Time to first token as the client sees it: request received to decode's first streamed byte "
        "(streaming requests), or to decode's whole answer (non-streaming).",
        buckets=TTFT_BUCKETS,
    ),
    "prefill_seconds": Metric(
        Histogram,
        "kvbridge_router_prefill_seconds",
        "The prefill call (prompt computed, transfer parameters returned).",
    ),
    "request_seconds": Metric(Histogram, "kvbridge_router_request_seconds", "Request received to the last byte sent."),
    "overhead_seconds": Metric(
        Histogram,
        "kvbridge_router_overhead_seconds",
        "The router's own time per request: the whole request less the prefill and decode calls.",
        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
    ),
    "pod_requests": Metric(
        Counter,
        "kvbridge_router_pod_requests",
        "Calls sent to each pod (prefill or decode), failed ones included.",
        ("role", "pod"),
    ),
    "outstanding": Metric(
        Gauge, "kvbridge_router_outstanding_requests", "Requests in flight per pod.", ("role", "pod")
    ),
    "endpoints": Metric(
        Gauge, "kvbridge_router_endpoints", "Routable pods per role, from the deployment's status.", ("role",)
    ),
    "peer_reports": Metric(
        Counter,
        "kvbridge_router_peer_reports",
        "Reports exchanged with the other router replicas (docs/router.md, Several replicas): sent, by outcome "
        "(delivered, unreachable, timeout, skipped, unresolved, failed, HTTP_<status>, records_dropped), and "
        "received, by outcome (accepted, stale, expired, TOO_LARGE, BODY_INCOMPLETE, or what was wrong with the "
        "frame: BAD_SIGNATURE, TRUNCATED, ...).",
        ("direction", "outcome"),
    ),
    "peers": Metric(Gauge, "kvbridge_router_peers", "Other router replicas whose last report is fresh."),
}


class RouterMetrics:
    """The router's metrics (:data:`METRICS`) in a registry of their own."""

    requests: Counter
    picks: Counter
    retries: Counter
    prefix_chunks: Counter
    prefix_evictions: Counter
    decode_retries: Counter
    engines_lost: Counter
    ttft: Histogram
    prefill_seconds: Histogram
    request_seconds: Histogram
    overhead_seconds: Histogram
    pod_requests: Counter
    outstanding: Gauge
    endpoints: Gauge
    peer_reports: Counter
    peers: Gauge

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        for attribute, metric in METRICS.items():
            setattr(self, attribute, metric.made(self.registry))
        self._outcomes: dict[tuple[str, str], Any] = {}
        self._picks: dict[tuple[str, str], Any] = {}
        self._peer_outcomes: dict[tuple[str, str], Any] = {}
        #: (role, pod) -> its calls counter and its in-flight gauge
        self._pods: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._hit, self._miss = self.prefix_chunks.labels("hit"), self.prefix_chunks.labels("miss")

    def answered(self, route: str, outcome: str) -> None:
        """A request answered: ``ok``, or the error code (outcomes are few: codes and HTTP statuses)."""
        _child(self._outcomes, self.requests, route, outcome).inc()

    def answered_in(self, route: str, status: int, seconds: float, overhead: float) -> None:
        """A request answered with an engine's ``status`` after ``seconds``, ``overhead`` of them the router's own."""
        self.answered(route, "ok" if status < 400 else f"HTTP_{status}")
        self.request_seconds.observe(seconds)
        self.overhead_seconds.observe(overhead)

    def picked(self, policy: str, reason: str) -> None:
        """A pair the ``policy`` chose, and why (``Choice.reason``: a few values, as the policies write them)."""
        _child(self._picks, self.picks, policy, reason).inc()

    def prefix_matched(self, hit: int, chunks: int) -> None:
        """A kv-aware choice: ``hit`` of the prompt's ``chunks`` leading chunks had been sent to its prefill pod."""
        self._hit.inc(hit)
        self._miss.inc(chunks - hit)

    def peer_report(self, direction: str, outcome: str) -> None:
        """A report sent to another replica, or received from one, and how it went."""
        _child(self._peer_outcomes, self.peer_reports, direction, outcome).inc()

    def calling(self, role: str, pod: str) -> None:
        """A call to ``pod`` begins."""
        children = self._pods.get((role, pod))
        if children is None:
            children = self._pods[role, pod] = (self.pod_requests.labels(role, pod), self.outstanding.labels(role, pod))
        children[0].inc()
        children[1].inc()

    def called(self, role: str, pod: str) -> None:
        """A call to ``pod`` ended (answered, failed or cancelled)."""
        children = self._pods.get((role, pod))
        if children is not None:  # else removed with its pod, nothing in flight counted
            children[1].dec()

    def keep_pods(self, pods: AbstractSet[str], busy: AbstractSet[str]) -> None:
        """Remove the series of pods not in ``pods`` (they left the pool), except those in ``busy`` (calls in
        flight: their gauge still counts them; removed on a later call)."""
        for role, pod in [key for key in self._pods if key[1] not in pods and key[1] not in busy]:
            del self._pods[role, pod]
            for metric in (self.pod_requests, self.outstanding, self.engines_lost):
                with contextlib.suppress(KeyError):
                    metric.remove(role, pod)
            for metric in (self.retries, self.decode_retries):
                with contextlib.suppress(KeyError):
                    metric.remove(pod)

    def summary(self) -> dict[str, Any]:
        """Requests by outcome, prefill retries, and the router's mean own time per request (for reports)."""
        samples = {
            (m.name, tuple(sorted(s.labels.items())), s.name): s.value
            for m in self.registry.collect()
            for s in m.samples
        }
        outcomes: dict[str, int] = {}
        retries = 0.0
        for (metric, labels, sample), value in samples.items():
            if metric == "kvbridge_router_requests" and sample.endswith("_total"):
                outcome = dict(labels)["outcome"]
                outcomes[outcome] = outcomes.get(outcome, 0) + int(value)
            elif metric == "kvbridge_router_prefill_retries" and sample.endswith("_total"):
                retries += value
        count = samples.get(("kvbridge_router_overhead_seconds", (), "kvbridge_router_overhead_seconds_count"), 0.0)
        total = samples.get(("kvbridge_router_overhead_seconds", (), "kvbridge_router_overhead_seconds_sum"), 0.0)
        return {
            "requests": outcomes,
            "prefillRetries": int(retries),
            "meanOverheadMilliseconds": round(1000 * total / count, 3) if count else 0.0,
        }

    def observe_ttft(self, seconds: float, trace_id: str = "") -> None:
        """One client's time to first token; with the request's trace id (tracing on, sampled) as the bucket's
        exemplar, which Grafana links to the trace (docs/tracing.md)."""
        self.ttft.observe(seconds, exemplar={"trace_id": trace_id} if trace_id else None)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The metrics and their content type: OpenMetrics (with exemplars) when the scraper accepts it, as a
        Prometheus with exemplar storage does; else Prometheus' text format."""
        if "application/openmetrics-text" in accept:
            return bytes(generate_openmetrics(self.registry)), OPENMETRICS  # type: ignore[no-untyped-call]
        return bytes(generate_latest(self.registry)), TEXT


def _child(cache: dict[tuple[str, str], Any], metric: Any, first: str, second: str) -> Any:
    """``metric``'s child of these two label values, looked up once and kept in ``cache`` (labels are few)."""
    child = cache.get((first, second))
    if child is None:
        child = cache[first, second] = metric.labels(first, second)
    return child
