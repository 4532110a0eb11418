"""vLLM's NixlConnector and kvbridge's KVBridgeConnector side by side, one run (not a test).

    .venv/bin/python benchmarks/vllm_connectors.py [--model tiny|large] [--rounds 4] [--repeats 2] [--json]

Same vLLM build (the CPU build `make setup` installs), same local random-weight model, same prompts, same machine,
same cores (prefill on core 0, decode on core 1): each connector's prefill/decode pair is started from exactly
what the operator renders for ``spec.engine.connector`` Nixl and KVBridge. The connectors take turns in paired
rounds, ABBA (Nixl, KVBridge, then KVBridge, Nixl, ...), so that both meet the same noise of a shared machine:
with ``--pairs together`` (or ``auto`` when memory allows) both pairs are started once and the idle one waits
while the other is measured; with ``restart`` each turn starts its pair and stops it after.

``--model tiny``: the tiny model (2 layers, 2 KV heads of 64: at most 0.5 MB of KV per request), prompts of 32 to
480 tokens, what the connectors cost per request. ``--model large``: :data:`tiny_model.LARGE` (16 layers, 8 KV
heads of 64, bf16: 32 KiB per token), prompts of 1,024 to 4,000 tokens (32 to 125 MiB of KV), so that the READ
takes time beside decode's forward.

In each turn, for every prompt length: prefill computes it, then decode is asked for one token with the prefill's
``kv_transfer_params`` (``--repeats`` prompts), and in the first ``--recompute-rounds`` a prompt of that length is
recomputed on decode alone once. Reported per turn and as medians over the rounds: decode's time to first token as
the client sees it (scheduling, the KV READ, one forward of the last token), the recompute, the CPU seconds the
decode engine's processes used per request, and what each connector reports on decode's /metrics per request:
transfer time (NixlConnector: ``vllm:nixl_xfer_time_seconds``, NIXL's own post-to-completion telemetry;
KVBridgeConnector: ``vllm:kvbridge_transfer_seconds``, post to completion as the worker's next step sees it —
coarser, it includes up to one engine step), bytes, and descriptors NIXL posted (both from NIXL's telemetry); for
KVBridgeConnector also the descriptor ids it handed NIXL (from the plan: descriptors per block x blocks). The JSON
adds each turn's start time and 1-minute load average (start, end), its CPU per decode thread (``/proc/<pid>/task``)
and the CPU the idle pair used meanwhile. ``--kvbridge-first`` mirrors the order (BAAB...), for a second run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvbridge_agent.core import Role, TransferPlan
from kvbridge_operator.api.spec import parse_deployment
from kvbridge_operator.children.verdict import verdict_for
from kvbridge_sim import pd_requests, tiny_model
from kvbridge_sim.support import fixed_address
from kvbridge_sim.vllm_engines import Engines, deployment, metric, process_group_stats, rendered_template


@dataclass(frozen=True)
class Model:
    shape: tiny_model.Shape
    lengths: tuple[int, ...]
    max_len: int


MODELS = {
    "tiny": Model(tiny_model.TINY, (32, 128, 256, 480), 512),  # up to the 512-token limit the deployment renders
    "large": Model(tiny_model.LARGE, (1024, 2048, 4000), 4096),
}
BLOCK = 32  # tokens per block, both roles (what deployment() renders)
#: each connector's per-request transfer metrics on decode's /metrics: seconds, descriptors posted, bytes
TRANSFER_METRICS = {
    "Nixl": ("vllm:nixl_xfer_time_seconds", "vllm:nixl_num_descriptors", "vllm:nixl_bytes_transferred"),
    "KVBridge": (
        "vllm:kvbridge_transfer_seconds",
        "vllm:kvbridge_descriptors_per_request",
        "vllm:kvbridge_transfer_bytes",
    ),
}
GIB = 2**30


@dataclass
class Pair:
    """One connector's prefill/decode pair (one variant: a connector and a verification policy)."""

    name: str
    connector: str
    document: dict[str, Any]
    engines: Engines
    ids_per_block: int
    running: bool = False
    rounds: list[dict[str, Any]] = field(default_factory=list)

    @property
    def pgids(self) -> set[int]:
        return {e.process.pid for e in self.engines.engines.values() if e.process is not None}

    def decode_pgid(self) -> int:
        process = self.engines.engines["decode"].process
        if process is None:
            raise RuntimeError(f"{self.name}'s decode engine is not running")
        return process.pid


def ticks(pgids: set[int]) -> int:
    """User + system CPU ticks of every process in these process groups (engines and what they spawned)."""
    return sum(int(fields[11]) + int(fields[12]) for fields in process_group_stats(pgids))


def thread_ticks(pgid: int) -> Counter[str]:
    """CPU ticks per thread name (``process/thread``) of every process in one process group."""
    found: Counter[str] = Counter()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            process = stat[stat.index("(") + 1 : stat.rindex(")")]
            for task in (entry / "task").iterdir():
                text = (task / "stat").read_text()
                rest = text.rsplit(")", 1)[1].split()
                found[f"{process}/{text[text.index('(') + 1 : text.rindex(')')]}"] += int(rest[11]) + int(rest[12])
        except (OSError, IndexError, ValueError):
            continue
    return found


def rss_gib(pgids: set[int]) -> float:
    return sum(int(fields[21]) for fields in process_group_stats(pgids)) * os.sysconf("SC_PAGE_SIZE") / GIB


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GIB
    return 0.0


async def transfer_figures(session: aiohttp.ClientSession, url: str, connector: str) -> tuple[float, ...]:
    """(requests, seconds, descriptors, bytes) the connector has reported so far on decode's /metrics."""
    seconds, descriptors, nbytes = TRANSFER_METRICS[connector]
    return (
        await metric(session, url, f"{seconds}_count"),
        await metric(session, url, f"{seconds}_sum"),
        await metric(session, url, f"{descriptors}_sum"),
        await metric(session, url, f"{nbytes}_sum"),
    )


async def reported_since(
    session: aiohttp.ClientSession, url: str, connector: str, before: tuple[float, ...], count: int
) -> tuple[float, ...]:
    """What the connector reported for the last ``count`` transfers (vLLM's front end records a step's stats
    shortly after it); zeros where it reports nothing."""
    deadline = time.monotonic() + 10
    while True:
        now = await transfer_figures(session, url, connector)
        delta = tuple(a - b for a, b in zip(now, before, strict=True))
        if delta[0] >= count or time.monotonic() > deadline:
            return delta
        await asyncio.sleep(0.2)


def make_pair(name: str, connector: str, policy: str, model: Model, path: Path, workdir: Path, slot: int) -> Pair:
    document = deployment(
        f"bench-{name.lower()}", 1, connector=connector, shape=model.shape, extra=(f"--max-model-len={model.max_len}",)
    )
    if policy:
        document["spec"]["transfer"]["verification"] = policy
    plan = verdict_for(parse_deployment(document))
    ids_per_block = plan.for_decode_rank(0).descriptors_per_block if isinstance(plan, TransferPlan) else 0
    engines = Engines(workdir / name, path, more_models={model.shape.name: path})
    env = {"KVBRIDGE_KEYS_DIR": str(workdir / "keys")}
    engines.add("prefill", rendered_template(document, Role.PREFILL), fixed_address(2 * slot), (0,), env=env)
    engines.add("decode", rendered_template(document, Role.DECODE), fixed_address(2 * slot + 1), (1,), env=env)
    return Pair(name, connector, document, engines, ids_per_block)


async def start(pair: Pair, model: Model) -> None:
    """Start a pair and warm it: first contact (handshake, connection set-up) and one prompt of the longest length."""
    print(f"starting the {pair.name} pair ...", file=sys.stderr, flush=True)
    pair.engines.start(["prefill", "decode"])
    pair.running = True
    prefill, decode = pair.engines.engines["prefill"], pair.engines.engines["decode"]
    async with pd_requests.client_session(600) as session:
        for salt, length in ((9000, 64), (9001, 64), (9002, model.lengths[-1])):
            tokens = tiny_model.prompt(length, salt=salt)
            await pd_requests.disaggregated(session, prefill.url, decode.url, model.shape.name, tokens, 1)


async def turn(pair: Pair, model: Model, repeats: int, round_index: int, recompute: bool) -> dict[str, Any]:
    """One turn of one pair: every length, ``repeats`` disaggregated requests and (``recompute``) the same length
    computed on decode alone once."""
    prefill, decode = pair.engines.engines["prefill"], pair.engines.engines["decode"]
    pgid, name = pair.decode_pgid(), model.shape.name
    threads: Counter[str] = Counter()
    rows: dict[str, Any] = {}
    async with pd_requests.client_session(600) as session:
        for length in model.lengths:
            ttft, cpu = [], []
            reported = await transfer_figures(session, decode.url, pair.connector)
            for repeat in range(repeats):
                tokens = tiny_model.prompt(length, salt=round_index * 100_000 + length * 10 + repeat)
                params = await pd_requests.prefill(session, prefill.url, name, tokens)
                threads_before, before = thread_ticks(pgid), ticks({pgid})
                started = time.perf_counter()
                await pd_requests.decode(session, decode.url, name, tokens, params, 1)
                ttft.append(time.perf_counter() - started)
                cpu.append((ticks({pgid}) - before) / os.sysconf("SC_CLK_TCK"))
                threads += thread_ticks(pgid) - threads_before
            count, seconds, descriptors, nbytes = await reported_since(
                session, decode.url, pair.connector, reported, repeats
            )
            started = time.perf_counter()
            if recompute:  # the same for every connector: decode alone
                salt = f"alone-{round_index}-{length}"
                prompt = tiny_model.prompt(length, salt=7 + length)
                await pd_requests.baseline(session, decode.url, name, prompt, 1, salt)
            rows[str(length)] = {
                "decodeTTFTms": round(statistics.median(ttft) * 1000, 1),
                "transferMs": round(seconds / count * 1000, 2) if count else None,
                "descriptorsPerRequest": round(descriptors / count, 1) if count else None,
                "idsPerRequest": pair.ids_per_block * math.ceil(length / BLOCK)
                if pair.connector == "KVBridge"
                else None,
                "MiBPerRequest": round(nbytes / count / 2**20, 1) if count else None,
                "recomputeTTFTms": round((time.perf_counter() - started) * 1000, 1) if recompute else None,
                "decodeCPUSecondsPerRequest": round(statistics.median(cpu), 3),
            }
    per_request = os.sysconf("SC_CLK_TCK") * repeats * len(model.lengths) / 1000
    top = {thread: round(spent / per_request, 1) for thread, spent in threads.most_common(8) if spent}
    return {"byPromptTokens": rows, "decodeThreadCPUmsPerRequest": top}


def together_fits(pairs: list[Pair], mode: str) -> bool:
    """Whether the other pairs may run beside the one started: ``auto`` when MemAvailable leaves 4 GiB spare
    beyond the running pair's resident memory for each of them."""
    if mode != "auto":
        return mode == "together"
    pair = rss_gib(next(p for p in pairs if p.running).pgids)
    need = (len(pairs) - 1) * pair + 4.0
    print(f"memory: {available_gib():.1f} GiB available, a pair uses {pair:.1f}", file=sys.stderr, flush=True)
    return available_gib() >= need


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model = MODELS[args.model]
    path = tiny_model.make(workdir / model.shape.name.split("/")[-1], model.shape)
    from kvbridge_agent.transfer.keys import generate_keys

    generate_keys(workdir / "keys")
    variants = [("Nixl", "Nixl", ""), *((f"KVBridge-{v}", "KVBridge", v) for v in args.verification)]
    pairs = [make_pair(n, c, v, model, path, workdir, slot) for slot, (n, c, v) in enumerate(variants)]
    pairs = pairs[::-1] if args.kvbridge_first else pairs  # BAAB: the other run's mirror
    try:
        await start(pairs[0], model)
        mode = "together" if together_fits(pairs, args.pairs) else "restart"
        for pair in pairs[1:] if mode == "together" else ():
            await start(pair, model)
        schedule = [
            (i, p, [q.name for q in order])
            for i in range(args.rounds)
            for order in [pairs if i % 2 == 0 else pairs[::-1]]
            for p in order
        ]
        for position, (index, pair, order) in enumerate(schedule):
            if not pair.running:
                await start(pair, model)
            others = [p for p in pairs if p is not pair and p.running]
            idle_before, began = ticks({g for p in others for g in p.pgids}), time.strftime("%H:%M:%S")
            load = os.getloadavg()[0]
            result = await turn(pair, model, args.repeats, index, index < args.recompute_rounds)
            # the machine's conditions: when the turn ran, the 1-minute load average at its start and end
            result["began"], result["loadAverage"] = began, [round(load, 1), round(os.getloadavg()[0], 1)]
            result["idlePairsCPUSeconds"] = round(
                (ticks({g for p in others for g in p.pgids}) - idle_before) / os.sysconf("SC_CLK_TCK"), 2
            )
            result["order"] = order
            pair.rounds.append(result)
            print(f"round {index} {pair.name}: {json.dumps(result)}", file=sys.stderr, flush=True)
            following = schedule[position + 1][1] if position + 1 < len(schedule) else None
            if mode == "restart" and following is not pair:  # ABBA: B's two turns in a row share a start
                pair.engines.stop(["prefill", "decode"])
                pair.running = False
    finally:
        for pair in pairs:
            pair.engines.stop()
    return {
        "model": {"name": model.shape.name, **model.shape.geometry, "maxModelLen": model.max_len},
        "pairs": mode,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "byPair": {p.name: {"rounds": p.rounds, **p.engines.summary()} for p in pairs},
    }


COLUMNS = (
    ("decode TTFT (ms)", "decodeTTFTms"),
    ("transfer (ms)", "transferMs"),
    ("MiB", "MiBPerRequest"),
    ("descriptors posted", "descriptorsPerRequest"),
    ("decode CPU s/req", "decodeCPUSecondsPerRequest"),
)


def figures(results: dict[str, Any], name: str, index: int | str, length: int) -> dict[str, Any]:
    """One pair's figures at one length: of turn ``index``, or (``"median"``) the median over the turns."""
    turns = [r["byPromptTokens"][str(length)] for r in results["byPair"][name]["rounds"]]
    if index != "median":
        return dict(turns[int(index)])
    medians: dict[str, Any] = {}
    for key in turns[0]:
        values = [t[key] for t in turns if t[key] is not None]
        medians[key] = round(statistics.median(values), 2) if values else None
    return medians


def paired_ratio(results: dict[str, Any], ours: str, index: int | str, length: int) -> float:
    """Ours / Nixl's decode TTFT in one round, or (``"median"``) the median of that over the rounds."""
    rounds = range(results["rounds"]) if index == "median" else [int(index)]
    ratios = [
        figures(results, ours, i, length)["decodeTTFTms"] / figures(results, "Nixl", i, length)["decodeTTFTms"]
        for i in rounds
    ]
    return round(float(statistics.median(ratios)), 2)


def cell(value: object) -> str:
    return "—" if value is None else str(value)


def table(results: dict[str, Any], lengths: tuple[int, ...]) -> str:
    ours = next(name for name in results["byPair"] if name != "Nixl")
    head = " | ".join(f"{label}, Nixl | {ours}" for label, _ in COLUMNS)
    lines = [
        f"| round | prompt tokens | {head} | {ours} ids | TTFT {ours} / Nixl | recompute (ms) |",
        "|---" * (5 + 2 * len(COLUMNS)) + "|",
    ]
    for index in [*range(results["rounds"]), "median"]:
        for length in lengths:
            nixl, mine = figures(results, "Nixl", index, length), figures(results, ours, index, length)
            row = " | ".join(f"{cell(nixl[key])} | {cell(mine[key])}" for _, key in COLUMNS)
            lines.append(
                f"| {index} | {length} | {row} | {mine['idsPerRequest']} | {paired_ratio(results, ours, index, length)}"
                f" | {cell(nixl['recomputeTTFTms'])} |"
            )
    peaks = ", ".join(f"{name} {pair['peakRssGiB']} GiB" for name, pair in results["byPair"].items())
    return "\n".join([*lines, "", f"pairs: {results['pairs']}; peak RSS: {peaks}"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--rounds", type=int, default=4, help="turns per connector, in ABBA order")
    parser.add_argument("--repeats", type=int, default=3, help="disaggregated requests per length in each turn")
    parser.add_argument(
        "--pairs",
        choices=["auto", "together", "restart"],
        default="auto",
        help="keep every pair running for the whole run (together), start and stop one per turn (restart), or "
        "together when memory allows (auto)",
    )
    parser.add_argument(
        "--recompute-rounds", type=int, default=1, help="rounds in which each length is also recomputed on decode"
    )
    parser.add_argument("--kvbridge-first", action="store_true", help="rounds start with KVBridge (BAAB...)")
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
        results = asyncio.run(run(args, Path(args.workdir)))
    else:
        with tempfile.TemporaryDirectory(prefix="kvbridge-bench-") as workdir:
            results = asyncio.run(run(args, Path(workdir)))
    print(json.dumps(results, indent=2) if args.json else table(results, MODELS[args.model].lengths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
