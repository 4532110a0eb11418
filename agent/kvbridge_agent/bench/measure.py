"""``kvbridge-agent bench``: throughput as a fraction of this machine's ceilings, measured in one run.

- memcpy: single-threaded copy of a 256 MiB buffer (the physical limit here);
- raw NIXL: one 256 MiB READ between two processes with one descriptor (the transport ceiling), and the same
  256 MiB as descriptors of 4 KiB .. 4 MiB in shuffled order, so NIXL cannot merge them (what one descriptor
  size costs);
- kvbridge: requests through real engine processes (``kvbridge-agent serve``, verification off, handshake
  excluded) for each cache kind (and MLA) and the TP pairs 1->1, 2->1, 1->2, 4->2, with contiguous and with
  scattered block ids, plus an 80-layer Split model with 1,000-block requests for the per-request CPU target.

Per request it reports kvbridge's own CPU work (block ids -> descriptor ids, plan lookups, bookkeeping: everything
from the request to every READ posted except NIXL's calls) and NIXL's (``make_prepped_xfer``; posting, which on
host memory contains the copy itself), each for the slowest decode rank. Medians over repeated requests.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbridge_agent.core import Attention, CacheKind, ModelGeometry, Role, RoleSettings
from kvbridge_agent.core.contract import BlockAllocation, EngineEnvironment
from kvbridge_agent.synthetic.processes import EngineProcess, start_engine
from kvbridge_agent.transfer.keys import generate_keys

SIZE = 256 << 20
SWEEP = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
TP_PAIRS = ((1, 1), (2, 1), (1, 2), (4, 2))
ALLOCATIONS = (BlockAllocation.SEQUENTIAL, BlockAllocation.SCATTERED)


@dataclass(frozen=True)
class Suite:
    """One model and the TP pairs it runs; every pair runs with contiguous and with scattered block ids."""

    name: str
    model: ModelGeometry
    tokens: int
    pairs: tuple[tuple[int, int], ...] = TP_PAIRS


def _llama(kind: CacheKind) -> ModelGeometry:  # Llama-3-8B geometry: 128 KiB of KV per token in bf16
    return ModelGeometry(name="llama3-8b-geometry", num_layers=32, num_kv_heads=8, head_dim=128, cache_kind=kind)


FULL = (
    Suite("split", _llama(CacheKind.SPLIT), 2048),
    Suite("blocksfirst", _llama(CacheKind.BLOCKS_FIRST), 2048),
    Suite("crosslayer", _llama(CacheKind.CROSS_LAYER), 2048),
    Suite(
        "mla",
        ModelGeometry(
            name="deepseek-v3-geometry", num_layers=61, num_kv_heads=1, head_dim=576, attention=Attention.MLA
        ),
        2048,
    ),
    # the per-request CPU target: 80 layers (Llama-3-70B at TP 8: one KV head per rank), 1,000-block requests
    Suite(
        "split80",
        ModelGeometry(name="llama3-70b-tp8-geometry", num_layers=80, num_kv_heads=1, head_dim=128),
        16000,
        ((1, 1),),
    ),
)
QUICK = (
    Suite("split", _llama(CacheKind.SPLIT), 256, ((1, 1),)),
    Suite("crosslayer", _llama(CacheKind.CROSS_LAYER), 256, ((1, 1),)),
)


_STARTED = time.monotonic()


def progress(message: str) -> None:
    print(f"[{time.monotonic() - _STARTED:6.1f} s] {message}", file=sys.stderr, flush=True)


# -- ceilings ------------------------------------------------------------------------------------------------------
def memcpy_gbps(trials: int = 5, device: str = "cpu") -> float:
    """One copy of ``SIZE`` bytes within ``device``'s memory (single-threaded on the host; on a GPU the copy
    engine's device-to-device copy, waited for)."""
    if device != "cpu":
        return _device_copy_gbps(trials, device)
    source = np.ones(SIZE, dtype=np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)  # touch the pages first
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return SIZE / statistics.median(times) / 1e9


def _device_copy_gbps(trials: int, device: str) -> float:
    import torch

    source = torch.ones(SIZE, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return SIZE / statistics.median(times) / 1e9


def _holder(conn: Connection, name: str, device: str = "cpu") -> None:
    import os

    import torch

    os.dup2(2, 1)  # the parent's stdout carries only its result
    from kvbridge_agent.transfer.transport import Transport

    tensor = torch.ones(SIZE, dtype=torch.uint8, device=device)
    transport = Transport(name)
    transport.register([tensor])
    conn.send((transport.metadata(), tensor.data_ptr()))
    while not conn.poll(0.0005):
        transport.notifications()  # keep progressing while the reader works
    transport.close()


def _chunk_rows(base: int, size: int, device_id: int = 0) -> Any:
    starts = base + np.arange(0, SIZE, size, dtype=np.int64)
    rows = np.empty((starts.size, 3), dtype=np.int64)
    rows[:, 0], rows[:, 1], rows[:, 2] = starts, size, device_id
    return rows


def nixl_ceilings(
    trials: int = 5, sizes: Sequence[int] = SWEEP, device: str = "cpu"
) -> tuple[float, list[dict[str, float]]]:
    """Raw NIXL READ throughput between two processes: one descriptor, and the sweep over descriptor ``sizes``
    (both buffers on ``device``: host memory, DRAM to NIXL, or a GPU's, VRAM)."""
    import torch

    from kvbridge_agent.transfer.transport import Transport

    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    tag = uuid.uuid4().hex[:8]
    holder = context.Process(target=_holder, args=(child, f"bench-src-{tag}", device), daemon=True)
    holder.start()
    transport = Transport(f"bench-dst-{tag}")
    try:
        target = torch.zeros(SIZE, dtype=torch.uint8, device=device)
        transport.register([target])
        memory = "DRAM" if device == "cpu" else "VRAM"
        if not parent.poll(120):
            raise RuntimeError("the NIXL source process did not start")
        metadata, base = parent.recv()
        peer = transport.add_peer(metadata)
        device_id = target.device.index or 0

        def measure(size: int, shuffled: bool) -> float:
            remote = transport.prep(peer, _chunk_rows(base, size, device_id), memory)
            local = transport.prep("", _chunk_rows(target.data_ptr(), size, device_id), memory)
            count = SIZE // size
            order = np.random.default_rng(size).permutation(count) if shuffled else np.arange(count)
            ids = order.astype(np.int32)
            times = []
            for _ in range(trials + 1):  # the first READ warms the connection
                start = time.perf_counter()
                handle = transport.read(local, ids, remote, ids, b"")
                while transport.state(handle) == "PROC":
                    pass
                times.append(time.perf_counter() - start)
                transport.release(handle)
            transport.release_dlist(remote)
            transport.release_dlist(local)
            return SIZE / statistics.median(times[1:]) / 1e9

        raw = measure(SIZE, False)
        sweep = []
        for size in sizes:
            progress(f"  raw NIXL, {size / 1024:g} KiB descriptors in shuffled order ...")
            sweep.append({"descriptorBytes": size, "gbps": round(measure(size, True), 3)})
        return raw, sweep
    finally:
        parent.send("stop")
        holder.join(timeout=30)
        transport.close()


# -- kvbridge through engine processes -----------------------------------------------------------------------------
def _peak_rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


@contextmanager
def _engines(
    suite: Suite, keys_dir: str, stopper: ThreadPoolExecutor
) -> Iterator[dict[tuple[Role, int], EngineProcess]]:
    """Every prefill and decode engine the suite's TP pairs need, started concurrently; stopped by ``stopper``
    in the background (stopping is mostly waiting, so the next suite's engines start meanwhile)."""
    blocks = -(-suite.tokens // 16)
    common: dict[str, Any] = {
        "model": suite.model,
        "prefill": RoleSettings(),
        "decode": RoleSettings(),
        "keys_dir": keys_dir,
        "num_blocks": 2 * blocks + 16,
        "http_port": 0,
        "side_channel_listen_port": 0,
        "verify": False,
    }
    wanted = sorted({(Role.PREFILL, p) for p, _ in suite.pairs} | {(Role.DECODE, d) for _, d in suite.pairs})

    def start(key: tuple[Role, int]) -> EngineProcess:
        role, tp = key
        settings = RoleSettings(tensor_parallel_size=tp)
        overrides = {"prefill": settings} if role is Role.PREFILL else {"decode": settings}
        engine_id = f"bench-{suite.name}-{role.value.lower()}-tp{tp}"
        return start_engine(EngineEnvironment(role=role, engine_id=engine_id, **{**common, **overrides}))

    engines: dict[tuple[Role, int], EngineProcess] = {}
    with ThreadPoolExecutor(len(wanted)) as pool:
        futures = {key: pool.submit(start, key) for key in wanted}
        errors = []
        for key, future in futures.items():
            try:
                engines[key] = future.result()
            except Exception as exc:
                errors.append(exc)
    try:
        if errors:
            raise errors[0]
        yield engines
    finally:
        for engine in engines.values():
            stopper.submit(engine.stop)


def _request(prefill: EngineProcess, decode: EngineProcess, request_id: str, suite: Suite, allocation: str) -> Any:
    status, body = prefill.post(
        "/v1/prefill", {"requestId": request_id, "numTokens": suite.tokens, "blockAllocation": allocation}
    )
    if status != 200:
        raise RuntimeError(f"prefill {request_id}: {body}")
    status, result = decode.post(
        "/v1/decode",
        {"requestId": request_id, "kvTransferParams": body["kvTransferParams"], "blockAllocation": allocation},
    )
    if status != 200:
        raise RuntimeError(f"decode {request_id}: {result}")
    return result


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(float(r[key]) for r in rows))


def run_suite(
    suite: Suite, keys_dir: str, requests: int, stopper: ThreadPoolExecutor
) -> tuple[list[dict[str, Any]], list[float], float]:
    """Result rows, handshake seconds per pair, and the largest peak RSS of any engine/rank process (MiB)."""
    rows: list[dict[str, Any]] = []
    handshakes: list[float] = []
    with _engines(suite, keys_dir, stopper) as engines:
        for tp_p, tp_d in suite.pairs:
            prefill, decode = engines[(Role.PREFILL, tp_p)], engines[(Role.DECODE, tp_d)]
            before = decode.metric("kvbridge_handshake_seconds_sum")
            _request(prefill, decode, f"warm-{tp_p}-{tp_d}", suite, BlockAllocation.SEQUENTIAL.value)
            handshakes.append(decode.metric("kvbridge_handshake_seconds_sum") - before)
            for allocation in ALLOCATIONS:
                name = f"{suite.name}-tp{tp_p}to{tp_d}-{'contiguous' if allocation is ALLOCATIONS[0] else 'scattered'}"
                progress(f"  {name}: {requests} requests of {suite.tokens} tokens")
                results = [
                    _request(prefill, decode, f"{name}-{index}", suite, allocation.value) for index in range(requests)
                ]
                rows.append(_row(name, suite, tp_p, tp_d, allocation, results))
        peak = max(_peak_rss_mib(pid) for engine in engines.values() for pid in engine.pids)
    return rows, handshakes, peak


def _row(
    name: str, suite: Suite, tp_p: int, tp_d: int, allocation: BlockAllocation, results: list[dict[str, Any]]
) -> dict[str, Any]:
    moved, descriptors = int(results[0]["bytes"]), int(results[0]["descriptors"])
    make, post = _median(results, "makeMicroseconds"), _median(results, "postMicroseconds")
    return {
        "name": name,
        "cacheKind": suite.model.cache_kind.value,
        "attention": suite.model.attention.value,
        "prefillTP": tp_p,
        "decodeTP": tp_d,
        "blockIds": "contiguous" if allocation is BlockAllocation.SEQUENTIAL else "scattered",
        "bytesPerRequest": moved,
        "gbps": round(moved / _median(results, "transferSeconds") / 1e9, 3),
        "descriptorsPerRequest": descriptors,
        "bytesPerDescriptor": moved // max(1, descriptors),
        "overheadUsPerRequest": round(_median(results, "ownMicroseconds"), 1),
        "idsUsPerRequest": round(_median(results, "idsMicroseconds"), 1),
        "nixlMakeUsPerRequest": round(make, 1),
        "nixlPostUsPerRequest": round(post, 1),
    }


def _targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The performance goals, each with what this run measured."""
    out: list[dict[str, Any]] = []

    def add(target: str, rows: list[dict[str, Any]], key: str, goal: float, at_least: bool) -> None:
        if not rows:
            return
        worst = min(rows, key=lambda r: r[key]) if at_least else max(rows, key=lambda r: r[key])
        met = worst[key] >= goal if at_least else worst[key] <= goal
        out.append({"target": target, "worst": worst["name"], "measured": worst[key], "met": bool(met)})

    dense = [r for r in results if r["attention"] == "Dense"]
    add("CrossLayer >= 0.9 x raw NIXL", [r for r in dense if r["cacheKind"] == "CrossLayer"], "ratioToRaw", 0.9, True)
    split_contiguous = [r for r in dense if r["cacheKind"] == "Split" and r["blockIds"] == "contiguous"]
    add("Split, contiguous ids >= 0.8 x raw NIXL", split_contiguous, "ratioToRaw", 0.8, True)
    big = [r for r in results if r["name"].startswith("split80")]
    add("kvbridge's own work < 2 ms (1,000 blocks, 80-layer Split)", big, "overheadUsPerRequest", 2000, False)
    add("kvbridge's own work <= 0.2 x NIXL's make_prepped_xfer", big, "ownToNixlMake", 0.2, False)
    return out


def raw_at(sweep: list[dict[str, float]], descriptor_bytes: int) -> float:
    """Raw NIXL throughput at one descriptor size, interpolated in log2(size) between the sweep's points."""
    sizes = np.log2([row["descriptorBytes"] for row in sweep])
    return float(np.interp(np.log2(max(descriptor_bytes, 1)), sizes, [row["gbps"] for row in sweep]))


def bench(requests: int = 4, quick: bool = False) -> dict[str, Any]:
    began = time.monotonic()
    progress("measuring memcpy ...")
    memcpy = memcpy_gbps()
    progress("measuring raw NIXL (256 MiB, two processes) ...")
    raw, sweep = nixl_ceilings()
    results: list[dict[str, Any]] = []
    handshakes: list[float] = []
    peak_engine = 0.0
    with (
        tempfile.TemporaryDirectory(prefix="kvbridge-bench-") as keys_dir,
        ThreadPoolExecutor(8, thread_name_prefix="stop") as stopper,
    ):
        generate_keys(keys_dir)
        for suite in QUICK if quick else FULL:
            progress(f"{suite.name}: starting engines ({suite.model.name}, {suite.model.cache_kind.value}) ...")
            rows, suite_handshakes, peak = run_suite(suite, keys_dir, requests, stopper)
            results.extend(rows)
            handshakes.extend(suite_handshakes)
            peak_engine = max(peak_engine, peak)
    for row in results:
        row["ratioToRaw"] = round(row["gbps"] / raw, 3)
        row["ratioToRawAtDescriptorSize"] = round(row["gbps"] / raw_at(sweep, row["bytesPerDescriptor"]), 3)
        row["ratioToMemcpy"] = round(row["gbps"] / memcpy, 3)
        row["ownToNixlMake"] = round(row["overheadUsPerRequest"] / max(row["nixlMakeUsPerRequest"], 1e-3), 3)
    return {
        "memcpyGBps": round(memcpy, 3),
        "nixlRawGBps": round(raw, 3),
        "descriptorSweep": sweep,
        "results": results,
        "handshakeMs": round(statistics.median(handshakes) * 1e3, 2),
        "peakRssMiB": {
            "bench": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "largestEngineProcess": round(peak_engine, 1),
        },
        "targets": _targets(results),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()},
        "seconds": round(time.monotonic() - began, 1),
    }
