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

``--engine vllm``: real vLLM (the CPU build) with kvbridge's connector and the tiny local model, 2 + 2 pods
rendered by the operator, each answer's tokens (a sample per operation) compared with a single engine's (a
surviving decode pod, its prefix cache salted). The blue/green rollout is left out there: it runs both revisions
at once, 8 vLLM engines, more memory than a 24 GiB machine has.
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
from kvbridge_sim.demo import LocalCluster, apply_all, local_cluster, models_for, synthetic_deployment
from kvbridge_sim.demo_traffic import send, start_router
from kvbridge_sim.demo_wait import NAMESPACE
from kvbridge_sim.support import until
from kvbridge_sim.tiny_model import NAME as TINY_MODEL
from kvbridge_sim.vllm_engines import deployment as vllm_deployment

NAME = "chaos"


@dataclass
class Tally:
    """What the requests sent during one phase of the run came to."""

    sent: int = 0
    failed: int = 0
    hung: int = 0
    wrong: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    seconds: list[float] = field(default_factory=list)
    #: vLLM: answers to compare with a single engine afterwards, (prompt, max tokens, tokens)
    answers: list[tuple[list[int], int, list[int]]] = field(default_factory=list)
    checked: int = 0

    def row(self, name: str) -> dict[str, Any]:
        p99 = float(np.percentile(self.seconds, 99)) if self.seconds else 0.0
        return {
            "operation": name,
            "sent": self.sent,
            "failed": self.failed,
            "hung": self.hung,
            "wrong": self.wrong,
            "checked": self.checked or self.sent - self.failed - self.hung,
            "p99Seconds": round(p99, 3),
            "codes": self.codes,
        }


def settled(cluster: LocalCluster, prefill: int, decode: int) -> bool:
    pods = [p for p in cluster.runner.pods.values() if not p.terminating]
    roles = [p.name.rsplit("-", 2)[-2] for p in pods]
    return (
        (roles.count("prefill"), roles.count("decode")) == (prefill, decode)
        and all(p.ready for p in pods)
        and (len(pods) == len(cluster.runner.pods))
    )


def vllm_chaos_deployment() -> dict[str, Any]:
    """2 prefill + 2 decode pods of real vLLM with kvbridge's connector (a 60 s lease, a 10 s drain)."""
    document = vllm_deployment(NAME, 1, connector="KVBridge")
    spec = document["spec"]
    spec["transfer"] = {"leaseSeconds": 60, "drainSeconds": 10}
    spec["prefill"]["replicas"] = spec["decode"]["replicas"] = 2
    return document


async def run(clients: int, bound: float, engine: str) -> list[dict[str, Any]]:
    outcomes: dict[str, Tally] = {}
    current = ["warm-up"]
    stop = asyncio.Event()
    vllm = engine == "vllm"
    wait = 900 if vllm else 300
    with tempfile.TemporaryDirectory(prefix="kvbridge-chaos-") as folder:
        document = vllm_chaos_deployment() if vllm else synthetic_deployment(NAME)
        async with local_cluster(Path(folder), models_for([document], Path(folder)), None) as cluster:
            client = cluster.client
            await apply_all(client, [document])
            await until(lambda: settled(cluster, 2, 2), wait, "2 + 2 ready pods")
            router = await start_router(client, NAME)

            async def load(index: int) -> None:
                timeout = aiohttp.ClientTimeout(total=bound)
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    n = 0
                    while not stop.is_set():
                        n += 1
                        prompt, max_tokens = [index + 1] * (17 + 13 * (n % 5)), 1
                        body: dict[str, Any] = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens}
                        if vllm:  # distinct prompts of 16 to 300 tokens, greedy, a few tokens each
                            prompt = [(index * 7919 + n * 104729 + i * 31) % 900 + 5 for i in range(16 + 37 * n % 285)]
                            max_tokens = 4 + n % 9
                            body = {
                                "model": TINY_MODEL,
                                "prompt": prompt,
                                "max_tokens": max_tokens,
                                "temperature": 0.0,
                                "ignore_eos": True,
                                "return_token_ids": True,
                            }
                        started = time.monotonic()
                        status, answer = await send(session, router.url, body)
                        elapsed = time.monotonic() - started
                        outcome = outcomes.setdefault(current[0], Tally())
                        outcome.sent += 1
                        outcome.seconds.append(elapsed)
                        code = str((answer.get("error") or {}).get("code") or "")
                        if status == 0 and elapsed >= bound * 0.99:
                            outcome.hung += 1
                        elif status != 200:
                            outcome.failed += 1
                            outcome.codes[code] = outcome.codes.get(code, 0) + 1
                        elif vllm:
                            choice = (answer.get("choices") or [{}])[0]
                            tokens = list(choice.get("token_ids") or [])
                            if len(tokens) != max_tokens or choice.get("finish_reason") != "length":
                                outcome.wrong += 1  # HTTP 200 without the whole answer
                            else:
                                outcome.answers.append((prompt, max_tokens, tokens))
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

            everything: list[tuple[str, Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]] = [
                (
                    "scale prefill 2 -> 1",
                    lambda: patch({"prefill": {"replicas": 1}}),
                    lambda: patch({"prefill": {"replicas": 2}}),
                ),
                (
                    "scale decode 2 -> 1",
                    lambda: patch({"decode": {"replicas": 1}}),
                    lambda: patch({"decode": {"replicas": 2}}),
                ),
                ("in-place rollout", lambda: patch({"transfer": {"drainSeconds": 6}}), nothing),
                (
                    "blue/green rollout",
                    lambda: patch({"prefill": {"blockSize": 32}, "decode": {"blockSize": 32}}),
                    nothing,
                ),
                ("node drain (a prefill and a decode pod evicted)", evict, nothing),
                ("prefill pod SIGKILLed", lambda: kill("prefill"), nothing),
                ("decode pod SIGKILLed", lambda: kill("decode"), nothing),
            ]
            operations = [o for o in everything if not (vllm and o[0].startswith("blue/green"))]
            tasks = [asyncio.create_task(load(i)) for i in range(clients)]
            try:
                await asyncio.sleep(3)
                for name, operation, restore in operations:
                    before = revisions()
                    print(f"{name} ...", file=sys.stderr, flush=True)
                    current[0] = name
                    await operation()
                    await asyncio.sleep(1)
                    shape = (
                        (1, 2)
                        if name.startswith("scale prefill")
                        else (2, 1)
                        if name.startswith("scale decode")
                        else (2, 2)
                    )
                    await until(lambda shape=shape: settled(cluster, *shape), wait, name)  # type: ignore[misc]
                    if "rollout" in name:
                        await until(
                            lambda b=before: not revisions() & b and settled(cluster, 2, 2),  # type: ignore[misc]
                            wait,
                            name,
                        )
                    current[0] = "between operations"
                    await restore()
                    await until(lambda: settled(cluster, 2, 2), wait, f"back to 2 + 2 after {name}")
                    await asyncio.sleep(1)
            finally:
                stop.set()
                await asyncio.gather(*tasks)
                await router.close()
            if vllm:
                await compare_with_a_single_engine(cluster, outcomes)
    return [outcomes[name].row(name) for name, *_ in operations if name in outcomes]


async def compare_with_a_single_engine(cluster: LocalCluster, outcomes: dict[str, Tally], sample: int = 40) -> None:
    """vLLM: a sample of each operation's answers against one decode pod alone (no transfer, prefix cache salted)."""
    import random

    decode = next(p for p in cluster.runner.pods.values() if "-decode-" in p.name and p.ready)
    url = f"http://{decode.ip}:{decode.spec.http_port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for name, outcome in outcomes.items():
            for index, (prompt, max_tokens, tokens) in enumerate(
                random.Random(0).sample(outcome.answers, min(sample, len(outcome.answers)))
            ):
                salt = f"chaos-{name}-{index}"
                body = {
                    "model": TINY_MODEL,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                    "cache_salt": salt,
                }
                async with session.post(f"{url}/v1/completions", json=body) as response:
                    want = (await response.json())["choices"][0]["token_ids"]
                outcome.checked += 1
                outcome.wrong += want != tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--bound", type=float, default=60.0, help="seconds after which a request counts as hung")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--engine", choices=["agent", "vllm"], default="agent")
    args = parser.parse_args()
    rows = asyncio.run(run(args.clients, args.bound, args.engine))
    if args.json:
        print(json.dumps(rows))
        return 0
    print("| operation | sent | failed | hung | wrong (of checked) | p99 (s) | codes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['operation']} | {r['sent']} | {r['failed']} | {r['hung']} | {r['wrong']} ({r['checked']}) | "
            f"{r['p99Seconds']} | {r['codes'] or ''} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
