"""The router's policies measured with vLLM's own client on real vLLM (not a test).

    .venv/bin/python benchmarks/router_policies.py [--manifest examples/vllm/small-cpu-kv-aware.yaml]
        [--rate 1.5] [--num-prompts 160] [--prefixes 40] [--prefix-len 384] [--suffix-len 32]
        [--routers least-loaded kv-aware kv-aware:4] [--json]

``kvbridge demo --serve -f MANIFEST`` runs the deployment's pods (real ``vllm serve`` processes of the CPU build,
kvbridge's connector), and two ``kvbridge-router --status-file`` processes are put over the same pods, one per
policy (``kv-aware``, ``least-loaded``). Each workload is sent by ``vllm bench serve`` through one router, then the
other, a new seed per run (no prefix carried over from one run to the next):

- ``prefix_repetition``: ``--prefixes`` shared prefixes of ``--prefix-len`` tokens, each with ``num-prompts /
  prefixes`` short suffixes, in random order (an agent's system prompt, a chat's earlier turns);
- ``random``: prompts of the same length that share nothing (kv-aware must be no worse).

``--routers`` names what each workload is sent through: a policy, and with ``:N`` that many router replicas over
the same pods (``kvbridge-router --replicas N`` each, reporting to each other, as the operator renders them;
``--no-peers``: not), the requests spread over them
at random, one by one, by a small HTTP front here (a Service, or a Gateway that balances per request). Every
configuration goes through that front, one replica included, so that they pay the same hop.

Reported per run: TTFT p50/p99 (vllm bench serve's), the prefill pods' prefix-cache hit rate over the run
(``vllm:prefix_cache_hits_total / queries_total``, vLLM's own counters), the workload's ideal hit rate (every
prefix's first request misses, every later one hits its whole blocks), and the KV bytes the decode pods read
(``vllm:kvbridge_transfer_bytes``: with decode affinity a follow-up reads only the blocks its decode pod lacks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvbridge_sim.support import free_port, wait_until

ROOT = Path(__file__).parents[1]
BIN = Path(sys.executable).parent
POLICIES = ("least-loaded", "kv-aware")


class Spreader(threading.Thread):
    """An HTTP front sending each request to one of ``backends`` drawn at random (seeded), its answer streamed back:
    what spreads requests over router replicas here."""

    def __init__(self, backends: list[str], seed: int) -> None:
        super().__init__(daemon=True)
        self.backends, self.port = backends, free_port()
        self._random = random.Random(seed)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        session = ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=900))

        async def forward(request: web.Request) -> web.StreamResponse:
            target = self._random.choice(self.backends)
            headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
            async with session.request(
                request.method, target + request.path_qs, data=await request.read(), headers=headers
            ) as upstream:
                answer = web.StreamResponse(
                    status=upstream.status,
                    headers={"Content-Type": upstream.headers.get("Content-Type", "application/json")},
                )
                await answer.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await answer.write(chunk)
                await answer.write_eof()
                return answer

        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._ready.set()
        try:
            await self._stopping.wait()
        finally:
            await runner.cleanup()
            await session.close()

    def start_serving(self) -> Spreader:
        self.start()
        if not self._ready.wait(30):
            raise TimeoutError("the spreading front did not start within 30 s")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            self.join(timeout=30)


def configuration(text: str) -> tuple[str, int]:
    """``POLICY`` or ``POLICY:N`` (N router replicas)."""
    policy, _, count = text.partition(":")
    if policy not in POLICIES or (count and (not count.isdigit() or int(count) < 1)):
        raise argparse.ArgumentTypeError(f"{text!r}: give POLICY or POLICY:N, POLICY one of {', '.join(POLICIES)}")
    return policy, int(count or 1)


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def read_line(proc: subprocess.Popen[str], pattern: str, timeout: float) -> re.Match[str]:
    """The first stdout line of ``proc`` matching ``pattern`` (other lines are passed to stderr)."""
    deadline = time.monotonic() + timeout
    if proc.stdout is None:
        raise RuntimeError("kvbridge demo --serve was started without a stdout pipe")
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"kvbridge demo --serve ended (exit {proc.wait()}) before printing {pattern!r}")
        progress(f"  demo: {line.rstrip()}")
        found = re.search(pattern, line)
        if found:
            return found
    raise TimeoutError(f"kvbridge demo --serve printed no {pattern!r} within {timeout:g} s")


def scrape(url: str) -> dict[str, float]:
    """A pod's Prometheus counters summed by metric name (labels dropped)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
    return totals


def counters(urls: dict[str, list[str]]) -> dict[str, float]:
    prefill = [scrape(u) for u in urls["prefill"]]
    decode = [scrape(u) for u in urls["decode"]]
    return {
        "hits": sum(m.get("vllm:prefix_cache_hits_total", 0.0) for m in prefill),
        "queries": sum(m.get("vllm:prefix_cache_queries_total", 0.0) for m in prefill),
        "readBytes": sum(m.get("vllm:kvbridge_transfer_bytes_sum", 0.0) for m in decode),
        "reads": sum(m.get("vllm:kvbridge_transfer_bytes_count", 0.0) for m in decode),
    }


def outcomes(routers: list[str]) -> dict[str, int]:
    """The routers' requests by outcome (``kvbridge_router_requests_total``: ok, or the error code answered), summed
    over the replicas."""
    found: dict[str, int] = {}
    for url in routers:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            text = response.read().decode()
        for line in text.splitlines():
            if not line.startswith("kvbridge_router_requests_total{"):
                continue
            labels, value = line.rsplit(" ", 1)
            outcome = re.search(r'outcome="([^"]*)"', labels)
            if outcome:
                found[outcome.group(1)] = found.get(outcome.group(1), 0) + int(float(value))
    return found


def logs(folder: Path | None, name: str) -> Any:
    """Where a router's log goes: a file in ``folder`` (--logs), else nowhere."""
    if folder is None:
        return subprocess.DEVNULL
    folder.mkdir(parents=True, exist_ok=True)
    return (folder / name).open("w")


def wait_healthy(url: str, timeout: float = 60) -> None:
    def healthy() -> bool:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return bool(response.status == 200)

    wait_until(healthy, timeout, f"router {url} to be healthy", interval=0.3, tolerate=(OSError,))


def bench(
    url: str, model: str, tokenizer: Path, workload: str, args: argparse.Namespace, seed: int, workdir: Path
) -> dict[str, Any]:
    """One ``vllm bench serve`` run through the router at ``url``; its saved result."""
    name = f"{workload}-{seed}.json"
    data = (
        [
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            str(args.prefix_len),
            "--prefix-repetition-suffix-len",
            str(args.suffix_len),
            "--prefix-repetition-num-prefixes",
            str(args.prefixes),
            "--prefix-repetition-output-len",
            str(args.output_len),
        ]
        if workload == "prefix_repetition"
        else [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(args.prefix_len + args.suffix_len),
            "--random-output-len",
            str(args.output_len),
            "--random-range-ratio",
            "0",
        ]
    )
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
        *data,
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        str(args.rate),
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
    run = subprocess.run(command, capture_output=True, text=True, timeout=args.num_prompts / args.rate + 900)
    if run.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({run.returncode}): {run.stderr[-2000:]}")
    return dict(json.loads((workdir / name).read_text()))


def ideal_hit_rate(args: argparse.Namespace, block: int) -> float:
    """Every prefix's first request misses; every later one hits the whole blocks of its prefix."""
    later = (args.num_prompts - args.prefixes) / args.num_prompts
    return float(later * (args.prefix_len // block * block) / (args.prefix_len + args.suffix_len))


def main(args: argparse.Namespace) -> dict[str, Any]:
    procs: list[subprocess.Popen[Any]] = []
    spreaders: list[Spreader] = []
    with tempfile.TemporaryDirectory(prefix="kvbridge-policies-") as folder:
        workdir = Path(folder)
        try:
            if args.attach:  # a `kvbridge demo --serve` already running: its kubeconfig
                kubeconfig = str(args.attach)
                listed = json.loads(
                    subprocess.run(
                        ["kubectl", "--kubeconfig", kubeconfig, "get", "dd", "-o", "json"],
                        check=True,
                        capture_output=True,
                        text=True,
                    ).stdout
                )
                dd = listed["items"][0]
            else:
                progress(f"starting kvbridge demo --serve -f {args.manifest} (models made, engines started: minutes)")
                demo = subprocess.Popen(
                    [str(BIN / "kvbridge"), "demo", "--serve", "-f", str(args.manifest)],
                    stdout=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
                procs.append(demo)
                kubeconfig = read_line(demo, r"^kubeconfig (\S+)", 1800).group(1)
                name = read_line(demo, r"^router (\S+) (\S+) model (\S+)", 300).group(1)
                got = subprocess.run(
                    ["kubectl", "--kubeconfig", kubeconfig, "get", "dd", name, "-o", "json"],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                dd = json.loads(got.stdout)
            model = str(dd["spec"]["model"]["name"])
            status_file = workdir / "dd.json"
            status_file.write_text(json.dumps(dd))
            block = int(dd["spec"]["prefill"].get("blockSize", 16))
            urls = {
                role: [f"http://{e['ip']}:{e['httpPort']}" for e in dd["status"][role]["endpoints"]]
                for role in ("prefill", "decode")
            }
            routers: dict[tuple[str, int], Spreader] = {}
            key_file = workdir / "peer-key"
            key_file.write_text(secrets.token_hex(32))
            for policy, count in args.routers:
                replicas: list[str] = []
                ports = [free_port() for _ in range(count)]
                # two or more: the replicas report to each other, as the operator renders them (router.md)
                peers = (
                    [
                        "--peers",
                        ",".join(f"http://127.0.0.1:{p}" for p in ports),
                        "--peer-key-file",
                        str(key_file),
                    ]
                    if count >= 2 and not args.no_peers
                    else []
                )
                for port in ports:
                    procs.append(
                        subprocess.Popen(
                            [
                                str(BIN / "kvbridge-router"),
                                "--status-file",
                                str(status_file),
                                "--host",
                                "127.0.0.1",
                                "--port",
                                str(port),
                                "--policy",
                                policy,
                                "--block-size",
                                str(block),
                                "--replicas",
                                str(count),
                                *peers,
                            ],
                            stderr=logs(args.logs, f"router-{policy}-{count}-{len(replicas)}.log"),
                        )
                    )
                    replicas.append(f"http://127.0.0.1:{port}")
                    wait_healthy(replicas[-1])
                spreaders.append(Spreader(replicas, args.seed).start_serving())
                routers[policy, count] = spreaders[-1]
            from kvbridge_sim import tiny_model

            tokenizer = tiny_model.make(workdir / "tokenizer")  # every local model has the same tokenizer
            runs = []
            seed = args.seed
            for workload in args.workloads:
                for policy, count in args.routers:
                    seed += 1
                    progress(
                        f"{workload} through {count} {policy} router(s) ({args.num_prompts} prompts at "
                        f"{args.rate:g}/s, seed {seed}) ..."
                    )
                    before, answered = counters(urls), outcomes(routers[policy, count].backends)
                    result = bench(routers[policy, count].url, model, tokenizer, workload, args, seed, workdir)
                    after = counters(urls)
                    delta = {k: after[k] - before[k] for k in after}
                    answered = {k: v - answered.get(k, 0) for k, v in outcomes(routers[policy, count].backends).items()}
                    runs.append(
                        {
                            "workload": workload,
                            "policy": policy,
                            "replicas": count,
                            "seed": seed,
                            "completed": result.get("completed"),
                            "failed": result.get("failed", 0),
                            # why they failed, as the routers answered them (an error code each)
                            "routerErrors": {k: v for k, v in sorted(answered.items()) if k != "ok" and v},
                            "ttftP50Ms": round(float(result["p50_ttft_ms"]), 1),
                            "ttftP99Ms": round(float(result["p99_ttft_ms"]), 1),
                            "hitRate": round(delta["hits"] / delta["queries"], 4) if delta["queries"] else None,
                            "idealHitRate": round(ideal_hit_rate(args, block), 4)
                            if workload == "prefix_repetition"
                            else 0.0,
                            "decodeReadMiB": round(delta["readBytes"] / 2**20, 1),
                            "decodeReads": int(delta["reads"]),
                        }
                    )
                    progress(f"  {runs[-1]}")
        finally:
            for proc in reversed(procs):
                if proc.poll() is None and proc.args[1:3] == ["demo", "--serve"]:
                    os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C: routers, pods, then the operator
                elif proc.poll() is None:
                    proc.terminate()
            for proc in reversed(procs):
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
            for spreader in spreaders:  # after the processes: a failure here leaves none running
                spreader.stop()
    return {
        "manifest": str(args.manifest),
        "rate": args.rate,
        "numPrompts": args.num_prompts,
        "prefixes": args.prefixes,
        "prefixLen": args.prefix_len,
        "suffixLen": args.suffix_len,
        "outputLen": args.output_len,
        "routers": [f"{policy}:{count}" for policy, count in args.routers],
        "runs": runs,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| workload | policy | routers | TTFT p50 (ms) | TTFT p99 (ms) | prefill hit rate (ideal) "
        "| decode KV read (MiB) | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        rate = "—" if run["hitRate"] is None else f"{100 * run['hitRate']:.1f} %"
        if run["idealHitRate"]:
            rate += f" ({100 * run['idealHitRate']:.1f} %)"
        lines.append(
            f"| {run['workload']} | {run['policy']} | {run['replicas']} | {run['ttftP50Ms']} | {run['ttftP99Ms']} "
            f"| {rate} | {run['decodeReadMiB']} | {run['failed']}"
            + "".join(f", {code} {count}" for code, count in run["routerErrors"].items())
            + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", type=Path, default=ROOT / "examples/vllm/small-cpu-kv-aware.yaml")
    parser.add_argument("--logs", type=Path, help="write each router's log to a file in this folder")
    parser.add_argument(
        "--no-peers", action="store_true", help="router replicas do not report to each other (as before they did)"
    )
    parser.add_argument("--rate", type=float, default=1.5, help="requests per second (default 1.5)")
    parser.add_argument("--num-prompts", type=int, default=160, help="requests per run (default 160)")
    parser.add_argument("--prefixes", type=int, default=40, help="shared prefixes (default 40)")
    parser.add_argument("--prefix-len", type=int, default=384, help="tokens per shared prefix (default 384)")
    parser.add_argument("--suffix-len", type=int, default=32, help="tokens after it (default 32)")
    parser.add_argument("--output-len", type=int, default=4, help="tokens generated per request (default 4)")
    parser.add_argument(
        "--seed",
        type=int,
        default=int(time.time()) % 1_000_000 * 10,
        help="the first run's seed, each run adds one (default: from the clock, so that a second "
        "invocation against the same pods finds none of its prefixes cached)",
    )
    parser.add_argument(
        "--workloads", nargs="+", default=["prefix_repetition", "random"], choices=["prefix_repetition", "random"]
    )
    parser.add_argument(
        "--attach",
        type=Path,
        metavar="KUBECONFIG",
        help="use the `kvbridge demo --serve` already running with this kubeconfig instead of starting one",
    )
    parser.add_argument(
        "--routers",
        nargs="+",
        type=configuration,
        default=[("least-loaded", 1), ("kv-aware", 1)],
        metavar="POLICY[:N]",
        help="what each workload goes through, in order: a policy, with :N that many replicas (default: "
        "least-loaded kv-aware)",
    )
    parser.add_argument("--json", action="store_true")
    parsed = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: still stop what it started (finally)
    outcome = main(parsed)
    print(json.dumps(outcome) if parsed.json else table(outcome))
