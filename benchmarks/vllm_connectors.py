"""vLLM's NixlConnector and kvbridge's KVBridgeConnector side by side, one run (not a test).

    .venv/bin/python benchmarks/vllm_connectors.py [--repeats 5] [--json]

Same vLLM build (the CPU build `make setup` installs), same tiny local model, same prompts, same machine, same
cores (prefill on core 0, decode on core 1): each connector's prefill/decode pair is started from exactly what
the operator renders for ``spec.engine.connector`` Nixl and KVBridge, one pair at a time. For every prompt
length: prefill computes it, then decode is asked for one token with the prefill's ``kv_transfer_params``.
Reported per length (median of the repeats): decode's time to first token as the client sees it (scheduling,
the KV READ, one forward of the last token), the same prompt recomputed on decode alone (no transfer), the CPU
seconds the decode engine's processes used per request, each pair's peak resident memory, and what each
connector reports on decode's /metrics: the mean KV transfer time per request (NixlConnector:
``vllm:nixl_xfer_time_seconds``, NIXL's own post-to-completion telemetry; KVBridgeConnector:
``vllm:kvbridge_transfer_seconds``, post to completion as the worker's next step sees it — coarser, it includes
up to one engine step) and descriptors per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvbridge_agent.core import Role
from kvbridge_agent.transfer.keys import generate_keys
from kvbridge_sim import pd_requests, tiny_model
from kvbridge_sim.vllm_engines import (
    MODEL_NAME,
    Engines,
    deployment,
    metric,
    process_group_stats,
    rendered_template,
)

ROOT = Path(__file__).parents[1]

LENGTHS = (32, 128, 256, 480)  # up to the 512-token limit the deployment renders
#: each connector's per-request transfer histograms on decode's /metrics: (seconds, descriptors)
TRANSFER_METRICS = {
    "Nixl": ("vllm:nixl_xfer_time_seconds", "vllm:nixl_num_descriptors"),
    "KVBridge": ("vllm:kvbridge_transfer_seconds", "vllm:kvbridge_descriptors_per_request"),
}


def cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every process in one process group (an engine and what it spawned)."""
    ticks = sum(int(fields[11]) + int(fields[12]) for fields in process_group_stats({pgid}))
    return ticks / os.sysconf("SC_CLK_TCK")


async def transfer_figures(session: aiohttp.ClientSession, url: str, connector: str) -> tuple[float, float, float]:
    """(requests, seconds, descriptors) the connector has reported so far on decode's /metrics."""
    seconds, descriptors = TRANSFER_METRICS[connector]
    return (
        await metric(session, url, f"{seconds}_count"),
        await metric(session, url, f"{seconds}_sum"),
        await metric(session, url, f"{descriptors}_sum"),
    )


async def reported_since(
    session: aiohttp.ClientSession, url: str, connector: str, before: tuple[float, float, float], count: int
) -> tuple[float, float, float]:
    """What the connector reported for the last ``count`` transfers (vLLM's front end records a step's stats
    shortly after it); zeros where it reports nothing."""
    deadline = time.monotonic() + 10
    while True:
        now = await transfer_figures(session, url, connector)
        delta = tuple(a - b for a, b in zip(now, before, strict=True))
        if delta[0] >= count or time.monotonic() > deadline:
            return delta  # type: ignore[return-value]
        await asyncio.sleep(0.2)


async def measure(engines: Engines, model: str, repeats: int, connector: str) -> dict[str, Any]:
    prefill, decode = engines.engines["prefill"], engines.engines["decode"]
    assert decode.process is not None
    rows: dict[str, Any] = {}
    async with pd_requests.client_session(300) as session:
        for warm in range(2):  # first contact: handshake, connection set-up
            tokens = tiny_model.prompt(64, salt=9000 + warm)
            await pd_requests.disaggregated(session, prefill.url, decode.url, model, tokens, 1)
        for length in LENGTHS:
            ttft, alone, cpu = [], [], []
            reported = await transfer_figures(session, decode.url, connector)
            for repeat in range(repeats):
                tokens = tiny_model.prompt(length, salt=length * 100 + repeat)
                params = await pd_requests.prefill(session, prefill.url, model, tokens)
                before = cpu_seconds(decode.process.pid)
                started = time.perf_counter()
                await pd_requests.decode(session, decode.url, model, tokens, params, 1)
                ttft.append(time.perf_counter() - started)
                cpu.append(cpu_seconds(decode.process.pid) - before)
                started = time.perf_counter()
                await pd_requests.baseline(session, decode.url, model, tokens, 1, salt=f"alone-{length}-{repeat}")
                alone.append(time.perf_counter() - started)
            count, seconds, descriptors = await reported_since(session, decode.url, connector, reported, repeats)
            rows[str(length)] = {
                "transferMs": round(seconds / count * 1000, 2) if count else None,
                "descriptorsPerRequest": round(descriptors / count, 1) if count else None,
                "decodeTTFTms": round(statistics.median(ttft) * 1000, 1),
                "recomputeTTFTms": round(statistics.median(alone) * 1000, 1),
                "decodeCPUSecondsPerRequest": round(statistics.median(cpu), 3),
            }
    return rows


async def run(repeats: int, workdir: Path, verification: list[str]) -> dict[str, Any]:
    model = tiny_model.make(workdir / "tiny-llama")
    keys = workdir / "keys"
    generate_keys(keys)
    results: dict[str, Any] = {}
    # KVBridgeConnector once per verification policy (spec.transfer.verification); the first is the table's
    variants = [
        ("Nixl", "Nixl", ""),
        *((("KVBridge" if i == 0 else f"KVBridge-{v}"), "KVBridge", v) for i, v in enumerate(verification)),
    ]
    for name, connector, policy in variants:
        engines = Engines(workdir / name, model)
        document = deployment(f"bench-{name.lower()}", 1, connector=connector)
        if policy:
            document["spec"]["transfer"]["verification"] = policy
        env = {"KVBRIDGE_KEYS_DIR": str(keys)}
        engines.add("prefill", rendered_template(document, Role.PREFILL), "127.0.2.2", (0,), env=env)
        engines.add("decode", rendered_template(document, Role.DECODE), "127.0.2.5", (1,), env=env)
        print(f"starting the {name} pair ...", file=sys.stderr, flush=True)
        try:
            engines.start(["prefill", "decode"])
            rows = await measure(engines, MODEL_NAME, repeats, connector)
        finally:
            engines.stop()
        results[name] = {"byPromptTokens": rows, "verification": policy or "none", **engines.summary()}
        print(f"{name}: {json.dumps(rows)}", file=sys.stderr, flush=True)
    return results


def table(results: dict[str, Any]) -> str:
    lines = [
        "| prompt tokens | transfer, Nixl (ms) | transfer, KVBridge (ms) | descriptors, Nixl | KVBridge "
        "| decode TTFT, Nixl (ms) | decode TTFT, KVBridge (ms) | KVBridge / Nixl | recompute on "
        "decode (ms) | decode CPU s/request, Nixl | KVBridge |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for length in LENGTHS:
        nixl, ours = results["Nixl"]["byPromptTokens"][str(length)], results["KVBridge"]["byPromptTokens"][str(length)]
        lines.append(
            f"| {length} | {nixl['transferMs']} | {ours['transferMs']} | {nixl['descriptorsPerRequest']} | "
            f"{ours['descriptorsPerRequest']} | {nixl['decodeTTFTms']} | {ours['decodeTTFTms']} | "
            f"{ours['decodeTTFTms'] / nixl['decodeTTFTms']:.2f} | {nixl['recomputeTTFTms']} | "
            f"{nixl['decodeCPUSecondsPerRequest']} | {ours['decodeCPUSecondsPerRequest']} |"
        )
    lines.append("")
    lines.append(
        f"peak RSS of the pair: Nixl {results['Nixl']['peakRssGiB']} GiB, "
        f"KVBridge {results['KVBridge']['peakRssGiB']} GiB"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--verification",
        nargs="+",
        default=["Sampled"],
        choices=["All", "Sampled", "Off"],
        help="run KVBridgeConnector once per policy (the first fills the table; the rest: --json)",
    )
    parser.add_argument("--workdir", help="keep the model and the engines' logs here (default: a temporary folder)")
    args = parser.parse_args()
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        results = asyncio.run(run(args.repeats, Path(args.workdir), args.verification))
    else:
        with tempfile.TemporaryDirectory(prefix="kvbridge-bench-") as workdir:
            results = asyncio.run(run(args.repeats, Path(workdir), args.verification))
    print(json.dumps(results, indent=2) if args.json else table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
