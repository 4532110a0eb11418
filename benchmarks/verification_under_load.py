"""What verified transfers cost under load, measured with vLLM's own client on real vLLM (not a test).

    .venv/bin/python benchmarks/verification_under_load.py [--num-prompts 256] [--input-len 400]
        [--output-len 64] [--concurrency 16] [--rounds 6] [--warmup 1] [--json]

``kvbridge demo --serve`` runs two deployments of the tiny local model side by side, each one prefill and one
decode pod of the CPU build with kvbridge's connector, alike but for ``spec.transfer.verification`` (``Off`` and
``All``), and a router in front of each. ``vllm bench serve`` sends the same workload (random prompts, a new seed
per round, ``--max-concurrency`` requests in flight) through one router and then the other, ``--rounds`` times,
the order swapped every round (Off, All, All, Off, ...), so that drift on the machine and whatever favours the
first or second run of a round fall on both alike. Reported per run: requests per second, output
tokens per second, TTFT p50/p99, failures, and the CPU seconds the driven deployment's engine processes used
per completed request (each pod's ``vllm serve`` and its descendants, read from ``/proc``), and the engines' own
time digesting per request (``vllm:kvbridge_digest_seconds`` from their ``/metrics``).

On a shared machine with few cores, throughput and TTFT drift by tens of percent between identical runs, more
than the cost being measured. Three figures resist that drift: the *paired* ratios (each round's ``All`` run against its
``Off`` run, median over the rounds), the engines' CPU time per request, and — the direct one —
the time the engines spent digesting, which is all the work verification adds to a request now that the digests
travel with the transfer parameters (no extra exchange, no extra engine step).
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
import urllib.request
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]
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


def pod_processes(deployment: str) -> list[psutil.Process]:
    """Each of ``deployment``'s pods' ``vllm serve`` process (the one that carries the pod's environment)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("KVBRIDGE_ENGINE_ID", "").startswith(f"{deployment}-"):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def flag(command: list[str], name: str, default: str) -> str:
    return command[command.index(name) + 1] if name in command[:-1] else default


def digest_totals(deployment: str) -> tuple[float, int]:
    """The seconds and count of ``vllm:kvbridge_digest_seconds`` over ``deployment``'s engines, from their
    ``/metrics`` (every request digested once on prefill and once on decode when verification is on)."""
    seconds, count = 0.0, 0
    for process in pod_processes(deployment):
        command = process.cmdline()
        if "serve" not in command:
            continue
        url = f"http://{flag(command, '--host', '127.0.0.1')}:{flag(command, '--port', '8000')}/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith("vllm:kvbridge_digest_seconds_sum"):
                    seconds += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:kvbridge_digest_seconds_count"):
                    count += int(float(line.rsplit(" ", 1)[1]))
    return seconds, count


def engine_cpu_seconds(deployment: str) -> dict[int, float]:
    """CPU seconds (user + system) so far of every process of ``deployment``'s pods, by process id: each pod's
    ``vllm serve`` and its descendants (vLLM's engine core and workers retitle themselves, which hides their
    environment)."""
    seconds: dict[int, float] = {}
    for process in pod_processes(deployment):
        try:
            for member in (process, *process.children(recursive=True)):
                times = member.cpu_times()
                seconds[member.pid] = times.user + times.system
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return seconds


def cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds used between two readings (a process started in between counts from zero)."""
    return sum(total - before.get(pid, 0.0) for pid, total in after.items())


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
            for warmup in range(args.warmup):  # vLLM on CPU speeds up over its first minutes (kernels per shape)
                for policy in POLICIES:
                    seed += 1
                    progress(f"warm-up {warmup + 1}: verification {policy} (not counted) ...")
                    bench(*routers[policy], tokenizer, args, seed, workdir)
            for round_index in range(args.rounds):
                # Off first in odd rounds, All first in even ones: neither always runs second (ABBA)
                for policy in POLICIES if round_index % 2 == 0 else POLICIES[::-1]:
                    seed += 1
                    url, model = routers[policy]
                    progress(
                        f"round {round_index + 1}: verification {policy}, {args.num_prompts} prompts, "
                        f"concurrency {args.concurrency}, seed {seed} ..."
                    )
                    deployment = f"verify-{policy.lower()}"
                    before, digests_before = engine_cpu_seconds(deployment), digest_totals(deployment)
                    result = bench(url, model, tokenizer, args, seed, workdir)
                    cpu = cpu_used(before, engine_cpu_seconds(deployment))
                    digests_after = digest_totals(deployment)
                    digest_seconds = digests_after[0] - digests_before[0]
                    digest_count = digests_after[1] - digests_before[1]
                    completed = int(result.get("completed") or 0)
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
                            "engineCpuMsPerRequest": round(1000 * cpu / completed, 2) if completed else None,
                            "digestMsPerRequest": round(1000 * digest_seconds / completed, 3) if completed else None,
                            "digestsPerRequest": round(digest_count / completed, 2) if completed else None,
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
        "warmupRounds": args.warmup,
        "runs": runs,
        "allVersusOff": compare(runs),
    }


def compare(runs: list[dict[str, Any]]) -> dict[str, float]:
    """``All`` against ``Off``: the ratio of the medians over the rounds, and the median of the per-round ratios."""

    def median(policy: str, key: str) -> float:
        return float(statistics.median(r[key] for r in runs if r["verification"] == policy))

    def paired(key: str) -> float:
        off = {r["round"]: r[key] for r in runs if r["verification"] == "Off"}
        return float(statistics.median(r[key] / off[r["round"]] for r in runs if r["verification"] == "All"))

    keys = {"throughput": "requestsPerSecond", "ttftP50": "ttftP50Ms", "engineCpuPerRequest": "engineCpuMsPerRequest"}
    ratios: dict[str, float] = {}
    for name, key in keys.items():
        ratios[name] = round(median("All", key) / median("Off", key), 4)
        ratios[f"{name}Paired"] = round(paired(key), 4)
    return ratios


def table(result: dict[str, Any]) -> str:
    lines = [
        "| round | verification | req/s | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | engine CPU ms/req "
        "| digest ms/req | digests/req | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        lines.append(
            f"| {run['round']} | {run['verification']} | {run['requestsPerSecond']} | "
            f"{run['outputTokensPerSecond']} | {run['ttftP50Ms']} | {run['ttftP99Ms']} | "
            f"{run['engineCpuMsPerRequest']} | {run['digestMsPerRequest']} | {run['digestsPerRequest']} | "
            f"{run['failed']} |"
        )
    ratio = result["allVersusOff"]
    lines.append("\n`All` / `Off` | ratio of medians | median of paired rounds\n|---|---|---|")
    for name in ("throughput", "ttftP50", "engineCpuPerRequest"):
        lines.append(f"| {name} | {ratio[name]:.3f} | {ratio[name + 'Paired']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=400)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 1_000_000 * 10)
    parser.add_argument("--json", action="store_true")
    parsed = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: still stop what it started (finally)
    outcome = main(parsed)
    print(json.dumps(outcome) if parsed.json else table(outcome))
