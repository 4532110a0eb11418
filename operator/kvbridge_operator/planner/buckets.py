"""What a percentile read from histogram buckets says, and how far it lies from a prediction.

Prometheus' ``histogram_quantile`` finds the bucket the percentile's rank falls in and interpolates linearly inside
it: any latency between two bounds reads somewhere between them (a steady 30 ms inter-token gap, every token in
vLLM's 25-50 ms bucket, reads as 49.75 ms at p99). The reading says only which bucket the true percentile lies in.
Compared as a number with a prediction made at one concurrency, it puts a bias of up to a whole bucket's width into
the planner's corrections (issue 61: decode's size flapped at rest on it).

The planner therefore compares alike: the prediction with the bucket the reading names (:func:`bucket`), and takes
the ratio of observed to predicted nearest 1 that the bucket allows (:func:`ratio`): 1 when the prediction lies in
the bucket (the histogram cannot tell them apart), else the ratio to the bucket's nearer bound. For a latency ``k``
times the prediction that ratio lies between 1 and ``k``: it never says the engines are faster when they are slower,
nor more than they are; a steady engine at its profile reads as 1 whatever the bucket layout.

Pure: no I/O; every function returns a value.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

#: how near a bound a reading is that bound: ``histogram_quantile`` computes a bucket's top as
#: ``low + (high - low) * 1.0``, which floating point may put a step above ``high``
ULPS = 1e-12


def bucket(reading: float, bounds: Sequence[float]) -> tuple[float, float]:
    """The range ``(low, high]`` the true percentile lies in when ``histogram_quantile`` read ``reading`` from a
    histogram of finite upper bounds ``bounds`` (increasing, the same unit; ``+Inf`` left out). Without bounds (an
    exact percentile) the range is the reading itself. A reading at the highest finite bound may be the ``+Inf``
    bucket's (Prometheus returns that bound for it): its range has no upper end."""
    if not bounds:
        return reading, reading
    below = bisect.bisect_left(bounds, reading)
    if below > 0 and math.isclose(reading, bounds[below - 1], rel_tol=ULPS):
        reading = bounds[below - 1]  # Prometheus' interpolation at a bucket's top, a rounding above its bound
    at = bisect.bisect_left(bounds, reading)
    if at >= len(bounds) - 1 and reading >= bounds[-1]:
        return (bounds[-2] if len(bounds) > 1 else 0.0), math.inf
    return (bounds[at - 1] if at > 0 else 0.0), bounds[at]


def ratio(reading: float, predicted: float, bounds: Sequence[float] = ()) -> float:
    """Observed over ``predicted``, nearest 1 within the bucket ``reading`` names (:func:`bucket`; without
    ``bounds``: ``reading / predicted``); NaN when either is not a positive number."""
    if not (math.isfinite(reading) and math.isfinite(predicted)) or reading <= 0 or predicted <= 0:
        return math.nan
    low, high = bucket(reading, bounds)
    if predicted < low:
        return low / predicted
    if predicted > high:
        return high / predicted
    return 1.0
