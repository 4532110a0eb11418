"""``spec.scaling`` and ``spec.autoscaling``: the ratio of decode to prefill engines, and kvbridge's planner
(its latency targets and the Prometheus it reads)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvbridge_agent.core.model import CamelModel


class RatioBound(CamelModel):
    min: float | None = Field(default=None, ge=0, le=1024, description="Fewest decode engines per prefill engine.")
    max: float | None = Field(default=None, gt=0, le=1024, description="Most decode engines per prefill engine.")

    @model_validator(mode="after")
    def _ordered(self) -> RatioBound:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        return self


class ScalingSpec(CamelModel):
    decode_per_prefill: RatioBound | None = Field(
        default=None,
        description="Bounds on decode engines per prefill engine, kept when either role scales: the operator raises "
        "the other role (never lowers what an autoscaler asked), within its maxReplicas.",
    )


class LatencyTarget(CamelModel):
    """A latency objective: this percentile of requests at or under ``milliseconds``."""

    milliseconds: float = Field(gt=0, le=600_000, description="The target, in milliseconds.")
    percentile: float = Field(
        default=95, ge=50, le=99.9, description="The percentile held to the target (50 to 99.9; default 95)."
    )


class ConfigMapKeyRef(CamelModel):
    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    key: str = Field(default="profile.json", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")


PROMETHEUS_URL_INVALID = "PROMETHEUS_URL_INVALID"
PLANNER_MIN_REPLICAS = "PLANNER_MIN_REPLICAS"
#: a Prometheus server's base URL: http(s)://HOST[:PORT][/PATH], HOST a DNS name, an IPv4 or a bracketed IPv6
#: address; no user or password, query or fragment; or empty (the planner off)
PROMETHEUS_URL_PATTERN = (
    r"^(https?://([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?(/[-A-Za-z0-9_.~/%]*)?)?$"
)


class AutoscalingSpec(CamelModel):
    """kvbridge's planner (docs/autoscaling.md): both roles sized to TTFT and ITL targets, through their /scale."""

    # it writes the roles' /scale as an autoscaler does, so minReplicas, maxReplicas and spec.scaling.decodePerPrefill
    # still bound what runs

    enabled: bool = Field(default=False, description="Run the planner for this deployment (off by default).")
    prometheus_url: str = Field(
        default="",
        max_length=2048,
        pattern=PROMETHEUS_URL_PATTERN,
        description="The Prometheus server whose HTTP API the planner queries (e.g. "
        "http://prometheus.monitoring:9090): http(s)://HOST[:PORT][/PATH], no user, password, query or fragment. "
        "The operator sends GET PATH/api/v1/query to it from its own pod, so whoever may create a "
        "DisaggregatedDeployment can make the operator send such GETs anywhere its pod reaches: restrict the "
        "operator's egress (docs/autoscaling.md).",
    )
    ttft: LatencyTarget | None = Field(default=None, description="Time to first token, as the router's clients see it.")
    itl: LatencyTarget | None = Field(default=None, description="Inter-token latency on decode.")
    profile: ConfigMapKeyRef | None = Field(
        default=None,
        description="The ConfigMap key holding the engines' performance profile (JSON; docs/autoscaling.md).",
    )
    interval_seconds: int = Field(default=30, ge=5, le=3600, description="How often the planner decides.")
    headroom_percent: int = Field(
        default=0,
        ge=0,
        le=400,
        description="Capacity over the predicted demand, in percent: bursts arrive faster than new engines start "
        "(docs/autoscaling.md measures what it buys).",
    )
    window_seconds: int = Field(
        default=60,
        ge=5,
        le=3600,
        description="The window the planner reads rates and latency percentiles over: at least four of "
        "Prometheus' scrape intervals.",
    )
    stabilization_window_seconds: int = Field(
        default=300,
        ge=0,
        le=86_400,
        description="A role is scaled down only to the largest size recommended over this window (scale-ups act "
        "at once), as HPA's scale-down stabilization.",
    )
    tolerance_percent: int = Field(
        default=10,
        ge=0,
        le=100,
        description="A scale-down goes only to a size that carries the demand with this much to spare, in percent "
        "(HPA's tolerance): a demand that wavers about a whole number of engines does not move the size.",
    )
    reversal_window_seconds: int = Field(
        default=300,
        ge=0,
        le=86_400,
        description="Within this long of a role's last scale-down, it is scaled up only when the demand's lower "
        "bound (the rate less twice its Poisson deviation over windowSeconds) needs more engines than run, not on "
        "chance; a scale-down after a scale-up already waits for stabilizationWindowSeconds (docs/autoscaling.md).",
    )
    warmup_seconds: int = Field(
        default=30,
        ge=0,
        le=3600,
        description="A role's latencies refine its profile only once all its pods are ready and windowSeconds plus "
        "this long have passed since its size changed (new engines' first requests, a window of two sizes).",
    )

    @field_validator("prometheus_url", mode="before")
    @classmethod
    def _prometheus_url(cls, url: object) -> object:
        """Refused with a code of its own, before the pattern's generic message."""
        if isinstance(url, str) and not re.fullmatch(PROMETHEUS_URL_PATTERN, url):
            raise PydanticCustomError(
                PROMETHEUS_URL_INVALID,
                "{url} is not a Prometheus URL the planner may query: write http(s)://HOST[:PORT][/PATH] (e.g. "
                "http://prometheus.monitoring:9090); no user or password, query or fragment",
                {"url": repr(url[:80])},
            )
        return url

    @model_validator(mode="after")
    def _complete(self) -> AutoscalingSpec:
        if self.enabled:
            missing = [
                name
                for name, value in (
                    ("prometheusUrl", self.prometheus_url),
                    ("ttft", self.ttft),
                    ("itl", self.itl),
                    ("profile", self.profile),
                )
                if not value
            ]
            if missing:
                raise ValueError(
                    f"enabled needs {', '.join(missing)}: the planner reads Prometheus, sizes to both targets and "
                    "needs the engines' performance profile (docs/autoscaling.md)"
                )
        return self
