"""What verified transfers cost under load, measured with vLLM's own client on real vLLM (not a test).

    .venv/bin/python benchmarks/verification_under_load.py [--num-prompts 256] [--input-len 400]
        [--output-len 64] [--concurrency 16] [--rounds 6] [--warmup 1]
        [--policies Off All Sampled Control] [--prefix-caching] [--json]

``kvbridge demo --serve`` runs one deployment per policy of the tiny local model side by side, each one prefill
and one decode pod of the CPU build with kvbridge's connector, alike but for ``spec.transfer.verification``
(``Off``, ``All``, the default ``Sampled``; ``Control`` is a second ``Off``), and a router in front of each.
``vllm bench serve`` sends the same workload (random prompts, a new seed per round, ``--max-concurrency``
requests in flight) through one router after the other, ``--rounds`` times, the order reversed every round and rotated
every two (:func:`round_order`), so that drift on the machine and whatever favours an early, middle or late run of
a round fall on all alike. Prefix caching is off unless asked for (:data:`NO_PREFIX_CACHING`). Reported per run:
requests per second, output tokens per second, TTFT p50/p99, TPOT p50, ITL p99, failures, the router's split of
the time to first token, the CPU seconds the driven deployment's engine processes used per completed request
(each pod's ``vllm serve`` and its descendants, read from ``/proc``), the engines' own time digesting per request
(``vllm:kvbridge_digest_seconds`` from their ``/metrics``), what their steps waited for verification per
request (``vllm:kvbridge_digest_wait_seconds``: decode's join of a check, an offer waiting for a digest) and all
the time vLLM's thread spent in kvbridge's hooks per request, by role (``vllm:kvbridge_step_hooks_seconds``).

On a shared machine with few cores, throughput and TTFT move by tens of percent between identical runs, more than
the cost being measured. So each policy is compared with ``Off`` round by round (the *paired* ratios, their
median and its 95 % bootstrap interval), and ``Control`` shows what two identical deployments differ by on the
same machine in the same run: a ratio inside ``Control``'s spread is below what the run can resolve. The direct
figures — digest time, step wait and hook time per request — do not drift with the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]
import yaml

from kvbridge_sim import tiny_model
from router_policies import BIN, progress, read_line

POLICIES = ("Off", "All", "Sampled")
#: ``Control``: a second deployment with verification ``Off``, compared with ``Off`` like the others: what the
#: machine's noise alone makes of two identical deployments (an A/A arm), the scale any other ratio is read on
CONTROL = "Control"
#: every request digested once on prefill and once on decode when verification is on
DIGEST_METRIC = "vllm:kvbridge_digest_seconds"
#: what engine steps waited for verification on the engine's own thread
WAIT_METRIC = "vllm:kvbridge_digest_wait_seconds"
#: all the time engine steps spent in kvbridge's hooks, by role: what the connector costs vLLM's thread
HOOKS_METRIC = "vllm:kvbridge_step_hooks_seconds"
METRICS = (DIGEST_METRIC, WAIT_METRIC, HOOKS_METRIC)
ROLES = ("prefill", "decode")
#: both engines' prefix caches off (the default here): ``vllm bench serve``'s random prompts are runs of consecutive
#: token ids from a random offset, so with the tiny model's 1,024-token vocabulary there are about a thousand of
#: them; with prefix caching, later rounds find more and more of their prompts cached on prefill and decode, and
#: the work per request (and throughput) drifts across the run more than verification costs
NO_PREFIX_CACHING = "--no-enable-prefix-caching"


def manifests(policies: tuple[str, ...], prefix_caching: bool = False) -> list[dict[str, Any]]:
    """One deployment per verification policy: 1 prefill + 1 decode of the tiny model, kvbridge's connector;
    without ``prefix_caching`` every request is computed, read and verified in full (:data:`NO_PREFIX_CACHING`)."""
    extra = ["--enforce-eager", "--max-model-len=512", *([] if prefix_caching else [NO_PREFIX_CACHING])]
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
                    "extraArgs": extra,
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
                "transfer": {"verification": "Off" if policy == CONTROL else policy},
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
        "ttft,tpot,itl",
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


def metric_totals(deployment: str) -> dict[tuple[str, str], float]:
    """Every ``_sum`` and ``_count`` of :data:`METRICS` over ``deployment``'s engines, by role and line name (e.g.
    ``("decode", "vllm:kvbridge_digest_seconds_count")``), from one read of each engine's ``/metrics``."""
    wanted = {f"{metric}_{part}" for metric in METRICS for part in ("sum", "count")}
    totals: dict[tuple[str, str], float] = {}
    for process in pod_processes(deployment):
        command = process.cmdline()
        if "serve" not in command:
            continue
        role = process.environ().get("KVBRIDGE_ROLE", "")
        url = f"http://{flag(command, '--host', '127.0.0.1')}:{flag(command, '--port', '8000')}/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            for line in answer.read().decode().splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name in wanted:
                    totals[role, name] = totals.get((role, name), 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def spent(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float], name: str, roles: tuple[str, ...] = ROLES
) -> float:
    """How much line ``name`` of :func:`metric_totals` grew between two readings, over ``roles``."""
    return sum(after.get((role, name), 0.0) - before.get((role, name), 0.0) for role in roles)


def router_totals(url: str) -> dict[str, float]:
    """The router's own split of the time to first token, so far: the prefill calls' seconds and the first
    tokens' (``kvbridge_router_prefill_seconds``, ``kvbridge_router_ttft_seconds``: sums and counts)."""
    names = [f"kvbridge_router_{name}_seconds_{part}" for name in ("prefill", "ttft") for part in ("sum", "count")]
    totals = dict.fromkeys(names, 0.0)
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        for line in answer.read().decode().splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def split_ms(before: dict[str, float], after: dict[str, float]) -> tuple[float | None, float | None]:
    """Mean prefill call and mean rest of the time to first token (decode: READs, check, first step), in ms."""
    delta = {name: after[name] - before[name] for name in after}
    prefills, firsts = delta["kvbridge_router_prefill_seconds_count"], delta["kvbridge_router_ttft_seconds_count"]
    if not prefills or not firsts:
        return None, None
    prefill = delta["kvbridge_router_prefill_seconds_sum"] / prefills
    return round(1000 * prefill, 1), round(1000 * (delta["kvbridge_router_ttft_seconds_sum"] / firsts - prefill), 1)


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


def pin(deployment: str) -> dict[str, list[int]]:
    """Every thread of ``deployment``'s engines onto one core per role, the same for every deployment (prefill on
    the first core, decode on the last): the local kubelet hands out cores in the order pods start, which may put
    one deployment's two pods on one core and another's on two — a placement, not a policy, that would decide
    the comparison. Returns the cores by role."""
    cores = sorted(os.sched_getaffinity(0))
    placed: dict[str, list[int]] = {}
    for process in pod_processes(deployment):
        try:
            role = process.environ().get("KVBRIDGE_ROLE", "")
            core = {cores[0]} if role == "prefill" else {cores[-1]}
            for member in (process, *process.children(recursive=True)):
                for thread in member.threads():
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(thread.id, core)
            placed[role] = sorted(core)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return placed


def cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds used between two readings (a process started in between counts from zero)."""
    return sum(total - before.get(pid, 0.0) for pid, total in after.items())


def round_order(policies: tuple[str, ...], round_index: int) -> tuple[str, ...]:
    """The order of a round: reversed every other round (ABBA) and rotated by one every two rounds, so that over
    ``2 * len(policies)`` rounds every policy runs in every position equally often (with three, ABBA alone would
    keep the middle one in the middle, next to both others every time)."""
    shift = (round_index // 2) % len(policies)
    rotated = policies[shift:] + policies[:shift]
    return rotated if round_index % 2 == 0 else rotated[::-1]


def main(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    policies = tuple(args.policies)
    with tempfile.TemporaryDirectory(prefix="kvbridge-verification-") as folder:
        workdir = Path(folder)
        manifest = workdir / "deployments.yaml"
        manifest.write_text(yaml.safe_dump_all(manifests(policies, args.prefix_caching), sort_keys=False))
        progress(f"starting kvbridge demo --serve with verification {', '.join(policies)} (engines start: minutes)")
        demo = subprocess.Popen(
            [str(BIN / "kvbridge"), "demo", "--serve", "-f", str(manifest)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            read_line(demo, r"^kubeconfig (\S+)", 1800)
            routers: dict[str, tuple[str, str]] = {}
            while len(routers) < len(policies):
                found = read_line(demo, r"^router (\S+) (\S+) model (\S+)", 600)
                policy = next(p for p in policies if found.group(1) == f"verify-{p.lower()}")
                routers[policy] = (found.group(2), found.group(3))
            placement = {policy: pin(f"verify-{policy.lower()}") for policy in policies}
            progress(f"cores by role: {placement}")
            tokenizer = tiny_model.make(workdir / "tokenizer")
            seed = args.seed
            for warmup in range(args.warmup):  # vLLM on CPU speeds up over its first minutes (kernels per shape)
                for policy in policies:
                    seed += 1
                    progress(f"warm-up {warmup + 1}: verification {policy} (not counted) ...")
                    bench(*routers[policy], tokenizer, args, seed, workdir)
            for round_index in range(args.rounds):
                for policy in round_order(policies, round_index):
                    seed += 1
                    url, model = routers[policy]
                    progress(
                        f"round {round_index + 1}: verification {policy}, {args.num_prompts} prompts, "
                        f"concurrency {args.concurrency}, seed {seed} ..."
                    )
                    deployment = f"verify-{policy.lower()}"
                    pin(deployment)  # threads started since (vLLM's, kvbridge's) too
                    before, metrics_before = engine_cpu_seconds(deployment), metric_totals(deployment)
                    routed = router_totals(url)
                    result = bench(url, model, tokenizer, args, seed, workdir)
                    prefill_ms, decode_ms = split_ms(routed, router_totals(url))
                    cpu = cpu_used(before, engine_cpu_seconds(deployment))
                    grown = partial(spent, metrics_before, metric_totals(deployment))
                    digest_seconds, digest_count = grown(f"{DIGEST_METRIC}_sum"), grown(f"{DIGEST_METRIC}_count")
                    waited = grown(f"{WAIT_METRIC}_sum")
                    completed = int(result.get("completed") or 0)
                    hooks = {role: grown(f"{HOOKS_METRIC}_sum", (role,)) for role in ROLES}
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
                            "tpotP50Ms": round(float(result["p50_tpot_ms"]), 2),
                            "itlP99Ms": round(float(result["p99_itl_ms"]), 1),
                            "prefillMeanMs": prefill_ms,
                            "decodeFirstMeanMs": decode_ms,
                            "engineCpuMsPerRequest": round(1000 * cpu / completed, 2) if completed else None,
                            "digestMsPerRequest": round(1000 * digest_seconds / completed, 3) if completed else None,
                            "digestsPerRequest": round(digest_count / completed, 2) if completed else None,
                            "stepWaitMsPerRequest": round(1000 * waited / completed, 3) if completed else None,
                            **{
                                f"{role}HooksMsPerRequest": round(1000 * hooks[role] / completed, 3)
                                if completed
                                else None
                                for role in ROLES
                            },
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
        "prefixCaching": args.prefix_caching,
        "runs": runs,
        "versusOff": {policy: compare(runs, policy) for policy in policies if policy != "Off"},
    }


#: the figures compared with ``Off``: name -> the run's key
FIGURES = {
    "throughput": "requestsPerSecond",
    "ttftP50": "ttftP50Ms",
    "tpotP50": "tpotP50Ms",
    "itlP99": "itlP99Ms",
    "prefillMean": "prefillMeanMs",
    "decodeFirstMean": "decodeFirstMeanMs",
    "engineCpuPerRequest": "engineCpuMsPerRequest",
    "prefillHooksPerRequest": "prefillHooksMsPerRequest",
    "decodeHooksPerRequest": "decodeHooksMsPerRequest",
}


#: resamples of the paired ratios behind each interval (seeded: the same runs give the same interval)
BOOTSTRAP_RESAMPLES = 4000


def compare(runs: list[dict[str, Any]], policy: str) -> dict[str, Any]:
    """``policy`` against ``Off``: the ratio of the medians over the rounds, the median of the per-round (paired)
    ratios, and a 95 % bootstrap interval of that median (``...PairedCI95``: the rounds' ratios resampled with
    replacement; with few rounds it is wide, which is what it should say)."""

    def median(which: str, key: str) -> float | None:
        found = [r[key] for r in runs if r["verification"] == which and r[key] is not None]
        return float(statistics.median(found)) if found else None

    def paired(key: str) -> list[float]:
        off = {r["round"]: r[key] for r in runs if r["verification"] == "Off"}
        rounds = [r for r in runs if r["verification"] == policy and r[key] is not None]
        return [r[key] / off[r["round"]] for r in rounds if off.get(r["round"])]

    ratios: dict[str, Any] = {}
    for name, key in FIGURES.items():
        mine, off = median(policy, key), median("Off", key)
        ratios[name] = round(mine / off, 4) if mine is not None and off else None
        rounds = paired(key)
        ratios[f"{name}Paired"] = round(statistics.median(rounds), 4) if rounds else None
        ratios[f"{name}PairedCI95"] = interval(rounds)
    return ratios


def interval(ratios: list[float]) -> list[float] | None:
    """The 95 % percentile-bootstrap interval of the median of ``ratios`` (``None`` below two rounds)."""
    if len(ratios) < 2:
        return None
    draw = random.Random(len(ratios))
    medians = sorted(statistics.median(draw.choices(ratios, k=len(ratios))) for _ in range(BOOTSTRAP_RESAMPLES))
    return [
        round(medians[int(0.025 * BOOTSTRAP_RESAMPLES)], 4),
        round(medians[int(0.975 * BOOTSTRAP_RESAMPLES) - 1], 4),
    ]


def table(result: dict[str, Any]) -> str:
    lines = [
        "| round | verification | req/s | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | ITL p99 (ms) "
        "| prefill mean (ms) | decode first mean (ms) | engine CPU ms/req | digest ms/req | digests/req "
        "| step wait ms/req | hooks ms/req (prefill, decode) | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        lines.append(
            f"| {run['round']} | {run['verification']} | {run['requestsPerSecond']} | "
            f"{run['outputTokensPerSecond']} | {run['ttftP50Ms']} | {run['ttftP99Ms']} | {run['tpotP50Ms']} | "
            f"{run['itlP99Ms']} | {run['prefillMeanMs']} | {run['decodeFirstMeanMs']} | "
            f"{run['engineCpuMsPerRequest']} | {run['digestMsPerRequest']} | "
            f"{run['digestsPerRequest']} | {run.get('stepWaitMsPerRequest')} | "
            f"{run.get('prefillHooksMsPerRequest')}, {run.get('decodeHooksMsPerRequest')} | {run['failed']} |"
        )
    for policy, ratio in result["versusOff"].items():
        lines.append(
            f"\n`{policy}` / `Off` | ratio of medians | median of paired rounds | its 95 % interval\n|---|---|---|---|"
        )
        for name in FIGURES:
            ci = ratio[name + "PairedCI95"]
            shown = f"{ci[0]:.3f} to {ci[1]:.3f}" if ci else "-"
            cells = [f"{ratio[n]:.3f}" if ratio[n] is not None else "-" for n in (name, name + "Paired")]
            lines.append(f"| {name} | {' | '.join(cells)} | {shown} |")
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
    parser.add_argument(
        "--policies",
        nargs="+",
        choices=(*POLICIES, CONTROL),
        default=list(POLICIES),
        help=f"Off comes first; {CONTROL} is a second Off deployment (the noise floor)",
    )
    parser.add_argument(
        "--prefix-caching", action="store_true", help="leave vLLM's prefix caching on (later rounds hit cached prompts)"
    )
    parser.add_argument("--json", action="store_true")
    parsed = parser.parse_args()
    if "Off" not in parsed.policies:
        parser.error("--policies: Off is what the others are compared with")
    parsed.policies = ["Off", *(p for p in parsed.policies if p != "Off")]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: still stop what it started (finally)
    outcome = main(parsed)
    print(json.dumps(outcome) if parsed.json else table(outcome))
