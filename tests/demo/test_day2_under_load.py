"""Planned operations under load lose no request: synthetic engines rendered by the operator, run by the local
kubelet stand-in (preStop, SIGTERM, grace, SIGKILL), kvbridge's router in front and clients sending all the while;
an in-place rollout of both roles, then prefill 2 -> 1 and decode 2 -> 1. Every answer is verified byte for byte
by the engines; not one may fail. (The bounded version of benchmarks' chaos-under-load run.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from kvbridge_operator.kube import DEPLOYMENTS
from kvbridge_sim.demo import apply_all, local_cluster, synthetic_deployment
from kvbridge_sim.demo_traffic import send, start_router
from kvbridge_sim.demo_wait import NAMESPACE
from kvbridge_sim.runner import LocalRunner
from kvbridge_sim.support import until

NAME = "day2"
CLIENTS = 3


def pods_of(runner: LocalRunner, role: str) -> list[str]:
    return sorted(name for (_ns, name), pod in runner.pods.items() if f"-{role}-" in name and not pod.terminating)


@pytest.mark.slow  # a rollout and two scale-downs of real engine processes under load (`make test` runs it)
async def test_a_rollout_and_scale_downs_under_load_lose_no_request(tmp_path: Path) -> None:
    results: list[tuple[str, int, str]] = []  # (phase, HTTP status, error code)
    phase = ["steady"]
    async with local_cluster(tmp_path, {}, None) as cluster:
        client, runner = cluster.client, cluster.runner
        load_stop = asyncio.Event()
        await apply_all(client, [synthetic_deployment(NAME)])
        await until(
            lambda: (
                len(pods_of(runner, "prefill")) == 2
                and all(p.ready for p in runner.pods.values())
                and len(runner.pods) == 4
            ),
            120,
            "four ready pods",
        )
        router = await start_router(client, NAME)

        async def client_loop(index: int) -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                n = 0
                while not load_stop.is_set():
                    n += 1
                    body = {"model": "demo", "prompt": [index + 1] * (17 + 13 * (n % 5)), "max_tokens": 1}
                    status, answer = await send(session, router.url, body)
                    verified = (answer.get("kvbridge") or {}).get("verified") is True
                    code = "" if status == 200 and verified else str((answer.get("error") or {}).get("code"))
                    results.append((phase[0], status, code))

        load = [asyncio.create_task(client_loop(i)) for i in range(CLIENTS)]
        try:
            await asyncio.sleep(2)
            initial = {p.revision for p in runner.pods.values()}  # one per role
            phase[0] = "rollout"  # a template change the pairing key ignores: both roles roll in place
            await client.patch(DEPLOYMENTS, NAMESPACE, NAME, {"spec": {"transfer": {"drainSeconds": 6}}})

            def rolled() -> bool:
                settled = len(runner.pods) == 4 and all(p.ready for p in runner.pods.values())
                return settled and not {p.revision for p in runner.pods.values()} & initial

            await until(rolled, 180, "every pod on the new revision and ready")
            phase[0] = "prefill 2->1"
            await client.patch(DEPLOYMENTS, NAMESPACE, NAME, {"spec": {"prefill": {"replicas": 1}}})
            await until(lambda: len(runner.pods) == 3, 120, "one prefill pod left")
            phase[0] = "decode 2->1"
            await client.patch(DEPLOYMENTS, NAMESPACE, NAME, {"spec": {"decode": {"replicas": 1}}})
            await until(lambda: len(runner.pods) == 2, 120, "one decode pod left")
            phase[0] = "after"
            await asyncio.sleep(1)
        finally:
            load_stop.set()
            await asyncio.gather(*load)
            await router.close()
    by_phase = {
        p: sum(1 for q, _s, _c in results if q == p) for p in ("steady", "rollout", "prefill 2->1", "decode 2->1")
    }
    failed = [r for r in results if r[2]]
    assert all(count > 0 for count in by_phase.values()), by_phase  # load ran through every operation
    print(f"requests by phase: {by_phase}, in all {len(results)}, failed {len(failed)}")
    assert failed == [], (failed[:10], len(failed), len(results), runner.log_tails())
