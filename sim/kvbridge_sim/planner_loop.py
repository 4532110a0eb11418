"""kvbridge's planner with its loop closed, on the local cluster: for ``benchmarks/planner_loop.py`` and its test.

The local cluster of ``kvbridge demo --serve`` (the emulated API, the real operator, the local kubelet stand-in) runs
a deployment of synthetic engines at a set speed (``KVBRIDGE_SYNTHETIC_*``: engines that sleep their service time,
so that more pods add capacity on two cores) with ``spec.autoscaling`` on, behind kvbridge's router; a real
Prometheus (``local_prometheus``) scrapes the engine pods, the router and the operator, and the planner reads it. A
load ramp (``load_ramp``) goes through the router while each role's planned size, pods and ready pods are sampled
every second; a prefill pod may be killed along the way. :func:`run_loop` returns the requests, the samples, when the
kill came and what Prometheus held of the planner's own series at the end.

The profile the planner sizes with is the caller's: measured with ``kvbridge profile`` against the router
(the benchmark), or :func:`computed_profile`, what the set speed is by construction (the test).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import start_http_server

from kvbridge_operator.api.objects import Obj
from kvbridge_operator.controller.metrics import REGISTRY
from kvbridge_operator.kube import CONFIG_MAPS, DEPLOYMENTS
from kvbridge_sim.demo import LocalCluster, apply_all, local_cluster, synthetic_deployment
from kvbridge_sim.demo_traffic import LocalRouter, start_router
from kvbridge_sim.demo_wait import NAMESPACE, progress
from kvbridge_sim.load_ramp import Sample, Segment, Sent, load, schedule_rate
from kvbridge_sim.local_prometheus import LocalPrometheus, Target, pod_targets
from kvbridge_sim.support import free_port, until

ROLES = ("prefill", "decode")
#: the planner's own series read back from Prometheus at the end (it scraped the operator)
PLANNER_SERIES = (
    'sum by (role, change) (kvbridge_operator_planner_decisions_total{reason="Sized"})',
    "kvbridge_operator_planned_replicas",
    # each role's correction, its least and most over the run (1: as profiled; issue 61: its bias at rest)
    "min_over_time(kvbridge_operator_planner_correction[1h])",
    "max_over_time(kvbridge_operator_planner_correction[1h])",
)


@dataclass(frozen=True)
class Loop:
    """The engines' set speed, the traffic, the planner's settings and the run's shape."""

    name: str = "loop"
    #: the engines' set speed: prefill's milliseconds per prompt token, decode's gap alone and per other sequence
    prefill_ms_per_token: float = 0.5
    decode_itl_ms: float = 15.0
    decode_itl_ms_per_sequence: float = 5.0
    #: prompts' length range (token ids) and tokens per answer
    prompt: tuple[int, int] = (150, 250)
    output: int = 24
    ttft_ms: float = 1000.0
    ttft_percentile: float = 99.0
    itl_ms: float = 60.0
    itl_percentile: float = 99.0
    interval_seconds: int = 5
    window_seconds: int = 10
    stabilization_seconds: int = 60
    headroom_percent: int = 50
    #: the hysteresis (planner.hysteresis): a scale-down's spare, the reversal window, the warm-up
    tolerance_percent: int = 10
    reversal_seconds: int = 300
    warmup_seconds: int = 10
    max_replicas: tuple[int, int] = (4, 4)
    segments: tuple[Segment, ...] = ()
    #: seconds into the load after which a ready prefill pod is SIGKILLed, once two are ready (None: none)
    kill_prefill_at: float | None = None
    scrape_seconds: float = 1.0
    #: a request not answered whole within this long is hung
    bound: float = 60.0
    #: after the load, how long to wait for both roles to be back to one pod
    settle_seconds: float = 120.0
    seed: int = 0

    @property
    def targets(self) -> dict[str, float]:
        return {
            "ttftSeconds": self.ttft_ms / 1000,
            "ttftPercentile": self.ttft_percentile,
            "itlSeconds": self.itl_ms / 1000,
        }


@dataclass
class LoopRun:
    sent: list[Sent] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    killed: list[tuple[float, str]] = field(default_factory=list)
    profile: Obj = field(default_factory=dict)
    prometheus: dict[str, Any] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)


#: the shortened run of the test (tests/demo/test_planner_loop.py) and ``benchmarks/planner_loop.py --quick``: 1 -> 3 ->
#: 6 requests/s and back to 1, a prefill pod killed once two are ready, a 30 s stabilization window (no longer: the
#: scale-in must come while the last 45 s of load still run) and a reversal window over the whole scale-in
QUICK = Loop(
    segments=(Segment(15, 1, "low"), Segment(20, 3), Segment(30, 6, "peak"), Segment(45, 1, "scale-in")),
    stabilization_seconds=30,
    reversal_seconds=120,
    kill_prefill_at=45,
    settle_seconds=60,
)
#: the benchmark's ramp (``benchmarks/planner_loop.py``, ``make planner-loop-test``): 1 request/s for a minute, steps
#: of 2.5, 4, 5.5, 7, 8.5 and 10 with bursts of 8 and 14 for 10 s, back to 1 for four minutes; a prefill pod killed
#: at 220 s
FULL = Loop(
    segments=(
        Segment(60, 1, "low"),
        Segment(40, 2.5),
        Segment(30, 4),
        Segment(10, 8, "burst"),
        Segment(40, 5.5),
        Segment(40, 7),
        Segment(30, 8.5),
        Segment(10, 14, "burst"),
        Segment(60, 10, "peak"),
        Segment(240, 1, "scale-in"),
    ),
    kill_prefill_at=220,
)


def computed_profile(loop: Loop) -> Obj:
    """The profile the set speed is by construction: prefill computes ``1000 / ms-per-token`` prompt tokens a second
    (one at a time), decode's gap is ``alone + per-sequence x (n - 1)`` with ``n`` sequences (linear: two points say
    it all, a third checks the interpolation)."""
    points = [
        {"concurrency": n, "itlMs": loop.decode_itl_ms + loop.decode_itl_ms_per_sequence * (n - 1)} for n in (1, 4, 16)
    ]
    return {
        "engine": f"synthetic engine at a set speed ({loop.prefill_ms_per_token:g} ms/token, computed)",
        "prefill": {"tokensPerSecond": 1000 / loop.prefill_ms_per_token},
        "decode": {
            "contextTokens": sum(loop.prompt) // 2 + loop.output // 2,
            "itlPercentile": loop.itl_percentile,
            "points": points,
        },
    }


def deployment(loop: Loop, prometheus_url: str, planning: bool) -> Obj:
    """The synthetic deployment at the set speed, 1 + 1 to begin with, the planner on (``planning``) or not yet."""
    document = synthetic_deployment(loop.name)
    spec = document["spec"]
    pace = [  # and no byte check: 100 ms of CPU a request, which would make two cores, not the pace, the limit
        {"name": "KVBRIDGE_VERIFY", "value": "False"},
        {"name": "KVBRIDGE_NUM_BLOCKS", "value": "512"},
        {"name": "KVBRIDGE_SYNTHETIC_PREFILL_MS_PER_TOKEN", "value": f"{loop.prefill_ms_per_token:g}"},
        {"name": "KVBRIDGE_SYNTHETIC_DECODE_ITL_MS", "value": f"{loop.decode_itl_ms:g}"},
        {"name": "KVBRIDGE_SYNTHETIC_DECODE_ITL_MS_PER_SEQUENCE", "value": f"{loop.decode_itl_ms_per_sequence:g}"},
    ]
    for role, most in zip(ROLES, loop.max_replicas, strict=True):
        spec[role] |= {"replicas": 1, "minReplicas": 1, "maxReplicas": most}
        spec[role]["template"] = {"spec": {"containers": [{"name": "engine", "env": [dict(v) for v in pace]}]}}
    spec["transfer"] = {"leaseSeconds": 20, "drainSeconds": 15}
    spec["router"] = {"policy": "least-loaded"}
    spec["autoscaling"] = {
        "enabled": planning,
        "prometheusUrl": prometheus_url,
        "ttft": {"milliseconds": loop.ttft_ms, "percentile": loop.ttft_percentile},
        "itl": {"milliseconds": loop.itl_ms, "percentile": loop.itl_percentile},
        "profile": {"name": f"{loop.name}-profile"},
        "intervalSeconds": loop.interval_seconds,
        "windowSeconds": loop.window_seconds,
        "headroomPercent": loop.headroom_percent,
        "stabilizationWindowSeconds": loop.stabilization_seconds,
        "tolerancePercent": loop.tolerance_percent,
        "reversalWindowSeconds": loop.reversal_seconds,
        "warmupSeconds": loop.warmup_seconds,
    }
    return document


def _pods(cluster: LocalCluster, name: str) -> tuple[tuple[int, int], tuple[int, int]]:
    mine = [p for p in cluster.runner.pods.values() if p.deployment == name and not p.terminating]
    counts = tuple(sum(f"-{role}-" in p.name for p in mine) for role in ROLES)
    ready = tuple(sum(f"-{role}-" in p.name and p.ready for p in mine) for role in ROLES)
    return (counts[0], counts[1]), (ready[0], ready[1])


def _planned(cluster: LocalCluster, name: str) -> tuple[int, int]:
    sizes = []
    for role in ROLES:
        found = cluster.api.find("disaggregatedroles", NAMESPACE, f"{name}-{role}") or {}
        sizes.append(int((found.get("spec") or {}).get("replicas", 0)))
    return sizes[0], sizes[1]


async def _watch(
    cluster: LocalCluster,
    loop: Loop,
    prometheus: LocalPrometheus,
    fixed: list[Target],
    run: LoopRun,
    began: list[float],
) -> None:
    """Every second: the targets Prometheus scrapes follow the pods; once the load began (``began`` holds its
    start), the cluster is sampled and the kill comes."""
    while True:
        prometheus.set_targets(pod_targets(cluster.runner, NAMESPACE, loop.name) + fixed)
        if not began:
            await asyncio.sleep(1.0)
            continue
        at = time.monotonic() - began[0]
        pods, ready = _pods(cluster, loop.name)
        rate, _ = schedule_rate(loop.segments, at)
        run.samples.append(Sample(at, rate, _planned(cluster, loop.name), pods, ready))
        if loop.kill_prefill_at is not None and not run.killed and at >= loop.kill_prefill_at and ready[0] >= 2:
            victim = max(
                (p for p in cluster.runner.pods.values() if "-prefill-" in p.name and p.ready and not p.terminating),
                key=lambda p: p.name,
                default=None,
            )
            if victim is not None:  # a pod of several: the one the planner added last
                cluster.runner.crash(NAMESPACE, victim.name)
                run.killed.append((at, victim.name))
                progress(f"planner loop: {victim.name} SIGKILLed at {at:.0f} s")
        await asyncio.sleep(1.0)


async def _settled(cluster: LocalCluster, name: str) -> None:
    await until(lambda: _pods(cluster, name)[1] == (1, 1), 180, "one ready pod of each role")


async def _store(cluster: LocalCluster, loop: Loop, profile: Obj) -> None:
    """The profile in the ConfigMap the deployment names."""
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{loop.name}-profile"},
        "data": {"profile.json": json.dumps(profile)},
    }
    await cluster.client.create(CONFIG_MAPS, NAMESPACE, config_map)


async def _settle(loop: Loop, run: LoopRun) -> None:
    """After the load: until each role is planned and runs one pod again, at most ``settle_seconds``."""
    with contextlib.suppress(TimeoutError):
        await until(
            lambda: run.samples[-1].planned == run.samples[-1].pods == (1, 1),
            loop.settle_seconds,
            "both roles back to one pod",
            interval=1.0,
        )


async def run_loop(loop: Loop, workdir: Path, measure: Callable[[str], Awaitable[Obj]] | None = None) -> LoopRun:
    """The whole run (see the module's docstring); ``measure``: the profile from the router's URL (None: computed).
    SIGINT or SIGTERM once the cluster is up cancels the run, and everything it started is stopped (the caller
    sees :class:`asyncio.CancelledError`)."""
    run = LoopRun()
    prometheus = LocalPrometheus(workdir / "prometheus", loop.scrape_seconds)
    operator_port = free_port()
    server, _thread = start_http_server(operator_port, "127.0.0.1", REGISTRY)
    interrupted = asyncio.Event()
    async with local_cluster(workdir, {}, interrupted) as cluster:
        watcher: asyncio.Task[None] | None = None
        router: LocalRouter | None = None
        this = asyncio.current_task()
        canceller = asyncio.create_task(_cancel_when(interrupted, this))
        try:
            await prometheus.start()
            if measure is None:
                run.profile = computed_profile(loop)
                await _store(cluster, loop, run.profile)
            await apply_all(cluster.client, [deployment(loop, prometheus.url, planning=measure is None)])
            await _settled(cluster, loop.name)
            router = await start_router(cluster.client, loop.name)
            labels = (("namespace", NAMESPACE), ("deployment", loop.name))
            fixed = [
                Target(router.url.removeprefix("http://"), (*labels, ("component", "router"))),
                Target(f"127.0.0.1:{operator_port}", (("component", "operator"),)),
            ]
            began: list[float] = []
            watcher = asyncio.create_task(_watch(cluster, loop, prometheus, fixed, run, began))
            if measure is not None:  # at one pod of each role, then the planner on, its window clear of it
                run.profile = await measure(router.url)
                await _store(cluster, loop, run.profile)
                await asyncio.sleep(loop.window_seconds + 2 * loop.scrape_seconds)
                patch = {"spec": {"autoscaling": {"enabled": True}}}
                await cluster.client.patch(DEPLOYMENTS, NAMESPACE, loop.name, patch)
            progress(f"planner loop: {sum(s.seconds for s in loop.segments):.0f} s of load begins")
            began.append(time.monotonic())
            run.sent = await load(
                router.url,
                loop.segments,
                prompt=loop.prompt,
                output=loop.output,
                bound=loop.bound,
                seed=loop.seed,
                started=began[0],
            )
            await _settle(loop, run)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
                run.prometheus = {q: await _vector(session, prometheus.url, q) for q in PLANNER_SERIES}
            run.events = [
                f"{e['reason']}: {e['message']}" for e in cluster.api.objects_of("events") if "Plann" in e["reason"]
            ]
        finally:
            canceller.cancel()
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            if router is not None:
                await router.close()
            await prometheus.close()
            server.shutdown()
    return run


async def _cancel_when(interrupted: asyncio.Event, task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` once ``interrupted`` is set (a signal: Kopf's own handlers would only stop the operator)."""
    await interrupted.wait()
    progress("planner loop: interrupted, stopping what it started")
    if task is not None:
        task.cancel()


async def _vector(session: aiohttp.ClientSession, url: str, query: str) -> list[dict[str, Any]]:
    """An instant query's series: their labels and values."""
    async with session.get(f"{url}/api/v1/query", params={"query": query}) as answer:
        result = (await answer.json())["data"]["result"]
    return [{"labels": r["metric"], "value": float(r["value"][1])} for r in result]
