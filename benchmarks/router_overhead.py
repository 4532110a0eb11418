"""What `kvbridge-router` adds to a P/D request (not a test).

    .venv/bin/python benchmarks/router_overhead.py [--rate 50] [--seconds 20] [--stream] [--before REV] [--tracing]
        [--floor] [--pods 256] [--prefixes 100000] [--prompt-tokens 1700] [--text] [--json]

Two engine stand-ins (a prefill and a decode, each a separate process answering as vLLM's KV connectors do, after
``--engine-ms`` of simulated work) and ``kvbridge-router --status-file`` (``python -m kvbridge_router``, what the
router Deployment runs) as a third process in front of them. At a steady rate the same requests are sent (a) by the
client itself, prefill then decode, as a router would, and (b) through the router. Reports each path's latency
p50/p99, the difference (what the router adds per request: one more hop, JSON parsing and re-encoding, the pairing
and balancing), and the router process's CPU seconds per request (from /proc, user and system). The engines are
stand-ins so that their CPU is neither counted nor competing; real vLLM behind the router is in
tests/vllm/test_router.py.

``--pods N`` lists N prefill and N decode pods in the status (each a name of its own, all served by the two
stand-ins), so that the router's choice runs over a pool of that size; ``--prefixes M`` sends prompts of
``--prompt-tokens`` token ids drawn from M distinct prefixes by a Zipf law (exponent 1.0: a few hot, most rare),
so that the kv-aware index fills as in production; without it every request is the same 512-token prompt.
Each path is warmed up first (a second's requests; with ``--prefixes``, at least 4 a pod, so that every
pod's first use, its hash ring and its share of the index, is not counted: a router pays those once per pool, not
per request). ``--text`` sends each drawn prompt as text instead, as most OpenAI clients do: a word of three letters
and a space per token id (4 bytes a token, what the router's text chunking assumes), the same words for the same
prefix.

``--before REV`` runs a second router, the one of git revision REV, beside this checkout's: the paths take turns
(``--rounds``), so that a change is measured before and after in one run, under the same noise. ``--profile FILE``
runs this checkout's router under cProfile. ``--tracing`` runs a second router beside the first with tracing on
(spec.tracing's environment: OTLP/HTTP to a sink process that accepts every export, sampling ratio 1.0), taking
turns the same way: the difference in CPU per request is what tracing costs, export included (the SDK's batch
exporter is a thread of the router's process). ``--floor`` runs benchmarks/proxy_floor.py beside it the same way: the
least a P/D proxy in Python does (uvloop, llhttp, msgspec; no checks, choice, metrics or bounds), the floor under the
router's cost as memcpy is the ceiling over a transfer's.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from kvbridge_sim.support import free_port, until

ROOT = Path(__file__).parents[1]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def serve_engine(port: int, role: str, engine_ms: float, hosts: int = 1) -> None:
    """A vLLM-shaped engine: prefill returns transfer parameters, decode a completion (or a 3-chunk stream). With
    ``hosts`` above 1 it listens on 127.0.0.1 to 127.0.0.<hosts>, one address a pod, and counts the prefill requests
    whose prompt the pod (the address called) had been sent before: what an unbounded prefix cache would hit
    (``GET /stats``)."""
    from aiohttp import web

    seen: dict[str, set[int]] = {}
    stats = {"requests": 0, "hits": 0}

    async def counts(request: web.Request) -> web.Response:
        return web.json_response(stats)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        await asyncio.sleep(engine_ms / 1000)
        if role == "prefill":
            if hosts > 1:
                pod = str(request.transport.get_extra_info("sockname")[0]) if request.transport else ""
                prompt = hash(json.dumps(body.get("prompt")))
                held = seen.setdefault(pod, set())
                stats["requests"] += 1
                stats["hits"] += prompt in held
                held.add(prompt)
            return web.json_response(
                {
                    "choices": [{"text": "x"}],
                    "kv_transfer_params": {
                        "remote_engine_id": "p",
                        "remote_block_ids": list(range(16)),
                        "remote_host": "127.0.0.1",
                    },
                }
            )
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "abc", "token_ids": [1, 2, 3]}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for token in (1, 2, 3):
            await response.write(f"data: {json.dumps({'choices': [{'token_ids': [token]}]})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/stats", counts)
    listened = [f"127.0.0.{i + 1}" for i in range(hosts)] if hosts > 1 else "127.0.0.1"
    web.run_app(app, host=listened, port=port, print=None, access_log=None)


def serve_sink(port: int) -> None:
    """An OTLP/HTTP receiver that accepts every export (an empty ExportTraceServiceResponse) and reads nothing."""
    from aiohttp import web

    async def traces(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/traces", traces)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def tracing_env(port: int) -> dict[str, str]:
    """What spec.tracing renders into the router's pod, the endpoint being the sink on ``port``."""
    return {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}/v1/traces",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "1",
        "OTEL_SERVICE_NAME": "bench-router",
    }


def cpu_seconds(pid: int) -> tuple[float, float]:
    """A process's user and system CPU seconds so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


async def wait_up(session: aiohttp.ClientSession, url: str) -> None:
    async def up() -> bool:
        async with session.get(url) as r:
            return r.status < 500

    await until(up, 60, f"{url} to come up", interval=0.2, tolerate=(aiohttp.ClientError,))


async def prefill_stats(session: aiohttp.ClientSession, urls: dict[str, str], name: str) -> tuple[int, int]:
    """The prefill requests the stand-in of ``name`` took so far, and how many went to a pod sent the prompt before."""
    async with session.get(urls[f"prefill:{name}"] + "/stats") as r:
        stats = await r.json()
    return stats["requests"], stats["hits"]


async def direct(session: aiohttp.ClientSession, prefill: str, decode: str, body: dict[str, Any]) -> None:
    first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    async with session.post(f"{prefill}/v1/completions", json=first) as r:
        params = (await r.json())["kv_transfer_params"]
    async with session.post(f"{decode}/v1/completions", json={**body, "kv_transfer_params": params}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"decode: HTTP {r.status}")


async def routed(session: aiohttp.ClientSession, router: str, body: dict[str, Any]) -> None:
    async with session.post(f"{router}/v1/completions", json=body) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"router: HTTP {r.status}")


async def steady(rate: float, seconds: float, call: Any) -> list[float]:
    """Start a request every 1/rate s for ``seconds`` (open loop); each one's latency."""
    latencies: list[float] = []

    async def one() -> None:
        started = time.perf_counter()
        await call()
        latencies.append(time.perf_counter() - started)

    tasks = []
    begin = time.perf_counter()
    for index in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, begin + index / rate - time.perf_counter()))
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return latencies


#: ``--text``: the word written for a token id (``id % 17576``: three letters, a-z)
WORDS = ["".join(letters) for letters in itertools.product("abcdefghijklmnopqrstuvwxyz", repeat=3)]


class Prompts:
    """Request bodies: the same 512-token prompt, or (``prefixes``) prompts of ``tokens`` token ids drawn from that
    many distinct prefixes by a Zipf law of exponent 1.0, each prefix's ids fixed by its number; ``text``: those ids
    written as words (:data:`WORDS`)."""

    def __init__(self, prefixes: int, tokens: int, stream: bool, seed: int = 0, text: bool = False) -> None:
        self.prefixes, self.tokens, self.stream, self.text = prefixes, tokens, stream, text
        self._random = random.Random(seed)
        self._cumulative = list(itertools.accumulate(1.0 / rank for rank in range(1, prefixes + 1)))

    def body(self) -> dict[str, Any]:
        if not self.prefixes:
            return {"model": "m", "prompt": list(range(512)), "max_tokens": 3, "stream": self.stream}
        drawn = self._random.random() * self._cumulative[-1]
        prefix = bisect.bisect_left(self._cumulative, drawn)
        ids = random.Random(prefix).choices(range(5, 30000), k=self.tokens)
        prompt: list[int] | str = " ".join(WORDS[i % len(WORDS)] for i in ids) if self.text else ids
        return {"model": "m", "prompt": prompt, "max_tokens": 3, "stream": self.stream}


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50Ms": round(1000 * statistics.median(ordered), 3),
        "p99Ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
    }


def router_code(workdir: str, ref: str | None) -> dict[str, str]:
    """The environment that runs the router of git revision ``ref`` (its agent and operator sources, extracted
    into ``workdir``), or of this checkout when None."""
    if ref is None:
        return {}
    tree = Path(workdir, "before")
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "agent", "operator"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return {"PYTHONPATH": os.pathsep.join((str(tree / "operator"), str(tree / "agent")))}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    names = ["before", "after"] if args.before else ["router", "traced"] if args.tracing else ["router"]
    names += ["floor"] if args.floor else []
    names = [f"policy:{policy}" for policy in args.policies] if args.policies else names
    ports = {
        "prefill": free_port(),
        "decode": free_port(),
        "sink": free_port(),
        **{name: free_port() for name in names},
        **{f"prefill:{name}": free_port() for name in names if name.startswith("policy:")},
    }
    hits = {name: [0, 0] for name in names if name.startswith("policy:")}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    latencies: dict[str, list[float]] = {name: [] for name in ("direct", *names)}
    cpu = {name: [0.0, 0.0] for name in names}
    with tempfile.TemporaryDirectory() as workdir:
        status = {
            role: {
                "endpoints": [
                    {"pod": f"{role}-{i}", "ip": "127.0.0.1", "httpPort": ports[role], "pairing": "k"}
                    for i in range(args.pods)
                ]
            }
            for role in ("prefill", "decode")
        }
        status_file = Path(workdir, "status.json")
        status_file.write_text(json.dumps(status))
        status_files = dict.fromkeys(names, status_file)
        for name in hits:  # a prefill stand-in per policy, an address per pod: what each pod was sent is counted
            endpoints = [
                {"pod": f"prefill-{i}", "ip": f"127.0.0.{i + 1}", "httpPort": ports[f"prefill:{name}"], "pairing": "k"}
                for i in range(args.pods)
            ]
            status_files[name] = Path(workdir, f"status-{name.split(':')[1]}.json")
            status_files[name].write_text(json.dumps({**status, "prefill": {"endpoints": endpoints}}))
        try:
            for role in ("prefill", "decode"):
                procs[role] = subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--serve-engine",
                        role,
                        "--port",
                        str(ports[role]),
                        "--engine-ms",
                        str(args.engine_ms),
                    ]
                )
            for name in hits:
                standin = [sys.executable, __file__, "--serve-engine", "prefill", "--engine-ms", str(args.engine_ms)]
                standin += ["--port", str(ports[f"prefill:{name}"]), "--hosts", str(max(2, args.pods))]
                procs[f"prefill:{name}"] = subprocess.Popen(standin)
            if args.tracing:
                sink = [sys.executable, __file__, "--serve-sink", "--port", str(ports["sink"])]
                procs["sink"] = subprocess.Popen(sink)
            for name in names:
                if name == "floor":
                    floor = [sys.executable, str(ROOT / "benchmarks" / "proxy_floor.py"), "--port", str(ports[name])]
                    floor += ["--prefill-port", str(ports["prefill"]), "--decode-port", str(ports["decode"])]
                    procs[name] = subprocess.Popen(floor)
                    continue
                env = {**os.environ, **router_code(workdir, args.before if name == "before" else None)}
                env.update(tracing_env(ports["sink"]) if name == "traced" else {})
                profile = ["-m", "cProfile", "-o", args.profile] if args.profile and name != "before" else []
                procs[name] = subprocess.Popen(
                    [
                        sys.executable,
                        *profile,
                        "-m",
                        "kvbridge_router",
                        "--status-file",
                        str(status_files[name]),
                        *(["--policy", name.split(":")[1]] if name in hits else []),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(ports[name]),
                    ],
                    stderr=subprocess.DEVNULL,
                    env=env,
                )
            urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
                for role in ("prefill", "decode"):
                    await wait_up(session, urls[role] + "/v1/models")
                for name in names:
                    await wait_up(session, urls[name] + "/health")
                prompts = Prompts(args.prefixes, args.prompt_tokens, args.stream, text=args.text)

                def via(url: str) -> Callable[[], Awaitable[None]]:
                    return lambda: routed(session, url, prompts.body())

                calls: dict[str, Callable[[], Awaitable[None]]] = {
                    "direct": lambda: direct(session, urls["prefill"], urls["decode"], prompts.body()),
                    **{name: via(urls[name]) for name in names},
                }
                # warm-up: connections, code paths, and each pod's first use (its hash ring, its share of the index:
                # a router pays these once per pod set, not per request), so that the rounds measure the steady state
                warm = max(1, int(args.rate), 4 * args.pods if args.prefixes else 0)
                for call in calls.values():
                    await steady(args.rate, warm / args.rate, call)
                # rounds that take turns, so that a noisy neighbour (CPU steal on a shared VM) hits every path alike
                for round_ in range(args.rounds):
                    for name, call in calls.items():
                        before = cpu_seconds(procs[name].pid) if name in cpu else (0.0, 0.0)
                        counted = await prefill_stats(session, urls, name) if name in hits else (0, 0)
                        latencies[name] += await steady(args.rate, args.seconds / args.rounds, call)
                        if name in cpu:
                            after = cpu_seconds(procs[name].pid)
                            cpu[name] = [total + b - a for total, a, b in zip(cpu[name], before, after, strict=True)]
                        if name in hits:
                            now = await prefill_stats(session, urls, name)
                            hits[name] = [total + b - a for total, a, b in zip(hits[name], counted, now, strict=True)]
                    print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                proc.wait(timeout=10)
    direct_q = quantiles(latencies["direct"])
    result: dict[str, Any] = {
        "rate": args.rate,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "stream": args.stream,
        "tracing": args.tracing,
        "engineMsPerCall": args.engine_ms,
        "promptTokens": args.prompt_tokens if args.prefixes else 512,
        "pods": args.pods,
        "prefixes": args.prefixes,
        "prompts": "text" if args.text and args.prefixes else "token ids",
        "direct": direct_q,
    }
    for name in names:
        routed_q, count = quantiles(latencies[name]), len(latencies[name])
        user, system = cpu[name]
        result[name] = {
            **({"revision": args.before} if name == "before" else {}),
            "requests": count,
            "viaRouter": routed_q,
            "addedP50Ms": round(routed_q["p50Ms"] - direct_q["p50Ms"], 3),
            "addedP99Ms": round(routed_q["p99Ms"] - direct_q["p99Ms"], 3),
            "routerCpuMsPerRequest": round(1000 * (user + system) / count, 3),
            "routerUserMsPerRequest": round(1000 * user / count, 3),
            "routerSystemMsPerRequest": round(1000 * system / count, 3),
            **({"prefixHitRate": round(hits[name][1] / max(1, hits[name][0]), 3)} if name in hits else {}),
        }
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=50.0, help="requests per second (default 50)")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds per path (default 20)")
    parser.add_argument("--engine-ms", type=float, default=5.0, help="simulated work per engine call (default 5)")
    parser.add_argument("--stream", action="store_true", help="streamed decode answers")
    parser.add_argument(
        "--before",
        metavar="REV",
        help="also run the router of this git revision (say, the commit "
        "before a change), taking turns with this checkout's, and report both",
    )
    parser.add_argument(
        "--rounds", type=int, default=4, help="turns each path takes, --seconds split among them (default 4)"
    )
    parser.add_argument(
        "--tracing", action="store_true", help="also run a router with tracing on (ratio 1.0), taking turns"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run benchmarks/proxy_floor.py (the least a P/D proxy in Python does), taking turns",
    )
    parser.add_argument("--pods", type=int, default=1, help="prefill and decode pods in the status (default 1)")
    parser.add_argument("--prefixes", type=int, default=0, help="distinct prompt prefixes, Zipf-drawn (default 0)")
    parser.add_argument("--prompt-tokens", type=int, default=1700, help="tokens per drawn prompt (default 1700)")
    parser.add_argument(
        "--text", action="store_true", help="with --prefixes: each prompt as text, 4 bytes a token (default: token ids)"
    )
    parser.add_argument(
        "--policies",
        nargs="+",
        metavar="POLICY",
        help="run one router per policy (kv-aware, least-loaded, round-robin) instead, taking turns, each in front of "
        "a prefill stand-in of its own that counts prefix hits (a prompt sent to a pod that was sent it before; "
        "up to 254 pods)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="run the router under cProfile, its stats written to FILE "
        "(read with python -m pstats FILE; CPU per request is then inflated)",
    )
    parser.add_argument("--serve-engine", choices=("prefill", "decode"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-sink", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hosts", type=int, default=1, help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.serve_sink:
        serve_sink(parsed.port)
        sys.exit(0)
    if parsed.serve_engine:
        serve_engine(parsed.port, parsed.serve_engine, parsed.engine_ms, parsed.hosts)
        sys.exit(0)
    if parsed.floor and parsed.stream:
        parser.error("--floor passes whole answers only: not with --stream")
    result = asyncio.run(main(parsed))
    if parsed.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            if isinstance(value, dict) and "viaRouter" in value:
                for inner, item in value.items():
                    print(f"{key + ' ' + inner:>32}: {item}")
            else:
                print(f"{key:>32}: {value}")
