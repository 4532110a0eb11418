"""What verified transfers cost under load, measured with vLLM's own client on real vLLM (not a test).

    .venv/bin/python benchmarks/verification_under_load.py [--num-prompts 256] [--input-len 400]
        [--output-len 64] [--concurrency 16] [--rounds 2] [--json]

``kvbridge demo --serve`` runs two deployments of the tiny local model side by side, each one prefill and one
decode pod of the CPU build with kvbridge's connector, alike but for ``spec.transfer.verification`` (``Off`` and
``All``), and a router in front of each. ``vllm bench serve`` sends the same workload (random prompts, a new seed
per round, ``--max-concurrency`` requests in flight) through one router and then the other, ``--rounds`` times in
alternation, so that drift on the machine falls on both alike. Reported per run: requests per second, output
tokens per second, TTFT p50/p99 and failures; then ``All`` against ``Off`` (medians over the rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from kvbridge_sim import tiny_model
from router_policies import BIN, progress, read_line

POLICIES = ("Off", "All")


def manifests(policies: tuple[str, ...]) -> list[dict[str, Any]]:
    """One deployment per verification policy: 1 prefill + 1 decode of the tiny model, kvbridge's connector."""
    return [
        {
            "apiVersion": "kvbridge.io/v1alpha1",
            "kind": "DisaggregatedDeployment",
            "metadata": {"name": f"verify-{policy.lower()}"},
            "spec": {
                "engine": {
                    "kind": "VLLM",
                    "device": "CPU",
                    "connector": "KVBridge",
                    "cpuKVCacheGiB": 1,
                    "extraArgs": ["--enforce-eager", "--max-model-len=512"],
                },
                "model": {
                    "name": "kvbridge/tiny-llama",
                    "numLayers": 2,
                    "numKVHeads": 2,
                    "headDim": 64,
                    "kvCacheDtype": "bfloat16",
                },
                "prefill": {"replicas": 1, "tensorParallelSize": 1, "blockSize": 32, "kvLayout": "HND"},
                "decode": {"replicas": 1, "tensorParallelSize": 1, "blockSize": 32, "kvLayout": "HND"},
                "transfer": {"verification": policy},
            },
        }
        for policy in policies
    ]


def bench(url: str, model: str, tokenizer: Path, args: argparse.Namespace, seed: int, workdir: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` run through the router at ``url``; its saved result."""
    name = f"run-{seed}.json"
    command = [
        str(BIN / "vllm"),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.concurrency),
        "--seed",
        str(seed),
        "--ignore-eos",
        "--percentile-metrics",
        "ttft",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(workdir),
        "--result-filename",
        name,
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({run.returncode}): {run.stderr[-2000:]}")
    return dict(json.loads((workdir / name).read_text()))


def main(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvbridge-verification-") as folder:
        workdir = Path(folder)
        manifest = workdir / "deployments.yaml"
        manifest.write_text(yaml.safe_dump_all(manifests(POLICIES), sort_keys=False))
        progress("starting kvbridge demo --serve with verification Off and All (engines start: minutes)")
        demo = subprocess.Popen(
            [str(BIN / "kvbridge"), "demo", "--serve", "-f", str(manifest)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            read_line(demo, r"^kubeconfig (\S+)", 1800)
            routers: dict[str, tuple[str, str]] = {}
            while len(routers) < len(POLICIES):
                found = read_line(demo, r"^router (\S+) (\S+) model (\S+)", 600)
                policy = next(p for p in POLICIES if found.group(1) == f"verify-{p.lower()}")
                routers[policy] = (found.group(2), found.group(3))
            tokenizer = tiny_model.make(workdir / "tokenizer")
            seed = args.seed
            for round_index in range(args.rounds):
                for policy in POLICIES:
                    seed += 1
                    url, model = routers[policy]
                    progress(
                        f"round {round_index + 1}: verification {policy}, {args.num_prompts} prompts, "
                        f"concurrency {args.concurrency}, seed {seed} ..."
                    )
                    result = bench(url, model, tokenizer, args, seed, workdir)
                    runs.append(
                        {
                            "round": round_index + 1,
                            "verification": policy,
                            "seed": seed,
                            "completed": result.get("completed"),
                            "failed": result.get("failed", 0),
                            "requestsPerSecond": round(float(result["request_throughput"]), 2),
                            "outputTokensPerSecond": round(float(result["output_throughput"]), 1),
                            "ttftP50Ms": round(float(result["p50_ttft_ms"]), 1),
                            "ttftP99Ms": round(float(result["p99_ttft_ms"]), 1),
                        }
                    )
                    progress(f"  {runs[-1]}")
        finally:
            if demo.poll() is None:
                os.killpg(demo.pid, signal.SIGINT)  # as Ctrl-C: routers, pods, then the operator
            try:
                demo.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait(timeout=30)
    return {
        "numPrompts": args.num_prompts,
        "inputLen": args.input_len,
        "outputLen": args.output_len,
        "concurrency": args.concurrency,
        "runs": runs,
        "allVersusOff": compare(runs),
    }


def compare(runs: list[dict[str, Any]]) -> dict[str, float]:
    """``All`` against ``Off``: the ratio of the medians over the rounds."""

    def median(policy: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["verification"] == policy)

    return {
        "throughput": round(median("All", "requestsPerSecond") / median("Off", "requestsPerSecond"), 4),
        "ttftP50": round(median("All", "ttftP50Ms") / median("Off", "ttftP50Ms"), 4),
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| round | verification | req/s | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        lines.append(
            f"| {run['round']} | {run['verification']} | {run['requestsPerSecond']} | "
            f"{run['outputTokensPerSecond']} | {run['ttftP50Ms']} | {run['ttftP99Ms']} | {run['failed']} |"
        )
    ratio = result["allVersusOff"]
    lines.append(f"\n`All` / `Off` (medians): throughput {ratio['throughput']:.3f}, TTFT p50 {ratio['ttftP50']:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=400)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 1_000_000 * 10)
    parser.add_argument("--json", action="store_true")
    parsed = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: still stop what it started (finally)
    outcome = main(parsed)
    print(json.dumps(outcome) if parsed.json else table(outcome))
