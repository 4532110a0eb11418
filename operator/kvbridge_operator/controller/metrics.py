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

# kvbridge's planner, seen (controller/autoscaling.py, docs/autoscaling.md): per pass, what it read, how it decided
PLANNER_DECISIONS = Counter(
    "kvbridge_operator_planner_decisions",
    "Planner passes by deployment, role, reason (Sized, TargetUnreachable, or why it held: MetricsMissing, "
    "MetricsStale, MetricsImplausible, ProfileInvalid) and change of the role's size (up, down, none).",
    ["namespace", "deployment", "role", "reason", "change"],
    registry=REGISTRY,
)
PLANNER_OBSERVED = Gauge(
    "kvbridge_operator_planner_observed",
    "What the planner's last pass read from Prometheus (NaN: not read): request_rate and predicted_rate "
    "(requests/s, the prediction with headroom), prompt_tokens and output_tokens (means per request), "
    "prefix_hit_rate, decode_running (requests), ttft_seconds and itl_seconds (at the targets' percentiles).",
    ["namespace", "deployment", "figure"],
    registry=REGISTRY,
)
PLANNER_TARGET_SECONDS = Gauge(
    "kvbridge_operator_planner_target_seconds",
    "The planner's latency targets (target: ttft or itl; percentile as the spec says it).",
    ["namespace", "deployment", "target", "percentile"],
    registry=REGISTRY,
)
PLANNER_CORRECTION = Gauge(
    "kvbridge_operator_planner_correction",
    "The planner's learnt correction of each role's profile (observed latency over the profile's prediction, "
    "damped; 1: as profiled, above 1: slower).",
    ["namespace", "deployment", "role"],
    registry=REGISTRY,
)
PLANNER_LAST_PASS = Gauge(
    "kvbridge_operator_planner_last_pass_timestamp_seconds",
    "When the planner last passed over the deployment (Unix seconds): alert when it stops.",
    ["namespace", "deployment"],
    registry=REGISTRY,
)


def serve(port: int) -> None:
    """Serve /metrics on ``port`` (0 disables) from a daemon thread."""
    if port:
        start_http_server(port, registry=REGISTRY)
