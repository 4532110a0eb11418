"""A trace-driven comparison of ways to size prefill and decode: static provisioning at the peak, the KEDA recipe of
docs/autoscaling.md, and kvbridge's planner (``kvbridge_operator.planner``), over one simulated day.

    .venv/bin/python benchmarks/planner_trace.py [--seeds 5] [--json]

The day (a 30 s step, 24 hours): a diurnal request rate (2 req/s at night, 10 at noon) with bursts (x2.5 for 10
minutes, at random times), prompts of 1,000 tokens until 14:00 and 1,800 after (a shift in lengths), 40 % of
prompt tokens cached, 200 output tokens. The pods follow a model, not real engines (what is simulated, said
plainly):

- prefill: one queue per engine (M/M/1): a request's uncached prompt takes ``s = uncached / capacity``; at
  ``lambda`` requests/s per engine its time to first token is exponential with rate ``1/s - lambda``, so a share
  ``1 - exp(-(1/s - lambda) x target)`` meets the target, none when ``lambda >= 1/s``;
- decode: requests in flight per engine ``n`` solve Little's law ``n = lambda x output x itl(n)`` on the engine's
  ITL curve; a request's mean ITL is ``itl(n)`` times log-normal noise (sigma 0.1);
- the engines are 15 % slower at prefill than the profile the planner is given (it must learn it), new pods take
  2 minutes to become ready, removed pods leave at once (drained; nothing lost).

Policies: **static** runs the fewest pods that meet both targets at the day's peak, all day; **KEDA** is the recipe
(prefill on waiting requests per pod over 4, decode on KV-cache usage over 0.7, HPA's rule ``ceil(current x
metric / target)`` with a 10 % tolerance and a 300 s scale-down stabilization); **planner** calls
``planner.sizing.decide`` every step on what Prometheus would report of the last step (TTFT p95 from the queue,
ITL p95 from the curve). Reported: the share of requests within both targets and the replica-hours of both roles,
against static.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("agent", "operator")]

from kvbridge_operator.planner.profile import DecodePoint, DecodeProfile, PerformanceProfile, PrefillProfile  # noqa: E402
from kvbridge_operator.planner.sizing import Bounds, Memory, Observation, Recommendation, Targets, decide  # noqa: E402

STEP = 30.0
DAY = 86_400
TARGETS = Targets(ttft_ms=600, itl_ms=40, ttft_percentile=99)
PROFILE = PerformanceProfile(
    engine="simulated",
    prefill=PrefillProfile(tokens_per_second=12_000),
    decode=DecodeProfile(
        context_tokens=2000,
        points=[
            DecodePoint(concurrency=1, itl_ms=12),
            DecodePoint(concurrency=16, itl_ms=18),
            DecodePoint(concurrency=64, itl_ms=35),
            DecodePoint(concurrency=128, itl_ms=60),
        ],
    ),
)
#: the engines' real prefill capacity, against the profile's
TRUE_PREFILL = 0.85
HIT_RATE, OUTPUT = 0.4, 200
READY_DELAY = 120.0
ITL_SIGMA = 0.1
BOUNDS = (Bounds(1, 64), Bounds(1, 64))
#: KV-cache capacity of one decode engine, in tokens (the KEDA recipe's kv_cache_usage)
KV_TOKENS = 128 * 2048
#: the planner's headroom settings compared (spec.autoscaling.headroomPercent)
HEADROOMS = (25, 50, 100)


@dataclass(frozen=True)
class Moment:
    rate: float
    prompt: float


def day(seed: int) -> list[Moment]:
    rng = random.Random(seed)
    bursts = [rng.uniform(0, DAY - 600) for _ in range(6)]
    moments = []
    for i in range(int(DAY / STEP)):
        t = i * STEP
        rate = 2 + 8 * (0.5 - 0.5 * math.cos(2 * math.pi * t / DAY))
        if any(b <= t < b + 600 for b in bursts):
            rate *= 2.5
        moments.append(Moment(rate, 1000 if t < 14 * 3600 else 1800))
    return moments


def prefill_state(moment: Moment, engines: int) -> tuple[float, float]:
    """The share of requests within the TTFT target, and the TTFT at the target's percentile (ms), on ``engines``
    ready engines."""
    if engines <= 0:
        return 0.0, 60_000.0
    service = moment.prompt * (1 - HIT_RATE) / (PROFILE.prefill.tokens_per_second * TRUE_PREFILL)
    spare = 1 / service - moment.rate / engines
    if spare <= 0:
        return 0.0, 60_000.0
    return 1 - math.exp(-spare * TARGETS.ttft_ms / 1000), 1000 * TARGETS.tail / spare


def decode_state(moment: Moment, engines: int) -> tuple[float, float, float]:
    """The share within the ITL target, the ITL p99 (ms) and the requests in flight per engine."""
    if engines <= 0:
        return 0.0, 60_000.0, 0.0
    per_engine = moment.rate / engines * OUTPUT  # tokens per second
    n = 1.0
    for _ in range(200):  # Little's law on the ITL curve, by fixed point
        following = per_engine * PROFILE.decode.itl_ms(n) / 1000
        if following > 10_000:
            return 0.0, 60_000.0, following
        if abs(following - n) < 1e-6:
            break
        n = following
    itl = PROFILE.decode.itl_ms(max(n, 1))
    within = 0.5 * (1 + math.erf(math.log(TARGETS.itl_ms / itl) / (ITL_SIGMA * math.sqrt(2))))
    return within, itl * math.exp(2.326 * ITL_SIGMA), n  # its 99th percentile, as the target's


@dataclass
class Fleet:
    """A role's pods: those ready, and those starting (ready at a time)."""

    ready: int
    starting: list[float]

    def ask(self, wanted: int, now: float) -> None:
        total = self.ready + len(self.starting)
        if wanted > total:
            self.starting += [now + READY_DELAY] * (wanted - total)
        elif wanted < total:  # drop starting pods first, then drain ready ones
            cut = total - wanted
            dropped = min(cut, len(self.starting))
            self.starting = self.starting[: len(self.starting) - dropped]
            self.ready -= cut - dropped

    def tick(self, now: float) -> None:
        self.ready += sum(1 for t in self.starting if t <= now)
        self.starting = [t for t in self.starting if t > now]

    @property
    def pods(self) -> int:
        return self.ready + len(self.starting)


def static_sizes(moments: list[Moment]) -> tuple[int, int]:
    """The fewest pods of each role meeting 99 % within each target at the day's worst moment."""
    prefill = max(next(e for e in range(1, 200) if prefill_state(m, e)[0] >= 0.995) for m in moments)
    decode = max(next(e for e in range(1, 200) if decode_state(m, e)[0] >= 0.995) for m in moments)
    return prefill, decode


class Keda:
    """HPA's rule on the recipe's two metrics, with its tolerance and scale-down stabilization."""

    def __init__(self) -> None:
        self.history: list[tuple[float, int, int]] = []

    def sizes(self, moment: Moment, prefill: Fleet, decode: Fleet, now: float) -> tuple[int, int]:
        rho = (
            moment.rate
            / max(prefill.ready, 1)
            * moment.prompt
            * (1 - HIT_RATE)
            / (PROFILE.prefill.tokens_per_second * TRUE_PREFILL)
        )
        waiting = 100.0 if rho >= 1 else rho * rho / (1 - rho)
        _, _, n = decode_state(moment, decode.ready)
        usage = min(1.0, n * (moment.prompt + OUTPUT) / KV_TOKENS)

        def rule(current: int, metric: float, target: float) -> int:
            ratio = metric / target
            return current if abs(ratio - 1) <= 0.1 else max(1, math.ceil(current * ratio))

        wanted = (rule(prefill.pods, waiting, 4), rule(decode.pods, usage, 0.7))
        self.history = [h for h in self.history if now - h[0] < 300] + [(now, *wanted)]
        return (
            min(64, max(h[1] for h in self.history)) if wanted[0] < prefill.pods else min(64, wanted[0]),
            min(64, max(h[2] for h in self.history)) if wanted[1] < decode.pods else min(64, wanted[1]),
        )


def simulate(policy: str, moments: list[Moment], static: tuple[int, int], headroom: float = 0.0) -> dict[str, float]:
    targets = replace(TARGETS, headroom=headroom)
    start = static if policy == "static" else (2, 2)
    prefill, decode = Fleet(start[0], []), Fleet(start[1], [])
    memory, keda = Memory(), Keda()
    within = total = pod_seconds = 0.0
    for i, moment in enumerate(moments):
        now = i * STEP
        prefill.tick(now)
        decode.tick(now)
        p_within, ttft_p95 = prefill_state(moment, prefill.ready)
        d_within, itl_p95, n = decode_state(moment, decode.ready)
        requests = moment.rate * STEP
        within += requests * p_within * d_within
        total += requests
        pod_seconds += (prefill.pods + decode.pods) * STEP
        if policy == "planner":
            seen = Observation(
                request_rate=moment.rate,
                prompt_tokens=moment.prompt,
                output_tokens=OUTPUT,
                prefix_hit_rate=HIT_RATE,
                decode_running=n * decode.ready,
                ttft_ms=ttft_p95,
                itl_ms=itl_p95,
                staleness_seconds=15,
            )
            running = Recommendation(now, prefill.ready, decode.ready)
            decision = decide(seen, "", targets, PROFILE, running, BOUNDS, memory, now, STEP, 300)
            memory = replace(decision.memory)
            prefill.ask(decision.prefill, now)
            decode.ask(decision.decode, now)
        elif policy == "keda":
            wanted = keda.sizes(moment, prefill, decode, now)
            prefill.ask(wanted[0], now)
            decode.ask(wanted[1], now)
    return {"withinBothTargets": within / total, "replicaHours": pod_seconds / 3600}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="days simulated (each its own bursts)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    policies = {"static": 0.0, "keda": 0.0, "planner": 0.0, **{f"planner +{h}%": h / 100 for h in HEADROOMS}}
    rows: dict[str, list[dict[str, float]]] = {policy: [] for policy in policies}
    for seed in range(args.seeds):
        moments = day(seed)
        static = static_sizes(moments)
        for policy, headroom in policies.items():
            rows[policy].append(simulate(policy.split()[0], moments, static, headroom))
    summary = {
        policy: {
            "withinBothTargetsMin": min(r["withinBothTargets"] for r in results),
            "withinBothTargetsMean": sum(r["withinBothTargets"] for r in results) / len(results),
            "replicaHoursMean": sum(r["replicaHours"] for r in results) / len(results),
        }
        for policy, results in rows.items()
    }
    static_hours = summary["static"]["replicaHoursMean"]
    for figures in summary.values():
        figures["ofStaticReplicaHours"] = figures["replicaHoursMean"] / static_hours
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{args.seeds} simulated days; targets TTFT {TARGETS.ttft_ms:g} ms, ITL {TARGETS.itl_ms:g} ms")
    print(f"{'policy':<14} {'within both (mean)':>19} {'(worst day)':>12} {'replica-hours':>14} {'of static':>10}")
    for policy, figures in summary.items():
        print(
            f"{policy:<14} {figures['withinBothTargetsMean']:>18.2%} {figures['withinBothTargetsMin']:>12.2%} "
            f"{figures['replicaHoursMean']:>14.0f} {figures['ofStaticReplicaHours']:>10.0%}"
        )


if __name__ == "__main__":
    main()
