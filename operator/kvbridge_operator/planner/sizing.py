"""The planner's decision: how many prefill and decode engines meet the TTFT and ITL targets next interval.

Given what Prometheus says of the last window (:class:`Observation`), the engines' profile and what the planner
remembers (:class:`Memory`, kept in ``status.autoscaling``):

- **demand**: the request rate, extrapolated one interval along its last change when it grows by more than chance
  would (twice a Poisson count's deviation over the rate's window; never predicted below what was seen), plus the
  headroom asked for (bursts arrive faster than new engines start), prompt and output lengths as observed;
- **prefill**: a request's uncached prompt (``prompt x (1 - prefix hit rate)``) takes ``s = uncached / capacity``
  on an idle engine; with one queue per engine at utilisation ``rho`` the time to first token is exponential with
  mean ``s / (1 - rho)`` (M/M/1), so its percentile ``q`` is ``ln(1 / (1 - q)) x s / (1 - rho)``; the TTFT target
  allows ``rho <= 1 - ln(1 / (1 - q)) x s / target`` and prefill needs ``ceil(rate x uncached / (capacity x rho))``
  engines;
- **decode**: the profile's ITL curve gives the most requests one engine decodes at once within the ITL target,
  ``n``, and so its token rate ``n / itl(n)``; decode needs ``ceil(rate x output / (n / itl(n)))`` engines;
- **online refinement**: each role's capacity is divided by a correction, the observed latency over the model's
  prediction at the engines running now, damped (square root per pass) and kept within [0.5, 4]; an observation
  more than 4x off the prediction (a queue a burst blew up) or at over 90 % utilisation refines nothing. Both sides
  are alike: the prediction is made at the window's mean load (its request rate; the mean of the decode engines'
  in-flight gauges over the window), and compared with the histogram bucket the observed percentile was read from,
  not with the reading's interpolated value (planner.buckets: a steady engine at its profile corrects nothing);
- **safety**: missing, NaN, negative, implausible or stale figures hold the current sizes (the reason says
  which); results lie within the roles' minReplicas and maxReplicas (the operator then keeps the P:D ratio);
- **hysteresis** (planner.hysteresis): a tolerance on scale-downs, the scale-down stabilization window (scale-ups
  act at once), a reversal window against changes of direction on chance, and no refinement from a role's latencies
  while its pods warm up.

Pure: no I/O; every function returns a value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .buckets import ratio
from .hysteresis import NONE, Change, Hysteresis, Sizes, changed, engines, settle, warm
from .profile import PerformanceProfile

#: what the planner refuses to believe of one deployment's traffic
MAX_RATE = 1e6  # requests per second
MAX_TOKENS = 1e7  # mean prompt or output tokens per request
#: the corrections' bounds: the profile is trusted within a factor of 2 faster and 4 slower
CORRECTION_RANGE = (0.5, 4.0)
#: utilisation above which a prefill observation does not refine the profile (the queue model is unreliable there)
REFINE_BELOW = 0.9
#: an observed latency further than this factor from the model's prediction does not refine it: a queue that a burst
#: blew up, or engines still starting, say nothing of the profile
REFINE_WITHIN = 4.0

# Stable reasons (docs/autoscaling.md): the first three hold the sizes.
METRICS_MISSING = "MetricsMissing"
METRICS_STALE = "MetricsStale"
METRICS_IMPLAUSIBLE = "MetricsImplausible"
SIZED = "Sized"
TARGET_UNREACHABLE = "TargetUnreachable"


@dataclass(frozen=True, slots=True)
class Observation:
    """The deployment's traffic over the last window, as Prometheus reports it."""

    request_rate: float  # requests finished per second (decode)
    prompt_tokens: float  # mean per request (NaN without requests)
    output_tokens: float  # mean per request (NaN without requests)
    prefix_hit_rate: float  # share of prompt tokens prefill found cached (0 without queries)
    decode_running: float  # requests decoding, on all decode engines: the mean over the window
    ttft_ms: float | None  # at the TTFT target's percentile (None without requests)
    itl_ms: float | None  # at the ITL target's percentile
    staleness_seconds: float  # since the engines' metrics were last scraped
    #: the finite upper bounds (ms, increasing) of the histograms the two percentiles were read from: a reading says
    #: only which bucket the percentile lies in (planner.buckets); empty: exact percentiles
    ttft_bounds_ms: tuple[float, ...] = ()
    itl_bounds_ms: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class Targets:
    ttft_ms: float
    itl_ms: float
    #: the TTFT target's percentile (50-99.9): the queue's tail the target holds
    ttft_percentile: float = 50.0
    #: extra capacity over the predicted demand, a fraction (0.25: a quarter more)
    headroom: float = 0.0

    @property
    def tail(self) -> float:
        """How many mean response times the TTFT percentile lies at in one exponential queue: ``ln(1/(1-q))``."""
        return math.log(1 / (1 - self.ttft_percentile / 100))


@dataclass(frozen=True, slots=True)
class Bounds:
    """A role's minReplicas and maxReplicas."""

    low: int
    high: int

    def clamp(self, value: int) -> int:
        return min(self.high, max(self.low, value))


@dataclass(frozen=True, slots=True)
class Recommendation:
    at: float  # Unix seconds
    prefill: int
    decode: int


@dataclass(frozen=True, slots=True)
class Memory:
    """What the planner keeps from one pass to the next (``status.autoscaling``)."""

    history: tuple[Recommendation, ...] = ()  # the sizes a scale-down may go to, recommended within the window
    last_rate: float | None = None
    prefill_correction: float = 1.0
    decode_correction: float = 1.0
    sizes: tuple[int, int] | None = None  # what the last pass asked for (None: the sizes running are taken)
    changes: tuple[Change | None, Change | None] = (None, None)  # each role's last change of size
    #: the first pass of the present run of passes that saw traffic (None: the last saw none): engines' first
    #: requests after a rest (cold caches, first compilations) are slower than any profile, and refine nothing
    traffic_since: float | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    prefill: int
    decode: int
    reason: str
    message: str
    held: bool
    predicted_rate: float = 0.0
    memory: Memory = field(default_factory=Memory)


def problem(observation: Observation, interval_seconds: float) -> tuple[str, str] | None:
    """Why ``observation`` cannot be acted on (a reason and a message), or None."""
    figures = {
        "request rate": observation.request_rate,
        "prefix hit rate": observation.prefix_hit_rate,
        "requests decoding": observation.decode_running,
        "staleness": observation.staleness_seconds,
    }
    if observation.request_rate > 0:
        figures |= {"mean prompt tokens": observation.prompt_tokens, "mean output tokens": observation.output_tokens}
    for name, value in figures.items():
        if not math.isfinite(value):
            return METRICS_MISSING, f"the {name} is {value} (no samples in the window?)"
        if value < 0:
            return METRICS_IMPLAUSIBLE, f"the {name} is negative ({value})"
    if observation.staleness_seconds > 3 * interval_seconds:
        return METRICS_STALE, (
            f"the engines' metrics were last scraped {observation.staleness_seconds:.0f} s ago (over 3 intervals)"
        )
    if observation.request_rate > MAX_RATE or observation.prefix_hit_rate > 1:
        return METRICS_IMPLAUSIBLE, (
            f"a request rate of {observation.request_rate:g}/s or a prefix hit rate of "
            f"{observation.prefix_hit_rate:g} cannot be one deployment's"
        )
    if observation.request_rate > 0 and max(observation.prompt_tokens, observation.output_tokens) > MAX_TOKENS:
        return METRICS_IMPLAUSIBLE, "a mean prompt or output over 10 million tokens per request"
    return None


def _damped(correction: float, observed: float, predicted: float, bounds: tuple[float, ...] = ()) -> float:
    """``correction`` moved by the square root of observed over predicted, compared alike (:func:`~.buckets.ratio`:
    the prediction against the bucket of ``bounds`` the observed percentile was read from)."""
    seen = ratio(observed, predicted, bounds)
    if not math.isfinite(seen):
        return correction
    if not 1 / REFINE_WITHIN <= seen <= REFINE_WITHIN:  # a queue blown by a burst, not the profile
        return correction
    low, high = CORRECTION_RANGE
    return min(high, max(low, correction * math.sqrt(seen)))


def refine(
    observation: Observation,
    profile: PerformanceProfile,
    running: Recommendation,
    memory: Memory,
    tail: float,
    warmed: tuple[bool, bool] = (True, True),
) -> Memory:
    """The corrections after comparing what was observed with what the profile predicts for the engines running
    (``warmed``: whether each role's latencies may refine it, :func:`~.hysteresis.warm`)."""
    prefill_c, decode_c = memory.prefill_correction, memory.decode_correction
    uncached = observation.prompt_tokens * (1 - observation.prefix_hit_rate)
    ttft = observation.ttft_ms if warmed[0] else None
    if ttft is not None and observation.request_rate > 0 and running.prefill > 0 and uncached > 0:
        capacity = profile.prefill.tokens_per_second / prefill_c
        rho = observation.request_rate * uncached / (running.prefill * capacity)
        if rho < REFINE_BELOW:
            predicted = tail * 1000 * uncached / capacity / (1 - rho)
            prefill_c = _damped(prefill_c, ttft, predicted, observation.ttft_bounds_ms)
    if warmed[1] and observation.itl_ms is not None and running.decode > 0 and observation.decode_running > 0:
        predicted = profile.decode.itl_ms(observation.decode_running / running.decode) * decode_c
        decode_c = _damped(decode_c, observation.itl_ms, predicted, observation.itl_bounds_ms)
    return replace(memory, prefill_correction=prefill_c, decode_correction=decode_c)


def rate_noise(rate: float, window_seconds: float) -> float:
    """Twice the standard deviation of a Poisson rate of ``rate`` counted over ``window_seconds`` (0 without a
    window): how much two windows' rates differ by chance alone, most of the time."""
    return 2 * math.sqrt(max(rate, 0.0) / window_seconds) if window_seconds > 0 else 0.0


def predicted_rate(rate: float, last: float | None, noise: float = 0.0) -> float:
    """Next interval's request rate: this one's, plus its last increase where that exceeds ``noise`` (chance alone
    does not grow the prediction); never below what was seen."""
    rise = 0.0 if last is None else rate - last
    return rate + rise if rise > noise else rate


def prefill_need(
    rate: float,
    observation: Observation,
    profile: PerformanceProfile,
    ttft_ms: float,
    correction: float,
    tail: float = math.log(2),
) -> float | None:
    """Prefill engines' worth of work (a fraction) for ``rate`` within the TTFT target at the percentile whose
    ``tail`` is given (the median's by default); None: not even an idle engine meets it."""
    uncached = observation.prompt_tokens * (1 - observation.prefix_hit_rate) if rate > 0 else 0.0
    if uncached <= 0:
        return 0.0
    capacity = profile.prefill.tokens_per_second / correction
    service_ms = tail * 1000 * uncached / capacity
    if service_ms >= ttft_ms:
        return None
    utilisation = 1 - service_ms / ttft_ms
    return rate * uncached / (capacity * utilisation)


def prefill_engines(
    rate: float,
    observation: Observation,
    profile: PerformanceProfile,
    ttft_ms: float,
    correction: float,
    tail: float = math.log(2),
) -> int | None:
    """Whole prefill engines for ``rate`` (:func:`prefill_need`)."""
    need = prefill_need(rate, observation, profile, ttft_ms, correction, tail)
    return None if need is None else engines(need)


def decode_need(
    rate: float, observation: Observation, profile: PerformanceProfile, itl_ms: float, correction: float
) -> float | None:
    """Decode engines' worth of work (a fraction) for ``rate`` within the ITL target (None: not even one request
    per engine meets it)."""
    if rate <= 0 or observation.output_tokens <= 0:
        return 0.0
    concurrency = profile.decode.concurrency_within(itl_ms / correction)
    if concurrency < 1:
        return None
    tokens_per_second = concurrency / (profile.decode.itl_ms(concurrency) * correction / 1000)
    return rate * observation.output_tokens / tokens_per_second


def decode_engines(
    rate: float, observation: Observation, profile: PerformanceProfile, itl_ms: float, correction: float
) -> int | None:
    """Whole decode engines for ``rate`` (:func:`decode_need`)."""
    need = decode_need(rate, observation, profile, itl_ms, correction)
    return None if need is None else engines(need)


def _needs(
    rate: float, observation: Observation, profile: PerformanceProfile, targets: Targets, memory: Memory
) -> tuple[float | None, float | None]:
    """Both roles' engines' worth of work for ``rate`` at the corrections of ``memory``."""
    return (
        prefill_need(rate, observation, profile, targets.ttft_ms, memory.prefill_correction, targets.tail),
        decode_need(rate, observation, profile, targets.itl_ms, memory.decode_correction),
    )


def role_sizes(
    needs: tuple[float | None, float | None, float | None],
    bounds: Bounds,
    busy: tuple[bool, bool],
    tolerance: float,
) -> Sizes:
    """One role's recommendations from its ``needs`` (None: a target no engine meets: the role's maximum): at the
    predicted demand (a scale-up's), the same at a correction of at least 1 (a scale-down's floor), and at the
    demand's lower bound (a reversal's); ``busy``: whether the demand and its lower bound are above 0 (then at least
    one engine)."""

    def whole(value: float | None, spare: float, above_zero: bool) -> int:
        count = bounds.high if value is None else engines(value, spare)
        return bounds.clamp(max(count, 1) if above_zero else count)

    up, down, low = needs
    return Sizes(whole(up, 0.0, busy[0]), whole(down, tolerance, busy[0]), whole(low, 0.0, busy[1]))


def _traffic_since(observation: Observation, memory: Memory, now: float) -> float | None:
    """When the present run of passes with traffic began: None without traffic now; 0 where the last pass saw
    traffic but no start was kept (a status written before ``trafficSince``): warm."""
    if observation.request_rate <= 0:
        return None
    if memory.traffic_since is not None:
        return memory.traffic_since
    return 0.0 if memory.last_rate else now


def decide(
    observation: Observation | None,
    unavailable: str,
    targets: Targets,
    profile: PerformanceProfile,
    running: Recommendation,
    bounds: tuple[Bounds, Bounds],
    memory: Memory,
    now: float,
    interval_seconds: float,
    window_seconds: float,
    rate_window_seconds: float = 0.0,
    *,
    hysteresis: Hysteresis = NONE,
    settled: tuple[bool, bool] = (True, True),
) -> Decision:
    """One pass: the sizes to ask for (``running``: the engines running now, with ``at`` unused; ``unavailable``:
    why there is no observation, when ``observation`` is None; ``window_seconds``: the stabilization window;
    ``rate_window_seconds``: the window the rate and latencies were read over, whose noise an increase must exceed to
    be extrapolated, 0: any increase is; ``hysteresis``: planner.hysteresis's settings; ``settled``: whether each
    role's pods are all ready)."""
    if observation is None:
        return Decision(running.prefill, running.decode, METRICS_MISSING, unavailable, True, memory=memory)
    wrong = problem(observation, interval_seconds)
    if wrong is not None:
        return Decision(running.prefill, running.decode, wrong[0], wrong[1], True, memory=memory)
    current = memory.sizes if memory.sizes is not None else (running.prefill, running.decode)
    since = _traffic_since(observation, memory, now)
    traffic_warm = since is not None and now - since >= rate_window_seconds + hysteresis.warmup_seconds
    warmed = (
        traffic_warm and warm(memory.changes[0], settled[0], now, rate_window_seconds, hysteresis),
        traffic_warm and warm(memory.changes[1], settled[1], now, rate_window_seconds, hysteresis),
    )
    refined = refine(observation, profile, running, memory, targets.tail, warmed)
    noise = rate_noise(max(observation.request_rate, memory.last_rate or 0.0), rate_window_seconds)
    rate = predicted_rate(observation.request_rate, memory.last_rate, noise) * (1 + targets.headroom)
    low = max(0.0, observation.request_rate - noise) * (1 + targets.headroom)  # not extrapolated: chance excluded
    lower = replace(  # nor a correction's rise alone
        refined,
        prefill_correction=min(memory.prefill_correction, refined.prefill_correction),
        decode_correction=min(memory.decode_correction, refined.decode_correction),
    )
    slowest = replace(  # a scale-down trusts no correction that says the engines are faster than profiled
        refined,
        prefill_correction=max(1.0, refined.prefill_correction),
        decode_correction=max(1.0, refined.decode_correction),
    )
    needs, down_needs, low_needs = (
        _needs(rate, observation, profile, targets, refined),
        _needs(rate, observation, profile, targets, slowest),
        _needs(low, observation, profile, targets, lower),
    )
    sizes = [
        role_sizes((needs[i], down_needs[i], low_needs[i]), bounds[i], (rate > 0, low > 0), hysteresis.tolerance)
        for i in range(2)
    ]
    kept = (
        *(r for r in memory.history if now - r.at < window_seconds),
        Recommendation(now, sizes[0].down, sizes[1].down),
    )
    stabilized = (max(r.prefill for r in kept), max(r.decode for r in kept))
    chosen = tuple(  # within the bounds as they are now (a window may hold sizes of a higher maximum)
        bounds[i].clamp(settle(current[i], sizes[i], stabilized[i], memory.changes[i], now, hysteresis))
        for i in range(2)
    )
    memory = replace(
        refined,
        history=kept,
        last_rate=observation.request_rate,
        sizes=(chosen[0], chosen[1]),
        changes=(
            changed(memory.changes[0], current[0], chosen[0], now),
            changed(memory.changes[1], current[1], chosen[1], now),
        ),
        traffic_since=since,
    )
    unreachable = [role for role, need in zip(("prefill", "decode"), needs, strict=True) if need is None]
    reason = TARGET_UNREACHABLE if unreachable else SIZED
    message = _message(observation, rate, unreachable, (sizes[0].up, sizes[1].up), (chosen[0], chosen[1]), memory)
    return Decision(chosen[0], chosen[1], reason, message, False, rate, memory)


def _message(
    observation: Observation,
    rate: float,
    unreachable: list[str],
    wanted: tuple[int, int],
    chosen: tuple[int, int],
    memory: Memory,
) -> str:
    if unreachable:
        return (
            f"{' and '.join(unreachable)}: even an idle engine misses the target (the profile and the corrections "
            f"{memory.prefill_correction:.2f}/{memory.decode_correction:.2f}); sized to maxReplicas"
        )
    return (
        f"{rate:.3g} req/s predicted ({observation.request_rate:.3g} seen), prompt {observation.prompt_tokens:.0f} "
        f"tokens at {observation.prefix_hit_rate:.0%} prefix hits, output {observation.output_tokens:.0f}: "
        f"{wanted[0]} prefill and {wanted[1]} decode engines; {chosen[0]} and {chosen[1]} after the hysteresis "
        "(stabilization window, tolerance, reversal window)"
    )
