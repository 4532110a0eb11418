"""Reconcile latency and memory of the operator (not a test).

    .venv/bin/python benchmarks/operator_reconcile.py [--deployments 100] [--json]

Starts the emulated Kubernetes API (kvbridge_sim/apiserver.py) in this
process and ``kvbridge operator run`` as a separate process against it,
plays the StatefulSet controller and kubelet (creates each role's pods and
marks them ready as soon as the StatefulSet appears), creates N
DisaggregatedDeployments at once and measures, per deployment, the time
from its creation to status condition Ready=True. Reports p50/p99/max, the
total time, the operator process's peak RSS, and the operator's API calls
(its own client and Kopf's, counted by the emulator by User-Agent; watches
apart): per deployment from creation to Ready, and per pod event once all
are Ready (the benchmark touches pods' labels and counts what follows).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import yaml

from kvbridge_operator.kube import DEPLOYMENTS, PODS, KubeClient
from kvbridge_sim.apiserver import RealisticKubernetes
from kvbridge_sim.local_api import emulated_api

ROOT = Path(__file__).parents[1]

BENCHMARK_AGENT = "kvbridge-benchmark"  # this process's own requests, not counted as the operator's
POD_EVENTS = 20


def operator_calls(api: RealisticKubernetes) -> dict[str, int]:
    """The operator process's API requests so far (watch streams apart), by verb."""
    calls: dict[str, int] = {}
    for (agent, verb, _plural), count in api.calls.items():
        if agent != BENCHMARK_AGENT and "watch" not in verb.lower():
            verb = verb.rsplit(".", 1)[-1].lower()
            calls[verb] = calls.get(verb, 0) + count
    return calls


async def settled(api: RealisticKubernetes, quiet: float = 2.0, limit: float = 60.0) -> dict[str, int]:
    """The operator's calls once it has made none for ``quiet`` seconds."""
    deadline = time.monotonic() + limit
    last = operator_calls(api)
    quiet_since = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - quiet_since < quiet:
        await asyncio.sleep(0.1)
        now = operator_calls(api)
        if now != last:
            last, quiet_since = now, time.monotonic()
    return last


def per(calls: dict[str, int], before: dict[str, int], count: int) -> dict[str, float]:
    delta = {verb: (calls.get(verb, 0) - before.get(verb, 0)) / count for verb in sorted(calls)}
    return {"total": round(sum(delta.values()), 1)} | {verb: round(n, 1) for verb, n in delta.items() if n}


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def kubelet(api: RealisticKubernetes, client: KubeClient, stop: asyncio.Event) -> None:
    started: set[str] = set()
    while not stop.is_set():
        for sts in list(api.peek("statefulsets")):
            name = sts["metadata"]["name"]
            if name in started:
                continue
            started.add(name)
            template = copy.deepcopy(sts["spec"]["template"])
            for index in range(int(sts["spec"]["replicas"])):
                pod = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "spec": copy.deepcopy(template["spec"]),
                    "metadata": {**copy.deepcopy(template["metadata"]), "name": f"{name}-{index}"},
                }
                await client.create(PODS, "default", pod)
                await client.patch(
                    PODS,
                    "default",
                    f"{name}-{index}",
                    {
                        "status": {
                            "phase": "Running",
                            "podIP": f"10.1.{len(started) % 250}.{index + 1}",
                            "conditions": [{"type": "Ready", "status": "True"}],
                        }
                    },
                    "status",
                )
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def operator_on_emulator(
    token: str | None = None,
) -> AsyncIterator[tuple[RealisticKubernetes, KubeClient, subprocess.Popen[bytes]]]:
    """The emulated API with the CRD, ``kvbridge operator run`` as a process against it, and the kubelet stand-in;
    yields once the operator's watches are up; stops all of it."""
    async with emulated_api(token=token, user_agent=BENCHMARK_AGENT) as (api, url, client):
        env = {
            **os.environ,
            "KVBRIDGE_OPERATOR_API_SERVER": url,
            "KVBRIDGE_OPERATOR_CPU_MODE": "1",
            "KVBRIDGE_OPERATOR_LIVENESS_PORT": "0",
        }
        operator = subprocess.Popen(
            [sys.executable, "-m", "kvbridge_operator", "operator", "run"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        stop = asyncio.Event()
        pods = asyncio.create_task(kubelet(api, client, stop))
        try:
            await asyncio.sleep(3)  # let the operator start its watches
            yield api, client, operator
        finally:
            stop.set()
            await pods
            operator.terminate()
            operator.wait(timeout=30)


async def run(count: int) -> dict[str, Any]:
    template = yaml.safe_load((ROOT / "examples" / "synthetic" / "llama3-8b-hetero-tp.yaml").read_text())
    async with operator_on_emulator() as (api, client, operator):
        idle_rss = rss_kib(operator.pid, "VmRSS")
        created: dict[str, float] = {}
        done: dict[str, float] = {}
        begin = time.monotonic()
        start_calls = operator_calls(api)
        for index in range(count):
            document = copy.deepcopy(template)
            document["metadata"]["name"] = f"dd-{index:03d}"
            created[document["metadata"]["name"]] = time.monotonic()
            await client.create(DEPLOYMENTS, "default", document)
        deadline = time.monotonic() + 300
        while len(done) < count and time.monotonic() < deadline:
            for obj in api.peek("disaggregateddeployments"):
                name = obj["metadata"]["name"]
                ready = [c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"]
                if name not in done and ready and ready[0]["status"] == "True":
                    done[name] = time.monotonic()
            await asyncio.sleep(0.02)
        latencies = sorted(done[n] - created[n] for n in done)
        to_ready = await settled(api)
        pods = api.peek("pods")[:POD_EVENTS]
        for pod in pods:  # one pod event each, nothing the operator needs to act on
            await client.patch(PODS, "default", pod["metadata"]["name"], {"metadata": {"labels": {"touched": "1"}}})
        after_events = await settled(api)
        return {
            "deployments": count,
            "ready": len(done),
            "p50Seconds": round(statistics.median(latencies), 3),
            "p99Seconds": round(latencies[max(0, int(len(latencies) * 0.99) - 1)], 3),
            "maxSeconds": round(latencies[-1], 3),
            "totalSeconds": round(max(done.values()) - begin, 3),
            "operatorIdleRssMiB": round(idle_rss / 1024, 1),
            "operatorPeakRssMiB": round(rss_kib(operator.pid, "VmHWM") / 1024, 1),
            "operatorCpuSeconds": round(cpu_seconds(operator.pid), 2),
            "apiServerCpuSeconds": round(cpu_seconds(os.getpid()), 2),
            "operatorCallsPerDeploymentToReady": per(to_ready, start_calls, count),
            "operatorCallsPerPodEvent": per(after_events, to_ready, len(pods)),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deployments", type=int, default=100)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(run(args.deployments))
    print(json.dumps(result, indent=None if args.json else 2))
    return 0 if result["ready"] == result["deployments"] else 1


if __name__ == "__main__":
    sys.exit(main())
