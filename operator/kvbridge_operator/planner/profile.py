"""An engine's performance profile: what one prefill and one decode engine can do, measured once per model, engine
and device, stored in a ConfigMap the planner reads (``spec.autoscaling.profile``).

- prefill: the uncached prompt tokens per second one engine computes at saturation;
- decode: inter-token latency at several concurrencies (requests decoding at once on one engine) at a stated
  context length; the planner interpolates between the points.

``profile_from_bench`` makes one from ``vllm bench serve`` runs (``kvbridge profile``, cli/profile.py runs them).

Pure: pydantic only.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

from pydantic import Field, model_validator

from kvbridge_agent.core import KVBridgeError
from kvbridge_agent.core.model import CamelModel


class PrefillProfile(CamelModel):
    tokens_per_second: float = Field(
        gt=0, le=1e9, description="Uncached prompt tokens one prefill engine computes per second at saturation."
    )


class DecodePoint(CamelModel):
    concurrency: int = Field(ge=1, le=100_000, description="Requests decoding at once on one engine.")
    itl_ms: float = Field(gt=0, le=600_000, description="Inter-token latency at that concurrency (milliseconds).")


class DecodeProfile(CamelModel):
    context_tokens: int = Field(ge=1, description="The context length the points were measured at.")
    itl_percentile: float | None = Field(
        default=None,
        ge=50,
        le=99.9,
        description="The percentile of the points' inter-token latencies (``kvbridge profile --itl-percentile``); "
        "the planner uses a profile only for an ITL target of this percentile or a lower one. Absent: not stated, "
        "taken as the target's.",
    )
    points: list[DecodePoint] = Field(min_length=1, max_length=256)

    @model_validator(mode="after")
    def _increasing(self) -> DecodeProfile:
        concurrencies = [p.concurrency for p in self.points]
        if concurrencies != sorted(set(concurrencies)):
            raise ValueError("points must be in strictly increasing concurrency")
        return self

    def itl_ms(self, concurrency: float) -> float:
        """Inter-token latency at ``concurrency``, interpolated linearly between the points (flat below the first,
        extrapolated along the last two points' slope above the last)."""
        points = self.points
        if concurrency <= points[0].concurrency or len(points) == 1:
            return points[0].itl_ms if concurrency <= points[0].concurrency else self._beyond(concurrency)
        for low, high in itertools.pairwise(points):
            if concurrency <= high.concurrency:
                share = (concurrency - low.concurrency) / (high.concurrency - low.concurrency)
                return low.itl_ms + share * (high.itl_ms - low.itl_ms)
        return self._beyond(concurrency)

    def _beyond(self, concurrency: float) -> float:
        last = self.points[-1]
        if len(self.points) == 1:  # one point: latency grows with the batch (work per step), the safe guess
            return last.itl_ms * concurrency / last.concurrency
        before = self.points[-2]
        slope = max(0.0, (last.itl_ms - before.itl_ms) / (last.concurrency - before.concurrency))
        return last.itl_ms + slope * (concurrency - last.concurrency)

    def concurrency_within(self, itl_ms: float) -> float:
        """The most requests one engine decodes at once with its inter-token latency at or under ``itl_ms`` (0:
        not even one request)."""
        if self.itl_ms(1) > itl_ms:
            return 0.0
        low, high = 1.0, float(max(1, self.points[-1].concurrency))
        while self.itl_ms(high) <= itl_ms and high < 1e6:
            low, high = high, high * 2
        for _ in range(60):  # bisect to well under one request
            middle = (low + high) / 2
            low, high = (middle, high) if self.itl_ms(middle) <= itl_ms else (low, middle)
        return low


class PerformanceProfile(CamelModel):
    """What one engine of each role can do (docs/autoscaling.md has the format and how to measure it)."""

    engine: str = Field(min_length=1, max_length=512, description="What was measured: model, engine, device.")
    prefill: PrefillProfile
    decode: DecodeProfile


#: what a run of ``vllm bench serve`` (its ``--save-result`` JSON) must hold for a profile
BenchResult = Mapping[str, Any]


def _checked(result: BenchResult, what: str, field: str) -> BenchResult:
    """A bench run's result, refused when any request failed or nothing was measured (a profile from errors would
    size the deployment from nothing)."""
    completed, failed = int(result.get("completed") or 0), int(result.get("failed") or 0)
    if failed or completed < 1:
        errors = [e for e in result.get("errors") or [] if e]
        first = f"; the first error: {str(errors[0])[:300]}" if errors else ""
        raise KVBridgeError(
            f"{what}: {completed} requests completed, {failed} failed{first}: a profile needs every request "
            "answered; check the URL, the model name and that the pod is ready",
            field=field,
            code="PROFILE_REQUESTS_FAILED",
        )
    duration = float(result.get("duration") or 0)
    if not math.isfinite(duration) or duration <= 0:
        raise KVBridgeError(f"{what}: the run has no duration", field=field, code="PROFILE_REQUESTS_FAILED")
    return result


def percentile_word(percentile: float) -> str:
    """A percentile as ``vllm bench serve`` writes it in its flags and result keys (``90``, ``99.9``)."""
    return str(int(percentile)) if int(percentile) == percentile else str(percentile)


def profile_from_bench(
    engine: str,
    prefill: BenchResult,
    decode: Mapping[int, BenchResult],
    percentile: float,
    context_tokens: int,
) -> PerformanceProfile:
    """A profile from ``vllm bench serve`` runs: ``prefill`` at saturation with one output token (its prompt tokens
    over its duration: random prompts the engine had not seen, so every token was computed), ``decode`` one run per
    concurrency (the inter-token latency at ``percentile``), measured at ``context_tokens`` of context."""
    computed = _checked(prefill, "prefill", "--prefill-url")
    tokens = float(computed.get("total_input_tokens") or 0)
    if tokens <= 0:
        raise KVBridgeError("prefill: no prompt tokens counted", field="--prefill-url", code="PROFILE_REQUESTS_FAILED")
    points = []
    key = f"p{percentile_word(percentile)}_itl_ms"
    for concurrency, result in sorted(decode.items()):
        itl = float(_checked(result, f"decode at concurrency {concurrency}", "--decode-url").get(key) or 0)
        if not math.isfinite(itl) or itl <= 0:
            raise KVBridgeError(
                f"decode at concurrency {concurrency}: no inter-token latency at p{percentile:g} ({key}); "
                "the output needs at least two tokens per request",
                field="--output-tokens",
                code="PROFILE_REQUESTS_FAILED",
            )
        points.append(DecodePoint(concurrency=concurrency, itl_ms=round(itl, 3)))
    return PerformanceProfile(
        engine=engine,
        prefill=PrefillProfile(tokens_per_second=round(tokens / float(computed["duration"]), 1)),
        decode=DecodeProfile(context_tokens=context_tokens, itl_percentile=percentile, points=points),
    )
