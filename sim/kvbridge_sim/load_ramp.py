"""An open-loop load of streamed completions at a rate that changes by steps, and what it came to, for the planner's
closed-loop test and benchmark (``planner_loop``).

Arrivals are Poisson at each segment's rate (seeded), whatever the answers' pace, as users arrive; each request asks
for ``output`` tokens of a prompt of token ids drawn within ``prompt`` (no two alike: nothing is cached), streamed,
and its time to first token, its tokens' gaps, its outcome (answered whole, failed with a code, or hung past
``bound`` seconds) are kept. :func:`summary` says what a run came to: the requests within both latency targets, the
time to recover after each step up, the losses, the engines' replica-hours against a static size at the peak, and
the changes of direction of each role's planned size.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

#: the window over which the rolling TTFT percentile is taken, to tell when a step was recovered from (seconds)
RECOVERY_WINDOW = 10.0


@dataclass(frozen=True, slots=True)
class Segment:
    """``seconds`` of arrivals at ``rate`` requests per second; ``phase`` names it in the results."""

    seconds: float
    rate: float
    phase: str = "ramp"


@dataclass(slots=True)
class Sent:
    """One request: when it was sent (seconds into the run), what came back, how fast."""

    at: float
    phase: str
    status: int = 0
    code: str = ""
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    hung: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.code and not self.hung

    @property
    def tpot(self) -> float:
        """Its mean gap between tokens (0 for one token)."""
        return sum(self.gaps) / len(self.gaps) if self.gaps else 0.0


@dataclass(frozen=True, slots=True)
class Sample:
    """The cluster at one moment (seconds into the run): each role's planned size (its DisaggregatedRole's
    ``spec.replicas``), its pods (running, not terminating) and ready ones."""

    at: float
    rate: float
    planned: tuple[int, int]
    pods: tuple[int, int]
    ready: tuple[int, int]


def schedule_rate(segments: Sequence[Segment], at: float) -> tuple[float, str]:
    """The rate and phase at ``at`` seconds (0 past the end)."""
    start = 0.0
    for segment in segments:
        if at < start + segment.seconds:
            return segment.rate, segment.phase
        start += segment.seconds
    return 0.0, "after"


def arrivals(segments: Sequence[Segment], seed: int) -> list[tuple[float, str]]:
    """Poisson arrival times over the segments (each at its own rate) and their phases."""
    draw, found, start = random.Random(seed), [], 0.0
    for segment in segments:
        at = start
        while segment.rate > 0:
            at += draw.expovariate(segment.rate)
            if at >= start + segment.seconds:
                break
            found.append((at, segment.phase))
        start += segment.seconds
    return found


async def _stream(response: aiohttp.ClientResponse, sent: Sent, began: float) -> None:
    """Read a streamed answer's events: the first token's time, the gaps, the tokens, an error event's code."""
    last, buffer = 0.0, b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            data = event.removeprefix(b"data: ").strip()
            if data == b"[DONE]" or not data:
                continue
            message: Any = json.loads(data)
            if "error" in message:
                sent.code = str((message["error"] or {}).get("code") or "STREAM_ERROR")
                return
            if not message.get("choices"):
                continue
            now = time.monotonic() - began
            if sent.ttft is None:
                sent.ttft = now
            else:
                sent.gaps.append(now - last)
            last = now
            sent.tokens += 1


async def send(session: aiohttp.ClientSession, url: str, sent: Sent, prompt: list[int], output: int) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": output, "stream": True}
    began = time.monotonic()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            sent.status = response.status
            if response.status != 200:
                answer = await response.text()
                try:
                    sent.code = str(json.loads(answer)["error"]["code"])
                except (ValueError, KeyError, TypeError):
                    sent.code = f"HTTP_{response.status}"
                return
            await _stream(response, sent, began)
    except TimeoutError:
        sent.hung = True
        sent.code = "HUNG"
    except (aiohttp.ClientError, ValueError) as exc:
        sent.code = type(exc).__name__
    if sent.status == 200 and not sent.code and sent.tokens < output:
        sent.code = "INCOMPLETE"


async def load(
    url: str,
    segments: Sequence[Segment],
    *,
    prompt: tuple[int, int],
    output: int,
    bound: float,
    seed: int = 0,
    started: float | None = None,
) -> list[Sent]:
    """Send the arrivals of ``segments`` through the router at ``url``; every request's outcome, once all ended
    (each within ``bound`` seconds, or hung)."""
    draw = random.Random(seed + 1)
    began = time.monotonic() if started is None else started
    results: list[Sent] = []
    tasks: list[asyncio.Task[None]] = []
    timeout = aiohttp.ClientTimeout(total=bound)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for index, (at, phase) in enumerate(arrivals(segments, seed)):
            await asyncio.sleep(max(0.0, began + at - time.monotonic()))
            length = draw.randint(*prompt)
            tokens = [(index * 7919 + i * 31) % 30000 + 1 for i in range(length)]  # no two prompts share a prefix
            results.append(Sent(time.monotonic() - began, phase))
            tasks.append(asyncio.create_task(send(session, url, results[-1], tokens, output)))
        await asyncio.gather(*tasks)
    return results


def _p(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def recoveries(sent: Sequence[Sent], segments: Sequence[Segment], ttft: float, q: float) -> list[dict[str, Any]]:
    """After each step up: how long until the TTFT at percentile ``q`` of the requests sent in the last
    :data:`RECOVERY_WINDOW` seconds was back under ``ttft`` for good within the step (0: never over it)."""
    found, start = [], 0.0
    for before, segment in zip([None, *segments], segments, strict=False):
        end = start + segment.seconds
        if before is not None and segment.rate > before.rate:
            inside = [s for s in sent if start <= s.at < end]
            over_at = [s.at for s in inside if _window_p(inside, s.at, q) > ttft]
            recovered = 0.0 if not over_at else max(over_at) - start
            worst = max((_window_p(inside, s.at, q) for s in inside), default=0.0)
            found.append(
                {
                    "at": round(start, 1),
                    "rate": f"{before.rate:g} -> {segment.rate:g}",
                    "recoveredSeconds": round(recovered, 1),
                    "recoveredWithinStep": not over_at or max(over_at) < end - RECOVERY_WINDOW,
                    "worstTtftSeconds": round(worst, 3),
                }
            )
        start = end
    return found


def _window_p(sent: Sequence[Sent], at: float, q: float) -> float:
    """The TTFT at percentile ``q`` of the requests sent within the window ending at ``at`` (a failure: infinite)."""
    ttfts = [s.ttft if s.ok and s.ttft is not None else float("inf") for s in sent if at - RECOVERY_WINDOW < s.at <= at]
    return float(np.percentile(ttfts, q, method="higher")) if ttfts else 0.0


def reversals(samples: Sequence[Sample], role: int) -> list[float]:
    """When a role's planned size changed direction (up after down, or down after up)."""
    found, direction, last = [], 0, None
    for sample in samples:
        size = sample.planned[role]
        if last is not None and size != last:
            now = 1 if size > last else -1
            if direction and now != direction:
                found.append(sample.at)
            direction = now
        last = size
    return found


def summary(
    sent: Sequence[Sent], samples: Sequence[Sample], segments: Sequence[Segment], targets: dict[str, float]
) -> dict[str, Any]:
    """What the run came to (``targets``: ``ttftSeconds``, ``ttftPercentile``, ``itlSeconds``)."""
    ttft, itl, q = targets["ttftSeconds"], targets["itlSeconds"], targets["ttftPercentile"]
    within = [s for s in sent if s.ok and s.ttft is not None and s.ttft <= ttft and s.tpot <= itl]
    seconds = [b.at - a.at for a, b in itertools.pairwise(samples)]
    used = sum(dt * (a.pods[0] + a.pods[1]) for dt, a in zip(seconds, samples, strict=False)) / 3600
    peak = (max((s.pods[0] for s in samples), default=0), max((s.pods[1] for s in samples), default=0))
    static = sum(seconds) * sum(peak) / 3600
    ok = [s for s in sent if s.ok and s.ttft is not None]
    losses = {
        phase: {"sent": n, "failed": f, "hung": h}
        for phase in dict.fromkeys(s.phase for s in sent)
        for n, f, h in [
            (
                sum(s.phase == phase for s in sent),
                sum(s.phase == phase and not s.ok and not s.hung for s in sent),
                sum(s.phase == phase and s.hung for s in sent),
            )
        ]
    }
    codes: dict[str, int] = {}
    for s in sent:
        if not s.ok:
            codes[s.code] = codes.get(s.code, 0) + 1
    return {
        "requests": len(sent),
        "withinBoth": len(within),
        "withinBothShare": round(len(within) / len(sent), 4) if sent else 0.0,
        "ttftP99Seconds": round(_p([s.ttft for s in ok if s.ttft is not None], 99), 3),
        "tpotP99Seconds": round(_p([s.tpot for s in ok], 99), 4),
        "failed": sum(not s.ok and not s.hung for s in sent),
        "hung": sum(s.hung for s in sent),
        "failures": codes,
        "byPhase": losses,
        "replicaHours": round(used, 4),
        "staticPeakReplicaHours": round(static, 4),
        "peakPods": {"prefill": peak[0], "decode": peak[1]},
        "recoveries": recoveries(sent, segments, ttft, q),
        "reversals": {"prefill": reversals(samples, 0), "decode": reversals(samples, 1)},
    }
