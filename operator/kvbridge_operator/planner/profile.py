"""An engine's performance profile: what one prefill and one decode engine can do, measured once per model, engine
and device, stored in a ConfigMap the planner reads (``spec.autoscaling.profile``).

- prefill: the uncached prompt tokens per second one engine computes at saturation;
- decode: inter-token latency at several concurrencies (requests decoding at once on one engine) at a stated
  context length; the planner interpolates between the points.

Pure: pydantic only.
"""

from __future__ import annotations

import itertools

from pydantic import Field, model_validator

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
