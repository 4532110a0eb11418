"""kvbridge's planner, its pure part (planner.profile, planner.sizing): the formulas on worked examples, the safety
rules, and properties over random traffic and profiles."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvbridge_operator.api.autoscaling import AutoscalingSpec
from kvbridge_operator.controller.autoscaling import may_be_due
from kvbridge_operator.planner.profile import DecodePoint, DecodeProfile, PerformanceProfile, PrefillProfile
from kvbridge_operator.planner.sizing import (
    METRICS_IMPLAUSIBLE,
    METRICS_MISSING,
    METRICS_STALE,
    SIZED,
    TARGET_UNREACHABLE,
    Bounds,
    Decision,
    Memory,
    Observation,
    Recommendation,
    Targets,
    decide,
    decode_engines,
    predicted_rate,
    prefill_engines,
    rate_noise,
)

ROOT = Path(__file__).resolve().parents[2]
PROFILE = PerformanceProfile(
    engine="test",
    prefill=PrefillProfile(tokens_per_second=10_000),
    decode=DecodeProfile(
        context_tokens=1100,
        points=[
            DecodePoint(concurrency=1, itl_ms=10),
            DecodePoint(concurrency=8, itl_ms=20),
            DecodePoint(concurrency=32, itl_ms=50),
        ],
    ),
)
TARGETS = Targets(ttft_ms=200, itl_ms=30)
BOUNDS = (Bounds(1, 64), Bounds(1, 64))
TRAFFIC = Observation(
    request_rate=30,
    prompt_tokens=1000,
    output_tokens=100,
    prefix_hit_rate=0.5,
    decode_running=40,
    ttft_ms=None,
    itl_ms=None,
    staleness_seconds=2,
)


NO_MEMORY = Memory()


def run(
    observation: Observation | None, memory: Memory = NO_MEMORY, now: float = 1000.0, running: tuple[int, int] = (2, 4)
) -> Decision:
    return decide(
        observation, "Prometheus is down", TARGETS, PROFILE, Recommendation(now, *running), BOUNDS, memory, now, 30, 300
    )


def test_decode_latency_is_interpolated_and_the_concurrency_within_a_target_found() -> None:
    decode = PROFILE.decode
    assert decode.itl_ms(1) == 10
    assert decode.itl_ms(0.5) == 10
    assert decode.itl_ms(20) == pytest.approx(35)
    assert decode.itl_ms(64) == pytest.approx(90)  # beyond the last point, along the last slope
    assert decode.concurrency_within(30) == pytest.approx(16, abs=1e-6)
    assert decode.concurrency_within(9) == 0.0  # not even one request


def test_the_formulas_on_a_worked_example() -> None:
    """Prefill: 500 uncached tokens take 50 ms on an idle engine; at the queue's mean (tail 1) a 200 ms TTFT allows
    75 % utilisation, so 15,000 tokens/s need 15,000 / 7,500 = 2 engines; its 95th percentile lies ln(20) = 3.0 mean
    times out, so 150 ms of the 200 go to the tail and 25 % utilisation is left: 6 engines. Decode: 16 requests per
    engine within 30 ms ITL, 533 tokens/s each; 3,000 tokens/s need 6."""
    assert prefill_engines(30, TRAFFIC, PROFILE, 200, 1.0, tail=1.0) == 2
    assert prefill_engines(31, TRAFFIC, PROFILE, 200, 1.0, tail=1.0) == 3
    assert prefill_engines(30, TRAFFIC, PROFILE, 200, 1.0, tail=Targets(200, 30, 95).tail) == 6
    assert decode_engines(30, TRAFFIC, PROFILE, 30, 1.0) == 6
    # the prefix hit rate discounts prefill alone (without hits: 100 ms a prompt, 50 % utilisation, 6 engines)
    assert prefill_engines(30, replace(TRAFFIC, prefix_hit_rate=0.0), PROFILE, 200, 1.0, tail=1.0) == 6
    assert decode_engines(30, replace(TRAFFIC, prefix_hit_rate=0.0), PROFILE, 30, 1.0) == 6
    # an idle engine cannot meet a TTFT shorter than one prompt's compute
    assert prefill_engines(1, TRAFFIC, PROFILE, 40, 1.0, tail=1.0) is None
    # headroom: a quarter more demand than predicted
    assert (
        run(TRAFFIC).prefill
        < decide(
            TRAFFIC, "", replace(TARGETS, headroom=1.0), PROFILE, Recommendation(0, 2, 4), BOUNDS, Memory(), 0.0, 30, 0
        ).prefill
    )


def test_a_pass_sizes_both_roles_and_remembers_what_it_saw() -> None:
    decision = run(TRAFFIC)
    assert (decision.prefill, decision.decode, decision.reason, decision.held) == (2, 6, SIZED, False)
    assert decision.memory.last_rate == 30
    assert decision.memory.history == (Recommendation(1000.0, 2, 6),)


def test_a_growing_rate_is_extrapolated_one_interval() -> None:
    decision = run(TRAFFIC, Memory(last_rate=20))
    assert decision.predicted_rate == 40  # 30 seen, 10 more than last time
    assert (decision.prefill, decision.decode) == (3, 8)


def test_an_increase_chance_alone_makes_is_not_extrapolated() -> None:
    """Found closing the loop (issue 61): at 1 request/s over a 10 s window, Poisson counts alone move the rate by
    +-0.6 request/s between passes, and extrapolating each such rise (doubled again by the headroom) added a decode pod
    at rest, scaled in a minute later: an oscillation."""
    assert rate_noise(1.0, 10) == pytest.approx(0.632, abs=1e-3)
    assert rate_noise(5.0, 0) == 0  # no window: any increase is extrapolated, as before
    assert predicted_rate(1.5, 1.0, rate_noise(1.5, 10)) == 1.5  # +0.5: chance
    assert predicted_rate(3.0, 1.0, rate_noise(3.0, 10)) == 5.0  # +2: a step, extrapolated
    quiet = replace(TRAFFIC, request_rate=31)
    assert run(quiet, Memory(last_rate=30)).predicted_rate == 32  # without the window: extrapolated
    seen = decide(quiet, "", TARGETS, PROFILE, Recommendation(0, 2, 4), BOUNDS, Memory(last_rate=30), 0.0, 30, 0, 60)
    assert seen.predicted_rate == 31  # 30 -> 31 over 60 s: within 2 x sqrt(31 / 60) = 1.4


@given(
    st.floats(0, 1e4, allow_nan=False),
    st.one_of(st.none(), st.floats(0, 1e4, allow_nan=False)),
    st.floats(0, 3600, allow_nan=False),
)
def test_the_prediction_is_what_was_seen_or_its_rise_beyond_chance_extrapolated(
    rate: float, last: float | None, window: float
) -> None:
    noise = rate_noise(max(rate, last or 0.0), window)
    predicted = predicted_rate(rate, last, noise)
    assert predicted >= rate
    assert predicted == rate or (
        last is not None and rate - last > noise and predicted == pytest.approx(2 * rate - last)
    )


@pytest.mark.parametrize(
    ("observation", "reason"),
    [
        (None, METRICS_MISSING),
        (replace(TRAFFIC, request_rate=math.nan), METRICS_MISSING),
        (replace(TRAFFIC, prompt_tokens=math.inf), METRICS_MISSING),
        (replace(TRAFFIC, staleness_seconds=120), METRICS_STALE),
        (replace(TRAFFIC, request_rate=-1), METRICS_IMPLAUSIBLE),
        (replace(TRAFFIC, prefix_hit_rate=1.5), METRICS_IMPLAUSIBLE),
        (replace(TRAFFIC, request_rate=1e9), METRICS_IMPLAUSIBLE),
        (replace(TRAFFIC, output_tokens=1e8), METRICS_IMPLAUSIBLE),
    ],
)
def test_bad_metrics_hold_the_sizes_and_say_why(observation: Observation | None, reason: str) -> None:
    memory = Memory(history=(Recommendation(990.0, 5, 5),), last_rate=12)
    decision = run(observation, memory, running=(3, 7))
    assert (decision.prefill, decision.decode, decision.reason, decision.held) == (3, 7, reason, True)
    assert decision.memory == memory  # nothing learnt from figures not believed
    assert decision.message


def test_no_traffic_is_not_missing_metrics_and_goes_to_the_minimum() -> None:
    idle = replace(TRAFFIC, request_rate=0, prompt_tokens=math.nan, output_tokens=math.nan, decode_running=0)
    decision = run(idle)
    assert (decision.prefill, decision.decode, decision.held) == (1, 1, False)


def test_scale_down_waits_for_the_stabilization_window_and_scale_up_does_not() -> None:
    high = run(replace(TRAFFIC, request_rate=60), now=1000.0)
    assert (high.prefill, high.decode) == (4, 12)
    low = run(TRAFFIC, replace(high.memory, last_rate=30), now=1100.0)
    assert (low.prefill, low.decode) == (4, 12)  # 2 and 6 wanted, 4 and 12 kept within 300 s
    later = run(TRAFFIC, replace(low.memory, last_rate=30), now=1301.0)
    assert (later.prefill, later.decode) == (2, 6)  # the high recommendation left the window
    burst = run(replace(TRAFFIC, request_rate=90), replace(later.memory, last_rate=90), now=1302.0)
    assert (burst.prefill, burst.decode) == (6, 17)


def test_sizes_stay_within_min_and_max_and_an_unreachable_target_asks_for_the_most() -> None:
    bounded = decide(
        replace(TRAFFIC, request_rate=1000),
        "",
        TARGETS,
        PROFILE,
        Recommendation(0, 2, 4),
        (Bounds(1, 8), Bounds(3, 9)),
        Memory(),
        0.0,
        30,
        300,
    )
    assert (bounded.prefill, bounded.decode) == (8, 9)
    slow = decide(
        TRAFFIC, "", Targets(ttft_ms=20, itl_ms=5), PROFILE, Recommendation(0, 2, 4), BOUNDS, Memory(), 0.0, 30, 300
    )
    assert (slow.prefill, slow.decode, slow.reason, slow.held) == (64, 64, TARGET_UNREACHABLE, False)


def test_observed_latency_above_the_profiles_refines_it() -> None:
    """2 prefill engines at 15 req/s run at 37.5 % of 10,000 tokens/s: the model predicts a median TTFT of
    ln(2) x 50 / 0.625 = 55 ms; observing 150 ms multiplies the work assumed per token by sqrt(150 / 55) (damped);
    an observation over 4x off (a queue a burst blew up) refines nothing."""
    predicted = math.log(2) * 50 / (1 - 15 * 500 / 20_000)
    slow = run(replace(TRAFFIC, ttft_ms=150.0, itl_ms=60.0, request_rate=15), running=(2, 6))
    assert slow.memory.prefill_correction == pytest.approx(math.sqrt(150 / predicted), rel=1e-6)
    assert slow.memory.decode_correction > 1
    fresh = run(replace(TRAFFIC, request_rate=15), running=(2, 6))
    assert (slow.prefill, slow.decode) > (fresh.prefill, fresh.decode)
    blown = run(replace(TRAFFIC, ttft_ms=60_000.0, request_rate=15), running=(2, 6))
    assert blown.memory.prefill_correction == 1.0


def test_autoscaling_needs_everything_it_uses_when_enabled() -> None:
    assert AutoscalingSpec().enabled is False
    with pytest.raises(ValidationError, match="enabled needs prometheusUrl, ttft, itl, profile"):
        AutoscalingSpec(enabled=True)
    for bad in (
        {"ttft": {"milliseconds": 0}},
        {"ttft": {"milliseconds": 100, "percentile": 30}},
        {"intervalSeconds": 1},
    ):
        with pytest.raises(ValidationError):
            AutoscalingSpec.model_validate(bad)
    with pytest.raises(ValidationError):
        AutoscalingSpec.model_validate({"prometheusUrl": "ftp://x"})
    with pytest.raises(ValidationError, match="strictly increasing"):
        DecodeProfile(
            context_tokens=1, points=[DecodePoint(concurrency=2, itl_ms=1), DecodePoint(concurrency=1, itl_ms=2)]
        )


observations = st.builds(
    Observation,
    request_rate=st.floats(0, 500),
    prompt_tokens=st.floats(1, 20_000),
    output_tokens=st.floats(1, 4_000),
    prefix_hit_rate=st.floats(0, 1),
    decode_running=st.floats(0, 2_000),
    ttft_ms=st.none() | st.floats(1, 10_000),
    itl_ms=st.none() | st.floats(1, 1_000),
    staleness_seconds=st.floats(0, 60),
)
profiles = st.tuples(st.floats(100, 1e6), st.lists(st.floats(1, 500), min_size=1, max_size=6)).map(
    lambda drawn: PerformanceProfile(
        engine="p",
        prefill=PrefillProfile(tokens_per_second=drawn[0]),
        decode=DecodeProfile(
            context_tokens=1000,
            points=[DecodePoint(concurrency=2**i, itl_ms=itl) for i, itl in enumerate(sorted(drawn[1]))],
        ),
    )
)
bounds = st.tuples(st.integers(0, 16), st.integers(0, 48)).map(lambda b: Bounds(b[0], b[0] + b[1]))


@settings(max_examples=300, deadline=None)
@given(observations, profiles, bounds, bounds, st.floats(1, 5_000), st.floats(1, 500), st.floats(1.0, 3.0))
def test_sizes_are_within_bounds_and_grow_with_the_rate(
    observation: Observation,
    profile: PerformanceProfile,
    prefill: Bounds,
    decode: Bounds,
    ttft: float,
    itl: float,
    growth: float,
) -> None:
    def sized(seen: Observation) -> Decision:
        return decide(
            seen, "", Targets(ttft, itl), profile, Recommendation(0, 1, 1), (prefill, decode), Memory(), 0.0, 30, 0
        )

    observation = replace(observation, ttft_ms=None, itl_ms=None)  # no refinement: one model for both
    first = sized(observation)
    assert not first.held
    assert prefill.low <= first.prefill <= prefill.high
    assert decode.low <= first.decode <= decode.high
    busier = sized(replace(observation, request_rate=observation.request_rate * growth))
    assert busier.prefill >= first.prefill
    assert busier.decode >= first.decode


def test_plan_shows_the_planner_when_it_is_on(tmp_path: Path) -> None:
    document = yaml.safe_load((ROOT / "examples" / "synthetic" / "llama3-8b-hetero-tp.yaml").read_text())
    document["spec"]["autoscaling"] = {
        "enabled": True,
        "prometheusUrl": "http://prometheus.monitoring:9090",
        "ttft": {"milliseconds": 500},
        "itl": {"milliseconds": 30, "percentile": 90},
        "profile": {"name": "llama-profile"},
    }
    path = tmp_path / "planned.yaml"
    path.write_text(yaml.safe_dump(document))
    command = [sys.executable, "-m", "kvbridge_operator", "plan", "-f", str(path)]
    text = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    assert (
        "  autoscaling: planner to TTFT p95 500 ms and ITL p90 30 ms, every 30 s from "
        "http://prometheus.monitoring:9090 (profile ConfigMap llama-profile/profile.json, 0% headroom); "
        "prefill 1-1024, decode 1-1024"
    ) in text.splitlines()
    answer = json.loads(
        subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=60, check=True).stdout
    )
    assert answer[0]["autoscaling"] == {
        "enabled": True,
        "ttft": {"milliseconds": 500.0, "percentile": 95.0},
        "itl": {"milliseconds": 30.0, "percentile": 90.0},
        "prometheusUrl": "http://prometheus.monitoring:9090",
        "profile": {"configMap": "llama-profile", "key": "profile.json"},
        "intervalSeconds": 30,
        "windowSeconds": 60,
        "headroomPercent": 0,
        "stabilizationWindowSeconds": 300,
        "tolerancePercent": 10,
        "reversalWindowSeconds": 300,
        "warmupSeconds": 30,
        "bounds": {"prefill": [1, 1024], "decode": [1, 1024]},
    }
    del document["spec"]["autoscaling"]["itl"]
    path.write_text(yaml.safe_dump(document))
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode != 0
    assert "spec.autoscaling" in refused.stdout + refused.stderr
    assert "enabled needs itl" in refused.stdout + refused.stderr


def test_a_pass_is_due_an_interval_after_the_last_and_odd_values_leave_it_to_the_fresh_read() -> None:
    body = {"spec": {"autoscaling": {"intervalSeconds": 30}}, "status": {"autoscaling": {"lastPassAt": 1000.0}}}
    assert not may_be_due(body, 1020.0)
    assert may_be_due(body, 1029.6)
    assert may_be_due({"spec": {}}, 1e9)  # never passed: due at once (Unix time is far past 0)
    assert may_be_due({"spec": {"autoscaling": {"intervalSeconds": "soon"}}}, 0.0)
