"""The planner's latency correction compares alike (issue 61's root cause): the prediction, made at the window's mean
load, against the bucket the observed percentile was read from, not against ``histogram_quantile``'s interpolated
reading (any gap between 25 and 50 ms reads as about 49 ms at p99).

``prometheus_quantile`` below is Prometheus' own ``histogram_quantile`` over classic buckets (promql/quantile.go's
``bucketQuantile``: the rank ``q x count``, the first bucket whose cumulative count reaches it, linear interpolation
inside it from 0 for the lowest bucket, the highest finite bound for a rank in ``+Inf``'s).
"""

from __future__ import annotations

import json
import math

import pytest
from aiohttp import ClientSession
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_operator.planner.buckets import bucket, ratio
from kvbridge_operator.planner.prometheus import (
    PROMETHEUS_MALFORMED,
    PrometheusError,
    Unanswered,
    bounds_query,
    histograms,
    known_bounds,
    queries,
    read_bounds,
)
from kvbridge_operator.planner.sizing import Memory, Observation, Recommendation, refine

from .test_planner_answers import Answerer, metrics_url  # noqa: F401 (the fixture)
from .test_planner_hysteresis import PROFILE

#: vLLM's inter-token latency buckets (ms), and the router's TTFT buckets before issue 61 (ms)
VLLM_ITL = (10.0, 25.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0, 400.0, 500.0, 750.0, 1000.0, 2500.0, 5000.0)
ROUTER_TTFT = (5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0, 60000.0)
TAIL = math.log(100)  # p99's, of an exponential


def prometheus_quantile(q: float, bounds: tuple[float, ...], samples: list[float]) -> float:
    """What ``histogram_quantile(q, ...)`` reads from a histogram of ``bounds`` (and ``+Inf``) holding ``samples``."""
    counts = [sum(s <= b for s in samples) for b in bounds] + [len(samples)]
    rank = q * len(samples)
    at = next(i for i, c in enumerate(counts) if c >= rank)
    if at == len(bounds):
        return bounds[-1]
    start, below = (bounds[at - 1], counts[at - 1]) if at > 0 else (0.0, 0)
    return start + (bounds[at] - start) * (rank - below) / (counts[at] - below)


layouts = st.lists(st.integers(1, 20_000), min_size=1, max_size=25, unique=True).map(
    lambda b: tuple(sorted(x / 4 for x in b))  # bounds in ms, at least a quarter apart
)
quantiles = st.sampled_from([0.5, 0.9, 0.95, 0.99, 0.999])


def seen(itl_ms: float, decode_running: float, bounds: tuple[float, ...], ttft_ms: float | None = None) -> Observation:
    return Observation(
        request_rate=2.0,
        prompt_tokens=200,
        output_tokens=24,
        prefix_hit_rate=0.0,
        decode_running=decode_running,
        ttft_ms=ttft_ms,
        itl_ms=itl_ms,
        staleness_seconds=1,
        ttft_bounds_ms=bounds,
        itl_bounds_ms=bounds,
    )


def test_issue_61s_case_a_steady_30_ms_reads_49_ms_and_corrects_nothing() -> None:
    reading = prometheus_quantile(0.99, VLLM_ITL, [30.0] * 500)
    assert reading == pytest.approx(49.75)
    assert bucket(reading, VLLM_ITL) == (25.0, 50.0)
    assert ratio(reading, 30.0, VLLM_ITL) == 1.0  # the old comparison: 49.75 / 30 = 1.66, a correction of 1.29
    assert ratio(reading, 20.0, VLLM_ITL) == pytest.approx(25 / 20)  # the least slowdown the bucket allows
    assert ratio(reading, 60.0, VLLM_ITL) == pytest.approx(50 / 60)
    assert ratio(reading, 30.0) == pytest.approx(49.75 / 30)  # exact percentiles (no bounds): as before


def test_a_reading_at_the_highest_bound_may_be_the_inf_buckets_and_the_lowest_bucket_starts_at_0() -> None:
    assert prometheus_quantile(0.99, VLLM_ITL, [9_000.0] * 10) == 5000.0
    assert bucket(5000.0, VLLM_ITL) == (2500.0, math.inf)
    assert ratio(5000.0, 9_000.0, VLLM_ITL) == 1.0
    assert bucket(4.0, VLLM_ITL) == (0.0, 10.0)
    assert bucket(3.0, (5.0,)) == (0.0, 5.0)
    assert bucket(5.0, (5.0,)) == (0.0, math.inf)
    assert math.isnan(ratio(0.0, 10.0, VLLM_ITL))
    assert math.isnan(ratio(10.0, math.nan, VLLM_ITL))


@settings(max_examples=300, deadline=None)
@given(layouts, quantiles, st.lists(st.floats(0.01, 20_000), min_size=1, max_size=200))
def test_the_true_percentile_lies_in_the_bucket_its_reading_names(
    bounds: tuple[float, ...], q: float, samples: list[float]
) -> None:
    truth = sorted(samples)[math.ceil(q * len(samples)) - 1]  # the sample at the rank Prometheus looks for
    low, high = bucket(prometheus_quantile(q, bounds, samples), bounds)
    assert low < truth <= high


@settings(max_examples=300, deadline=None)
@given(layouts, quantiles, st.floats(0.1, 12), st.integers(1, 4))
def test_a_steady_engine_at_its_profile_corrects_nothing_whatever_the_buckets(
    bounds: tuple[float, ...], q: float, per_engine: float, engines: int
) -> None:
    """Every token at the profile's gap for the window's mean load, every first token at the queue's prediction:
    both corrections stay 1."""
    itl = PROFILE.decode.itl_ms(per_engine)
    uncached, capacity = 200.0, PROFILE.prefill.tokens_per_second
    rho = 2.0 * uncached / (engines * capacity)
    ttft = TAIL * 1000 * uncached / capacity / (1 - rho)
    observation = seen(
        prometheus_quantile(q, bounds, [itl] * 100),
        per_engine * engines,
        bounds,
        prometheus_quantile(q, bounds, [ttft] * 100),
    )
    memory = refine(observation, PROFILE, Recommendation(0, engines, engines), Memory(), TAIL)
    assert memory.decode_correction == pytest.approx(1.0, abs=1e-9)
    assert memory.prefill_correction == pytest.approx(1.0, abs=1e-9)


@settings(max_examples=300, deadline=None)
@given(layouts, quantiles, st.floats(0.1, 12), st.floats(0.3, 3.5), st.floats(0.6, 2.5))
def test_the_correction_moves_the_way_the_engine_is_off_and_no_further(
    bounds: tuple[float, ...], q: float, per_engine: float, off: float, correction: float
) -> None:
    """An engine ``off`` times the prediction (slower above 1): the decode correction moves that way, by no more
    than the damped ``off`` (the bucket's nearer bound, never its interpolated reading)."""
    predicted = PROFILE.decode.itl_ms(per_engine) * correction
    observation = seen(prometheus_quantile(q, bounds, [predicted * off] * 100), per_engine * 2, bounds)
    after = refine(observation, PROFILE, Recommendation(0, 1, 2), Memory(decode_correction=correction), TAIL)
    moved = after.decode_correction / correction
    lowest, highest = 0.5 / correction, 4.0 / correction  # CORRECTION_RANGE
    if off >= 1:
        assert 1 - 1e-9 <= moved <= max(math.sqrt(off), lowest) + 1e-9
    else:
        assert min(math.sqrt(off), highest) - 1e-9 <= moved <= 1 + 1e-9


def test_the_prediction_is_made_at_the_windows_mean_load() -> None:
    """The decode figure is the window's mean of the in-flight gauges (the load the gaps were observed at): at 2
    requests per engine the profile's 20 ms gap lies in vLLM's 10-25 ms bucket, where the engines' gaps read, and
    nothing is corrected; had the load been 6 per engine (the profile's 40 ms), the same reading says they are
    faster, by the least the bucket allows."""
    reading = prometheus_quantile(0.99, VLLM_ITL, [20.0] * 100)
    at_mean = refine(seen(reading, 4, VLLM_ITL), PROFILE, Recommendation(0, 1, 2), Memory(), TAIL)
    assert at_mean.decode_correction == 1.0
    at_peak = refine(seen(reading, 12, VLLM_ITL), PROFILE, Recommendation(0, 1, 2), Memory(), TAIL)
    assert at_peak.decode_correction == pytest.approx(math.sqrt(25 / 40))


def _by_le(*les: str) -> bytes:
    result = [{"metric": {"le": le}, "value": [1.5, "3"]} for le in les]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()


def test_bucket_bounds_are_read_from_an_answer_by_le() -> None:
    assert read_bounds(200, _by_le("0.05", "+Inf", "0.01", "0.025", "0.025")) == (0.01, 0.025, 0.05)
    assert read_bounds(200, _by_le()) == ()
    # bounds no latency has are left out, never infinite once in milliseconds: 1e308 s would be
    assert read_bounds(200, _by_le("-1", "0", "0.5", "86400", "86401", "1e308", "NaN")) == (0.0, 0.5, 86400.0)
    malformed = read_bounds(200, _by_le("0.05", "fast"))
    assert isinstance(malformed, Unanswered)
    assert malformed.code == PROMETHEUS_MALFORMED
    assert isinstance(read_bounds(200, _by_le("1" * 65)), Unanswered)  # a label longer than any number
    scalar = json.dumps({"status": "success", "data": {"resultType": "scalar", "result": [1.5, "1"]}}).encode()
    assert isinstance(read_bounds(200, scalar), Unanswered)


async def test_bounds_that_cannot_be_read_are_the_last_read_not_a_held_pass(
    metrics_url: tuple[str, list[Answerer]],  # noqa: F811 (the fixture)
) -> None:
    """A histogram's buckets change only with the engine: an unreadable bounds answer takes the last read for the
    same query; with none read yet, the typed failure stands."""
    url, answering = metrics_url
    answering.append(lambda query: (200, "application/json", _by_le("0.1", "0.5", "+Inf")))
    async with ClientSession() as session:
        assert await known_bounds(session, url, "bounds-a") == (0.1, 0.5)
        answering.append(lambda query: (200, "application/json", _by_le("0.1", "fast")))
        assert await known_bounds(session, url, "bounds-a") == (0.1, 0.5)
        with pytest.raises(PrometheusError) as caught:
            await known_bounds(session, url, "bounds-b")
        assert caught.value.code == PROMETHEUS_MALFORMED


def test_the_queries_read_the_windows_mean_load_and_the_histograms_bounds() -> None:
    """The decode load is the in-flight gauges' mean over the window, not one instant's sum; each histogram's bounds
    come from its buckets' series over the same window."""
    asked = queries("team-a", "llama", "10s", 0.99, 0.99)
    assert asked["decode_running"].startswith("sum(avg_over_time(")
    assert asked["decode_running"].endswith("[10s]))")
    itl = histograms("team-a", "llama")["itl"]
    assert itl in asked["itl"]
    assert bounds_query(itl, "10s") == f"count by (le) (last_over_time({itl}[10s]))"


def test_a_reading_a_rounding_above_a_bound_is_that_bounds_bucket() -> None:
    """Prometheus reads a percentile at a bucket's top as 0.001 + (0.01 - 0.001) * 1.0 = 0.010000000000000002 s: the
    bucket below, not the next one (else a prediction inside it would read as engines twice as slow)."""
    reading = 1000 * (0.001 + (0.01 - 0.001) * 1.0)
    assert reading > 10.0
    assert bucket(reading, (1.0, 10.0, 100.0)) == (1.0, 10.0)
    assert ratio(reading, 5.0, (1.0, 10.0, 100.0)) == 1.0
    assert ratio(10.5, 5.0, (1.0, 10.0, 100.0)) == 2.0  # a real reading above the bound still names the next one
