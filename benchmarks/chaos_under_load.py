"""Planned operations and failures under constant load, through kvbridge's router (not a test).

    .venv/bin/python benchmarks/chaos_under_load.py [--clients 3] [--bound 60] [--json]

The local cluster of ``kvbridge demo --serve`` (the emulated API, the operator, the local kubelet stand-in that
ends pods as a kubelet does) runs a synthetic-engine deployment of 2 prefill + 2 decode pods behind kvbridge's
router, and ``--clients`` clients send requests all the while. One operation at a time, each followed by a return
to 2 + 2 (not counted):

  scale prefill 2 -> 1, scale decode 2 -> 1, an in-place rollout (a template change), a blue/green rollout (block
  size 16 -> 32: a new pairing key), a node drain (one prefill and one decode pod evicted), a prefill pod
  SIGKILLed, a decode pod SIGKILLed.

Per operation: requests sent, failed, hung past ``--bound`` seconds, wrong (the synthetic engines check every
byte decode read), and the p99 latency during it. Targets: 0 failed, 0 hung, 0 wrong for every planned
operation; for a SIGKILL, no more failures than requests in flight on that pod, 0 hung.

Real vLLM engines in place of the synthetic ones need about one core per engine (2 + 2 engines, their surge
pods and the clients): this machine has 2, so the vLLM run is not made here (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from kvbridge_operator.kube import DEPLOYMENTS, PODS
from kvbridge_sim.demo import (
    NAMESPACE,
    LocalCluster,
    apply_all,
    local_cluster,
    send,
    start_router,
    synthetic_deployment,
    until,
)

NAME = "chaos"


@dataclass
class Outcome:
    sent: int = 0
    failed: int = 0
    hung: int = 0
    wrong: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    seconds: list[float] = field(default_factory=list)

    def row(self, name: str) -> dict[str, Any]:
        p99 = float(np.percentile(self.seconds, 99)) if self.seconds else 0.0
        return {"operation": name, "sent": self.sent, "failed": self.failed, "hung": self.hung, "wrong": self.wrong,
                "p99Seconds": round(p99, 3), "codes": self.codes}  # fmt: skip


def settled(cluster: LocalCluster, prefill: int, decode: int) -> bool:
    pods = [p for p in cluster.runner.pods.values() if not p.terminating]
    roles = [p.name.rsplit("-", 2)[-2] for p in pods]
    return (roles.count("prefill"), roles.count("decode")) == (prefill, decode) and all(p.ready for p in pods) and (
        len(pods) == len(cluster.runner.pods))  # fmt: skip


async def run(clients: int, bound: float) -> list[dict[str, Any]]:
    outcomes: dict[str, Outcome] = {}
    current = ["warm-up"]
    stop = asyncio.Event()
    with tempfile.TemporaryDirectory(prefix="kvbridge-chaos-") as folder:
        async with local_cluster(Path(folder), {}, None) as cluster:
            client = cluster.client
            await apply_all(client, [synthetic_deployment(NAME)])
            await until(lambda: settled(cluster, 2, 2), 180, "2 + 2 ready pods")
            router = await start_router(client, NAME)

            async def load(index: int) -> None:
                timeout = aiohttp.ClientTimeout(total=bound)
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    n = 0
                    while not stop.is_set():
                        n += 1
                        body = {"model": "demo", "prompt": [index + 1] * (17 + 13 * (n % 5)), "max_tokens": 1}
                        started = time.monotonic()
                        status, answer = await send(session, router.url, body)
                        elapsed = time.monotonic() - started
                        outcome = outcomes.setdefault(current[0], Outcome())
                        outcome.sent += 1
                        outcome.seconds.append(elapsed)
                        code = str((answer.get("error") or {}).get("code") or "")
                        if status == 0 and elapsed >= bound * 0.99:
                            outcome.hung += 1
                        elif status != 200:
                            outcome.failed += 1
                            outcome.codes[code] = outcome.codes.get(code, 0) + 1
                        elif (answer.get("kvbridge") or {}).get("verified") is not True:
                            outcome.wrong += 1

            async def patch(spec: dict[str, Any]) -> None:
                await client.patch(DEPLOYMENTS, NAMESPACE, NAME, {"spec": spec})

            def pod(role: str) -> str:
                return str(sorted(p.name for p in cluster.runner.pods.values() if f"-{role}-" in p.name)[0])

            async def evict() -> None:
                for role in ("prefill", "decode"):
                    await client.delete(PODS, NAMESPACE, pod(role))

            async def kill(role: str) -> None:
                cluster.runner.crash(NAMESPACE, pod(role))
                await asyncio.sleep(3)  # the kubelet stand-in restarts it

            def revisions() -> set[str]:
                return {p.revision for p in cluster.runner.pods.values()}

            async def nothing() -> None:
                return None

            operations: list[tuple[str, Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]] = [
                ("scale prefill 2 -> 1", lambda: patch({"prefill": {"replicas": 1}}),
                 lambda: patch({"prefill": {"replicas": 2}})),
                ("scale decode 2 -> 1", lambda: patch({"decode": {"replicas": 1}}),
                 lambda: patch({"decode": {"replicas": 2}})),
                ("in-place rollout", lambda: patch({"transfer": {"drainSeconds": 6}}), nothing),
                ("blue/green rollout", lambda: patch({"prefill": {"blockSize": 32}, "decode": {"blockSize": 32}}),
                 nothing),
                ("node drain (a prefill and a decode pod evicted)", evict, nothing),
                ("prefill pod SIGKILLed", lambda: kill("prefill"), nothing),
                ("decode pod SIGKILLed", lambda: kill("decode"), nothing),
            ]  # fmt: skip
            tasks = [asyncio.create_task(load(i)) for i in range(clients)]
            try:
                await asyncio.sleep(3)
                for name, operation, restore in operations:
                    before = revisions()
                    print(f"{name} ...", file=sys.stderr, flush=True)
                    current[0] = name
                    await operation()
                    await asyncio.sleep(1)
                    shape = (1, 2) if name.startswith("scale prefill") else (2, 1) if name.startswith(
                        "scale decode") else (2, 2)  # fmt: skip
                    await until(lambda shape=shape: settled(cluster, *shape), 300, name)  # type: ignore[misc]
                    if "rollout" in name:
                        await until(lambda b=before: not revisions() & b and settled(cluster, 2, 2),  # type: ignore[misc]
                                    300, name)  # fmt: skip
                    current[0] = "between operations"
                    await restore()
                    await until(lambda: settled(cluster, 2, 2), 300, f"back to 2 + 2 after {name}")
                    await asyncio.sleep(1)
            finally:
                stop.set()
                await asyncio.gather(*tasks)
                await router.close()
    return [outcomes[name].row(name) for name, *_ in operations if name in outcomes]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--bound", type=float, default=60.0, help="seconds after which a request counts as hung")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = asyncio.run(run(args.clients, args.bound))
    if args.json:
        print(json.dumps(rows))
        return 0
    print("| operation | sent | failed | hung | wrong | p99 (s) | codes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['operation']} | {r['sent']} | {r['failed']} | {r['hung']} | {r['wrong']} | {r['p99Seconds']} | "
              f"{r['codes'] or ''} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
