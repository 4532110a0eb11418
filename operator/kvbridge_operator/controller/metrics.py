"""Prometheus metrics of the operator (served on the metrics port, default 8081)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)
RECONCILES = Counter(
    "kvbridge_operator_reconciles",
    "Reconciles of DisaggregatedDeployments, by result: applied, refused (incompatible or invalid), observed "
    "(status only, after a pod event).",
    ["result"],
    registry=REGISTRY,
)
RECONCILE_SECONDS = Histogram(
    "kvbridge_operator_reconcile_seconds",
    "Duration of one reconcile.",
    registry=REGISTRY,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
PLANNED_REPLICAS = Gauge(
    "kvbridge_operator_planned_replicas",
    "Engines kvbridge's planner (spec.autoscaling) asks for, by deployment and role: what it writes to the role's "
    "/scale, exported for HPA or KEDA users who act on it themselves.",
    ["namespace", "deployment", "role"],
    registry=REGISTRY,
)


def serve(port: int) -> None:
    """Serve /metrics on ``port`` (0 disables) from a daemon thread."""
    if port:
        start_http_server(port, registry=REGISTRY)
