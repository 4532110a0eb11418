"""Operator convergence after Kubernetes API faults (not a test).

    .venv/bin/python benchmarks/operator_faults.py [--deployments 10] [--json]

The emulated API (kvbridge_sim.apiserver) injects faults into the operator's requests only (the
benchmark's own client and its kubelet stand-in are exempt), ``kvbridge operator run`` runs as a process:

- outage: every operator request answers 500 for 25 s while N deployments are created; reported: the time from
  the API healing to every deployment Ready;
- flaky: 30 % of operator requests answer 500 and 10 % take 2 s, throughout; reported: the time from creation
  to every deployment Ready.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kvbridge_operator.kube import DEPLOYMENTS
from kvbridge_sim.apiserver import RealisticKubernetes
from operator_reconcile import operator_on_emulator

ROOT = Path(__file__).parents[1]

BENCH_TOKEN = "benchmark"  # requests with this bearer token are never faulted


def ready_names(api: RealisticKubernetes) -> set[str]:
    found = set()
    for obj in api.peek("disaggregateddeployments"):
        conditions = (obj.get("status") or {}).get("conditions") or []
        if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
            found.add(obj["metadata"]["name"])
    return found


async def scenario(kind: str, count: int, outage: float = 25.0, timeout: float = 300.0) -> dict[str, Any]:
    template = yaml.safe_load((ROOT / "examples" / "synthetic" / "llama3-8b-hetero-tp.yaml").read_text())
    rng = random.Random(7)
    state = {"outage": False}

    def faults(verb: str, plural: str, headers: Mapping[str, str]) -> tuple[int, float] | None:
        if headers.get("Authorization") == f"Bearer {BENCH_TOKEN}":
            return None
        if kind == "outage":
            return (500, 0.0) if state["outage"] else None
        draw = rng.random()
        return (500, 0.0) if draw < 0.3 else (200, 2.0) if draw < 0.4 else None

    async with operator_on_emulator(token=BENCH_TOKEN) as (api, client, _):
        api.faults = faults
        state["outage"] = True
        begin = time.monotonic()
        for index in range(count):
            document = copy.deepcopy(template)
            document["metadata"]["name"] = f"dd-{index:03d}"
            await client.create(DEPLOYMENTS, "default", document)
        if kind == "outage":
            await asyncio.sleep(outage)
            state["outage"] = False
        healed = time.monotonic()
        deadline = healed + timeout
        while len(ready_names(api)) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        done = time.monotonic()
        return {
            "scenario": kind,
            "deployments": count,
            "ready": len(ready_names(api)),
            "secondsAfterHeal" if kind == "outage" else "secondsToReady": round(
                done - (healed if kind == "outage" else begin), 1
            ),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deployments", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = [asyncio.run(scenario(kind, args.deployments)) for kind in ("outage", "flaky")]
    print(json.dumps(results) if args.json else "\n".join(json.dumps(r) for r in results))
    return 0 if all(r["ready"] == r["deployments"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
